"""The feed-forward's `wo` projection at many rows: cuBLAS's GEMM against K-split partials that the
next add + RMSNorm kernel sums.

    python benchmarks/diag_wo_partials.py [--models t5-large,flan-t5-xl] [--rows 16,64,128,512]
                                          [--splits 2,4,8] [--proj wo|o] [--out DIR]

An op-by-op decode step (5+ rows) runs `wo` as one cuBLAS GEMM, which at 16-128 rows cuBLAS splits
over K and finishes with a `splitKreduce` kernel of its own; the layer's output then goes through
the next layer's add + RMSNorm kernel (`kernels.rms_norm(residual=...)`). Here the other way: `wo`
as one batched GEMM over S slices of K (`torch.bmm(..., out_dtype=torch.float32)`: S partial
products [S, rows, d_model] in float32) and the package's add + RMSNorm kernel given them
(`kernels.rms_norm(partials=...)`), which sums the partials in slice order, rounds the sum to the
activations' dtype (what the GEMM's output is), adds the residual and norms. The split-K reduce's
launch leaves the chain if cuBLAS runs the batched GEMM without splitting it again (the kernel
names say). The decode step serves two slices up to `split_k.MAX_ROWS` rows (`kernels.split_k_linear`);
this script measures any S at any rows.

Per model layout (t5-large: d_model 1,024, d_ff 4,096; flan-t5-xl: 2,048, 5,120), rows and S: 24
layers of distinct bf16 weights replayed in one CUDA graph, µs per layer (median of 50 replays), the
kernels of one replay by name (launches, µs), and each variant's error against float64 on the first
layer (max |out - ref| / max |ref| of the normed output; the residual sum's too). Writes
DIR/wo_partials.json (default DIR: benchmarks/results/<date>-<gpu>/).

`--device cpu` (with TRITON_INTERPRET=1) runs the kernel at a tiny width in float32 (the
interpreter's bf16 casts do not round as a GPU's do) and prints its error against float64, no
timing: what the tests check.

`--proj o` measures an attention output projection `o` the same way (K = heads x d_kv, which is
d_model in both layouts) followed by the add + RMSNorm that opens the next sub-layer; it writes
DIR/o_partials.json.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

import common  # benchmarks/ is on sys.path (the scripts' import rule)

from hf_paged_t5.kernels.rmsnorm import rms_norm

LAYOUTS = {"t5-large": (1024, 4096), "flan-t5-xl": (2048, 5120), "tiny": (48, 96)}
LAYERS = 24
EPS = 1e-6


def split_partials(x: torch.Tensor, wo: torch.Tensor, splits: int) -> torch.Tensor:
    """[splits, rows, d_model] float32: x[:, slice s] @ wo[:, slice s]^T for each of `splits` equal
    slices of d_ff, as one batched GEMM (strided views, no copies)."""
    rows, d_ff = x.shape
    d_model = wo.shape[0]
    if d_ff % splits:
        raise ValueError(f"d_ff {d_ff} does not split into {splits} equal slices")
    xs = x.view(rows, splits, d_ff // splits).transpose(0, 1)  # [S, rows, d_ff / S]
    ws = wo.view(d_model, splits, d_ff // splits).permute(1, 2, 0)  # [S, d_ff / S, d_model]
    if x.is_cuda and x.dtype != torch.float32:
        return torch.bmm(xs, ws, out_dtype=torch.float32)  # half-precision operands, float32 products
    return torch.bmm(xs.float(), ws.float())  # the CPU has no mixed-dtype bmm: the same products in float32


def partials_add_norm(partials: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float = EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + sum of partials), residual + sum): the package's add + RMSNorm kernel
    given the sub-layer output as float32 partials [S, rows, d_model] (`rms_norm(partials=...)`)."""
    return rms_norm(hidden=residual, weight=weight, eps=eps, partials=partials)


