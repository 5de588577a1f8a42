"""A model split across devices with accelerate's device_map, patched: same tokens as stock HF.

    python benchmarks/multi_gpu_check.py [--devices cuda:0,cuda:1] [--shape flan-t5-xl] [--out DIR]

Writes DIR/multi-gpu-<devices>.json (default DIR: benchmarks/results/<date>-<gpu>/, with its env.json).

The first half of the encoder's and of the decoder's layers go on the first device, the rest
on the second (embeddings/lm_head on the first). `dispatch_model` runs with the *last* device
as main device, so a "cpu" entry really runs on the CPU (with a CUDA main device accelerate
would offload it instead). Checks, each printed and written to JSON:
  - fp32 greedy (batch 8, padded, 64 new tokens): tokens identical to unpatched HF, same map;
  - bf16 greedy runs, each decoder layer's KV pool on that layer's device;
  - beam search (4 beams) across the split: tokens identical to HF in fp32;
  - ms per decode step, HF vs patched, bf16.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import dispatch_model

import common  # benchmarks/ is on sys.path
import hf_paged_t5 as hp
from hf_paged_t5 import tiny


def build(shape: str, dtype: torch.dtype, devices: list[str]):
    model = tiny.build_model(shape, family="t5v1_1" if "flan" in shape else "t5", vocab_size=32128, dtype=dtype,
                             device=devices[0], initializer_factor=1.25)  # on the GPU: fast; 1.25: well-conditioned in fp32
    device_map = tiny.split_device_map(model, *devices)
    return dispatch_model(model, device_map=device_map, main_device=devices[-1]), device_map


def batch(rows: int, src_len: int, device: str):
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(2, 32000, (rows, src_len), generator=g)
    mask = torch.ones_like(ids)
    for r in range(1, rows, 2):
        mask[r, src_len - 17 * r:] = 0  # padded rows of different lengths
    return ids.to(device), mask.to(device)


def timed_generate(model, devices, **kw):
    model.generate(**{**kw, "max_new_tokens": 4, "min_new_tokens": 4})
    seconds, out = common.timed(lambda: model.generate(**kw), devices)
    return out, seconds / kw["max_new_tokens"] * 1e3


def hf_vs_patched(model, devices, **kw):
    ref, hf_ms = timed_generate(model, devices, **kw)
    hp.patch_model(model)
    try:
        out, paged_ms = timed_generate(model, devices, **kw)
        pool = common.kv_pool(model)
        if pool is None:
            raise RuntimeError("the paged path did not run (see the logged fallback reason)")
        pool_devices = [str(k.device) for k in pool.key_caches]
        idle = pool.is_idle()
    finally:
        hp.unpatch_model(model)
    ref, out = ref.cpu(), out.cpu()
    width = min(ref.shape[1], out.shape[1])
    agreement = float((ref[:, :width] == out[:, :width]).float().mean())
    return dict(identical=bool(torch.equal(ref, out)), token_agreement=agreement, hf_ms_per_step=hf_ms,
                paged_ms_per_step=paged_ms, pool_devices=pool_devices, pool_idle=idle)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--devices", default="cuda:0,cuda:1")
    ap.add_argument("--shape", default="flan-t5-xl")
    ap.add_argument("--out", default=None, help="folder for the JSON (default: benchmarks/results/<date>-<gpu>)")
    args = ap.parse_args(argv)
    devices = args.devices.split(",")
    for device in devices:
        common.require_cuda("multi_gpu_check.py", device)
    missing = [d for d in devices if d.startswith("cuda") and (torch.device(d).index or 0) >= torch.cuda.device_count()]
    if missing:
        raise SystemExit(f"multi_gpu_check.py: no {', '.join(missing)}: torch sees {torch.cuda.device_count()} GPU(s)")
    out = common.start_suite(args.out, "multi-gpu")
    results = {}
    model, device_map = build(args.shape, torch.float32, devices)
    expected = [device_map[f"decoder.block.{i}"] for i in range(len(model.decoder.block))]
    ids, mask = batch(8, 256, devices[0])
    results["fp32_greedy"] = hf_vs_patched(model, devices, input_ids=ids, attention_mask=mask,
                                           max_new_tokens=64, min_new_tokens=64)
    results["fp32_beam4"] = hf_vs_patched(model, devices, input_ids=ids[:4], attention_mask=mask[:4],
                                          max_new_tokens=32, num_beams=4)
    del model
    model, _ = build(args.shape, torch.bfloat16, devices)
    results["bf16_greedy"] = hf_vs_patched(model, devices, input_ids=ids, attention_mask=mask,
                                           max_new_tokens=64, min_new_tokens=64)
    ok = all(r["pool_devices"] == [str(torch.device(d)) for d in expected] and r["pool_idle"]
             for r in results.values())
    ok = ok and results["fp32_greedy"]["identical"] and results["fp32_beam4"]["identical"]
    for name, r in results.items():
        print(f"{name:12s} identical={r['identical']!s:5s} agreement={r['token_agreement']:.3f} HF {r['hf_ms_per_step']:7.2f} ms/step  "
              f"paged {r['paged_ms_per_step']:7.2f} ms/step  pools on {sorted(set(r['pool_devices']))}", flush=True)
    names = [torch.cuda.get_device_name(d) if d.startswith("cuda") else d for d in devices]
    report = dict(devices=devices, device_names=names, shape=args.shape, checks_passed=ok, results=results)
    tag = "x".join(d.replace(":", "") for d in devices)
    common.write_json(out / f"multi-gpu-{tag}.json", report)
    print(f"all checks passed: {ok}")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
