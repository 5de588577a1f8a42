"""Launch knobs of the attention kernels and how their defaults are picked on a GPU.

`DecodeConfig` / `decode_config` for `decode.paged_decode`, `PrefillConfig` / `prefill_config`
for `prefill.prefill`, `LocalConfig` / `local_config` for `local.local_prefill`. The defaults come
from H200 sweeps (`benchmarks/tune_kernels.py`; `local_config`'s were not swept); a caller may pass any
config, and every config computes the same attention.
"""

from __future__ import annotations

from types import MappingProxyType
import dataclasses
import os

import torch
import triton
import triton.language as tl

from ._checks import block_d, interpreting

# A split shorter than this costs more (partials, the combine launch) than it wins in parallelism.
_MIN_KEYS_PER_SPLIT = 512
_MAX_SPLITS = 128
# Enough resident programs per SM to hide memory latency on a bandwidth-bound kernel.
_PROGRAMS_PER_SM = 4
# DecodeConfig.prefetch -> the kernel's PREFETCH.
_PREFETCH = MappingProxyType({"tile": 0, "table": 1, "async": 2})


def pdl_available(device: torch.device) -> bool:
    """Whether kernels on `device` may be launched as programmatic dependent launches (PDL): each
    then starts while the kernel before it finishes and waits for its results in-kernel
    (`gdc_wait`). Needs a CUDA GPU of compute capability 9.0 or later (Hopper) and a Triton with
    grid-dependency control; HF_PAGED_T5_PDL=0 turns it off (A/B measurements)."""
    return (
        device.type == "cuda" and not interpreting() and os.environ.get("HF_PAGED_T5_PDL", "1") != "0"
        and hasattr(getattr(tl, "extra", None), "cuda") and hasattr(tl.extra.cuda, "gdc_wait")
        and torch.cuda.get_device_capability(device)[0] >= 9
    )


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """Launch knobs of `paged_decode` (see `decode_config` for how defaults are picked).

    block_n: keys per tile, a power of two >= 16 (any multiple or fraction of block_size)
    num_warps: warps per program
    num_stages: software-pipelining depth of the key loop (1 = only the kernel's own one-tile prefetch)
    num_splits: key splits per (row, head); > 1 adds the combine kernel (or the fused merge)
    fused_combine: with splits, the last split of each (row, head) to finish (an atomic ticket)
        merges the partials instead of a second kernel; costs a [batch, num_heads] int32 memset
    prefetch: how K/V of the coming tiles are requested while one is used: "tile" (the next
        tile into registers, its block ids read just before), "table" (likewise, with the block
        ids one tile further ahead, so no K/V load waits on a table round trip) or "async" (a
        plain loop that Triton's pipeliner turns into async copies of the next num_stages - 1
        tiles into shared memory)
    """

    block_n: int
    num_warps: int
    num_stages: int = 1
    num_splits: int = 1
    fused_combine: bool = False
    prefetch: str = "tile"

    def __post_init__(self) -> None:
        if self.block_n < 16 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n must be a power of two >= 16, got {self.block_n}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1 or self.num_splits < 1:
            raise ValueError(f"num_stages and num_splits must be >= 1, got {self.num_stages}, {self.num_splits}")
        if self.prefetch not in _PREFETCH:
            raise ValueError(f"prefetch must be one of {', '.join(_PREFETCH)}, got {self.prefetch!r}")


