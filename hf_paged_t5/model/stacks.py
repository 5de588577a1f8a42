"""The paged forward of T5's (and LongT5's) encoder stack and of one decoder step, built from HF's own modules.

Every weight is the model's own (`T5LayerNorm`, the q/k/v/o Linears, `T5LayerFF`); only the
attention core and the KV bookkeeping are ours. The order of operations is HF's, including
the fp16 clamps, so results match stock HF.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from types import ModuleType
from typing import Callable, Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from . import attention as attn_ops
from . import fused_layer, longt5, packing
from .bias import is_local, self_attention
from ..kv.pool import KVPool, StepMetadata
from ..kv.tables import upload

# The encoder runs its feed-forward over the packed tokens in row chunks so that each
# [chunk_tokens, d_ff] intermediate stays under this many bytes; otherwise the FF's two or three
# full-size intermediates (t5-small at 8 x 512 tokens: 2 x 16 MiB) set the encoder's peak memory.
FF_CHUNK_BYTES = 4 * 2**20
# Fewer rows than this would leave the FF's GEMMs too small to run efficiently (T5 v1.1 XXL's
# 512 tokens would run as three chunks of 204 rows); 1,024 rows of t5-11b's d_ff (65,536) are
# 128 MiB in bf16, next to 42 GiB of weights.
FF_MIN_CHUNK_TOKENS = 1024
# At most this many chunks per layer: each costs a few launches from the host (measured on an H200:
# 4 MiB chunks made t5-large at batch 64 x 512 tokens 18% slower per generated token, 64 chunks in
# each of 24 layers), and a large batch's other activations dwarf the FF's anyway.
FF_MAX_CHUNKS = 4


def weight_devices(module: nn.Module) -> frozenset:
    """The devices of `module`'s parameters: what `{p.device for p in module.parameters()}` gives,
    by a plain walk of the module tree (`parameters()` dedupes names and modules through sets and
    generators: ~1-3 ms a t5-large call, several times this walk)."""
    devices: set = set()
    stack = [module]
    while stack:
        current = stack.pop()
        if current is None:
            continue
        for param in current._parameters.values():
            if param is not None:
                devices.add(param.device)
        stack.extend(current._modules.values())
    return frozenset(devices)


def module_device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def pack_tokens(mask: torch.Tensor, device: Optional[torch.device] = None) -> tuple[torch.Tensor, list[int], torch.Tensor, int]:
    """Where the real tokens of a padded batch are.

    mask: [batch, seq_len], nonzero = real token (padding may be left or right). A mask on the
        device is read back (one sync); a CPU mask is not: the results are uploaded without
        waiting for the device (what `BatchGenerator` gives, whose steps must not wait).
    device: where `index` and `cu_seqlens` go (default: the mask's device)
    returns: flat index [total_tokens] into batch*seq_len, per-row lengths (host ints),
        cu_seqlens [batch + 1] int32, max length
    """
    device = mask.device if device is None else torch.device(device)
    lens, firsts, empty, holes, _ = _layout(mask)
    if empty:
        rows = [i for i, n in enumerate(lens) if n == 0]
        raise ValueError(
            f"rows {rows} of the batch are all padding (attention_mask is 0 everywhere); "
            "remove them or give each row at least one real token"
        )
    if holes:
        index = np.flatnonzero(_host_real(mask))
    else:  # each row's tokens are one run from its first real position
        counts = np.asarray(lens)
        starts = np.arange(len(lens)) * mask.shape[1] + np.asarray(firsts)
        index = np.repeat(starts - (np.cumsum(counts) - counts), counts) + np.arange(int(counts.sum()))
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    return upload(torch.from_numpy(index), device), lens, upload(cu, device), max(lens)


def _host_real(mask: torch.Tensor) -> np.ndarray:
    """[batch, seq_len] bool on the host: where `mask` is nonzero (one read back of a device mask)."""
    if mask.dtype == torch.bfloat16:  # numpy has no bfloat16
        mask = mask.ne(0)
    return mask.detach().cpu().numpy() != 0


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` on `device`: a host tensor through `upload` (no wait for the device)."""
    return upload(tensor, device) if tensor.device.type == "cpu" else tensor.to(device)


EMPTY_ROW = "a row of attention_mask has no real token (all zeros)"
HOLE = "attention_mask has zeros between a row's real tokens (a hole)"


def mask_rows(mask: torch.Tensor, right_padded: bool = False) -> tuple[list[int], Optional[str]]:
    """(real tokens per row, why `pack_tokens` cannot serve `mask` exactly or None): `mask_layout`
    without the rows' first positions."""
    lens, _, reason = mask_layout(mask, right_padded)
    return lens, reason


def mask_layout(mask: torch.Tensor, right_padded: bool = False) -> tuple[list[int], list[int], Optional[str]]:
    """(real tokens per row, each row's first real position, why `pack_tokens` cannot serve `mask`
    exactly or None); a mask it serves (no hole) is those two lists. Not served:
    a row with no real token (HF's encoder then attends over every position of that row), and
    zeros between a row's ones (HF keeps the tokens after such a hole at their original
    distances; packing would close it up); with `right_padded`, padding before a row's first
    token too (LongT5's transient-global blocks are counted from the tensor's first position).
    One host read of the mask (none for `known_mask`'s after the first).

    mask: [batch, seq_len], nonzero = real token; the reason is EMPTY_ROW, HOLE, LEFT_PADDED or None
    """
    if mask.numel() == 0:
        return [0] * mask.shape[0], [0] * mask.shape[0], None  # an empty batch or empty rows: the callers' own checks say so
    rows, firsts, empty, holes, late = _layout(mask)
    left = right_padded and late
    reason = EMPTY_ROW if empty else HOLE if holes else longt5.LEFT_PADDED if left else None
    return rows, firsts, reason


# The mask of the generate() call running in this context and its layout, read once (`known_mask`).
_known: contextvars.ContextVar = contextvars.ContextVar("hf_paged_t5_known_mask", default=None)


@contextlib.contextmanager
def known_mask(mask: Optional[torch.Tensor]):
    """While entered, `mask_layout` and `pack_tokens` of this very tensor read it once: a
    generate() call's encoder and cross K/V store ask again for its attention_mask, and each read
    of a device mask waits for the work queued before it (the encoder's, for the store). The
    caller does not change the mask meanwhile (HF's generate() does not)."""
    token = _known.set(None if mask is None else [mask, None])
    try:
        yield
    finally:
        _known.reset(token)


def _layout(mask: torch.Tensor) -> tuple[list[int], list[int], bool, bool, bool]:
    """(real tokens per row, first real position per row, a row has none, a row has a hole, a
    row starts after position 0) of a non-empty mask: one read of it, or none for `known_mask`'s."""
    known = _known.get()
    if known is not None and known[0] is mask:
        if known[1] is None:
            known[1] = _read_layout(mask)
        return known[1]
    return _read_layout(mask)


def _read_layout(mask: torch.Tensor) -> tuple[list[int], list[int], bool, bool, bool]:
    if mask.shape[1] == 0:
        return [0] * mask.shape[0], [0] * mask.shape[0], mask.shape[0] > 0, False, False
    real = _host_real(mask)
    width = real.shape[1]
    lens = real.sum(axis=1)
    some = lens > 0
    first = np.where(some, real.argmax(axis=1), width)
    last = np.where(some, width - 1 - real[:, ::-1].argmax(axis=1), -1)
    return (lens.tolist(), first.tolist(), bool((~some).any()), bool(((last - first + 1 != lens) & some).any()),
            bool(((first > 0) & some).any()))


def ff_chunk_tokens(d_ff: int, element_size: int, tokens: int) -> int:
    """Rows per encoder feed-forward chunk over `tokens` rows: [rows, d_ff] elements of
    `element_size` bytes fit in FF_CHUNK_BYTES, but at least FF_MIN_CHUNK_TOKENS rows and at most
    FF_MAX_CHUNKS chunks."""
    return max(FF_MIN_CHUNK_TOKENS, FF_CHUNK_BYTES // (d_ff * element_size), -(-tokens // FF_MAX_CHUNKS))


def _ff_element_size(dense: nn.Module, hidden: torch.Tensor) -> int:
    """Bytes per element of the FF's widest intermediate: the activations' dtype, or fp32 where
    HF keeps `wo` in fp32 and casts the intermediate up to it (int8/4-bit weights don't count)."""
    sizes = [p.element_size() for p in dense.parameters() if p.is_floating_point()]
    return max([hidden.element_size(), *sizes])


def _dense(ops: ModuleType, dense: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`dense(x)`: HF's module, or its Linears around one `gated_gelu` kernel (`fused_gated_gelu`;
    wi_0 and wi_1 as one GEMM where they are packed, `attention.gated_middle`), or with `wi`'s
    ReLU in its GEMM's epilogue (`attention.relu_epilogue`)."""
    if attn_ops.fused_gated_gelu(ops, dense, x.dtype):
        return dense.wo(attn_ops.to_wo_dtype(dense, attn_ops.gated_middle(ops, dense, x)))
    if attn_ops.relu_epilogue(ops, dense, x):
        return dense.wo(attn_ops.to_wo_dtype(dense, dense.dropout(ops.relu_linear(x, dense.wi.weight))))
    return dense(x)


def _chunked_feed_forward(ops: ModuleType, ff: nn.Module, normed: torch.Tensor, chunk_tokens: int) -> torch.Tensor:
    """`ff.dropout(ff.DenseReluDense(normed))`, HF's own modules (`_dense`) called on row chunks of `normed`.

    Each row's result depends on that row only, so chunking changes which rows share a GEMM, not
    the formula per row; the BLAS may still sum a row in another order for a GEMM of another
    size (last-bit differences; MKL's fp32 GEMM on CPU does, see tests/test_encoder_memory.py).
    Chunk outputs go into one tensor (no concatenation copy).
    normed: [total_tokens, d_model]; returns [total_tokens, d_model] in the module's output dtype
    """
    total_tokens = normed.shape[0]
    first = ff.dropout(_dense(ops, ff.DenseReluDense, normed[:chunk_tokens]))
    if total_tokens <= chunk_tokens:
        return first
    out = first.new_empty((total_tokens, *first.shape[1:]))
    out[:chunk_tokens] = first
    del first  # one chunk's output alive at a time
    for start in range(chunk_tokens, total_tokens, chunk_tokens):
        stop = start + chunk_tokens
        out[start:stop] = ff.dropout(_dense(ops, ff.DenseReluDense, normed[start:stop]))
    return out


def encoder_forward(
    stack: nn.Module,
    ops_for: Callable[[torch.device], ModuleType],
    bias_tables: list[torch.Tensor],
    inputs_embeds: Optional[torch.Tensor],
    attention_mask: Optional[torch.Tensor],
    input_ids: Optional[torch.Tensor] = None,
    packed: bool = False,
    band_memos: Optional[list[dict]] = None,
    side_tables: Optional[list[torch.Tensor]] = None,
    packing: Optional[tuple] = None,
    blocks: Optional[int] = None,
) -> torch.Tensor:
    """T5 (or LongT5) encoder over the real tokens only (varlen); padded positions of the output are 0.

    inputs_embeds: [batch, seq_len, d_model], or None with input_ids [batch, seq_len]: then only
    the real tokens are embedded (no [batch, seq_len, d_model] copy of the embeddings is made);
    attention_mask: [batch, seq_len] or None; on the CPU, nothing here waits for the device
    bias_tables[i]: layer i's bidirectional table (see bias.py); band_memos[i]: its memo for the
    prefill kernel (`BiasTableCache.memos`), or None
    LongT5 (local / transient-global attention): bias_tables[i] is layer i's local table and
    side_tables[i] its side table (transient-global) or side_tables None; the rows of
    attention_mask must be right-padded for transient-global attention (`longt5.unserved_reason`)
    packed: return the real tokens only, [total_tokens, d_model] row by row (no padded copy)
    packing: `pack_tokens` of the call's mask, made before (a captured graph's: nothing is read
        back here, so the forward is graph-capturable); then attention_mask is not read
    blocks: run only the first `blocks` layers, then the final norm (a compile-only pass that
        requests one input length's kernels without the host work of every layer); None: all
    returns: last_hidden_state [batch, seq_len, d_model] (or packed, above)
    """
    source = inputs_embeds if inputs_embeds is not None else input_ids
    batch, seq_len = source.shape[:2]
    if packing is not None:
        index, lens, cu_seqlens, max_seqlen = packing
    elif attention_mask is None:  # every position real: nothing to pack, nothing read back (graph-capturable)
        index, lens, max_seqlen = None, [seq_len] * batch, seq_len
        cu_seqlens = torch.arange(0, (batch + 1) * seq_len, seq_len, dtype=torch.int32, device=source.device)
    else:
        index, lens, cu_seqlens, max_seqlen = pack_tokens(attention_mask, source.device)
    local = is_local(self_attention(stack.block[0].layer[0]))  # LongT5's windowed attention
    plan = longt5.local_plan(stack, lens, cu_seqlens, max_seqlen) if local else None
    plans: dict[torch.device, longt5.LocalPlan] = {}  # the plan on each layer device
    if inputs_embeds is None:
        flat = input_ids.reshape(-1)
        hidden = stack.embed_tokens(flat if index is None else flat[index])
    else:
        flat = inputs_embeds.reshape(batch * seq_len, -1)
        hidden = flat if index is None else flat[index]
    d_model = hidden.shape[-1]
    hidden = stack.dropout(hidden)
    # The residual stream `hidden` and the pending sub-layer output `out` are added inside
    # the next layer norm (attn_ops.add_norm), as HF adds them just before it. `out` is
    # dropped once added, so it is not held through the next sub-layer's temporaries.
    out = None
    for i, block in enumerate(itertools.islice(stack.block, blocks)):
        device = module_device(block)
        ops = ops_for(device)
        sa, ff = block.layer[0], block.layer[-1]
        normed, hidden = attn_ops.add_norm(ops, sa.layer_norm, hidden, out)
        del out
        if plan is None:
            out = sa.dropout(attn_ops.encoder_self_attention(
                ops, sa.SelfAttention, normed, cu_seqlens.to(device), max_seqlen, bias_tables[i].to(device),
                None if band_memos is None else band_memos[i],
            ))
        else:
            if device not in plans:
                plans[device] = plan.on(device, _to_device)
            side = None if side_tables is None else side_tables[i].to(device)
            out = sa.dropout(longt5.local_self_attention(
                ops, self_attention(sa), normed, plans[device], bias_tables[i].to(device), side,
            ))
        normed, hidden = attn_ops.add_norm(ops, ff.layer_norm, hidden, out)
        del out
        chunk_tokens = ff_chunk_tokens(stack.config.d_ff, _ff_element_size(ff.DenseReluDense, normed),
                                       normed.shape[0])
        out = _chunked_feed_forward(ops, ff, normed, chunk_tokens)
    ops = ops_for(module_device(stack.final_layer_norm))
    hidden, _ = attn_ops.add_norm(ops, stack.final_layer_norm, hidden, out)
    del out
    hidden = stack.dropout(hidden)
    if packed or hidden.shape[0] == batch * seq_len:
        return hidden if packed else hidden.reshape(batch, seq_len, d_model)  # no padding: every position in order
    padded = hidden.new_zeros(batch * seq_len, d_model)
    padded[index.to(padded.device)] = hidden
    return padded.reshape(batch, seq_len, d_model)


def store_cross(
    decoder: nn.Module,
    ops_for: Callable[[torch.device], ModuleType],
    cache,
    encoder_hidden: torch.Tensor,
    encoder_mask: Optional[torch.Tensor],
) -> None:
    """Project each source's real encoder tokens to K/V once per layer and store them.

    encoder_hidden: [rows, src_len, d_model], rows = num_sources * expand (HF's expanded batch,
    of which every `expand`-th row is read) or num_sources.
    """
    # one row per source already where generate() did not expand it (hf.generate._encoder_outputs_per_source)
    per_source = encoder_hidden.shape[0] == cache.num_sources
    sources = encoder_hidden if per_source else encoder_hidden[:: cache.expand]
    if encoder_mask is None:
        encoder_mask = torch.ones(sources.shape[:2], dtype=torch.bool)  # on the host: nothing to read back
    elif encoder_mask.shape[0] != sources.shape[0]:
        encoder_mask = encoder_mask[:: cache.expand]
    index, lens, _, _ = pack_tokens(encoder_mask, sources.device)
    packed = sources.reshape(-1, sources.shape[-1])  # [total_tokens, d_model]
    if sum(lens) < packed.shape[0]:
        packed = packed[index]
    store_cross_packed(decoder, ops_for, cache.pool, packed, cache.store_cross_plan(lens))


def _slot_dtype(pool: KVPool) -> torch.dtype:
    """The cross K/V store's slot dtype: int32, as a captured decode step's self-attention store has
    it (both stores are then one compiled kernel), unless the pool has 2^31 slots or more."""
    return torch.int32 if pool.num_blocks * pool.block_size < 2**31 else torch.int64


def store_cross_ahead(decoder: nn.Module, ops_for: Callable[[torch.device], ModuleType], pool: KVPool,
                      packed: torch.Tensor) -> None:
    """`store_cross_packed`'s launches for a compile-only pass (`kernels/ahead.py`): the first layer's
    K/V of `packed` [tokens, d_model] onto the scratch block's first slot (every layer's store is
    the same kernel; were a launch to run, it would write where no row reads)."""
    block = decoder.block[0]
    device = module_device(block)
    slots = torch.full((packed.shape[0],), pool.scratch_block * pool.block_size, dtype=_slot_dtype(pool), device=device)
    attn_ops.store_cross_kv(ops_for(device), block.layer[1].EncDecAttention, packed.to(device), pool.key_caches[0],
                            pool.value_caches[0], slots)


def store_cross_packed(
    decoder: nn.Module,
    ops_for: Callable[[torch.device], ModuleType],
    pool: KVPool,
    packed: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Every decoder layer's cross-attention K/V of `packed` [tokens, d_model] (real encoder tokens,
    source by source) into the pool at `slot_mapping` [tokens] int (stored as int32 where the pool
    allows: `_slot_dtype`). The tokens and slots move to each layer device once.

    Layers whose cross (k, v) weights `packing` laid out back to back and whose K/V share one pool
    tensor run as one GEMM and one `store_kv` launch per `CROSS_SPAN_BYTES` of output (`_store_span`),
    instead of a GEMM and a store launch per layer: a t5-large call's 24 layers spent ~4 ms of host
    time launching them one by one, longer than the GPU took."""
    on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
    slot_mapping = slot_mapping.to(_slot_dtype(pool))

    def inputs(device):
        if device not in on_device:
            on_device[device] = (packed.to(device), upload(slot_mapping, device))
        return on_device[device]

    attns = [block.layer[1].EncDecAttention for block in decoder.block]
    for start, stop, weight in packing.packed_runs([(attn.k, attn.v) for attn in attns]):
        span = pool.layer_span(start, stop) if weight is not None else None
        tokens, slots = inputs(weight.device if weight is not None else module_device(decoder.block[start]))
        if span is not None and weight.dtype == tokens.dtype == span.dtype and span.device == weight.device:
            _store_span(ops_for(weight.device), weight, tokens, span, slots)
            continue
        for i in range(start, stop):
            tokens, slots = inputs(module_device(decoder.block[i]))
            attn_ops.store_cross_kv(ops_for(tokens.device), attns[i], tokens, pool.key_caches[i],
                                    pool.value_caches[i], slots)


# `_store_span`'s projected K/V of many layers is computed this many bytes at a time at most
# (t5-large at 512 tokens: 24 layers in one GEMM; 8,192 tokens: 2 layers a GEMM).
CROSS_SPAN_BYTES = 64 << 20


def _store_span(ops: ModuleType, weight: torch.Tensor, tokens: torch.Tensor, span: torch.Tensor,
                slots: torch.Tensor) -> None:
    """K/V of consecutive layers at once: weight [layers * 2 * inner, d_model] (each layer's k then
    v rows), span [layers, 2, num_blocks, block_size, heads, head_dim] (`KVPool.layer_span`)."""
    layers, _, _, _, heads, head_dim = span.shape
    per_layer = 2 * heads * head_dim
    step = max(1, CROSS_SPAN_BYTES // max(1, tokens.shape[0] * per_layer * tokens.element_size()))
    for first in range(0, layers, step):
        last = min(layers, first + step)
        w = weight[first * per_layer : last * per_layer]
        y = ops.gemv(tokens, w) if ops.gemv_supports(tokens, w) else F.linear(tokens, w)
        kv = y.view(-1, last - first, 2, heads, head_dim)  # [tokens, layers, k / v, heads, head_dim]
        ops.store_kv(key=kv[:, :, 0].transpose(0, 1), value=kv[:, :, 1].transpose(0, 1),
                     key_cache=span[first:last, 0], value_cache=span[first:last, 1], slot_mapping=slots)


def decoder_layers(
    decoder: nn.Module,
    ops_for: Callable[[torch.device], ModuleType],
    bias_tables: list[torch.Tensor],
    pool: KVPool,
    meta_for: Callable[[torch.device], StepMetadata],
    input_ids: torch.Tensor,
    state=None,
    fused_served: Optional[dict] = None,
    blocks: Optional[int] = None,
) -> torch.Tensor:
    """The decoder stack over prepared step metadata; no host sync (CUDA-graph capturable).

    input_ids: [rows, num_new]; returns [rows, num_new, d_model]
    state: the call's `cpu_ops.DecodeState` when every decoder layer runs the CPU backend, else None
    fused_served: run the step as `fused_layer.decoder_layers` where that serves it (None: never); the
        dict keeps `fused_layer.serves`' verdict per input shape (its checks walk every layer's
        modules, milliseconds of host time: a plan's dict asks once per call)
    blocks: run only the first `blocks` layers, then the final norm (as `encoder_forward`'s); None: all
    """
    if fused_served is not None and state is None:
        device = module_device(decoder.embed_tokens)
        ops = ops_for(device)
        served = fused_served.get(input_ids.shape)
        if served is None:
            served = fused_served[input_ids.shape] = fused_layer.serves(decoder, ops, pool, input_ids)
        if served:
            return fused_layer.decoder_layers(decoder, ops, bias_tables, pool, meta_for(device), input_ids, blocks)
    hidden = decoder.dropout(decoder.embed_tokens(input_ids))
    out = None  # pending sub-layer output, added inside the next layer norm (see encoder_forward)
    for i, block in enumerate(itertools.islice(decoder.block, blocks)):
        device = module_device(block)
        meta, ops = meta_for(device), ops_for(device)
        kc, vc = pool.key_caches[i], pool.value_caches[i]
        sa, ca, ff = block.layer[0], block.layer[1], block.layer[-1]
        normed, hidden = attn_ops.add_norm(ops, sa.layer_norm, hidden, out)
        out = sa.dropout(attn_ops.decoder_self_attention(
            ops, sa.SelfAttention, normed, kc, vc, meta, bias_tables[i].to(device), state
        ))
        normed, hidden = attn_ops.add_norm(ops, ca.layer_norm, hidden, out)
        out = ca.dropout(attn_ops.cross_attention(ops, ca.EncDecAttention, normed, kc, vc, meta, state, i))
        normed, hidden = attn_ops.add_norm(ops, ff.layer_norm, hidden, out)
        out = attn_ops.ff_sublayer(ops, ff, normed, hidden)
    ops = ops_for(module_device(decoder.final_layer_norm))
    hidden, _ = attn_ops.add_norm(ops, decoder.final_layer_norm, hidden, out)
    return decoder.dropout(hidden)
