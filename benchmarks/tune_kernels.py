"""Sweep the launch knobs of the Triton kernels on the GPU; print and save the best per shape.

    python benchmarks/tune_kernels.py [--out DIR] [--budget SECONDS] [--only decode|prefill] [--shapes A,B] [--jobs N]

One run (< 4 minutes on an H200 with the default 140 s sweep budget, half of it for decode;
`--only` gives one section the whole budget) measures, in this order:
- copy bandwidth (a 2 GiB device-to-device copy, bytes read + written / time);
- paged decode, bf16, 16 heads, block_size 16, head_dim 64 and 128: 1 x 16384 and 64 x 2048
  keys (bandwidth: % of copy bandwidth), the graph-replayed decode step of t5-large at batch 1
  (self-attention over 128 keys with the causal bias table in a 256-key table,
  cross-attention over 512 keys), 16 x 512 cross-attention and a batch-64 step's self- and
  cross-attention (64 x 96 self, 64 and 128 x 512 cross). Every decode config and the
  SDPA baseline are timed per call inside a CUDA graph (so the Python launch cost, ~tens of
  µs, never hides the kernel, and the step runs that way), the calls cycling over copies of
  the KV that together pass 3x the L2 size, so K/V are read cold;
- varlen encoder prefill (bidirectional, bias table), 16 heads x 64, bf16, 16 x 512,
  4 x 2048, 1 x 8192 and 32 x 512 tokens (do_bench, L2 cleared; the default, the best and
  SDPA also per call inside a CUDA graph), against SDPA with the materialized
  [1, heads, L, L] bias, SDPA without bias (flash speed) and our best config without bias
  (what the bias costs us).
Every config is first checked against `hf_paged_t5.reference` (fp32 maths); a config that
fails the check, fails to compile or runs out of resources is recorded and skipped. Each
pass's kernels are first compiled by `--jobs` worker processes at once (they fill Triton's
disk cache, which the measuring process then reads), so the sweep is not one compile at a
time. Decode: a first pass sweeps tile size x warps around the heuristic (one row over long
keys: tile x warps x splits, plus the async-copy loop), a second tries, on the two best,
pipelining depth, the three K/V prefetch schemes and the fused split merge, a third split
counts around the best. Prefill: a first pass over tile shapes with and without the widened
(Toeplitz) bias table and the band split, then pipelining depth on the two best and the
toeplitz / band-split toggles of the best. The best config per shape is printed as Python
(`DecodeConfig(...)`, `PrefillConfig(...)`) to paste into `decode_config` / `prefill_config`,
and everything goes to DIR/tune.json (written after every shape; default DIR:
benchmarks/results/<date>-<gpu>/, with its env.json). `--quick` runs tiny shapes (CPU: Triton
interpreter) to check the script itself.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import multiprocessing
import os
import time

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

import common  # noqa: E402  (benchmarks/ is on sys.path)
from hf_paged_t5 import reference  # noqa: E402
from hf_paged_t5.kernels import paged_decode, prefill  # noqa: E402
from hf_paged_t5.kernels.decode import DecodeConfig, decode_config  # noqa: E402
from hf_paged_t5.kernels.prefill import PrefillConfig, prefill_config  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
BLOCK_SIZE = 16
HEADS = 16
TOLERANCE = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 2e-5}


class Sweep:
    """The configs measured for one shape, pass after pass: each config once, compiled ahead by
    the workers, until the time budget runs out (the first config is always measured)."""

    def __init__(self, kind: str, shape, measure, compiler, clock, result: dict) -> None:
        self.kind, self.shape, self.measure, self.compiler, self.clock, self.result = (
            kind, shape, measure, compiler, clock, result)
        self.rows: list[dict] = []
        self.seen: set = set()

    def run(self, configs: list) -> None:
        configs = [c for c in dict.fromkeys(configs) if c not in self.seen]
        self.compiler.warm(self.kind, self.shape, configs, self.clock)
        for cfg in configs:
            if self.clock.left() < 0 and self.rows:
                self.result["skipped"] = "time budget"
                return
            self.seen.add(cfg)
            self.rows.append(self.measure(cfg))


class Clock:
    """The run's time budget: sections check it and skip what no longer fits."""

    def __init__(self, budget_s: float) -> None:
        self.start = time.perf_counter()
        self.budget_s = budget_s

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)


