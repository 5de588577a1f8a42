"""LongT5's encoder attention over the packed real tokens: local windows and transient-global side keys.

HF's `LongT5LocalAttention`: token i attends token j of its row iff |i - j| <= local_radius and
both are real, with T5's bidirectional bias of j - i (layer 0's, reused by every layer), no
1/sqrt(d) scaling. `LongT5TransientGlobalAttention` adds side keys to the same softmax: the row is
cut into global blocks of `global_block_size` positions counted from the padded tensor's first
position (the tail that does not fill a block joins the last full one); each block's side input is
the sum of its tokens' attention inputs, then the layer's `global_input_layer_norm` and its k / v
projections. A real token attends every block of its row (HF's global_segment_ids; none when the
row has fewer real tokens than a block), with layer 0's side bias at `block - block_id(token)`.

With right padding a token's position in its row is its position among the row's real tokens, so
all of this follows from the row lengths alone: `LocalPlan` holds it, built on the host once per
encoder call (no device read). A row with padding before its tokens has other block ids and is
served by stock HF (`unserved_reason`).
"""

from __future__ import annotations

import dataclasses
from types import ModuleType
from typing import Callable, Optional

import torch
from torch import nn

from .bias import self_attention

LEFT_PADDED = ("attention_mask has padding before a row's tokens: LongT5's transient-global blocks are counted "
               "from the padded tensor's first position")


def is_transient_global(attention: nn.Module) -> bool:
    return hasattr(attention, "global_block_size")


def unserved_reason(stack: nn.Module, mask: Optional[torch.Tensor]) -> Optional[str]:
    """Why the paged LongT5 encoder cannot give HF's exact result for this stack and mask, or None.
    Only transient-global attention has such cases (its block ids come from positions in the
    padded tensor, through a float cumsum); the caller checks the mask's layout (`LEFT_PADDED`)."""
    attention = self_attention(stack.block[0].layer[0])
    if not is_transient_global(attention):
        return None
    size = attention.global_block_size
    if size < 1 or size & (size - 1):
        return (f"global_block_size {size} is not a power of two: HF's block ids (a float cumsum of "
                f"1 / {size}) are then rounded, not floor(position / {size})")
    if mask is not None and mask.dtype in (torch.float16, torch.bfloat16):
        return f"a {mask.dtype} attention_mask: HF's transient-global block ids are rounded in that dtype"
    return None


