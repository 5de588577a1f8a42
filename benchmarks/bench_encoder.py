"""Text encoders: `T5EncoderModel` / `UMT5EncoderModel` patched vs stock HF, stock + torch.compile
and nai-t5-wrapper (when importable), in one process, one run.

    python benchmarks/bench_encoder.py [--models t5-v1_1-xxl,umt5-xxl] [--cases 1x77,1x512,2x512p]
        [--systems sdpa,compile,nai-sdpa,nai-flex,paged[,paged-unpacked]] [--profile] [--first-call] [--out DIR]
    python benchmarks/bench_encoder.py --quick --device cpu      (a smoke run)

Random weights at the real layouts, bf16 (fp32 on the CPU), called the way diffusion pipelines
call a text encoder: `encoder(input_ids, attention_mask=...)[0]`, no mask at full length (Flux,
SD3), a right-padded mask for `2x512p` (PixArt: the second row 300 real tokens). Each system:
5 calls of warm-up (the patched encoder captures a shape's graph at its second call), then the
mean of 20 calls. torch.compile's and the Flex variant's compile seconds are their first call's.
Accuracy: each system's relative error (Frobenius, real positions only) against the same
weights in float32 (stock HF, TF32 off), and its ratio to stock bf16's own error.

`--profile`: the patched forward's CUDA kernels (torch.profiler over 3 calls): the count per
forward and the 12 longest by total time. `--first-call`: a fresh process with an empty Triton
cache loads the saved checkpoint, patches it and times `patch_model` and its first three 1 x 512
calls (compiles; the graph capture; a replay). Triton's one-time start-up (`triton_start.py`)
runs on a thread from `import hf_paged_t5` on, while the checkpoint loads.

Floor per case: max(bytes read / read bandwidth, FLOPs / bf16 GEMM rate) (the weights read once;
2 FLOPs per weight per token plus the attention), at the GPU's rates measured in the run (a read
pass over 1 GiB, a bf16 8192^3 GEMM; the JSON's `floor_rates`); off a GPU at the H200 figures of
the encoder issue (4.3 TB/s, 790 TFLOP/s).
Writes DIR/encoder.json (default DIR: benchmarks/results/<date>-<gpu>/, with its env.json).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import torch
from transformers import T5EncoderModel, UMT5EncoderModel

import common  # benchmarks/ is on sys.path
import hf_paged_t5 as hp
from hf_paged_t5 import tiny

XXL = dict(d_model=4096, d_ff=10240, d_kv=64, num_heads=64, num_layers=24)
# name: (tiny family, tiny shape, config overrides, encoder class)
MODELS = {
    "t5-v1_1-xxl": ("t5v1_1", "flan-t5-xl", XXL, T5EncoderModel),
    "umt5-xxl": ("umt5", "flan-t5-xl", dict(XXL, vocab_size=256384), UMT5EncoderModel),
    "t5-large": ("t5", "t5-large", {}, T5EncoderModel),
    "flan-t5-xl": ("t5v1_1", "flan-t5-xl", {}, T5EncoderModel),
    "tiny-t5v1_1": ("t5v1_1", "tiny", {}, T5EncoderModel),
    "tiny-umt5": ("umt5", "tiny", {}, UMT5EncoderModel),
}
SYSTEMS = ("sdpa", "compile", "nai-sdpa", "nai-flex", "paged", "paged-unpacked")
# `paged-unpacked`: patched with `pack_projections=False` (one GEMM per projection), an A/B row
DEFAULT_SYSTEMS = SYSTEMS[:-1]
PADDED_LEN = 300  # real tokens of the padded row in a `...p` case
# The floor's rates off a GPU (the H200 figures of the encoder issue); on a GPU, measured (`rates`).
HBM_BYTES_PER_S, BF16_FLOPS = 4.3e12, 790e12
RESULT_PREFIX = "first-call-result: "


def parse_case(text: str) -> tuple[int, int, bool]:
    padded = text.endswith("p")
    batch, length = text.rstrip("p").split("x")
    return int(batch), int(length), padded


def build(name: str, device: str) -> torch.nn.Module:
    family, shape, overrides, cls = MODELS[name]
    config = tiny.build_config(shape, family=family, **overrides)
    config._attn_implementation = "sdpa"
    with torch.device(device):
        torch.manual_seed(0)
        model = cls(config)
    return model.float().eval()


def inputs(model, case, device: str):
    batch, length, padded = case
    g = torch.Generator().manual_seed(batch * 1000 + length)
    ids = torch.randint(2, model.config.vocab_size, (batch, length), generator=g).to(device)
    if not padded:
        return ids, None
    mask = torch.ones_like(ids)
    mask[1:, PADDED_LEN:] = 0
    return ids, mask


def call(model, ids, mask):
    with torch.inference_mode():
        return model(ids, attention_mask=mask)[0] if mask is not None else model(ids)[0]


def ms_per_call(fn, device: str, warmup: int, repeats: int) -> tuple[float, float, torch.Tensor]:
    """(first call's seconds, mean ms of `repeats` calls after `warmup` calls, the last output)."""
    first, out = common.timed(fn, device)
    for _ in range(warmup - 1):
        out = fn()
    seconds, out = common.timed(lambda: [fn() for _ in range(repeats)][-1], device)
    return first, seconds / repeats * 1e3, out


def rel_error(out: torch.Tensor, ref: torch.Tensor, mask) -> float:
    keep = torch.ones(ref.shape[:2], dtype=torch.bool, device=ref.device) if mask is None else mask.bool()
    diff = out.float()[keep] - ref[keep]
    return float(diff.norm() / ref[keep].norm())


def rates(device: str) -> dict:
    """The floor's rates: on a GPU a read pass over 1 GiB and a bf16 8192^3 GEMM, measured; off
    one, the H200 figures of the encoder issue."""
    if not device.startswith("cuda"):
        return dict(hbm_bytes_per_s=HBM_BYTES_PER_S, bf16_flops=BF16_FLOPS, measured=False)
    dev = torch.device(device)
    return dict(hbm_bytes_per_s=common.read_bandwidth(dev, 1 << 30) * 1e9,
                bf16_flops=common.gemm_tflops(dev) * 1e12, measured=True)


def floor_ms(model, case, rate: dict) -> float:
    batch, length, padded = case
    c = model.config
    tokens = batch * length if not padded else length + (batch - 1) * PADDED_LEN
    weights = sum(p.numel() for n, p in model.named_parameters() if "shared" not in n and "embed" not in n)
    inner = c.num_heads * c.d_kv
    flops = 2 * weights * tokens + 4 * c.num_layers * inner * batch * length * length
    return max(weights * 2 / rate["hbm_bytes_per_s"], flops / rate["bf16_flops"]) * 1e3


def profile(fn, calls: int = 3) -> dict:
    """CUDA kernels of `calls` calls of fn: count per call and the 12 longest by total time."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        by_name.setdefault(e.name, []).append(e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total)
    top = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))[:12]
    return dict(kernels_per_call=len(kernels) / calls,
                gpu_ms_per_call=sum(sum(v) for v in by_name.values()) / calls / 1e3,
                top=[dict(kernel=name[:90], calls_per_forward=len(v) / calls, ms_per_forward=sum(v) / calls / 1e3)
                     for name, v in top])


def nai_model(checkpoint: str, flex: bool, device: str):
    from nai_t5_wrapper import NAIT5EncoderModel

    model = NAIT5EncoderModel.from_pretrained(checkpoint, dtype=torch.bfloat16, device_map=device,
                                              use_flex_attention=flex)
    return model.compile() if flex else model


def first_call_worker(checkpoint: str, model_name: str, device: str, length: int) -> None:
    """In a fresh process: load, patch, time the first three calls of one 1 x `length` input."""
    cls = MODELS[model_name][3]
    model = cls.from_pretrained(checkpoint, dtype=torch.bfloat16 if device == "cuda" else torch.float32).to(device).eval()
    patch_s = common.timed(lambda: hp.patch_model(model), device)[0]
    ids = torch.randint(2, model.config.vocab_size, (1, length), device=device)
    times = [common.timed(lambda: call(model, ids, None), device)[0] for _ in range(3)]
    print(RESULT_PREFIX + json.dumps(dict(patch_s=patch_s, first_s=times[0], second_s=times[1], third_s=times[2])),
          flush=True)


def first_call(checkpoint: str, model_name: str, device: str, length: int) -> dict:
    cache = tempfile.mkdtemp(prefix="triton-cold-")
    env = {**os.environ, "TRITON_CACHE_DIR": cache,
           "PYTHONPATH": os.pathsep.join(filter(None, [str(common.REPO), str(common.BENCH),
                                                       os.environ.get("PYTHONPATH")]))}
    argv = [sys.executable, __file__, "--worker", checkpoint, "--models", model_name, "--device", device,
            "--worker-length", str(length)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=common.REPO, check=False)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        return dict(error=f"exit {proc.returncode}: {proc.stderr[-1500:]}")
    return json.loads(lines[-1][len(RESULT_PREFIX):])


def bench_model(name: str, args, checkpoint_root: pathlib.Path, rate: dict) -> list[dict]:
    device = args.device
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    reference = build(name, device)
    model = copy.deepcopy(reference).to(dtype)
    cases = [parse_case(c) for c in args.cases.split(",")]
    rows = {case: dict(model=name, case=f"{case[0]}x{case[1]}{'p' if case[2] else ''}",
                       floor_ms=floor_ms(model, case, rate), systems={}) for case in cases}
    feeds = {case: inputs(model, case, device) for case in cases}
    for case, (ids, mask) in feeds.items():  # float32 (TF32 is off by default)
        rows[case]["ref"] = call(reference, ids, mask).float()
    del reference
    systems = args.systems.split(",")
    checkpoint = None
    if any(s.startswith("nai") for s in systems) or args.first_call:
        checkpoint = str(checkpoint_root / name)
        model.save_pretrained(checkpoint)

    def record(system: str, case, fn):
        ids, mask = feeds[case]
        first_s, ms, out = ms_per_call(fn, device, args.warmup, args.repeats)
        rows[case]["systems"][system] = dict(ms=ms, first_call_s=first_s,
                                             rel_error=rel_error(out, rows[case]["ref"], mask))
        print(f"{name} {rows[case]['case']} {system}: {ms:.3f} ms (first call {first_s:.2f} s)", flush=True)

    for system in systems:
        if system == "sdpa":
            for case, (ids, mask) in feeds.items():
                record(system, case, lambda: call(model, ids, mask))
        elif system in ("paged", "paged-unpacked"):
            hp.patch_model(model, hp.PagedCacheConfig(pack_projections=system == "paged"))
            try:
                for case, (ids, mask) in feeds.items():
                    record(system, case, lambda: call(model, ids, mask))
                    if args.profile and device == "cuda" and system == "paged":
                        rows[case]["paged_profile"] = profile(lambda: call(model, ids, mask))
            finally:
                hp.unpatch_model(model)
        elif system == "compile":
            compiled = torch.compile(model)
            for case, (ids, mask) in feeds.items():
                record(system, case, lambda: call(compiled, ids, mask))
            del compiled
            torch._dynamo.reset()
        elif system.startswith("nai"):
            try:
                nai = nai_model(checkpoint, system == "nai-flex", device)
            except ImportError as exc:
                print(f"{system}: skipped ({exc})", flush=True)
                continue
            for case, (ids, mask) in feeds.items():
                record(system, case, lambda: nai(ids, attention_mask=mask).last_hidden_state)
            del nai
            torch._dynamo.reset()
    for row in rows.values():
        del row["ref"]
        stock = row["systems"].get("sdpa")
        for system, r in row["systems"].items():
            if stock:
                r["error_vs_stock_bf16"] = r["rel_error"] / stock["rel_error"] if stock["rel_error"] else None
                r["speedup_vs_stock"] = stock["ms"] / r["ms"]
    if args.first_call and device == "cuda":
        result = first_call(checkpoint, name, device, 512)
        for row in rows.values():
            row["paged_fresh_process_1x512"] = result
        print(f"{name} fresh process, empty Triton cache, 1 x 512: {result}", flush=True)
    return list(rows.values())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=None, help="folder for encoder.json (default: benchmarks/results/<date>-<gpu>)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--models", default="t5-v1_1-xxl,umt5-xxl", help=f"comma-separated, of {', '.join(MODELS)}")
    ap.add_argument("--cases", default="1x77,1x512,2x512p", help="BATCHxLENGTH[p], p: the rows after the first "
                                                                 f"padded to {PADDED_LEN} tokens")
    ap.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS), help=f"comma-separated, of {', '.join(SYSTEMS)}")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="profile the patched forward's kernels (GPU)")
    ap.add_argument("--first-call", action="store_true", help="the patched first calls in a fresh process (GPU)")
    ap.add_argument("--quick", action="store_true", help="tiny layouts, stock and patched, few calls (CPU is fine)")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-length", type=int, default=512, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return first_call_worker(args.worker, args.models, args.device, args.worker_length)
    if args.quick:
        args.models, args.cases, args.systems, args.warmup, args.repeats = (
            "tiny-t5v1_1,tiny-umt5", "1x16,2x32p", "sdpa,paged", 3, 3)
    unknown = [m for m in args.models.split(",") if m not in MODELS] + [
        s for s in args.systems.split(",") if s not in SYSTEMS]
    if unknown:
        ap.error(f"unknown model or system: {', '.join(unknown)}")
    for case in args.cases.split(","):
        try:
            parse_case(case)
        except ValueError:
            ap.error(f"--cases: {case!r} is not BATCHxLENGTH[p], e.g. 1x77 or 2x512p")
    common.require_cuda("bench_encoder.py", args.device)
    out = common.start_suite(args.out, "encoder")
    rows, rate = [], rates(args.device)
    with tempfile.TemporaryDirectory(prefix="encoder-ckpt-") as root:
        for name in args.models.split(","):
            rows += bench_model(name, args, pathlib.Path(root), rate)
            if args.device == "cuda":
                torch.cuda.empty_cache()
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    common.write_json(out / "encoder.json", dict(gpu=gpu, dtype=dtype, warmup=args.warmup, repeats=args.repeats,
                                                 padded_row_tokens=PADDED_LEN, rows=rows,
                                                 floor_rates=rate))
    systems = [s for s in SYSTEMS if any(s in r["systems"] for r in rows)]
    common.print_table(
        ["model", "case", "floor ms", *[f"{s} ms" for s in systems], *[f"{s} err/stock" for s in systems]],
        ([r["model"], r["case"], f"{r['floor_ms']:.2f}",
          *[common.fmt(r["systems"].get(s, {}).get("ms"), ".2f") for s in systems],
          *[common.fmt(r["systems"].get(s, {}).get("error_vs_stock_bf16"), ".2f") for s in systems]] for r in rows),
        title=f"ms per encoder forward, {dtype}, mean of {args.repeats} calls after {args.warmup}")
    for r in rows:
        if "paged_profile" in r:
            p = r["paged_profile"]
            common.print_table(["kernel", "calls / forward", "ms / forward"],
                               ([t["kernel"], f"{t['calls_per_forward']:g}", f"{t['ms_per_forward']:.3f}"]
                                for t in p["top"]),
                               title=f"{r['model']} {r['case']} patched: {p['kernels_per_call']:g} kernels, "
                                     f"{p['gpu_ms_per_call']:.3f} ms of GPU time per forward")


if __name__ == "__main__":
    main()
