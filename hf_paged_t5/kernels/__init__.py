"""Triton kernels of the paged T5 backend; each has a plain-PyTorch twin in `reference.py`.

- `store_kv`: write K/V of new tokens into pool slots.
- `paged_decode`: one query token per row over paged keys, with the causal T5 bias table,
  a dense bias or none; splits long key ranges across programs (flash-decoding).
- `grouped_decode`: the same without a bias for rows in groups that share keys (a beam search's
  rows of a source over its cross-attention keys), each K/V tile read once per group
  (`grouped_supports`: the rows and dtypes it takes).
- `rms_norm`: T5's layer norm, optionally fused with the residual add (a tensor, or
  `split_k_linear`'s partials).
- `gated_gelu`: the gated feed-forward's `gelu_tanh(gate) * linear` (T5 v1.1, mT5, UMT5).
- `gemv`: x @ weight.T for at most a few rows (batch-1 decode projections).
- `relu_linear`: relu(x @ weight.T) for more rows, the ReLU in cuBLASLt's GEMM epilogue (not a
  Triton kernel: T5's non-gated feed-forward without a pointwise launch of its own).
- `split_k_linear`: x @ weight.T as float32 partials over slices of K for `rms_norm` to sum (the
  feed-forward's `wo` at many rows in two launches with the next add + norm, not cuBLAS's three;
  `split_k_supports`: the products it takes).
- `fused_linear`: the same with the layer norm before it and the residual add, activation or
  K/V store after it folded in (a decode step's layer in a few kernels).
- `greedy_update`: a greedy decode step's token choice and the next step's inputs, one launch.
- `beam_update`: a beam-search step's bookkeeping, the cache reorder and the next inputs, four launches
  (`beam_update_supports`: the sizes it takes; `beam_workspace`: its scratch).
- `prefill`: varlen flash-attention over packed sequences, bidirectional or causal.
- `local_prefill`: varlen local (windowed) attention plus optional side keys (LongT5's encoder).

Integer arguments that follow the workload (sequence lengths, key counts, splits, rows, table
widths) are excluded from Triton's specialization (`do_not_specialize`): Triton otherwise compiles
a kernel again for each new combination of "equals 1" / "divisible by 16" among them, and each
compile stalls the caller for 0.4-1 s (H200): a batch job whose row counts and lengths keep
moving would keep compiling. These arguments are loop bounds and masks, where the hint buys nothing.

The kernels write `exp2` and `rsqrt` as `fast_math`'s, the instructions Triton's own become
without libdevice: a compile that calls no libdevice function skips linking its bitcode.
"""

from .beam import beam_update
from .beam import supports as beam_update_supports
from .beam import workspace as beam_workspace
from .decode import grouped_decode, grouped_supports, paged_decode
from .gated_gelu import gated_gelu
from .gemv import gemv, gemv_supports
from .greedy import greedy_update
from .launch import pdl_available
from .linear import fused_linear, fused_linear_supports
from .local import local_prefill
from .prefill import prefill
from .relu_linear import relu_linear, relu_linear_supports
from .rmsnorm import rms_norm
from .split_k import split_k_linear, split_k_supports
from .store_kv import store_kv

__all__ = ["beam_update", "beam_update_supports", "beam_workspace", "fused_linear", "fused_linear_supports", "gated_gelu",
           "gemv", "gemv_supports", "greedy_update", "grouped_decode", "grouped_supports", "local_prefill",
           "paged_decode", "pdl_available", "prefill", "relu_linear", "relu_linear_supports", "rms_norm",
           "split_k_linear", "split_k_supports", "store_kv"]
