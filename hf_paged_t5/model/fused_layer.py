"""A decode step's decoder layers as a few fused kernels each (few rows, bfloat16).

`stacks.decoder_layers` runs each layer op by op: three norms, seven projections, the K/V store,
the residual adds and the activation, ~17 kernels per layer. Where every layer is HF's own
modules as they are (`serves`), this runs each layer as

    norm + q/k/v + K/V store | self-attention | o + residual
    norm + q                 | cross-attention | o + residual
    norm + wi (+ activation) | wo + residual

(`kernels.fused_linear` and `kernels.paged_decode`, cross-attention `grouped_decode` over each
source's rows where a call has several sources and beams: 8 launches; a split attention merges its partials in its last
program, on the step's `tickets`), each a programmatic dependent launch
where the GPU allows it (`pdl_available`). Each kernel of the chain triggers its dependent only
after its own wait, so when a kernel starts, every kernel two or more launches back has finished:
what those wrote (the residual stream, the step's tables and slots, the keys of earlier steps,
the cross keys) loads before the wait (`early_inputs`, `keys_ready`), and only what the kernel
just before wrote (its output, the newest key) after it. The arithmetic is HF's at every point
where HF rounds (`fused_linear`'s docstring); the order of a dot product's sums is the GEMV's, as
on the unfused path.

Whether a step is served is decided once per input shape for a decode plan's life (a
`generate()` call, a batch job: `decode/runner.py`); a hook added in the middle of a call is
seen from the next call on.

bfloat16 only: float16 clamps the residual stream after every sub-layer by a test over the whole
tensor (`attention.clamp_fp16`), and float32 keeps cuBLAS so its tokens stay HF's bit for bit.
"""

from __future__ import annotations

import itertools
from types import ModuleType
from typing import Optional

import torch
from torch import nn

from . import attention as attn_ops
from ..kv.pool import KVPool, StepMetadata

# The row counts the fused layer's binaries are compiled for: its projections (`kernels/linear.py`)
# compile one per power of two of rows up to `MAX_ROWS`; a captured step's rows are one of them.
ROW_COUNTS = (1, 2, 4)


def _inactive(dropout: nn.Module) -> bool:
    return type(dropout) is nn.Dropout and attn_ops.unhooked(dropout) and not (dropout.training and dropout.p)


