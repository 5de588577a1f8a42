"""T5 attention over the paged cache: encoder (varlen, bias table), decoder self, cross.

Each function takes one of HF's attention modules (`T5Attention` / `UMT5Attention`) and uses
its own `q`/`k`/`v`/`o` Linear layers; only the attention core runs on our kernels. `ops` is a
backend namespace (`hf_paged_t5.reference` or `hf_paged_t5.kernels`) with `store_kv`,
`paged_decode` and `prefill`.
"""

from __future__ import annotations

import contextlib
import logging
import sys
from types import ModuleType
from typing import Callable, Iterator, NamedTuple, Optional, Union

import torch
from torch import nn
import torch.nn.functional as F

from ..kv.pool import StepMetadata
from . import packing
from .packing import plain_linear, unhooked  # (what a module that runs as HF wrote it is: defined there)

logger = logging.getLogger(__name__)


def backend_ops(name: str) -> ModuleType:
    """The kernel namespace for a resolved backend name ("triton", "cpu" or "torch")."""
    if name == "torch":
        from .. import reference

        return reference
    if name == "cpu":
        from .. import cpu_ops

        return cpu_ops
    from .. import kernels

    return kernels


def compile_ahead_for(device: torch.device, backend: str):
    """`kernels.ahead.compile_ahead` where it can run (the "triton" backend on a CUDA device,
    a Triton that allows it, not inside a caller's CUDA graph capture), else None."""
    if device.type != "cuda" or backend != "triton" or torch.cuda.is_current_stream_capturing():
        return None
    from ..kernels import ahead

    return ahead.compile_ahead if ahead.available(device) else None


@contextlib.contextmanager
def _in_ahead(device: torch.device, name: str) -> Iterator[bool]:
    """`kernels.ahead.<name>()` on a CUDA device where the kernels are imported; else yields False."""
    if device.type != "cuda" or f"{__package__.rsplit('.', 1)[0]}.kernels.ahead" not in sys.modules:
        yield False
        return
    from ..kernels import ahead

    with getattr(ahead, name)() as sending:
        yield sending


def compile_elsewhere(device: torch.device) -> contextlib.AbstractContextManager:
    """`kernels.ahead.compile_elsewhere` on a CUDA device (inside a compile-only pass, launches
    compile in the compile worker processes; yields whether they do); elsewhere it yields False."""
    return _in_ahead(device, "compile_elsewhere")


def compile_in_workers(device: torch.device) -> contextlib.AbstractContextManager:
    """`kernels.ahead.compile_in_workers` on a CUDA device (inside a compile-only pass, launches
    compile in a free compile worker process, else on the pass's pool; yields whether workers can
    take them); elsewhere it yields False."""
    return _in_ahead(device, "compile_in_workers")


def kernel_binaries() -> int:
    """`kernels.ahead.binaries()`: the package's Triton binaries loaded in this process; 0 where its
    Triton kernels were never imported (the CPU backend)."""
    if f"{__package__.rsplit('.', 1)[0]}.kernels" not in sys.modules:
        return 0
    from ..kernels import ahead

    return ahead.binaries()


def prefill_lengths(attention: nn.Module, dtype: torch.dtype, longest: int) -> list[int]:
    """One input length per configuration the Triton prefill kernel picks for `attention`'s heads
    (a T5Attention) at 1 to `longest` tokens (`kernels.launch.prefill_lengths`): what a
    compile-only pass runs the encoder at to compile each binary inputs of those lengths need."""
    from ..kernels.launch import prefill_lengths as lengths

    return lengths(attention.key_value_proj_dim, dtype, longest)


