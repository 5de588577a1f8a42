"""Where a patched text encoder's wall time goes under sustained load: kernels, gaps, clocks.

    python benchmarks/diag_encoder_power.py [--model t5-v1_1-xxl] [--case 1x512] [--out DIR]

The patched encoder (bench_encoder.py's random-weight model, bf16, one CUDA graph per shape)
after 5 warm-up calls:
- ms per call timed with CUDA events over 20 and over 200 calls back to back, while
  `nvidia-smi` samples SM clock, memory clock, power and the active throttle reasons every 50 ms
  (0x4: the software power cap);
- a profiler trace of 5 calls: per call, the span from its first kernel's start to its last
  kernel's end against the sum of its kernels' durations (the difference: idle gaps inside the
  graph), the largest gaps by kernel pair, and time by kernel;
- the same four GEMMs per layer alone (q/k/v packed, o, wi packed, wo; 24 layers at the case's
  token count), as one CUDA graph, timed the same way: what the GEMMs cost at the clocks this
  load holds.
Writes DIR/encoder_power.json (default DIR: benchmarks/results/<date>-<gpu>/, with its env.json).
"""

from __future__ import annotations

import argparse
import collections
import subprocess
import time

import torch

import common  # benchmarks/ is on sys.path

SMI_FIELDS = "timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"


def event_ms(fn, calls: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / calls


def trace(fn, calls: int = 5) -> list:
    """CUDA kernel events of `calls` calls, in start order."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return sorted(kernels, key=lambda e: e.time_range.start)


def gaps_and_kinds(kernels: list, calls: int) -> dict:
    per_call = len(kernels) // calls
    spans, sums, pairs, kinds = [], [], collections.defaultdict(list), collections.defaultdict(float)
    for c in range(calls):
        call = kernels[c * per_call:(c + 1) * per_call]
        spans.append((call[-1].time_range.end - call[0].time_range.start) / 1e3)
        sums.append(sum(e.time_range.end - e.time_range.start for e in call) / 1e3)
        for a, b in zip(call, call[1:]):
            pairs[(a.name[:40], b.name[:40])].append(b.time_range.start - a.time_range.end)
    for e in kernels:
        kinds[e.name[:50]] += (e.time_range.end - e.time_range.start) / calls / 1e3
    return dict(
        kernels_per_call=per_call, trace_span_ms=spans, trace_kernel_sum_ms=sums,
        gap_by_pair_us=sorted([(a, b, len(v) / calls, sum(v) / calls) for (a, b), v in pairs.items()],
                              key=lambda t: -t[3])[:15],
        kinds_ms=sorted(kinds.items(), key=lambda kv: -kv[1])[:15],
    )  # fmt: skip


def gemms_alone(config, tokens: int):
    """The encoder's GEMMs per layer (packed q/k/v, o, packed wi, wo) for `tokens` rows, 24
    layers' worth on one set of weights, captured as one CUDA graph; returns its replay."""
    d, inner, ff = config.d_model, config.num_heads * config.d_kv, config.d_ff
    gated = config.is_gated_act
    w = {"qkv": (3 * inner, d), "o": (d, inner), "wi": ((2 if gated else 1) * ff, d), "wo": (d, ff)}
    ws = {k: torch.randn(s, device="cuda", dtype=torch.bfloat16) * 0.02 for k, s in w.items()}
    x = torch.randn(tokens, d, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(tokens, ff, device="cuda", dtype=torch.bfloat16)
    linear = torch.nn.functional.linear

    def body():
        for _ in range(config.num_layers):
            linear(x, ws["qkv"]), linear(x, ws["o"]), linear(x, ws["wi"]), linear(h, ws["wo"])

    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        body()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    return graph


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="t5-v1_1-xxl", help="a model of bench_encoder.py")
    ap.add_argument("--case", default="1x512", help="batch x tokens, no mask")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    common.require_cuda("diag_encoder_power.py")
    import bench_encoder as be
    import hf_paged_t5 as hp

    out_dir = common.start_suite(args.out, "encoder-power")
    batch, length, _ = be.parse_case(args.case)
    model = be.build(args.model, "cuda").to(torch.bfloat16)
    hp.patch_model(model)
    ids, mask = be.inputs(model, (batch, length, False), "cuda")

    def fn():
        return be.call(model, ids, mask)

    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    res = dict(model=args.model, case=args.case)
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={SMI_FIELDS}", "--format=csv,noheader", "-lms", "50"],
                           stdout=subprocess.PIPE, text=True)
    time.sleep(0.3)
    res["event_ms_20"] = event_ms(fn, 20)
    time.sleep(0.5)
    res["event_ms_200"] = event_ms(fn, 200)
    time.sleep(0.3)
    smi.terminate()
    res["smi_fields"] = SMI_FIELDS
    res["smi"] = smi.communicate()[0].splitlines()[-60:]
    print(f"patched encoder, ms per call: {res['event_ms_20']:.3f} over 20 calls, {res['event_ms_200']:.3f} over 200")
    for line in res["smi"][::3]:
        print("  nvidia-smi:", line)
    res.update(gaps_and_kinds(trace(fn), 5))
    print("trace span per call (ms):", [round(s, 3) for s in res["trace_span_ms"]])
    print("kernel time per call (ms):", [round(s, 3) for s in res["trace_kernel_sum_ms"]])
    for row in res["gap_by_pair_us"][:8]:
        print("  gap (us per call):", row)
    for row in res["kinds_ms"]:
        print("  kernel (ms per call):", row)
    graph = gemms_alone(model.config, batch * length)
    res["gemm_graph_ms_20"] = event_ms(graph.replay, 20)
    res["gemm_graph_ms_200"] = event_ms(graph.replay, 200)
    kernels = trace(graph.replay)
    res["gemm_trace_span_ms"] = (kernels[-1].time_range.end - kernels[0].time_range.start) / 5e3
    res["gemm_trace_sum_ms"] = sum(e.time_range.end - e.time_range.start for e in kernels) / 5e3
    print(f"the GEMMs alone in a graph, ms per forward: {res['gemm_graph_ms_20']:.3f} over 20 calls, "
          f"{res['gemm_graph_ms_200']:.3f} over 200; trace span {res['gemm_trace_span_ms']:.3f}, "
          f"kernel sum {res['gemm_trace_sum_ms']:.3f}")
    common.write_json(out_dir / "encoder_power.json", res)


if __name__ == "__main__":
    main()