def bench_ms(fn) -> float:
    """Median ms of `fn()` (triton's do_bench: L2 cleared before every call; CPU: one call)."""
    return common.kernel_ms(fn, warmup=5, rep=30, cpu_calls=1)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def error_text(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"


def l2_bytes() -> int:
    if not CUDA:
        return 2**20
    return int(getattr(torch.cuda.get_device_properties(DEVICE), "L2_cache_size", 50 * 2**20))


def num_sms() -> int:
    return common.num_sms(DEVICE)


# ----------------------------------------------------------------------------- compile pool


def compile_job(section: str, shape: dict, config: dict) -> str:
    """In a worker: run `config` once at `shape` (bf16), which compiles its kernels into
    Triton's disk cache. Returns '' or the error (the measuring process records it itself)."""
    try:
        if section == "decode":
            data = decode_inputs(shape, torch.bfloat16, copies=1)
            paged_decode(block_table=data["tables"][0], config=DecodeConfig(**config), **decode_args(data))
        else:
            prefill(**prefill_args(dict(shape, batch=1), torch.bfloat16), config=PrefillConfig(**config))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return ""
    except Exception as exc:  # compile failures, out of resources: the measuring pass records them
        return error_text(exc)


def kernel_key(section: str, shape: dict, cfg) -> tuple:
    """What tells one compiled kernel of a sweep from another (what the shapes share is left out:
    every sweep shape gives the same integer specialisations). Decode: every split count above
    one runs the same kernel, unless the merge is fused (its split count, to a power of two)."""
    if section == "prefill":
        return (section, shape["head_dim"], cfg)
    splits = triton.next_power_of_2(cfg.num_splits) if cfg.fused_combine else min(cfg.num_splits, 2)
    return (section, shape["head_dim"], shape["bias"], cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.prefetch, splits)


class Compiler:
    """Worker processes that compile a pass's configs at once before the pass measures them.

    Without CUDA, or with jobs 0, or if the pool cannot start, it does nothing and every
    config compiles in the measuring process on first use, one at a time.
    """

    def __init__(self, jobs: int) -> None:
        self.pool = None
        self.submitted: set = set()
        if CUDA and jobs > 0:
            try:
                spawn = multiprocessing.get_context("spawn")  # CUDA cannot be forked
                self.pool = concurrent.futures.ProcessPoolExecutor(jobs, mp_context=spawn)
            except Exception as exc:  # e.g. no /dev/shm: fall back to compiling on first use
                print(f"compile pool unavailable ({error_text(exc)}); compiling one at a time", flush=True)

    def warm(self, section: str, shape: dict, configs: list, clock: Clock) -> None:
        """Compile `configs` of `section` at `shape` in the workers; wait at most the budget left."""
        if self.pool is None or clock.left() < 0:
            return
        jobs = {}
        for cfg in configs:
            key = kernel_key(section, shape, cfg)
            if key not in self.submitted and key not in jobs:
                jobs[key] = cfg
        self.submitted.update(jobs)
        try:
            futures = [self.pool.submit(compile_job, section, shape, cfg.__dict__.copy()) for cfg in jobs.values()]
        except Exception as exc:  # a broken pool (a worker died): compile on first use from now on
            print(f"compile pool failed ({error_text(exc)}); compiling one at a time", flush=True)
            self.close()
            self.pool = None
            return
        concurrent.futures.wait(futures, timeout=max(1.0, clock.left()))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


# ----------------------------------------------------------------------------- decode


def decode_inputs(shape: dict, dtype: torch.dtype, copies: int) -> dict:
    """A shuffled pool with `copies` disjoint sets of block tables for `shape`'s rows.

    key_cache, value_cache: [num_blocks, BLOCK_SIZE, HEADS, head_dim]
    tables: [copies, batch, width] int32 (width from the table capacity; spare columns -> block 0)
    """
    batch, keys, head_dim = shape["batch"], shape["keys"], shape["head_dim"]
    per_row = triton.cdiv(keys, BLOCK_SIZE)
    width = max(per_row, triton.cdiv(shape.get("capacity", keys), BLOCK_SIZE))
    num_blocks = copies * batch * per_row
    key_cache = torch.randn(num_blocks, BLOCK_SIZE, HEADS, head_dim, device=DEVICE, dtype=dtype)
    value_cache = torch.randn_like(key_cache)
    ids = torch.randperm(num_blocks, device=DEVICE).to(torch.int32).view(copies, batch, per_row)
    tables = torch.zeros(copies, batch, width, dtype=torch.int32, device=DEVICE)
    tables[:, :, :per_row] = ids
    seq_lens = torch.full((batch,), keys, dtype=torch.int32, device=DEVICE)
    query = torch.randn(batch, HEADS, head_dim, device=DEVICE, dtype=dtype)
    bias = {"bias_table": torch.randn(HEADS, 129, device=DEVICE)} if shape["bias"] else {}
    return dict(key_cache=key_cache, value_cache=value_cache, tables=tables, seq_lens=seq_lens, query=query, bias=bias)


def decode_args(data: dict) -> dict:
    """`paged_decode` keyword arguments of `decode_inputs` data, all but the block table."""
    return dict(query=data["query"], key_cache=data["key_cache"], value_cache=data["value_cache"],
                seq_lens=data["seq_lens"], scale=1.0, **data["bias"])  # fmt: skip


def long_row(shape: dict) -> bool:
    """Few (row, head) pairs over long keys: the flash-decoding case, swept over splits too."""
    return shape["batch"] * HEADS < num_sms() and shape["keys"] >= 4096


def decode_candidates(shape: dict, base: DecodeConfig, quick: bool) -> list[DecodeConfig]:
    """First pass: tile size x warps around the heuristic, at its split count (long rows:
    the whole grid of tile size x warps x splits, every point cheap once compiled, 8 warps on
    8K-element tiles, and the async-copy loop 3 stages deep at the likely split counts)."""
    padded = common.padded_head_dim(shape["head_dim"])
    low, high = (256, 4096) if quick else (1024, 16384)
    tiles = [n for n in (16, 32, 64, 128, 256) if low <= n * padded <= high]
    if long_row(shape):
        splits = [s for s in (32, 64, 16, 128, 8) if s * 128 <= shape["keys"]]
        configs = [DecodeConfig(n, w, 1, s) for s in splits for n in tiles if n * padded <= 8192 for w in (4, 2, 1)]
        configs += [DecodeConfig(8192 // padded, 8, 1, s) for s in splits]
        configs += [DecodeConfig(n, 4, 3, s, prefetch="async") for s in splits[:2] for n in tiles if n * padded <= 8192]
    else:
        near = [n for n in tiles if base.block_n // 2 <= n <= base.block_n * 2]
        warps = (2, 4, 8) if shape["batch"] * HEADS < num_sms() else (4, 8)
        configs = [DecodeConfig(n, w, 1, base.num_splits) for n in near for w in warps]
    return [base] + [c for c in configs if c != base]


def decode_second_pass(ranked: list[DecodeConfig]) -> list[DecodeConfig]:
    """On the two best: pipelining depth, the three prefetch schemes, the fused split merge."""
    configs = []
    for cfg in ranked[:2]:
        merges = (False, True) if cfg.num_splits > 1 else (False,)
        if cfg.prefetch == "async":
            configs += [dataclasses.replace(cfg, num_stages=s) for s in (2, 4)]
        else:
            configs += [dataclasses.replace(cfg, num_stages=2)]
        for prefetch in ("tile", "table", "async"):
            stages = 3 if prefetch == "async" else 1
            configs += [dataclasses.replace(cfg, prefetch=prefetch, num_stages=stages, fused_combine=m) for m in merges]
    return configs


def decode_third_pass(shape: dict, best: DecodeConfig) -> list[DecodeConfig]:
    """Split counts around the best (long rows: x2 and /2; others: 1, 2 (4, 8 for few rows))."""
    if long_row(shape):
        counts = [c for c in (best.num_splits // 2, best.num_splits * 2) if 1 <= c and c * 128 <= shape["keys"]]
    else:
        counts = (1, 2) if shape["batch"] * HEADS >= num_sms() else (1, 2, 4, 8)
        counts = [s for s in counts if s * 64 <= shape["keys"]]
    return [dataclasses.replace(best, num_splits=s, fused_combine=best.fused_combine and s > 1) for s in counts]


def graph_calls_per_copy(copies: int) -> list[int]:
    """Which KV copy each call of the timing graph reads: every copy once, at least 2 calls."""
    return [i % copies for i in range(max(copies, 2))]


def tune_decode_shape(
    shape: dict, dtype: torch.dtype, copy_gbps: float, clock: Clock, compiler: Compiler, quick: bool
) -> dict:
    """Every config timed per call inside a CUDA graph (no host launch cost in the number, as
    the decode step runs), the calls cycling over copies of the KV that together pass 3x the
    L2 size, so every call reads cold K/V; SDPA on contiguous copies is timed the same way."""
    batch, keys, head_dim = shape["batch"], shape["keys"], shape["head_dim"]
    kv_bytes = 2 * batch * keys * HEADS * head_dim * torch.finfo(dtype).bits // 8
    copies = max(1, min(256, triton.cdiv(3 * l2_bytes(), kv_bytes))) if CUDA else 1
    data = decode_inputs(shape, dtype, copies)
    capacity = data["tables"].shape[2] * BLOCK_SIZE
    args = decode_args(data)
    tables = data["tables"]
    order = graph_calls_per_copy(copies)
    ref = reference.paged_decode(
        data["query"].float(), data["key_cache"], data["value_cache"], tables[0], data["seq_lens"], **data["bias"]
    )
    result = {"shape": shape, "kv_bytes": kv_bytes, "graph_copies": copies, "configs": []}
    metric = "graph_us" if CUDA else "bench_us"

    def measure(cfg: DecodeConfig) -> dict:
        row = {"config": cfg.__dict__.copy()}
        try:
            out = paged_decode(block_table=tables[0], config=cfg, **args)
            row["rel_err"] = rel_err(out, ref)
            if not row["rel_err"] < TOLERANCE[dtype]:
                row["error"] = f"wrong result: rel_err {row['rel_err']:.3g}"
                return row
            if CUDA:
                calls = [(lambda i=i: paged_decode(block_table=tables[i], config=cfg, **args)) for i in order]
                row["graph_us"] = common.graph_us(calls)
            else:
                row["bench_us"] = 1e3 * bench_ms(lambda: paged_decode(block_table=tables[0], config=cfg, **args))
            row["gbps"] = kv_bytes / row[metric] / 1e3
            row["pct_of_copy"] = 100 * row["gbps"] / copy_gbps
        except Exception as exc:  # compile failures, out of resources: record and go on
            row["error"] = error_text(exc)
        return row

    base = decode_config(batch, HEADS, head_dim, capacity, num_sms())
    sweep = Sweep("decode", shape, measure, compiler, clock, result)
    rows, run_pass = sweep.rows, sweep.run

    def ranked() -> list[DecodeConfig]:
        return [DecodeConfig(**r["config"]) for r in sorted((r for r in rows if metric in r), key=lambda r: r[metric])]

    run_pass(decode_candidates(shape, base, quick))
    result["default"] = rows[0]
    if ranked():
        run_pass(decode_second_pass(ranked()))
    if ranked():
        run_pass(decode_third_pass(shape, ranked()[0]))
    result["configs"] = rows
    ok = sorted((r for r in rows if metric in r), key=lambda r: r[metric])
    result["metric"] = metric
    result["best"] = ok[0] if ok else None
    result["sdpa_us"] = sdpa_decode_us(data, shape, dtype, order)
    return result


def sdpa_decode_us(data: dict, shape: dict, dtype: torch.dtype, order: list[int]) -> float:
    """SDPA with the causal bias materialized as HF builds it, on contiguous copies of each
    KV copy, timed like the kernel (per call in a CUDA graph; CPU: one call)."""
    batch, keys, head_dim = shape["batch"], shape["keys"], shape["head_dim"]
    q = data["query"][:, :, None, :]
    mask = None
    if shape["bias"]:
        distance = (keys - 1 - torch.arange(keys, device=DEVICE)).clamp(max=128)
        mask = data["bias"]["bias_table"][:, distance][None, :, None, :].to(dtype)
    kv = []
    for i in sorted(set(order)):
        ids = data["tables"][i][:, : triton.cdiv(keys, BLOCK_SIZE)].long()
        k = data["key_cache"][ids].reshape(batch, -1, HEADS, head_dim)[:, :keys].transpose(1, 2).contiguous()
        v = data["value_cache"][ids].reshape(batch, -1, HEADS, head_dim)[:, :keys].transpose(1, 2).contiguous()
        kv.append((k, v))
    if not CUDA:
        return 1e3 * bench_ms(lambda: F.scaled_dot_product_attention(q, *kv[0], attn_mask=mask, scale=1.0))
    calls = [(lambda i=i: F.scaled_dot_product_attention(q, *kv[i], attn_mask=mask, scale=1.0)) for i in order]
    return common.graph_us(calls)


DECODE_SHAPES = [
    # name, batch, keys, head_dim, bias table, table capacity; the shapes first, so a
    # short budget still sweeps them
    dict(name="1x16384", batch=1, keys=16384, head_dim=64, bias=True),
    dict(name="64x2048", batch=64, keys=2048, head_dim=64, bias=True),
    dict(name="1x512 cross", batch=1, keys=512, head_dim=64, bias=False),
    dict(name="1x128 self", batch=1, keys=128, head_dim=64, bias=True, capacity=256),
    dict(name="16x512 cross", batch=16, keys=512, head_dim=64, bias=False),
    dict(name="1x16384 d128", batch=1, keys=16384, head_dim=128, bias=True),
    dict(name="64x2048 d128", batch=64, keys=2048, head_dim=128, bias=True),
    dict(name="1x128 self d128", batch=1, keys=128, head_dim=128, bias=True, capacity=256),
    dict(name="1x512 cross d128", batch=1, keys=512, head_dim=128, bias=False),
    # a graphed decode step at batch 64 (t5-large: 16 heads; flan-t5-xl's 32 heads double the programs)
    dict(name="64x512 cross", batch=64, keys=512, head_dim=64, bias=False),
    dict(name="128x512 cross", batch=128, keys=512, head_dim=64, bias=False),
    dict(name="64x96 self", batch=64, keys=96, head_dim=64, bias=True, capacity=256),
]
QUICK_DECODE_SHAPES = [
    dict(name="2x40", batch=2, keys=40, head_dim=16, bias=True, capacity=64),
    dict(name="1x300", batch=1, keys=300, head_dim=16, bias=False),
]


# ----------------------------------------------------------------------------- prefill


PREFILL_FIRST_PASS = [
    # The defaults of prefill_config (64x64 up to 1K tokens, 128x32 longer) and a close alternative.
    PrefillConfig(64, 64, 4, 2, band_split=False),
    PrefillConfig(128, 32, 8, 3),
    PrefillConfig(128, 64, 8, 2),
    # The widened (Toeplitz) table across tile shapes, with and without the band split.
    PrefillConfig(64, 64, 4, 2, band_split=False, toeplitz=True),
    PrefillConfig(64, 64, 4, 2, toeplitz=True),
    PrefillConfig(128, 32, 8, 3, toeplitz=True),
    PrefillConfig(128, 64, 8, 2, toeplitz=True),
    PrefillConfig(128, 64, 8, 2, band_split=False, toeplitz=True),
    PrefillConfig(128, 64, 4, 2, toeplitz=True),
    PrefillConfig(128, 128, 8, 2, toeplitz=True),
    PrefillConfig(128, 128, 8, 2, band_split=False, toeplitz=True),
    PrefillConfig(64, 128, 4, 2, band_split=False, toeplitz=True),
    PrefillConfig(64, 32, 4, 3, band_split=False, toeplitz=True),
    PrefillConfig(64, 64, 4, 3, toeplitz=True),
    # Prebuilt band tiles (block_m a multiple of block_n), with the toeplitz tail or the gather one.
    PrefillConfig(64, 64, 4, 2, band_tiles=True),
    PrefillConfig(64, 64, 4, 3, band_tiles=True),
    PrefillConfig(64, 32, 4, 2, band_tiles=True),
    PrefillConfig(128, 32, 8, 2, band_tiles=True),
    PrefillConfig(128, 32, 8, 3, band_tiles=True),
    PrefillConfig(128, 64, 8, 2, band_tiles=True),
    PrefillConfig(128, 64, 4, 2, band_tiles=True),
    PrefillConfig(128, 128, 8, 2, band_tiles=True),
    PrefillConfig(64, 64, 4, 2, band_tiles=True, toeplitz=True),
    # One loop over every whole tile, the constant tiles prebuilt too (half the compile time)
    PrefillConfig(64, 32, 4, 2, band_tiles=True, one_loop=True),
    PrefillConfig(64, 32, 4, 3, band_tiles=True, one_loop=True),
    PrefillConfig(128, 32, 8, 3, band_tiles=True, one_loop=True),
]
QUICK_PREFILL = [
    PrefillConfig(16, 16, 4, 1),
    PrefillConfig(32, 16, 4, 1, band_split=False),
    PrefillConfig(16, 32, 4, 2, toeplitz=True),
    PrefillConfig(32, 16, 4, 1, band_tiles=True),
    PrefillConfig(32, 16, 4, 1, band_tiles=True, one_loop=True),
]


def prefill_args(shape: dict, dtype: torch.dtype) -> dict:
    """`prefill` keyword arguments: `shape`'s equal-length sequences packed, the bidirectional table."""
    batch, length, head_dim = shape["batch"], shape["length"], shape["head_dim"]
    total = batch * length
    query, key, value = (torch.randn(total, HEADS, head_dim, device=DEVICE, dtype=dtype) for _ in range(3))
    cu_seqlens = torch.arange(0, total + 1, length, dtype=torch.int32, device=DEVICE)
    table = torch.randn(HEADS, 257, device=DEVICE)  # bidirectional, max_distance 128
    return dict(query=query, key=key, value=value, cu_seqlens=cu_seqlens, max_seqlen=length, scale=1.0,
                causal=False, bias_table=table)  # fmt: skip


def prefill_graph_ms(fn) -> float:
    """ms per call of `fn` replayed 4 times in one CUDA graph (NaN without CUDA)."""
    return common.graph_us([fn] * 4) / 1e3


def prefill_second_pass(ranked: list[PrefillConfig], quick: bool) -> list[PrefillConfig]:
    """Pipelining depth on the two best; the toeplitz and band-split toggles of the best."""
    configs = [dataclasses.replace(cfg, num_stages=s) for cfg in ranked[:2] for s in ((1,) if quick else (2, 3, 4))]
    best = ranked[0]
    configs += [dataclasses.replace(best, toeplitz=not best.toeplitz)]
    configs += [dataclasses.replace(best, band_split=not best.band_split)]
    return configs


def tune_prefill_shape(shape: dict, dtype: torch.dtype, clock: Clock, compiler: Compiler, quick: bool) -> dict:
    batch, length, head_dim = shape["batch"], shape["length"], shape["head_dim"]
    args = prefill_args(shape, dtype)
    query, key, value, table = args["query"], args["key"], args["value"], args["bias_table"]
    ref = reference.prefill(query.float(), key.float(), value.float(), args["cu_seqlens"], length, bias_table=table)
    flops = 4 * batch * HEADS * length * length * head_dim
    result = {"shape": shape, "configs": []}

    def measure(cfg: PrefillConfig) -> dict:
        row = {"config": cfg.__dict__.copy()}
        try:
            row["rel_err"] = rel_err(prefill(**args, config=cfg), ref)
            if not row["rel_err"] < TOLERANCE[dtype]:
                row["error"] = f"wrong result: rel_err {row['rel_err']:.3g}"
                return row
            row["ms"] = bench_ms(lambda: prefill(**args, config=cfg))
            row["tflops"] = flops / row["ms"] / 1e9
        except Exception as exc:
            row["error"] = error_text(exc)
        return row

    base = PrefillConfig(16, 16, 4, 1) if not CUDA else prefill_config(head_dim, dtype, length)
    sweep = Sweep("prefill", shape, measure, compiler, clock, result)
    rows, run_pass = sweep.rows, sweep.run

    run_pass([base] + (QUICK_PREFILL if quick else PREFILL_FIRST_PASS))
    result["default"] = rows[0]
    ranked = [PrefillConfig(**r["config"]) for r in sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])]
    if ranked:
        run_pass(prefill_second_pass(ranked, quick))
    result["configs"] = rows
    ok = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
    result["best"] = ok[0] if ok else None
    if ok:
        best_cfg = PrefillConfig(**ok[0]["config"])
        # What the bias costs: the best config with no bias at all (compare with SDPA flash).
        no_bias = dict(args, bias_table=None)
        result["ours_nobias_ms"] = bench_ms(lambda: prefill(**no_bias, config=best_cfg))
        result["best_graph_ms"] = prefill_graph_ms(lambda: prefill(**args, config=best_cfg))
        if "ms" in result["default"]:
            result["default_graph_ms"] = prefill_graph_ms(lambda: prefill(**args, config=base))

    q, k, v = (t.view(batch, length, HEADS, head_dim).transpose(1, 2) for t in (query, key, value))
    pos = torch.arange(length, device=DEVICE)
    bias = table[:, (pos[None, :] - pos[:, None]).clamp(-128, 128) + 128][None].to(dtype)  # [1, H, L, L]

    def sdpa_bias():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=1.0)

    result["sdpa_bias_ms"] = bench_ms(sdpa_bias)
    result["sdpa_bias_graph_ms"] = prefill_graph_ms(sdpa_bias)
    result["sdpa_nobias_ms"] = bench_ms(lambda: F.scaled_dot_product_attention(q, k, v, scale=1.0))
    result["flops"] = flops
    return result


PREFILL_SHAPES = [
    dict(name="16x512", batch=16, length=512, head_dim=64),
    dict(name="4x2048", batch=4, length=2048, head_dim=64),
    dict(name="1x8192", batch=1, length=8192, head_dim=64),
    dict(name="32x512", batch=32, length=512, head_dim=64),
    # T5 v1.1 XXL's encoder (64 heads) at 1 x 512 and 1 x 77: as many (sequence, head) pairs
    dict(name="4x512", batch=4, length=512, head_dim=64),
    dict(name="4x77", batch=4, length=77, head_dim=64),
]
# Run only when named in --shapes: lengths between 1K and 4K, where one configuration serves
# every input of a long-tailed batch job
EXTRA_PREFILL_SHAPES = [
    dict(name="8x1024", batch=8, length=1024, head_dim=64),
    dict(name="2x1536", batch=2, length=1536, head_dim=64),
    dict(name="1x4096", batch=1, length=4096, head_dim=64),
]
QUICK_PREFILL_SHAPES = [dict(name="2x40", batch=2, length=40, head_dim=16)]


# ----------------------------------------------------------------------------- report


def _fmt(cfg: dict, cls: str) -> str:
    return f"{cls}(" + ", ".join(f"{k}={v!r}" for k, v in cfg.items()) + ")"


def print_report(result: dict) -> None:
    print(f"\n{result['gpu']}  {result['dtype']}")
    print(f"copy bandwidth: {result['copy_gbps']:.0f} GB/s (read + write)")
    print("\npaged decode, µs per call in a CUDA graph, cold KV (CPU: bench_us, one call); sdpa likewise")
    print(f"{'shape':<18}{'metric':<10}{'default':>10}{'best':>10}{'%copy':>7}{'sdpa':>10}  best config")
    for row in result["decode"]:
        best, default, metric = row["best"], row["default"], row["metric"]
        if best is None:
            print(f"{row['shape']['name']:<18} no config passed: {default.get('error')}")
            continue
        d = default.get(metric, float("nan"))
        print(
            f"{row['shape']['name']:<18}{metric:<10}{d:>10.2f}{best[metric]:>10.2f}{best['pct_of_copy']:>7.0f}"
            f"{row['sdpa_us']:>10.2f}  {_fmt(best['config'], 'DecodeConfig')}"
        )
    print("\nprefill, bidirectional with the bias table (ms, do_bench with L2 cleared; TFLOP/s of the best;")
    print("'no bias': the best config without it; 'graph': per call in a CUDA graph, L2 warm)")
    print(
        f"{'shape':<10}{'default':>9}{'best':>9}{'TFLOP/s':>9}{'no bias':>9}{'sdpa+bias':>11}{'sdpa flash':>11}"
        f"{'graph: default':>16}{'best':>8}{'sdpa+bias':>11}  best config"
    )
    nan = float("nan")
    for row in result["prefill"]:
        best, default = row["best"], row["default"]
        if best is None:
            print(f"{row['shape']['name']:<10} no config passed: {default.get('error')}")
            continue
        print(
            f"{row['shape']['name']:<10}{default.get('ms', nan):>9.3f}{best['ms']:>9.3f}{best['tflops']:>9.1f}"
            f"{row.get('ours_nobias_ms', nan):>9.3f}{row['sdpa_bias_ms']:>11.3f}{row['sdpa_nobias_ms']:>11.3f}"
            f"{row.get('default_graph_ms', nan):>16.3f}{row.get('best_graph_ms', nan):>8.3f}"
            f"{row['sdpa_bias_graph_ms']:>11.3f}  {_fmt(best['config'], 'PrefillConfig')}"
        )
    failed = [
        (section, row["shape"]["name"], cfg["config"], cfg["error"])
        for section in ("decode", "prefill")
        for row in result[section]
        for cfg in row["configs"]
        if "error" in cfg
    ]
    for section, name, cfg, error in failed:
        print(f"failed: {section} {name} {cfg}: {error}")
    for section, name, error in result.get("failed_shapes", []):
        print(f"failed shape: {section} {name}: {error}")
    print_winners(result)
    print(f"\n{result['elapsed_s']:.0f} s")


def print_winners(result: dict) -> None:
    """The best config per shape with its gain over the default, as Python to paste."""
    print("\nwinners (apply: decode_config in hf_paged_t5/kernels/decode.py, prefill_config in")
    print("hf_paged_t5/kernels/prefill.py; decode at head_dim 64 / 128, prefill bf16 head_dim 64)")
    for section, metric, cls in (("decode", None, "DecodeConfig"), ("prefill", "ms", "PrefillConfig")):
        for row in result[section]:
            best, default = row["best"], row["default"]
            if best is None:
                continue
            key = metric or row["metric"]
            gain = default.get(key, float("nan")) / best[key]
            print(f"  {section:<8}{row['shape']['name']:<18}x{gain:<6.2f}{_fmt(best['config'], cls)}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="folder for tune.json (default: benchmarks/results/<date>-<gpu>)")
    parser.add_argument("--budget", type=float, default=140.0, help="seconds for the sweeps (baselines run anyway)")
    parser.add_argument("--only", choices=("decode", "prefill"), default=None)
    parser.add_argument("--quick", action="store_true", help="tiny shapes, to check the script (CPU ok)")
    parser.add_argument("--shapes", default=None,
                        help="comma-separated shape names to run (default: all; prefill also 8x1024, 2x1536, 1x4096)")
    parser.add_argument(
        "--jobs", type=int, default=min(8, max(1, (os.cpu_count() or 2) - 2)),
        help="compile worker processes (0: compile in this process, one config at a time)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if not args.quick:  # the full sweep through the Triton interpreter would take days
        common.require_cuda("tune_kernels.py (without --quick)")
    out = common.start_suite(args.out, "tune") / "tune.json"
    dtype = torch.bfloat16 if CUDA else torch.float32
    torch.manual_seed(0)
    clock = Clock(args.budget)
    compiler = Compiler(args.jobs)
    copy_gbps = common.copy_bandwidth(DEVICE, 2**20 if args.quick else 2**31)
    decode_shapes = QUICK_DECODE_SHAPES if args.quick else DECODE_SHAPES
    prefill_shapes = QUICK_PREFILL_SHAPES if args.quick else PREFILL_SHAPES
    if args.shapes:
        wanted = set(args.shapes.split(","))
        decode_shapes = [s for s in decode_shapes if s["name"] in wanted]
        prefill_shapes = [s for s in prefill_shapes + EXTRA_PREFILL_SHAPES if s["name"] in wanted]
    # Decode gets ~50% of the budget, prefill the rest (its kernels are bigger to compile).
    decode_clock = Clock(args.budget * (0.5 if args.only is None else 1.0))
    result = {
        "gpu": torch.cuda.get_device_name(DEVICE) if CUDA else "cpu (triton interpreter)",
        "dtype": str(dtype).removeprefix("torch."),
        "heads": HEADS,
        "block_size": BLOCK_SIZE,
        "copy_gbps": copy_gbps,
        "compile_jobs": args.jobs if compiler.pool is not None else 0,
        "decode": [],
        "prefill": [],
    }
    sections = []
    if args.only != "prefill":
        sections += [("decode", shape, decode_clock) for shape in decode_shapes]
    if args.only != "decode":
        sections += [("prefill", shape, clock) for shape in prefill_shapes]
    try:
        for section, shape, section_clock in sections:
            print(f"{section} {shape['name']} ({section_clock.left():.0f} s left)", flush=True)
            try:
                if section == "decode":
                    row = tune_decode_shape(shape, dtype, copy_gbps, section_clock, compiler, args.quick)
                else:
                    row = tune_prefill_shape(shape, dtype, section_clock, compiler, args.quick)
                result[section].append(row)
            except Exception as exc:  # e.g. out of memory: keep what was measured so far
                print(f"  {section} {shape['name']} failed: {type(exc).__name__}: {exc}", flush=True)
                result.setdefault("failed_shapes", []).append([section, shape["name"], f"{type(exc).__name__}: {exc}"])
            if CUDA:
                torch.cuda.empty_cache()
            # Written after every shape, so a crash later still leaves the results so far.
            result["elapsed_s"] = time.perf_counter() - clock.start
            common.write_json(out, result, quiet=True)
    finally:
        compiler.close()
    print_report(result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