def run_compiled_ahead(device: torch.device, backend: str, forward: Callable[[], object], what: str,
                       before: Optional[Callable[[], None]] = None) -> None:
    """`forward()` once inside `compile_ahead_for`'s context, where there is one (its kernels
    compiled at once, none run, its output dropped), after `before()`; else nothing. A failure is
    the real call's to raise (it runs next, the same work): here it is only logged."""
    compile_ahead = compile_ahead_for(device, backend)
    if compile_ahead is None:
        return
    if before is not None:
        before()
    try:
        with torch.no_grad(), compile_ahead(device):
            forward()
    except Exception as exc:  # noqa: BLE001 - the real call that follows raises its own error
        logger.debug("hf_paged_t5: compiling ahead for %s failed (%s: %s)", what, type(exc).__name__, exc)


class OnDevice:
    """A kernel namespace whose calls run with `device` as the current CUDA device.

    Triton launches on the *current* device's current stream, not on the device of the tensors
    it is given. With a model split across GPUs (accelerate's device_map), a layer on cuda:1
    called while cuda:0 is current would run on cuda:0, reading cuda:1's memory over the link
    and unordered with cuda:1's stream: wrong answers, not an error. Every kernel call of such a
    layer goes through this wrapper.
    """

    def __init__(self, ops: ModuleType, device: torch.device) -> None:
        self._ops, self._device = ops, device
        self._wrapped: dict[str, object] = {}

    def __getattr__(self, name: str):
        fn = self._wrapped.get(name)
        if fn is None:
            inner, device = getattr(self._ops, name), self._device
            if not callable(inner):
                return inner

            def fn(*args, **kwargs):
                with torch.cuda.device(device):
                    return inner(*args, **kwargs)

            self._wrapped[name] = fn
        return fn


# HF's T5-family RMSNorm classes: `weight * x / sqrt(mean(x^2) + variance_epsilon)`, in HF's dtype order
_RMS_NORMS = frozenset({"T5LayerNorm", "MT5LayerNorm", "UMT5LayerNorm"})


def plain_rms_norm(norm: nn.Module) -> bool:
    """One of HF's T5-family RMSNorms as it is (not apex's fused norm, not hooked)."""
    return type(norm).__name__ in _RMS_NORMS and unhooked(norm)