def _weight_ok(module: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    return module.weight.dtype == dtype and module.weight.device == device


def _norm_ok(norm: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    return attn_ops.plain_rms_norm(norm) and _weight_ok(norm, dtype, device)


def _linears_ok(linears, dtype: torch.dtype, device: torch.device) -> bool:
    return all(attn_ops.plain_linear(lin) and _weight_ok(lin, dtype, device) for lin in linears)


def _feed_forward_ok(ff: nn.Module, dtype: torch.dtype, device: torch.device) -> bool:
    dense = ff.DenseReluDense
    if not (_norm_ok(ff.layer_norm, dtype, device) and _inactive(ff.dropout) and attn_ops.unhooked(dense)):
        return False
    if hasattr(dense, "wi_0"):
        linears = (dense.wi_0, dense.wi_1, dense.wo)
        if not attn_ops.fused_gated_gelu(None, dense, dtype):
            return False
    else:
        linears = (dense.wi, dense.wo)
        names = {cls.__name__ for cls in type(dense).__mro__}
        if "T5DenseActDense" not in names or type(dense.act) is not nn.ReLU or not _inactive(dense.dropout):
            return False
    return _linears_ok(linears, dtype, device)


def _weights(block: nn.Module) -> list[torch.Tensor]:
    """The projection weights one decoder layer's step reads, as meta tensors (shapes only)."""
    cross = block.layer[1].EncDecAttention
    once = {id(getattr(cross, "k", None)), id(getattr(cross, "v", None))}  # once per call, not per step
    return [m.weight.to("meta") for m in block.modules() if isinstance(m, nn.Linear) and id(m) not in once]


def serves(decoder: nn.Module, ops: ModuleType, pool: KVPool, input_ids: torch.Tensor) -> bool:
    """Whether `decoder_layers` serves this step: the backend has `fused_linear`, one new token per
    row and at most its MAX_ROWS rows, a bfloat16 decoder on one device with a bfloat16 pool, and
    in every layer HF's own norms, plain bias-free Linears, a ReLU or gated tanh-GELU feed-forward
    and no active dropout or hook (anything else runs `stacks.decoder_layers` op by op)."""
    if not hasattr(ops, "fused_linear") or input_ids.dim() != 2 or input_ids.shape[1] != 1:
        return False
    dtype, device = decoder.embed_tokens.weight.dtype, decoder.embed_tokens.weight.device
    if not (_inactive(decoder.dropout) and _norm_ok(decoder.final_layer_norm, dtype, device)):
        return False
    if dtype != torch.bfloat16 or not all(
        ops.fused_linear_supports(torch.empty((input_ids.shape[0], w.shape[1]), dtype=dtype, device="meta"), [w])
        for w in _weights(decoder.block[0])
    ):  # x as a shape only (no memory); every layer has layer 0's shapes
        return False
    for i, block in enumerate(decoder.block):
        sa, ca, ff = block.layer[0], block.layer[1], block.layer[-1]
        attn, cross = sa.SelfAttention, ca.EncDecAttention
        # every weight the fused layer reads is checked for dtype and device here
        if (
            len(block.layer) != 3 or pool.key_caches[i].dtype != dtype or pool.key_caches[i].device != device
            or not all(map(attn_ops.unhooked, (block, sa, ca, ff, attn, cross)))
            or not (_norm_ok(sa.layer_norm, dtype, device) and _norm_ok(ca.layer_norm, dtype, device))
            or not (_inactive(sa.dropout) and _inactive(ca.dropout))
            or not _linears_ok((attn.q, attn.k, attn.v, attn.o, cross.q, cross.o), dtype, device)
            or not _feed_forward_ok(ff, dtype, device)
        ):
            return False
    return True


def decoder_layers(
    decoder: nn.Module,
    ops: ModuleType,
    bias_tables: list[torch.Tensor],
    pool: KVPool,
    meta: StepMetadata,
    input_ids: torch.Tensor,
    blocks: Optional[int] = None,
) -> torch.Tensor:
    """`stacks.decoder_layers` for a step that `serves` accepts; no host sync (graph capturable).

    input_ids: [rows, 1]; returns [rows, 1, d_model]; blocks: the first `blocks` layers only (None: all)
    """
    device = decoder.embed_tokens.weight.device
    pdl = ops.pdl_available(device)
    hidden = decoder.dropout(decoder.embed_tokens(input_ids)).reshape(input_ids.shape[0], -1)  # [rows, d_model]
    for i, block in enumerate(itertools.islice(decoder.block, blocks)):
        hidden = _layer(ops, block, hidden, pool.key_caches[i], pool.value_caches[i], meta, bias_tables[i], pdl)
    norm = decoder.final_layer_norm
    hidden = ops.rms_norm(hidden=hidden, weight=norm.weight, eps=norm.variance_epsilon, pdl=pdl)[0]
    return decoder.dropout(hidden).unsqueeze(1)


def _layer(ops: ModuleType, block: nn.Module, hidden: torch.Tensor, key_cache: torch.Tensor,
           value_cache: torch.Tensor, meta: StepMetadata, bias_table: torch.Tensor, pdl: bool) -> torch.Tensor:
    """One decoder layer over hidden [rows, d_model] (the residual stream, complete): returns the next."""
    sa, ca, ff = block.layer[0], block.layer[1], block.layer[-1]
    rows = hidden.shape[0]
    attn = sa.SelfAttention
    q = ops.fused_linear(
        x=hidden, weights=(attn.q.weight, attn.k.weight, attn.v.weight), norm_weight=sa.layer_norm.weight,
        eps=sa.layer_norm.variance_epsilon, key_cache=key_cache, value_cache=value_cache,
        slot_mapping=meta.slot_mapping, pdl=pdl, early_inputs=True,
    )
    heads = key_cache.shape[2:]
    out = ops.paged_decode(
        query=q.view(rows, *heads), key_cache=key_cache, value_cache=value_cache, block_table=meta.self_block_table,
        seq_lens=meta.self_seq_lens, scale=1.0, bias_table=bias_table, pdl=pdl, tickets=meta.tickets,
        keys_ready="past",
    )
    hidden = ops.fused_linear(x=out.view(rows, -1), weights=(attn.o.weight,), residual=hidden, pdl=pdl,
                              early_inputs=True)
    cross = ca.EncDecAttention
    q = ops.fused_linear(x=hidden, weights=(cross.q.weight,), norm_weight=ca.layer_norm.weight,
                         eps=ca.layer_norm.variance_epsilon, pdl=pdl)
    out = attn_ops.cross_decode(
        ops, meta, dict(pdl=pdl, tickets=meta.tickets, keys_ready="all"), query=q.view(rows, *heads),
        key_cache=key_cache, value_cache=value_cache, block_table=meta.cross_block_table,
        seq_lens=meta.cross_seq_lens, scale=1.0,
    )
    hidden = ops.fused_linear(x=out.view(rows, -1), weights=(cross.o.weight,), residual=hidden, pdl=pdl,
                              early_inputs=True)
    dense, norm = ff.DenseReluDense, ff.layer_norm
    if hasattr(dense, "wi_0"):
        h = ops.fused_linear(x=hidden, weights=(dense.wi_0.weight, dense.wi_1.weight), norm_weight=norm.weight,
                             eps=norm.variance_epsilon, activation="gelu_tanh", pdl=pdl)
    else:
        h = ops.fused_linear(x=hidden, weights=(dense.wi.weight,), norm_weight=norm.weight,
                             eps=norm.variance_epsilon, activation="relu", pdl=pdl)
    return ops.fused_linear(x=h, weights=(dense.wo.weight,), residual=hidden, pdl=pdl, early_inputs=True)