@dataclasses.dataclass(frozen=True)
class LocalPlan:
    """Where one encoder call's sequences, and for transient-global attention their global blocks, are.

    cu_seqlens: [batch + 1] int32; max_seqlen: the longest sequence; local_radius: HF's
    cu_globals: [batch + 1] int32, sequence b's global blocks are [cu_globals[b], cu_globals[b + 1])
        (as many as the full blocks of its real tokens); block_ids: [total_tokens] int32, each
        token's block within its sequence (0 where the sequence has none); segment_lengths:
        [total_globals] int64, the tokens summed into each block, in packed order; segment_tokens:
        [summed tokens] int64 into the packed tokens, or None when every token is summed
        (these four None for local attention, or when no sequence has a full block)
    """

    cu_seqlens: torch.Tensor
    max_seqlen: int
    local_radius: int
    cu_globals: Optional[torch.Tensor] = None
    block_ids: Optional[torch.Tensor] = None
    segment_lengths: Optional[torch.Tensor] = None
    segment_tokens: Optional[torch.Tensor] = None

    def on(self, device: torch.device, move: Callable[[torch.Tensor, torch.device], torch.Tensor]) -> "LocalPlan":
        """The plan with its tensors on `device` (`move(tensor, device)` copies one)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return LocalPlan(**{k: move(v, device) if isinstance(v, torch.Tensor) and v.device != device else v
                            for k, v in fields.items()})


def local_plan(stack: nn.Module, lens: list[int], cu_seqlens: torch.Tensor, max_seqlen: int) -> LocalPlan:
    """The plan of a LongT5 encoder call over right-padded rows of `lens` real tokens (host ints);
    `cu_seqlens` as packed (any device). Its global-block tensors are on the host."""
    attention = self_attention(stack.block[0].layer[0])
    plan = LocalPlan(cu_seqlens, max_seqlen, attention.local_radius)
    if not is_transient_global(attention):
        return plan
    size = attention.global_block_size
    lengths = torch.tensor(lens, dtype=torch.long)
    blocks = lengths // size  # [batch] global blocks each row's real tokens attend
    if int(blocks.sum()) == 0:
        return plan  # no row fills a block: no side keys anywhere, local attention alone
    cu_globals = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu_globals[1:] = torch.cumsum(blocks, 0)
    starts = torch.cumsum(lengths, 0) - lengths
    row = torch.repeat_interleave(torch.arange(len(lens)), lengths)  # [total_tokens]
    position = torch.arange(int(lengths.sum())) - starts[row]
    # the tail that does not fill a block belongs to the last full one (HF's orphan tokens)
    block_ids = torch.minimum(position // size, (blocks[row] - 1).clamp(min=0)).to(torch.int32)
    segment_lengths = torch.full((int(blocks.sum()),), size, dtype=torch.long)
    full = blocks > 0
    segment_lengths[cu_globals[1:].long()[full] - 1] = lengths[full] - (blocks[full] - 1) * size
    segment_tokens = None if bool(full.all()) else torch.nonzero(full[row]).squeeze(1)
    return dataclasses.replace(plan, cu_globals=cu_globals, block_ids=block_ids, segment_lengths=segment_lengths,
                               segment_tokens=segment_tokens)


def _heads(x: torch.Tensor, attn: nn.Module) -> torch.Tensor:
    """[..., num_heads * head_dim] -> [prod(...), num_heads, head_dim]"""
    return x.reshape(-1, attn.n_heads, attn.key_value_proj_dim)


def side_keys(attn: nn.Module, hidden: torch.Tensor, plan: LocalPlan) -> tuple[torch.Tensor, torch.Tensor]:
    """The side keys and values of every global block: HF's `_create_global_aggregates` (a sum per
    block, in the hidden states' dtype: HF's einsum with a one-hot matrix, which a GEMM accumulates
    in fp32 for half inputs), its `global_input_layer_norm`, then the layer's k / v projections.

    hidden: [total_tokens, d_model] (the attention input, layer-normed); returns two
    [total_globals, num_heads, head_dim]
    """
    tokens = hidden if plan.segment_tokens is None else hidden[plan.segment_tokens]
    sums = torch.segment_reduce(tokens.to(torch.promote_types(hidden.dtype, torch.float32)), "sum",
                                lengths=plan.segment_lengths, axis=0)  # [total_globals, d_model]
    inputs = attn.global_input_layer_norm(sums.to(hidden.dtype))
    return _heads(attn.k(inputs), attn), _heads(attn.v(inputs), attn)


def local_self_attention(
    ops: ModuleType,
    attn: nn.Module,
    hidden: torch.Tensor,
    plan: LocalPlan,
    bias_table: torch.Tensor,
    side_table: Optional[torch.Tensor],
) -> torch.Tensor:
    """LongT5's local or transient-global self-attention within each packed sequence.

    hidden: [total_tokens, d_model] (already layer-normed); returns [total_tokens, d_model]
    bias_table: [num_heads, 2 * D + 1] (`bias.local_bias_table`, layer 0's); side_table: the side
    table (`bias.side_bias_table`), or None for local attention
    """
    side = {}
    if plan.cu_globals is not None:
        side_key, side_value = side_keys(attn, hidden, plan)
        side = dict(side_key=side_key, side_value=side_value, cu_globals=plan.cu_globals, block_ids=plan.block_ids,
                    side_bias_table=side_table)
    q, k, v = _heads(attn.q(hidden), attn), _heads(attn.k(hidden), attn), _heads(attn.v(hidden), attn)
    out = ops.local_prefill(
        query=q, key=k, value=v, cu_seqlens=plan.cu_seqlens, max_seqlen=plan.max_seqlen,
        local_radius=plan.local_radius, scale=1.0, bias_table=bias_table, **side,
    )  # [total_tokens, num_heads, head_dim]
    del q, k, v, side
    return attn.o(out.reshape(hidden.shape[0], -1))
