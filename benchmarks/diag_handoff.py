"""What one dependent stage of a decode step costs: a kernel boundary against a handoff inside one
kernel, on the same work.

A graphed decode step at batch 1 is a chain of ~200 dependent kernels (8 per decoder layer), each
a GEMV over the whole output of the one before (t5-large on one H200, 2026-12-04: ~630 µs against
~200 µs of bytes; docs/performance.md). This
measures the chain's two ways of passing a vector from one stage to the next, with nothing else:
each stage is a [dim, dim] GEMV (bf16 weights, fp32 vectors) over the previous stage's output,
`programs` programs of dim / programs weight rows each, every program reading the whole input
vector, as the step's projections do. Variants, each captured in a CUDA graph (µs per stage: the
median of the replays' GPU time / stages):

- launches: one kernel launch per stage;
- pdl: the same launches as programmatic dependent launches; each program loads its weight rows
  before it waits for the kernel before it (`gdc_wait`), as the package's fused layer does;
- counters: one persistent launch of one program per SM for all stages. A program takes its
  stage's tasks in order (task t = stage * programs + index, program p runs t = p, p + P, ...),
  loads the task's weight rows, spins until the stage before has counted every one of its
  programs done (an acquire read of a counter in global memory), reads that stage's output from
  L2, stores its rows and counts itself done (release). Every program of the grid is resident at
  once (one per SM), so a spinning program never waits on one that cannot start.

The floor: the weights' bytes at the copy bandwidth measured in the same run. The vectors all
stages produce are checked against torch (float32 GEMVs over the same bf16 weights).

    python benchmarks/diag_handoff.py [--stages 96] [--dim 1024] [--programs 128,512]

Writes handoff.json (with env.json) under --out or benchmarks/results/<date>-<gpu>/.
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

import common  # benchmarks/ is on sys.path

VARIANTS = ("launches", "pdl", "counters")


@triton.jit
def _stage_kernel(x_ptr, w_ptr, out_ptr, dim, ROWS: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
    """out[rows of this program] = W[rows] @ x, one stage as one launch."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    live = cols < dim
    w = tl.load(w_ptr + rows[:, None] * dim + cols[None, :], mask=live[None, :], other=0.0)
    if PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + cols, mask=live, other=0.0)
    tl.store(out_ptr + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1))


