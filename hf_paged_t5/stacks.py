"""The paged forward of T5's encoder stack and of one decoder step, built from HF's own modules.

Every weight is the model's own (`T5LayerNorm`, the q/k/v/o Linears, `T5LayerFF`); only the
attention core and the KV bookkeeping are ours. The order of operations is HF's, including
the fp16 clamps, so results match stock HF.
"""

from __future__ import annotations

from types import ModuleType
from typing import Callable, Optional

import torch
from torch import nn

from . import attention as attn_ops
from .cache import KVPool, PagedEncoderDecoderCache, StepMetadata


def module_device(module: nn.Module) -> torch.device:
    return next(module.parameters()).device


def pack_tokens(mask: torch.Tensor) -> tuple[torch.Tensor, list[int], torch.Tensor, int]:
    """Where the real tokens of a padded batch are.

    mask: [batch, seq_len], nonzero = real token (padding may be left or right)
    returns: flat index [total_tokens] into batch*seq_len, per-row lengths (host ints),
        cu_seqlens [batch + 1] int32 on mask's device, max length
    """
    real = mask.bool()
    lens = real.sum(dim=1).tolist()
    if any(n == 0 for n in lens):
        rows = [i for i, n in enumerate(lens) if n == 0]
        raise ValueError(
            f"rows {rows} of the batch are all padding (attention_mask is 0 everywhere); "
            "remove them or give each row at least one real token"
        )
    index = real.reshape(-1).nonzero().squeeze(1)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    return index, lens, cu.to(mask.device), max(lens)


def encoder_forward(
    stack: nn.Module,
    ops_for: Callable[[torch.device], ModuleType],
    bias_tables: list[torch.Tensor],
    inputs_embeds: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
) -> torch.Tensor:
    """T5 encoder over the real tokens only (varlen); padded positions of the output are 0.

    inputs_embeds: [batch, seq_len, d_model]; attention_mask: [batch, seq_len] or None
    bias_tables[i]: layer i's bidirectional table (see bias.py)
    returns: last_hidden_state [batch, seq_len, d_model]
    """
    batch, seq_len, d_model = inputs_embeds.shape
    if attention_mask is None:
        attention_mask = torch.ones(batch, seq_len, dtype=torch.long, device=inputs_embeds.device)
    index, _, cu_seqlens, max_seqlen = pack_tokens(attention_mask)
    hidden = inputs_embeds.reshape(batch * seq_len, d_model)[index.to(inputs_embeds.device)]
    hidden = stack.dropout(hidden)
    # The residual stream `hidden` and the pending sub-layer output `out` are added inside
    # the next layer norm (attn_ops.add_norm), as HF adds them just before it.
    out = None
    for i, block in enumerate(stack.block):
        device = module_device(block)
        ops = ops_for(device)
        sa, ff = block.layer[0], block.layer[-1]
        normed, hidden = attn_ops.add_norm(ops, sa.layer_norm, hidden, out)
        out = sa.dropout(attn_ops.encoder_self_attention(
            ops, sa.SelfAttention, normed, cu_seqlens.to(device), max_seqlen, bias_tables[i].to(device),
        ))
        normed, hidden = attn_ops.add_norm(ops, ff.layer_norm, hidden, out)
        out = ff.dropout(ff.DenseReluDense(normed))
    ops = ops_for(module_device(stack.final_layer_norm))
    hidden, _ = attn_ops.add_norm(ops, stack.final_layer_norm, hidden, out)
    hidden = stack.dropout(hidden)
    out = hidden.new_zeros(batch * seq_len, d_model)
    out[index.to(out.device)] = hidden
    return out.reshape(batch, seq_len, d_model)


def store_cross(
    decoder: nn.Module,
    ops_for: Callable[[torch.device], ModuleType],
    cache: PagedEncoderDecoderCache,
    encoder_hidden: torch.Tensor,
    encoder_mask: Optional[torch.Tensor],
) -> None:
    """Project each source's real encoder tokens to K/V once per layer and store them.

    encoder_hidden: [rows, src_len, d_model], rows = num_sources * expand (HF's expanded batch);
    only every `expand`-th row is read.
    """
    sources = encoder_hidden[:: cache.expand]
    if encoder_mask is None:
        encoder_mask = torch.ones(sources.shape[:2], dtype=torch.long, device=sources.device)
    else:
        encoder_mask = encoder_mask[:: cache.expand]
    index, lens, _, _ = pack_tokens(encoder_mask)
    packed = sources.reshape(-1, sources.shape[-1])[index.to(sources.device)]  # [total_tokens, d_model]
    slots = cache.store_cross_plan(lens)
    for i, block in enumerate(decoder.block):
        device = module_device(block)
        attn_ops.store_cross_kv(
            ops_for(device), block.layer[1].EncDecAttention, packed.to(device),
            cache.pool.key_caches[i], cache.pool.value_caches[i], slots.to(device),
        )


def decoder_layers(
    decoder: nn.Module,
    ops_for: Callable[[torch.device], ModuleType],
    bias_tables: list[torch.Tensor],
    pool: KVPool,
    meta_for: Callable[[torch.device], StepMetadata],
    input_ids: torch.Tensor,
) -> torch.Tensor:
    """The decoder stack over prepared step metadata; no host sync (CUDA-graph capturable).

    input_ids: [rows, num_new]; returns [rows, num_new, d_model]
    """
    hidden = decoder.dropout(decoder.embed_tokens(input_ids))
    out = None  # pending sub-layer output, added inside the next layer norm (see encoder_forward)
    for i, block in enumerate(decoder.block):
        device = module_device(block)
        meta, ops = meta_for(device), ops_for(device)
        kc, vc = pool.key_caches[i], pool.value_caches[i]
        sa, ca, ff = block.layer[0], block.layer[1], block.layer[-1]
        normed, hidden = attn_ops.add_norm(ops, sa.layer_norm, hidden, out)
        out = sa.dropout(attn_ops.decoder_self_attention(
            ops, sa.SelfAttention, normed, kc, vc, meta, bias_tables[i].to(device)
        ))
        normed, hidden = attn_ops.add_norm(ops, ca.layer_norm, hidden, out)
        out = ca.dropout(attn_ops.cross_attention(ops, ca.EncDecAttention, normed, kc, vc, meta))
        normed, hidden = attn_ops.add_norm(ops, ff.layer_norm, hidden, out)
        out = ff.dropout(attn_ops.feed_forward(ops, ff.DenseReluDense, normed))
    ops = ops_for(module_device(decoder.final_layer_norm))
    hidden, _ = attn_ops.add_norm(ops, decoder.final_layer_norm, hidden, out)
    return decoder.dropout(hidden)