def reference(x: torch.Tensor, wo: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
              eps: float = EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 (normed, sum) of the same layer."""
    total = residual.double() + x.double() @ wo.double().t()
    normed = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps)
    return weight.double() * normed, total


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).abs().max() / want.abs().max())


def errors(x, wo, residual, weight, splits_list) -> dict:
    """Each variant's error against float64 on one layer: {variant: [normed, sum]}."""
    want = reference(x, wo, residual, weight)
    res = {}
    out, total = rms_norm(hidden=residual, weight=weight, eps=EPS, residual=F.linear(x, wo))
    res["cublas"] = [rel_error(out, want[0]), rel_error(total, want[1])]
    for s in splits_list:
        out, total = partials_add_norm(split_partials(x, wo, s), residual, weight)
        res[f"partials-{s}"] = [rel_error(out, want[0]), rel_error(total, want[1])]
    return res


def build(d_model: int, d_ff: int, rows: int, layers: int, device, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    wo = [(torch.randn(d_model, d_ff, generator=g) * d_ff ** -0.5).to(device, dtype) for _ in range(layers)]
    xs = [torch.randn(rows, d_ff, generator=g).relu().to(device, dtype) for _ in range(layers)]
    hs = [torch.randn(rows, d_model, generator=g).to(device, dtype) for _ in range(layers)]
    weight = (1 + 0.1 * torch.randn(d_model, generator=g)).to(device, dtype)
    return wo, xs, hs, weight


def graph_profile(fn, replays: int = 50) -> tuple[float, dict]:
    """(median µs of one replay of `fn` captured as a CUDA graph, its kernels by name:
    `common.graph_kernels`)."""
    graph = common.capture_graph([fn])
    us = common.median(common.replay_times_us(graph, replays))
    _, names = common.graph_kernels(graph)
    del graph
    return us, names


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="t5-large,flan-t5-xl", help=f"layouts among {', '.join(LAYOUTS)}")
    ap.add_argument("--rows", default="16,64,128,512")
    ap.add_argument("--splits", default="2,4,8")
    ap.add_argument("--proj", choices=("wo", "o"), default="wo",
                    help="the projection: the feed-forward's wo (K = d_ff) or attention's o (K = d_model)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    splits_list = [int(s) for s in args.splits.split(",")]
    models = args.models.split(",")
    unknown = [m for m in models if m not in LAYOUTS]
    if unknown:
        ap.error(f"unknown layout(s) {unknown}; choose among {list(LAYOUTS)}")
    if args.device == "cpu":  # the kernel against float64 at a tiny width, no timing
        wo, xs, hs, weight = build(*LAYOUTS["tiny"], rows=5, layers=1, device="cpu", dtype=torch.float32)
        for name, (normed, total) in errors(xs[0], wo[0], hs[0], weight, splits_list).items():
            print(f"{name:12s} error vs float64: normed {normed:.2e}, sum {total:.2e}")
        return
    common.require_cuda("diag_wo_partials.py", "cuda")
    try:  # torch's mixed-dtype bmm (bf16 operands, float32 output), before any timing
        torch.bmm(torch.ones(1, 2, 2, device="cuda", dtype=torch.bfloat16),
                  torch.ones(1, 2, 2, device="cuda", dtype=torch.bfloat16), out_dtype=torch.float32)
    except (TypeError, RuntimeError) as exc:
        raise SystemExit(f"diag_wo_partials.py: torch {torch.__version__} has no bmm(out_dtype=float32) on this "
                         f"GPU ({exc}); it needs a torch that has") from None
    out = common.start_suite(args.out, f"{args.proj}_partials")
    rows_out = []
    for model in models:
        d_model, d_ff = LAYOUTS[model]
        d_in = d_ff if args.proj == "wo" else d_model
        for rows in (int(r) for r in args.rows.split(",")):
            wo, xs, hs, weight = build(d_model, d_in, rows, LAYERS, "cuda")

            def cublas():
                for i in range(LAYERS):
                    rms_norm(hidden=hs[i], weight=weight, eps=EPS, residual=F.linear(xs[i], wo[i]))

            variants = {"cublas": cublas}
            for s in splits_list:
                def partials(s=s):
                    for i in range(LAYERS):
                        partials_add_norm(split_partials(xs[i], wo[i], s), hs[i], weight)
                variants[f"partials-{s}"] = partials
            errs = errors(xs[0], wo[0], hs[0], weight, splits_list)
            for name, fn in variants.items():
                us, names = graph_profile(fn)
                row = dict(model=model, proj=args.proj, k=d_in, rows=rows, variant=name,
                           us_per_layer=us / LAYERS,
                           kernels_per_layer=sum(n for n, _ in names.values()) / LAYERS, kernels=names,
                           error_normed=errs[name][0], error_sum=errs[name][1])
                rows_out.append(row)
                print(f"{model:10s} {args.proj:2s} rows {rows:4d} {name:11s}: "
                      f"{row['us_per_layer']:6.2f} µs/layer, "
                      f"{row['kernels_per_layer']:.1f} kernels/layer, error {row['error_normed']:.2e} "
                      f"(sum {row['error_sum']:.2e}); {sorted(names)}", flush=True)
    common.write_json(out / f"{args.proj}_partials.json",
                      dict(gpu=torch.cuda.get_device_name(), layers=LAYERS, rows=rows_out))


if __name__ == "__main__":
    main()