@triton.jit
def _stages_kernel(vec_ptr, w_ptr, done_ptr, dim, stages, per_stage, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Every stage in one launch: vec[s + 1] = W[s] @ vec[s], handed over by done[s] counters."""
    cols = tl.arange(0, BLOCK_D)
    live = cols < dim
    for task in range(tl.program_id(0), stages * per_stage, tl.num_programs(0)):
        stage = task // per_stage
        rows = (task % per_stage) * ROWS + tl.arange(0, ROWS)
        w_off = stage.to(tl.int64) * dim * dim + rows[:, None] * dim + cols[None, :]
        w = tl.load(w_ptr + w_off, mask=live[None, :], other=0.0)  # before the wait: no stage writes it
        if stage > 0:
            seen = tl.atomic_add(done_ptr + stage - 1, 0, sem="acquire")
            while seen < per_stage:
                seen = tl.atomic_add(done_ptr + stage - 1, 0, sem="acquire")
        # .cg: from L2, where the other SMs' stores are (this SM's L1 may hold none of them).
        x = tl.load(vec_ptr + stage * dim + cols, mask=live, other=0.0, cache_modifier=".cg")
        tl.store(vec_ptr + (stage + 1) * dim + rows, tl.sum(w.to(tl.float32) * x[None, :], axis=1))
        # Every thread's stores precede the count (one thread takes it, release).
        tl.debug_barrier()
        tl.atomic_add(done_ptr + stage, 1, sem="release")


def build(stages: int, dim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [stages, dim, dim] bf16 scaled to keep the vectors' size, vectors [stages + 1, dim]
    fp32 with the input in row 0)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    weights = (torch.randn(stages, dim, dim, generator=gen) / dim**0.5).to(torch.bfloat16).to(device)
    vectors = torch.zeros(stages + 1, dim, dtype=torch.float32, device=device)
    vectors[0] = torch.randn(dim, generator=gen).to(device)
    return weights, vectors


def expected(weights: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """[stages, dim]: each stage's output by torch (float32 products over the same weights)."""
    out, x = [], first
    for w in weights:
        x = w.float() @ x
        out.append(x)
    return torch.stack(out)


def launcher(variant: str, weights: torch.Tensor, vectors: torch.Tensor, programs: int, persistent: int,
             num_warps: int = 4):
    """A function that runs every stage once (the variant's launches), for a CUDA graph to capture."""
    stages, dim, _ = weights.shape
    if dim % programs:
        raise ValueError(f"--programs must divide --dim: {programs} does not divide {dim}")
    rows, block_d = dim // programs, triton.next_power_of_2(dim)
    if variant == "counters":
        done = torch.zeros(stages, dtype=torch.int32, device=weights.device)

        def run():
            done.zero_()
            _stages_kernel[(persistent,)](vectors, weights, done, dim, stages, programs, ROWS=rows, BLOCK_D=block_d,
                                          num_warps=num_warps)
        return run
    pdl = variant == "pdl"
    options = {"launch_pdl": True} if pdl else {}

    def run():
        for s in range(stages):
            _stage_kernel[(programs,)](vectors[s], weights[s], vectors[s + 1], dim, ROWS=rows, BLOCK_D=block_d,
                                       PDL=pdl, num_warps=num_warps, **options)
    return run


def time_variant(variant: str, weights: torch.Tensor, vectors: torch.Tensor, programs: int, replays: int) -> dict:
    """Checked once eagerly, then captured and replayed: µs per stage and the largest error."""
    stages = weights.shape[0]
    run = launcher(variant, weights, vectors, programs, common.num_sms(weights.device))
    vectors[1:].zero_()
    run()
    torch.cuda.synchronize()
    want = expected(weights, vectors[0])
    error = ((vectors[1:] - want).abs().max() / want.abs().max()).item()
    replay_us = common.graph_us([run], replays)
    return dict(us_per_stage=replay_us / stages, replay_us=replay_us, max_rel_error=error)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stages", type=int, default=96)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--programs", default="128,512", help="programs per stage, comma-separated")
    ap.add_argument("--replays", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    common.require_cuda("diag_handoff.py")
    counts = [int(p) for p in args.programs.split(",") if p]
    device = torch.device("cuda")
    weights, vectors = build(args.stages, args.dim, device)
    bandwidth = common.copy_bandwidth(device, 1 << 30)  # GB/s
    floor_us = weights[0].numel() * weights.element_size() / bandwidth * 1e-3
    rows = []
    for programs in counts:
        for variant in VARIANTS:
            r = time_variant(variant, weights, vectors, programs, args.replays)
            rows.append(dict(variant=variant, programs=programs, **r))
            print(f"{variant} programs={programs}: {r['us_per_stage']:.3f} us/stage "
                  f"(error {r['max_rel_error']:.1e})", flush=True)
    folder = common.start_suite(args.out, "handoff")
    common.print_table(
        ["variant", "programs / stage", "µs per stage", "floor µs", "max rel. error"],
        [[r["variant"], r["programs"], f"{r['us_per_stage']:.3f}", f"{floor_us:.3f}", f"{r['max_rel_error']:.1e}"]
         for r in rows],
        title=f"{args.stages} stages of a [{args.dim}, {args.dim}] bf16 GEMV, one CUDA graph",
    )
    common.write_json(folder / "handoff.json", dict(
        stages=args.stages, dim=args.dim, copy_bandwidth_gbs=bandwidth, floor_us_per_stage=floor_us,
        persistent_programs=common.num_sms(device), rows=rows, environment=common.environment()))


if __name__ == "__main__":
    main()