def decode_config(batch: int, num_heads: int, head_dim: int, max_keys: int, num_sms: int) -> DecodeConfig:
    """Default knobs for one launch shape on a GPU of `num_sms` SMs; `max_keys` bounds seq_lens.

    From H200 sweeps (`benchmarks/tune_kernels.py`, `tune_mixed_decode.py`; bf16, 16 heads, block_size 16):
    - Few (row, head) pairs over short keys (graph-replayed decode at small batch): latency
      of a few dependent memory round trips. 128-key tiles, and up to 4 splits of ~128 keys
      while they add programs; 4 warps at head_dim 64, split or not, else 8. Per call in a
      graph, as a decode step launches it (PDL, the fused merge; H200, 2026-12-03,
      `benchmarks/tune_step_decode.py`, code d0a4d62): 1 x 512 cross 5.25 µs on 4 splits of 4 warps (8 warps:
      5.76; one split: 7.12), 2 x 512 5.87 (6.36), 4 x 512 7.54 (2 splits of 8 warps: 8.17);
      8 and 16 x 512 one split of 4 warps (9.8, 13.2 µs) was best. One warp count for split
      and unsplit launches makes them one binary (the split count is read at run time), so a
      new batch size compiles no decode kernel.
    - Many pairs (4+ programs per SM: a batch-64 decode step, BatchGenerator's hundreds of
      rows): bandwidth; 8K-element tiles (128 keys at d64, 64 at d128) on 4 warps. At d64 the
      loads go through shared memory ("async"), 2 deep, and over <= 256 keys on 32-key tiles
      of one warp (the figures are at the rule); at d128 3 deep up to 1024 keys, and 2 splits
      of 1024 keys past that (65% vs 62% of copy bandwidth), so a split holds at most 128K K
      elements.
    - Few rows over long keys (1 x 16384): splits up to _PROGRAMS_PER_SM programs per SM,
      never below _MIN_KEYS_PER_SPLIT keys, with 4K-element tiles (d128 best: 32 keys, 4 warps,
      32 splits); at d64 twice those splits on one-warp 32-key tiles, pipelined ("async").
    """
    padded_d = block_d(head_dim)
    programs = batch * num_heads
    if programs < num_sms and max_keys <= 1024:
        splits = max(1, min(4, triton.cdiv(max_keys, 128), num_sms // programs))
        warps = 4 if padded_d <= 64 else 8
        return DecodeConfig(block_n=max(16, min(128, 16384 // padded_d)), num_warps=warps, num_splits=splits)
    splits = max(1, triton.cdiv(max_keys * padded_d, 2**17))
    if programs < _PROGRAMS_PER_SM * num_sms:
        splits = max(splits, triton.cdiv(_PROGRAMS_PER_SM * num_sms, programs))
    splits = max(1, min(splits, max_keys // _MIN_KEYS_PER_SPLIT, _MAX_SPLITS))
    if splits > 1 and programs * splits < _PROGRAMS_PER_SM * num_sms:
        if padded_d <= 64:
            # H200 (benchmarks/tune_kernels.py, 2026-11-29), 1 x 16384 at d64: twice the splits (256 keys each), 32-key
            # tiles on one warp, loads pipelined 3 deep: 24.0 us per call in a graph, 63% of copy
            # bandwidth (32 splits of 64-key tiles on 4 warps: 29.7 us, 52%).
            splits = max(1, min(2 * splits, max_keys // 256, _MAX_SPLITS))
            return DecodeConfig(block_n=32, num_warps=1, num_stages=3, num_splits=splits, prefetch="async")
        return DecodeConfig(block_n=max(16, min(128, 4096 // padded_d)), num_warps=4, num_splits=splits)
    many_rows = splits == 1 and programs >= _PROGRAMS_PER_SM * num_sms
    if many_rows and padded_d <= 64 and (max_keys <= 1024 or programs >= 2 * _PROGRAMS_PER_SM * num_sms):
        # H200 (benchmarks/tune_mixed_decode.py --configs depths, 2026-12-03, code 4d94b74), many
        # rows at d64: 128-key tiles on 4 warps through Triton's async-copy pipeline, 2 deep (over
        # <= 256 keys that sweep chose 1 deep; see below), against 3 deep or the register
        # prefetch ("tile"), per call in a graph: 40 / 64 / 128 x 512 cross 26.6 / 41.7 / 75.9 µs vs 33.1 / 45.2 /
        # 80.7 (3 deep); BatchGenerator's mixed rows (20-1,868 keys, longest first) at 512 / 256
        # rows 164.5 / 85.8 vs 195.5 / 99.5 (tile); self-attention's 1-200-key mix with the bias
        # table at 512 / 64 rows 76.2 / 12.2 (1 deep) vs 119.1 / 18.6 (3 deep). Past 1,024 keys
        # only with 8+ programs per SM: 64 mixed rows 30.2 (tile) vs 47.7; 64 x 2048 141.2 (tile)
        # vs 142.4.
        if max_keys <= 256:
            # Short rows (self-attention's 1-200 keys with the bias table, longest first): 32-key
            # tiles on one warp, 2 deep. H100, 2026-12-06 (`tune_mixed_decode.py --kinds self
            # --rows 512,320,128 --orders longest-first --configs tiles`, code 6ac445f), per call in
            # a graph at 512 / 320 / 128 rows: 67.6 / 42.9 / 16.8 µs against 91.7 / 60.8 / 26.8
            # for 128-key tiles on 4 warps, 1 deep (64-key tiles on 2 warps, 1 deep: 73.6 / 49.3 /
            # 19.5). The cross-attention mix (20-1,868 keys) keeps 128-key tiles, 2 deep.
            return DecodeConfig(block_n=32, num_warps=1, num_stages=2, prefetch="async")
        return DecodeConfig(block_n=128, num_warps=4, num_stages=2, prefetch="async")
    if many_rows and max_keys <= 1024:
        # d128 (not swept): the async-copy pipeline 3 deep, as the d64 sweep of a batch-64/128
        # step found against the register prefetch (benchmarks/tune_kernels.py, H200, 2026-12-03:
        # 64 x 512 cross 47.0 vs 50.4 µs, 128 x 512 81.8 vs 87.2, 64 x 96 self 16.7 vs 18.0).
        return DecodeConfig(block_n=max(16, min(128, 8192 // padded_d)), num_warps=4, num_stages=3, prefetch="async")
    return DecodeConfig(block_n=max(16, min(128, 8192 // padded_d)), num_warps=4, num_splits=splits)


def grouped_config(groups: int, num_heads: int, head_dim: int, max_keys: int, num_sms: int) -> DecodeConfig:
    """Default knobs of `grouped_decode`: 64-key tiles on 4 warps (sm_90, Triton 3.6, with the
    in-kernel merge: 122 registers at d64, 203 at d128, no spills; `benchmarks/diag_ptxas.py`'s
    `compile_report`), and key splits while programs are fewer than the SMs, at least one tile
    each. The split count is read at run time: one binary serves every batch and group."""
    block_n = 64
    splits = max(1, min(num_sms // max(1, groups * num_heads), triton.cdiv(max_keys, block_n), _MAX_SPLITS))
    return DecodeConfig(block_n=block_n, num_warps=4, num_splits=splits)


def _check_tiles(config, tiles: tuple[str, ...]) -> None:
    """A tiled attention config's checks: each of `tiles` a power of two >= 16, num_warps a power
    of two up to 16, num_stages >= 1."""
    for name in tiles:
        value = getattr(config, name)
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if config.num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps must be 1, 2, 4, 8 or 16, got {config.num_warps}")
    if config.num_stages < 1:
        raise ValueError(f"num_stages must be >= 1, got {config.num_stages}")


@dataclasses.dataclass(frozen=True)
class PrefillConfig:
    """Launch knobs of `prefill` (see `prefill_config` for the defaults).

    block_m: queries per program, block_n: keys per tile (powers of two >= 16)
    num_warps: warps per program; num_stages: software-pipelining depth of the key loop
    tile_ranges: split the key loop into unmasked / constant-bias / gathered / masked ranges
        (off: one masked loop with the general bias; for fp32, whose FMA dots would spill
        registers across several loops)
    band_split: with tile_ranges and the bidirectional table, key tiles wholly outside the
        T5 distance band add one constant (three loops, for long sequences); off: every whole
        tile gathers in one loop (short sequences, where the band covers most keys and each
        extra loop adds a pipeline prologue and drain)
    toeplitz: with a bias table, widen it first (one small launch; [num_heads, 2 * (max_seqlen
        + max(block_m, block_n)) + 1, 4] fp32, O(L) memory) so gathering tiles load their bias
        at k - q in 16-byte vectors, with no per-element clamp or log2(e) scaling; off: gather
        one element at a time from T5's table
    band_tiles: with band_split and the bidirectional table (block_m a multiple of block_n),
        build every bias tile the band can hold first (one small launch; a tile's bias depends
        only on k_start - q_start: [num_heads, tiles, block_m, block_n] in the table's dtype,
        ~(2 * max_distance / block_n + 4) tiles with the constant one either side, no O(L)
        term) so a band tile loads its bias like a dense tile, coalesced, instead of gathering
        per element; the ragged end loads its tile from the set too, wherever it falls (one
        masked copy of the tile step: a quarter less to compile); wins over `toeplitz` where
        it applies
    one_loop: with band_tiles, every whole key tile loads its bias tile (the offset clamped
        into the set) in one loop: two copies of the tile step in the binary instead of four, so
        it compiles faster, at the cost of a bias tile load (from L2) where the split adds one
        scalar (6-18% slower past 16 x 512 tokens on an H100: off by default; the default's twin
        while a compile worker compiles the default in a cold process: `ahead.Twins`)
    """

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int = 2
    tile_ranges: bool = True
    band_split: bool = True
    toeplitz: bool = False
    band_tiles: bool = False
    one_loop: bool = False

    def __post_init__(self) -> None:
        _check_tiles(self, ("block_m", "block_n"))


# The sequence length past which `prefill_config` picks another configuration (head_dim <= 64).
PREFILL_LENGTH_STEPS = (4096,)


def prefill_lengths(head_dim: int, dtype: torch.dtype, longest: int) -> list[int]:
    """One sequence length per configuration `prefill_config` gives sequences of 1 to `longest`
    tokens, shortest first: a compile-only pass that runs the prefill once at each compiles every
    binary a workload of such sequences launches (lengths are run-time arguments, not part of a
    binary's specialization)."""
    chosen: dict = {}
    for length in sorted({min(step, longest) for step in PREFILL_LENGTH_STEPS} | {max(longest, 1)}):
        chosen.setdefault(prefill_config(head_dim, dtype, length), length)
    return sorted(chosen.values())


def prefill_config(head_dim: int, dtype: torch.dtype, max_seqlen: int) -> PrefillConfig:
    """Default knobs on a GPU, from the H200 sweep (bf16, 16 heads x 64, bidirectional table).

    head_dim <= 64, constant-bias ranges outside the distance band and prebuilt band tiles
    inside it: 64 x 32 tiles on 4 warps, 3 stages, up to 4096 tokens; past that 64 x 64 tiles
    with the widened table (`toeplitz`), where the band is a sliver. H200, 2026-11-29
    (`benchmarks/tune_kernels.py`, results/2026-11-29-h200/tune-prefill.log), 16 heads, table to
    max_distance 128: 16 x 512 0.082 ms, 32 x 512 0.151, 1 x 8192 0.802 (SDPA with the
    materialized bias: 0.090, 0.168, 1.12; plain 64 x 64 tiles with the gathered bias: 0.200,
    0.388, 0.802). One configuration from 1 to 4096 tokens: a batch job of inputs up to 4096
    tokens (or a process's calls) compiles one prefill binary, the longest compile of a cold
    job (1.5-2.2 s), not two. H200, 2026-12-06 (`tune_kernels.py --only prefill --shapes
    8x1024,2x1536,4x2048,1x4096`, results/2026-12-06-h200/one-prefill/): 0.135 / 0.132 / 0.235 /
    0.226 ms against 0.141 / 0.086 / 0.246 / 0.238 for 128 x 32 tiles on 8 warps (in a CUDA
    graph 2 x 1536: 0.076 against the sweep's best, 0.081); a cold default batch job's pass
    0.44-0.70 s shorter (`docs/performance.md`, "One prefill binary up to 4,096 tokens").
    Larger heads: 128 x 32 tiles on 8 warps, 3 stages.
    """
    if dtype == torch.float32:
        # IEEE fp32 dots run on FMA units with operands in registers: smaller tiles, one loop.
        return PrefillConfig(block_m=64, block_n=32, num_warps=8, num_stages=2, tile_ranges=False)
    if head_dim <= 64:
        if max_seqlen <= PREFILL_LENGTH_STEPS[0]:
            return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=3, band_tiles=True)
        return PrefillConfig(block_m=64, block_n=64, num_warps=4, num_stages=2, toeplitz=True)
    if head_dim <= 128:
        return PrefillConfig(block_m=128, block_n=32, num_warps=8, num_stages=3)
    return PrefillConfig(block_m=64, block_n=32, num_warps=8, num_stages=2)


@dataclasses.dataclass(frozen=True)
class LocalConfig:
    """Launch knobs of `local_prefill`.

    block_m: queries per program; block_n: local keys per tile; block_g: side keys per tile
    (powers of two >= 16); num_warps: warps per program; num_stages: pipelining depth of the loops
    """

    block_m: int
    block_n: int
    block_g: int
    num_warps: int
    num_stages: int = 1

    def __post_init__(self) -> None:
        _check_tiles(self, ("block_m", "block_n", "block_g"))


def local_config(head_dim: int, dtype: torch.dtype) -> LocalConfig:
    """Default knobs on a GPU: the prefill kernel's tile shapes for one masked loop (not tuned on
    the window yet; a LongT5 window of radius 127 spans ~5 key tiles of 64 per 64 queries)."""
    if dtype == torch.float32 or block_d(head_dim) > 64:
        return LocalConfig(block_m=64, block_n=32, block_g=32, num_warps=8, num_stages=2)
    return LocalConfig(block_m=64, block_n=64, block_g=64, num_warps=4, num_stages=2)