def project(ops: ModuleType, layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`layer(x)`, on the backend's few-row GEMV kernel when it serves this product.

    Only a plain linear layer qualifies (`plain_linear`): a LoRA, quantized or hooked layer runs
    its own forward, so its adapter, dequantization or hook applies as in stock HF.
    """
    if plain_linear(layer) and ops.gemv_supports(x, layer.weight):
        return ops.gemv(x, layer.weight)
    return layer(x)


def project_group(ops: ModuleType, group: tuple[nn.Module, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """`[layer(x) for layer in group]`, as one GEMM (or GEMV) over the group's weights where
    `packing` laid them out as one tensor; the results are column slices of its output (views).

    x: [..., in_features]; returns one [..., out_features] tensor per layer
    """
    weight = packing.packed_weight(group)
    if weight is None or weight.dtype != x.dtype or weight.device != x.device:
        return [project(ops, layer, x) for layer in group]
    y = ops.gemv(x, weight) if ops.gemv_supports(x, weight) else F.linear(x, weight)
    return list(y.split([layer.out_features for layer in group], dim=-1))


# HF's gated feed-forward classes and its tanh-approximated GELUs (`gelu_new`, `gelu_pytorch_tanh`)
_GATED_FF = frozenset({"T5DenseGatedActDense", "MT5DenseGatedActDense", "UMT5DenseGatedActDense",
                       "LongT5DenseGatedActDense"})
_GELU_TANH = frozenset({"NewGELUActivation", "GELUTanh", "PytorchGELUTanh"})
# HF's non-gated feed-forward classes: `wo(dropout(act(wi(x))))`, wo's dtype cast between
_PLAIN_FF = frozenset({"T5DenseActDense", "MT5DenseActDense", "UMT5DenseActDense", "LongT5DenseActDense"})


def fused_gated_gelu(ops: ModuleType, dense: nn.Module, dtype: torch.dtype) -> bool:
    """Whether `gelu_tanh(wi_0(x)) * wi_1(x)` of `dense` runs as one kernel (the backend's
    `gated_gelu`; `ops` None: any backend's): HF's gated FF with a tanh GELU as they are (no hooks,
    no dropout), half-precision activations (float32 keeps HF's op-by-op rounding, so fp32 tokens
    stay HF's bit for bit)."""
    return (
        dtype in (torch.float16, torch.bfloat16) and (ops is None or hasattr(ops, "gated_gelu"))
        and type(dense).__name__ in _GATED_FF and type(dense.act).__name__ in _GELU_TANH
        and not (dense.training and dense.dropout.p) and all(map(unhooked, (dense, dense.act, dense.dropout)))
    )


class Partials(NamedTuple):
    """A sub-layer's output left as float32 partial sums over K-slices of its last projection
    (the backend's `split_k_linear`), for the next `add_norm` to add in its kernel.

    parts: [S, ..., d_model] float32; the output is their sum in slice order rounded to the
    activations' dtype (`total`)."""

    parts: torch.Tensor

    def total(self, dtype: torch.dtype) -> torch.Tensor:
        """The sub-layer's output as a tensor: the partials summed in slice order, rounded once."""
        from .. import reference

        return reference.sum_partials(self.parts).to(dtype)


def feed_forward(
    ops: ModuleType, dense: nn.Module, x: torch.Tensor, partials: bool = False
) -> Union[torch.Tensor, Partials]:
    """HF's T5DenseActDense / T5DenseGatedActDense forward, op for op, with `project` for the Linears
    (the gated GELU as one kernel where `fused_gated_gelu` allows).

    x: [..., d_model] (normed); returns [..., d_model]. Any other module runs its own forward.
    partials: the caller's next `add_norm` takes `Partials`: `wo` runs as `split_k_linear` where
        `split_wo` allows, and its partials are returned instead of the tensor
    """
    names = {cls.__name__ for cls in type(dense).__mro__}
    if hasattr(dense, "_hf_hook") or not names & {"T5DenseActDense", "T5DenseGatedActDense"}:
        return dense(x)
    if hasattr(dense, "wi_0"):
        h = gated_middle(ops, dense, x)
    elif relu_epilogue(ops, dense, x):
        h = ops.relu_linear(x, dense.wi.weight)
    else:
        h = dense.act(project(ops, dense.wi, x))
    h = to_wo_dtype(dense, dense.dropout(h))
    if partials and split_wo(ops, dense, h):
        return Partials(ops.split_k_linear(h, dense.wo.weight))
    return project(ops, dense.wo, h)


def split_wo(ops: ModuleType, dense: nn.Module, h: torch.Tensor) -> bool:
    """Whether the feed-forward's `wo` runs as the backend's `split_k_linear` (K-slice partials that
    the next add + norm sums): HF's FF module as it is (no hooks), a plain `wo`, bf16 activations
    (fp16 keeps HF's clamp between the residual add and the norm, which the fused add cannot place),
    more rows than the backend's `gemv` serves and a product `split_k_supports` takes."""
    wo = getattr(dense, "wo", None)
    return (
        hasattr(ops, "split_k_supports") and h.dtype == torch.bfloat16  # the cheap refusals first
        and type(dense).__name__ in _PLAIN_FF | _GATED_FF and plain_linear(wo) and unhooked(dense)
        and ops.split_k_supports(h, wo.weight) and not ops.gemv_supports(h, wo.weight)
    )


def ff_sublayer(ops: ModuleType, ff: nn.Module, normed: torch.Tensor, hidden: torch.Tensor
                ) -> Union[torch.Tensor, Partials]:
    """A T5LayerFF's output before its residual add: `ff.dropout(feed_forward(...))`, as `Partials`
    where `feed_forward` gives them and the sub-layer's dropout does nothing (not training or p 0,
    no hooks) on the residual's dtype and device; the caller's next `add_norm` takes either."""
    dropout = ff.dropout
    idle = not (dropout.training and dropout.p) and unhooked(dropout)
    if idle and hidden.dtype == normed.dtype and hidden.device == normed.device:
        return feed_forward(ops, ff.DenseReluDense, normed, partials=True)
    return dropout(feed_forward(ops, ff.DenseReluDense, normed))


def relu_epilogue(ops: ModuleType, dense: nn.Module, x: torch.Tensor) -> bool:
    """Whether `relu(wi(x))` of HF's non-gated feed-forward runs as one GEMM with the ReLU in its
    epilogue (the backend's `relu_linear`): the module, a plain `wi` and `nn.ReLU` as they are (no
    hooks), for operands the backend takes (half precision on CUDA, more rows than its `gemv` serves)."""
    return (
        hasattr(ops, "relu_linear_supports") and type(dense).__name__ in _PLAIN_FF and unhooked(dense)
        and type(getattr(dense, "act", None)) is nn.ReLU
        and unhooked(dense.act) and plain_linear(getattr(dense, "wi", None))
        and not ops.gemv_supports(x, dense.wi.weight) and ops.relu_linear_supports(x, dense.wi.weight)
    )


def gated_middle(ops: ModuleType, dense: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`act(wi_0(x)) * wi_1(x)` of a gated feed-forward (both projections as one GEMM where they are
    packed; the product as one kernel where `fused_gated_gelu` allows)."""
    gate, linear = project_group(ops, (dense.wi_0, dense.wi_1), x)
    if fused_gated_gelu(ops, dense, x.dtype):
        return ops.gated_gelu(gate=gate, linear=linear)
    return dense.act(gate) * linear


def to_wo_dtype(dense: nn.Module, h: torch.Tensor) -> torch.Tensor:
    """`h` in the dtype of `dense.wo`'s weight, as HF's FF casts it (HF keeps `wo` in fp32 for some
    half-precision checkpoints; int8 weights are left to their module)."""
    wo = dense.wo.weight
    if isinstance(wo, torch.Tensor) and h.dtype != wo.dtype and wo.dtype != torch.int8:
        return h.to(wo.dtype)
    return h


def _heads(x: torch.Tensor, attn: nn.Module) -> torch.Tensor:
    """[..., num_heads * head_dim] -> [prod(...), num_heads, head_dim]"""
    return x.reshape(-1, attn.n_heads, attn.key_value_proj_dim)


def encoder_self_attention(
    ops: ModuleType,
    attn: nn.Module,
    hidden: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    bias_table: torch.Tensor,
    band_memo: Optional[dict] = None,
) -> torch.Tensor:
    """Bidirectional attention within each packed sequence.

    hidden: [total_tokens, d_model] (already layer-normed); returns [total_tokens, d_model]
    bias_table: [num_heads, 2 * D + 1] float32 (see bias.py); band_memo: the table's memo for
    what the kernel derives from it (`BiasTableCache.memos`), or None
    """
    q, k, v = (_heads(y, attn) for y in project_group(ops, (attn.q, attn.k, attn.v), hidden))
    out = ops.prefill(
        query=q, key=k, value=v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
        scale=1.0, causal=False, bias_table=bias_table, band_memo=band_memo,
    )  # [total_tokens, num_heads, head_dim]
    del q, k, v  # three [total_tokens, inner_dim] tensors: not held through the output projection
    return attn.o(out.reshape(hidden.shape[0], -1))


def _per_token_rows(meta_table: torch.Tensor, seq_lens: torch.Tensor, num_new: int, causal: bool):
    """Block tables and key counts for `num_new` queries per row, flattened row-major.

    A row's j-th new token sees `seq_len - num_new + 1 + j` keys when causal, all keys otherwise.
    """
    if num_new == 1:
        return meta_table, seq_lens
    table = meta_table.repeat_interleave(num_new, dim=0)
    if not causal:
        return table, seq_lens.repeat_interleave(num_new)
    offsets = torch.arange(num_new, device=seq_lens.device, dtype=seq_lens.dtype) - (num_new - 1)
    return table, (seq_lens[:, None] + offsets[None, :]).reshape(-1)


def _decode_launch(ops: ModuleType, query: torch.Tensor, meta: StepMetadata, keys_ready: str) -> dict:
    """The Triton backend's `paged_decode` launch options, as `fused_layer` passes them: a step of
    any row count then launches the kernels a 1-row step compiled (where the launch knobs agree),
    so a new batch size compiles less. Other backends take none.

    keys_ready: "all" (cross-attention) or "past" (self-attention), `paged_decode`'s promise for
    a step of one new token per row. A step of several new tokens per row goes without it, the
    counters (they cover one query per row) and a dependent launch: its tables and key counts
    come from the kernels just before the attention (`_per_token_rows`).
    """
    if not hasattr(ops, "pdl_available"):
        return {}
    if meta.num_new != 1:
        return dict(pdl=False, tickets=None, keys_ready=None)
    return dict(pdl=ops.pdl_available(query.device), tickets=meta.tickets, keys_ready=keys_ready)


def cross_decode(ops: ModuleType, meta: StepMetadata, launch: dict, **kwargs) -> torch.Tensor:
    """Cross-attention's decode launch: rows of a source in groups (`meta.cross_group`, one new
    token per row) read the source's keys once through the backend's `grouped_decode` where it
    takes them (`grouped_supports`: half precision, up to 16 rows per source); else `paged_decode`
    per row. kwargs: `paged_decode`'s query, caches, table, lengths and scale; launch: its
    launch options (`_decode_launch`), of which the grouped launch takes the dependent launch and
    the step's split counters."""
    group = meta.cross_group
    if group > 1 and meta.num_new == 1 and hasattr(ops, "grouped_supports") and ops.grouped_supports(
            kwargs["query"], group):
        return ops.grouped_decode(**kwargs, group=group, pdl=launch.get("pdl", False), tickets=launch.get("tickets"))
    return ops.paged_decode(**kwargs, **launch)


def decoder_self_attention(
    ops: ModuleType,
    attn: nn.Module,
    hidden: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: StepMetadata,
    bias_table: torch.Tensor,
    state=None,
) -> torch.Tensor:
    """Causal self-attention of the new decoder tokens over each row's paged history.

    hidden: [rows, num_new, d_model] (normed); returns [rows, num_new, d_model]
    bias_table: [num_heads, D + 1] float32
    state: the call's `cpu_ops.DecodeState` (CPU backend: one gather plan per step), or None
    """
    rows, num_new = hidden.shape[:2]
    q, k, v = (_heads(y, attn) for y in project_group(ops, (attn.q, attn.k, attn.v), hidden))
    table, lens = _per_token_rows(meta.self_block_table, meta.self_seq_lens, num_new, causal=True)
    kwargs = dict(query=q, key_cache=key_cache, value_cache=value_cache, block_table=table, seq_lens=lens,
                  bias_table=bias_table, scale=1.0)
    launch = _decode_launch(ops, q, meta, "past") if state is None else {}
    if launch and num_new == 1:
        # The Triton backend takes each row's new K/V with the attention: at many rows its binary
        # stores them itself, sparing a store launch (`kernels.paged_decode`).
        out = ops.paged_decode(**kwargs, **launch, new_key=k, new_value=v, slot_mapping=meta.slot_mapping)
    else:
        ops.store_kv(key=k, value=v, key_cache=key_cache, value_cache=value_cache, slot_mapping=meta.slot_mapping)
        out = state.self_decode(**kwargs) if state is not None else ops.paged_decode(**kwargs, **launch)
    # out: [rows * num_new, num_heads, head_dim]
    return project(ops, attn.o, out.reshape(rows, num_new, -1))


def cross_attention(
    ops: ModuleType,
    attn: nn.Module,
    hidden: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: StepMetadata,
    state=None,
    layer: int = 0,
) -> torch.Tensor:
    """Attention of the new decoder tokens over their source's encoder K/V (no bias).

    hidden: [rows, num_new, d_model] (normed); returns [rows, num_new, d_model]
    state: the call's `cpu_ops.DecodeState` (CPU backend: K/V gathered once per call), or None
    """
    rows, num_new = hidden.shape[:2]
    q = _heads(project(ops, attn.q, hidden), attn)
    table, lens = _per_token_rows(meta.cross_block_table, meta.cross_seq_lens, num_new, causal=False)
    kwargs = dict(query=q, key_cache=key_cache, value_cache=value_cache, block_table=table, seq_lens=lens, scale=1.0)
    if state is not None:
        out = state.cross_decode(layer, **kwargs)
    else:
        out = cross_decode(ops, meta, _decode_launch(ops, q, meta, "all"), **kwargs)
    return project(ops, attn.o, out.reshape(rows, num_new, -1))


def store_cross_kv(
    ops: ModuleType,
    attn: nn.Module,
    encoder_tokens: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Project the packed real encoder tokens [total_tokens, d_model] to K/V once and store them."""
    k, v = (_heads(y, attn) for y in project_group(ops, (attn.k, attn.v), encoder_tokens))
    ops.store_kv(key=k, value=v, key_cache=key_cache, value_cache=value_cache, slot_mapping=slot_mapping)


def clamp_fp16(hidden: torch.Tensor) -> torch.Tensor:
    """HF T5's fp16 guard after each sub-layer, reproduced exactly (no host sync)."""
    if hidden.dtype != torch.float16:
        return hidden
    max_value = torch.finfo(hidden.dtype).max
    clamp_value = torch.where(torch.isinf(hidden).any(), max_value - 1000, max_value)
    return torch.clamp(hidden, min=-clamp_value, max=clamp_value)


def add_norm(
    ops: ModuleType, layer_norm: nn.Module, hidden: torch.Tensor, out: Union[torch.Tensor, Partials, None]
) -> tuple[torch.Tensor, torch.Tensor]:
    """(layer_norm(hidden + out), hidden + out) with HF's fp16 clamp in between; `out` may be None.

    One fused kernel where HF's order allows it (no fp16 clamp, one device, one dtype). A norm
    that is not HF's own T5 RMSNorm as it is (apex's fused norm, a hooked one) runs its own forward.
    `out` as `Partials` (`ff_sublayer`'s) is summed inside that kernel; elsewhere it is summed first.
    """
    if isinstance(out, Partials):
        parts = out.parts
        if (plain_rms_norm(layer_norm) and hidden.dtype == torch.bfloat16
                and hidden.device == parts.device == layer_norm.weight.device):
            return ops.rms_norm(hidden=hidden, weight=layer_norm.weight, eps=layer_norm.variance_epsilon,
                                partials=parts)
        out = out.total(hidden.dtype)
    if not plain_rms_norm(layer_norm):
        total = hidden if out is None else clamp_fp16(hidden + out)
        total = total.to(layer_norm.weight.device)
        return layer_norm(total), total
    device = layer_norm.weight.device
    eps = layer_norm.variance_epsilon
    fusable = (
        out is not None and hidden.dtype != torch.float16 and out.dtype == hidden.dtype
        and hidden.device == out.device == device
    )
    if fusable:
        return ops.rms_norm(hidden=hidden, weight=layer_norm.weight, eps=eps, residual=out)
    total = hidden if out is None else clamp_fp16(hidden + out)
    total = total.to(device)
    return ops.rms_norm(hidden=total, weight=layer_norm.weight, eps=eps)[0], total
