"""Where a patched decode step's time goes: the whole step, the host time of its launches (the
decode graph and the greedy / beam update of the device-resident loops), the decode graph alone,
and the phases of a call with one new token (what every step of a call shares). With --gaps, the
GPU's idle time inside one call: the longest gaps between kernels, by the kernels on either side.
With --host, the host time of a 1-token call's parts (HF's preamble pieces, the paged set-up; a
part inside another counts in both) and stock HF's 1-token call on the same weights.

    python benchmarks/profile_step.py [--models t5-small,t5-large] [--batch 1,64] [--table PATH] [--gaps] [--host]
"""

from __future__ import annotations

import argparse
import collections

import torch
from torch.profiler import ProfilerActivity, profile

import common  # benchmarks/ is on sys.path
import hf_paged_t5 as hp


def one_token(kw: dict) -> dict:
    return {**kw, "max_new_tokens": 1, "min_new_tokens": 1}


def fixed_ms(model, kw: dict, calls: int = 5) -> float:
    """Median ms of a generate() call with one new token: the per-call cost (HF's preamble, the
    encoder, the decoder prompt, the loop's setup) that every step of a call shares."""
    with torch.inference_mode():
        model.generate(**one_token(kw))
        return 1e3 * common.median(common.timed(lambda: model.generate(**one_token(kw)))[0] for _ in range(calls))


def phase_ms(model, kw: dict, calls: int = 5) -> dict:
    """Median ms per phase of a generate() call with one new token, each phase bracketed by
    device syncs (`common.call_phases`); 'rest' is HF's preamble and the paged call's own set-up."""
    rows = []
    with torch.inference_mode():
        for _ in range(calls):
            with common.timers(common.call_phases(model), synced=True) as (spent, _):
                total, _ = common.timed(lambda: model.generate(**one_token(kw)))
            phases = {label: 1e3 * s for label, s in spent.items()}
            rows.append({**phases, "rest": 1e3 * total - sum(phases.values()), "total": 1e3 * total})
    return {k: common.median(r.get(k, 0.0) for r in rows) for k in rows[0]}


def gpu_gaps(prof, top: int = 12) -> str:
    """The GPU's idle time in a profiled call: busy vs span of its kernels and copies, and the
    largest idle gaps summed by (kernel before, kernel after)."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if not spans:
        return "no GPU activity recorded"
    busy, gaps, end, before = 0.0, collections.defaultdict(lambda: [0, 0.0]), spans[0][0], spans[0][2]
    for start, stop, name in spans:
        busy += max(0.0, stop - max(start, end))
        if start - end > 2.0:  # us
            key = (before[:60], name[:60])
            gaps[key][0] += 1
            gaps[key][1] += start - end
        if stop >= end:
            end, before = stop, name
    lines = [f"GPU span {end - spans[0][0]:.0f} us, busy {busy:.0f} us, idle {end - spans[0][0] - busy:.0f} us; "
             f"largest idle gaps (count, total us, before -> after):"]
    for (a, b), (n, total) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {n:4d} {total:9.0f}  {a} -> {b}")
    return "\n".join(lines)


def host_parts_ms(model, kw: dict, calls: int = 10) -> tuple[float, dict]:
    """(ms of a 1-token call, {part: host ms per call}) over `calls` calls (`common.call_host_parts`)."""
    with torch.inference_mode(), common.timers(common.call_host_parts(model)) as (spent, _):
        total, _ = common.timed(lambda: [model.generate(**one_token(kw)) for _ in range(calls)])
    return 1e3 * total / calls, {label: 1e3 * s / calls for label, s in spent.most_common()}


def run(name: str, batch: int, beams: int, table: str | None, new: int = 64, table_new: int = 16,
        gaps: bool = False, host: bool = False) -> None:
    stock = common.make_model(name, "sdpa", torch.bfloat16)
    ids, mask = common.random_inputs(batch, 512)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, num_beams=beams)
    if host:
        print(f"{name} b{batch} beams{beams}: stock HF 1-token call {fixed_ms(stock, kw, calls=10):.2f} ms", flush=True)
    model = hp.patch_model(stock)
    with torch.inference_mode():
        for _ in range(2):  # warm: the second call of a shape captures its graphs (encoder, decode)
            model.generate(**kw)
        with common.timers(common.step_launches()) as (spent, calls):
            total, _ = common.timed(lambda: model.generate(**kw))
        total = total / new * 1e3
        launches = sum(spent.values()) / max(calls["decode graph replay"], 1) * 1e3
        graph = next(iter(common.decode_graphs(model).values()))
        replay, _ = common.timed(lambda: [graph.replay() for _ in range(100)])
        replay = replay / 100 * 1e3
        update = common.update_replay_ms(model)
        if table:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                model.generate(**{**kw, "max_new_tokens": table_new, "min_new_tokens": table_new})
            with open(table, "a") as f:
                f.write(f"\n##### {name} b{batch} beams{beams}\n")
                f.write(prof.key_averages().table(sort_by="cpu_time_total", row_limit=45))
        if gaps:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                model.generate(**{**kw, "max_new_tokens": table_new, "min_new_tokens": table_new})
            print(f"{name} b{batch} beams{beams}, {table_new} new tokens: {gpu_gaps(prof)}", flush=True)
    fixed = fixed_ms(model, kw)
    if host:
        with torch.inference_mode():
            model.generate(**one_token(kw))
        call_ms, parts = host_parts_ms(model, kw)
        print(f"{name} b{batch} beams{beams}: patched 1-token call {call_ms:.2f} ms; host ms per call: "
              + ", ".join(f"{k} {v:.2f}" for k, v in parts.items()), flush=True)
    phases = phase_ms(model, kw)
    print(f"{name} b{batch} beams{beams}: phases of a 1-token call (ms, synced) "
          + ", ".join(f"{k} {v:.2f}" for k, v in phases.items()), flush=True)
    print(f"{name} b{batch} beams{beams}: per call outside the steps (generate() with 1 new token) {fixed:.2f} ms",
          flush=True)
    print(f"{name} b{batch} beams{beams}: generate {total:.3f} ms/step | host launches per step (decode graph + "
          f"update) {launches:.3f} | decode graph replay alone (GPU) {replay:.3f} | update graph replay alone "
          f"{common.fmt(update, '.3f')} | generate minus replay {total - replay:.3f}", flush=True)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="t5-small,t5-large")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--beams", default="1")
    ap.add_argument("--table", default=None, help="append a torch.profiler table of one call to this file")
    ap.add_argument("--new-tokens", type=int, default=64, help="new tokens of the timed calls")
    ap.add_argument("--table-new-tokens", type=int, default=16, help="new tokens of the profiled call")
    ap.add_argument("--gaps", action="store_true", help="print the GPU's idle gaps inside one profiled call")
    ap.add_argument("--host", action="store_true", help="print the host time of a 1-token call's parts, and stock's call")
    args = ap.parse_args(argv)
    common.require_cuda("profile_step.py")
    for name in args.models.split(","):
        for b in args.batch.split(","):
            for k in args.beams.split(","):
                run(name, int(b), int(k), args.table, new=args.new_tokens, table_new=args.table_new_tokens, gaps=args.gaps, host=args.host)


if __name__ == "__main__":
    main()
