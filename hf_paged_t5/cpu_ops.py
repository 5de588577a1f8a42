"""The CPU backend: the kernels' interface in PyTorch, written for speed (`reference.py` is for reading).

Same functions, keyword arguments and results (up to rounding) as `reference.py` and `kernels/`:
`store_kv`, `paged_decode`, `prefill`, `rms_norm`, `gemv`, `gemv_supports`, `greedy_update` (the
reference's, already a few batched ops). The reference loops over rows in Python and builds a bias
per row; here every call is a few batched tensor ops:

- `paged_decode` gathers each row's blocks at once ([batch, keys, heads, head_dim], padded to the
  longest row) and runs one `scaled_dot_product_attention` whose additive mask carries the bias
  (gathered from the small table once per call) and the key padding;
- `grouped_decode` (a beam step's cross-attention, rows of one source consecutive) gathers each
  source's keys once and attends its rows' queries to them in one SDPA call;
- `DecodeState` (one per generate() call) keeps each decoder layer's cross-attention K/V gathered
  for the rest of the call (they are written once, before the first step), so a step reads them
  in place as stock HF's cache does, and builds one step's self-attention gather plan and bias
  mask once for all its layers;
- `prefill` pads the packed sequences to [batch, max_seqlen] and runs SDPA per chunk of query rows
  with the bias of relative positions built once per chunk (it is the same for every sequence),
  so its memory is O(batch * heads * chunk * max_seqlen), never O(L^2) per head for long inputs;
- `local_prefill` (LongT5's encoder) splits each sequence into blocks of local_radius + 1 queries, as
  HF does, each over its three-block key window (and the sequence's side keys), with the window's
  bias built once per call; SDPA per chunk of blocks, so memory is O(L), not O(L^2).

Like the reference, a float64 model is computed in float64 (softmax and accumulation in
`promote_types(dtype, float32)`).

KV pool layout: key_cache, value_cache [num_blocks, block_size, num_heads, head_dim].
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F

from .reference import gemv, gemv_supports, greedy_update, rms_norm, store_kv

__all__ = ["DecodeState", "gemv", "gemv_supports", "greedy_update", "grouped_decode", "grouped_supports",
           "local_prefill", "paged_decode", "prefill", "rms_norm", "store_kv"]

# Query rows per SDPA call in `prefill`: bounds the [batch, heads, rows, keys] bias + mask.
PREFILL_QUERY_CHUNK = 1024
# Elements of one `local_prefill` chunk's keys and additive mask: bounds its memory for long inputs.
LOCAL_CHUNK_ELEMENTS = 2**23


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


@dataclasses.dataclass(frozen=True)
class _RowKeys:
    """Where each row's keys are, for one block table and set of lengths (shared by every layer
    whose table is the same: the self-attention of one decode step, a call's cross-attention)."""

    block_table: torch.Tensor  # [batch, max_blocks] int32, as given (compared by `matches`)
    seq_lens: torch.Tensor  # [batch] int32, as given
    lens: torch.Tensor  # [batch] int64
    slots: torch.Tensor  # [batch * max_len] int64: pool slot of each (row, key position)
    max_len: int
    mask: Optional[torch.Tensor]  # [batch, 1, 1, max_len] additive key padding, None without padding

    @classmethod
    def build(cls, block_table: torch.Tensor, seq_lens: torch.Tensor, block_size: int, dtype) -> "_RowKeys":
        device = block_table.device
        max_len = int(seq_lens.max())
        k_pos = torch.arange(max_len, device=device)
        lens = seq_lens.to(device, torch.long)
        beyond = k_pos[None, :] >= lens[:, None]  # [batch, max_len]: slots past the row's keys
        # A slot past a row's length would read another row's K/V or never-written memory (maybe
        # NaN, which a -inf mask does not cancel: 0 * NaN is NaN), so it reads the row's first key
        # instead, which the mask then leaves out.
        positions = torch.where(beyond, 0, k_pos[None, :])
        blocks = block_table.to(torch.long).gather(1, positions // block_size)
        slots = (blocks * block_size + positions % block_size).reshape(-1)
        mask = None
        if bool(beyond.any()):
            mask = torch.zeros(lens.shape[0], 1, 1, max_len, dtype=dtype, device=device)
            mask.masked_fill_(beyond[:, None, None, :], float("-inf"))
        return cls(block_table.clone(), seq_lens.clone(), lens, slots, max_len, mask)

    def matches(self, block_table: torch.Tensor, seq_lens: torch.Tensor) -> bool:
        return (
            self.block_table.shape == block_table.shape and torch.equal(self.block_table, block_table)
            and torch.equal(self.seq_lens, seq_lens)
        )

    def gather(self, cache: torch.Tensor, dtype) -> torch.Tensor:
        """cache [num_blocks, block_size, num_heads, head_dim] -> [batch, num_heads, max_len, head_dim]"""
        num_heads, head_dim = cache.shape[2:]
        flat = cache.reshape(-1, num_heads, head_dim).index_select(0, self.slots)
        return flat.view(-1, self.max_len, num_heads, head_dim).transpose(1, 2).to(dtype)

    def causal_bias(self, bias_table: torch.Tensor, dtype) -> torch.Tensor:
        """The bias of each row's one query (its last position) over its keys, plus the padding:
        [batch, num_heads, 1, max_len]. bias_table: [num_heads, max_distance + 1]."""
        max_distance = bias_table.shape[1] - 1
        k_pos = torch.arange(self.max_len, device=self.lens.device)
        index = ((self.lens[:, None] - 1) - k_pos[None, :]).clamp(0, max_distance)  # [batch, max_len]
        bias = bias_table.to(dtype)[:, index].permute(1, 0, 2)[:, :, None, :]
        # contiguous: SDPA's CPU kernel reads a permuted mask many times slower
        return bias.contiguous() if self.mask is None else bias + self.mask


def _attend(query: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, scale: float) -> torch.Tensor:
    """One query token per row: query [batch, heads, head_dim] -> [batch, heads, head_dim]."""
    q = query.to(k.dtype)[:, :, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)[:, :, 0, :].to(query.dtype)


def paged_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float = 1.0,
    bias_table: Optional[torch.Tensor] = None,
    dense_bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Attention of one query token per row over that row's paged keys (see `reference.paged_decode`).

    query: [batch, num_heads, head_dim]; block_table: [batch, max_blocks] int32;
    seq_lens: [batch] int32 (>= 1); returns [batch, num_heads, head_dim], query's dtype
    """
    dtype = _compute_dtype(query.dtype)
    rows = _RowKeys.build(block_table.to(query.device), seq_lens, key_cache.shape[1], dtype)
    mask = rows.mask if bias_table is None else rows.causal_bias(bias_table, dtype)
    if dense_bias is not None:
        bias = dense_bias[:, :, None, : rows.max_len].to(dtype)
        mask = bias if mask is None else mask + bias
    return _attend(query, rows.gather(key_cache, dtype), rows.gather(value_cache, dtype), mask, scale)


def grouped_supports(query: torch.Tensor, group: int) -> bool:
    """Whether `grouped_decode` takes these rows: groups of 2 or more, any dtype."""
    return group > 1


def grouped_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    group: int,
    scale: float = 1.0,
    pdl: bool = False,
    tickets: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """`paged_decode` without a bias for rows in consecutive groups of `group` that share keys (a
    beam search's rows of one source; the last group may be shorter): each group's first row's
    table and length serve the whole group (a promise, unchecked, as the Triton kernel's), its
    keys are gathered once and its rows' queries attend to them in one SDPA call. pdl, tickets:
    the GPU launch's options, unused here.

    query: [batch, num_heads, head_dim]; returns [batch, num_heads, head_dim], query's dtype
    """
    batch, num_heads, head_dim = query.shape
    groups = -(-batch // group)
    first = torch.arange(groups, device=block_table.device) * group
    dtype = _compute_dtype(query.dtype)
    keys = _RowKeys.build(block_table[first], seq_lens.to(block_table.device)[first], key_cache.shape[1], dtype)
    q = query.to(dtype)
    if groups * group != batch:  # the short last group: padded with zero queries, dropped after
        q = torch.cat([q, q.new_zeros(groups * group - batch, num_heads, head_dim)])
    q = q.view(groups, group, num_heads, head_dim).transpose(1, 2)  # [groups, heads, group, head_dim]
    out = F.scaled_dot_product_attention(q, keys.gather(key_cache, dtype), keys.gather(value_cache, dtype),
                                         attn_mask=keys.mask, scale=scale)
    return out.transpose(1, 2).reshape(groups * group, num_heads, head_dim)[:batch].to(query.dtype)


class DecodeState:
    """What a generate() call's decode steps share on the CPU backend: one per call, owned by the
    call's decode plan, never shared across calls (whose blocks differ).

    - Cross-attention: a call writes its encoder K/V into the pool once, before the first decode
      step, and never again; beam reorders keep each row's source, so its cross block table. The
      first step of each layer gathers the rows' K/V ([rows, heads, keys, head_dim]) and later
      steps attend to that copy, as stock HF's cache does, instead of gathering them again.
    - Self-attention: one step's layers share block table, lengths and (T5) bias table, so the
      slots to gather, the padding and the bias mask are built by the first layer of the step.
    Reuse needs the table and lengths of the step to equal the kept ones (compared on the host:
    a few dozen int32), so a changed table is never served stale.
    """

    def __init__(self) -> None:
        self._cross: dict[int, tuple] = {}  # layer -> (_RowKeys, k, v)
        self._self: Optional[_RowKeys] = None
        self._self_mask: Optional[tuple] = None  # (bias_table, mask) of `_self`

    def self_decode(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        block_table: torch.Tensor, seq_lens: torch.Tensor, bias_table: torch.Tensor, scale: float = 1.0,
    ) -> torch.Tensor:
        """`paged_decode(..., bias_table=bias_table)` with the step's gather plan and mask shared."""
        dtype = _compute_dtype(query.dtype)
        if self._self is None or not self._self.matches(block_table, seq_lens):
            self._self, self._self_mask = _RowKeys.build(block_table, seq_lens, key_cache.shape[1], dtype), None
        rows = self._self
        if self._self_mask is None or self._self_mask[0] is not bias_table:
            self._self_mask = (bias_table, rows.causal_bias(bias_table, dtype))
        k, v = rows.gather(key_cache, dtype), rows.gather(value_cache, dtype)
        return _attend(query, k, v, self._self_mask[1], scale)

    def cross_decode(
        self, layer: int, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float = 1.0,
    ) -> torch.Tensor:
        """`paged_decode(query, key_cache, value_cache, block_table, seq_lens, scale)` (no bias)
        over the layer's K/V gathered at the call's first step."""
        entry = self._cross.get(layer)
        if entry is None or not entry[0].matches(block_table, seq_lens):
            dtype = _compute_dtype(query.dtype)
            rows = _RowKeys.build(block_table, seq_lens, key_cache.shape[1], dtype)
            entry = self._cross[layer] = (rows, rows.gather(key_cache, dtype), rows.gather(value_cache, dtype))
        return _attend(query, entry[1], entry[2], entry[0].mask, scale)


def prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float = 1.0,
    causal: bool = False,
    bias_table: Optional[torch.Tensor] = None,
    dense_bias: Optional[torch.Tensor] = None,
    band_memo: Optional[dict] = None,
) -> torch.Tensor:
    """Attention within each packed sequence (see `reference.prefill`).

    query, key, value: [total_tokens, num_heads, head_dim]; cu_seqlens: [batch + 1] int32;
    band_memo: the Triton kernel's cache of what it derives from the table; unused here
    returns [total_tokens, num_heads, head_dim], query's dtype
    """
    total, num_heads, head_dim = query.shape
    dtype = _compute_dtype(query.dtype)
    device = query.device
    starts = cu_seqlens[:-1].to(device, torch.long)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device, torch.long)
    batch, length = lens.shape[0], max_seqlen
    pos = torch.arange(length, device=device)
    # every row as long as the longest (no padding): the packed tokens are the padded batch already,
    # and no key needs masking; else each padded slot gathers its packed token (clamped where it is padding)
    full = total == batch * length
    if full:
        def padded(x: torch.Tensor) -> torch.Tensor:  # [batch, heads, length, head_dim], a view
            return x.to(dtype).view(batch, length, num_heads, head_dim).transpose(1, 2)

        key_mask = None
    else:
        real = pos[None, :] < lens[:, None]  # [batch, length]
        index = (starts[:, None] + pos[None, :]).clamp(max=max(total - 1, 0))

        def padded(x: torch.Tensor) -> torch.Tensor:  # [batch, heads, length, head_dim]
            return x.to(dtype)[index].transpose(1, 2)

        key_mask = torch.zeros(batch, 1, 1, length, dtype=dtype, device=device)
        key_mask.masked_fill_(~real[:, None, None, :], float("-inf"))

    q, k, v = padded(query), padded(key), padded(value)
    out = torch.empty(batch, num_heads, length, head_dim, dtype=dtype, device=device)
    for q0 in range(0, length, PREFILL_QUERY_CHUNK):
        q1 = min(q0 + PREFILL_QUERY_CHUNK, length)
        # the additive mask, broadcast over what it does not depend on: the bias is added once for
        # all rows ([1, heads, chunk, length]), the key mask once for all heads and queries
        mask = None if key_mask is None else key_mask
        rel = pos[None, :] - pos[q0:q1, None]  # [chunk, length]: key - query
        if bias_table is not None:
            if causal:
                idx = (-rel).clamp(0, bias_table.shape[1] - 1)
            else:
                d = (bias_table.shape[1] - 1) // 2
                idx = rel.clamp(-d, d) + d
            bias = bias_table.to(dtype)[:, idx][None]
            mask = bias if mask is None else mask + bias
        if dense_bias is not None:
            dense = dense_bias[:, :, q0:q1, :length].to(dtype)
            mask = dense if mask is None else mask + dense
        if causal:
            future = (rel > 0)[None, None]
            mask = torch.zeros(future.shape, dtype=dtype, device=device) if mask is None else mask
            mask = mask.masked_fill(future, float("-inf"))
        if mask is not None and mask.shape[2] != q1 - q0:  # the key mask alone: one row of queries
            mask = mask.expand(mask.shape[0], mask.shape[1], q1 - q0, length)
        out[:, :, q0:q1] = F.scaled_dot_product_attention(q[:, :, q0:q1], k, v, attn_mask=mask, scale=scale)
    # back to packed order: each real slot's row
    if full:
        return out.transpose(1, 2).reshape(total, num_heads, head_dim).to(query.dtype)
    return out.transpose(1, 2)[real].to(query.dtype)


def _side_rows(side_bias_table, block_ids: torch.Tensor, num_globals: int, dtype) -> Optional[torch.Tensor]:
    """[num_heads, len(block_ids), num_globals] side bias at clamp(g - block_id), or None."""
    if side_bias_table is None:
        return None
    d = (side_bias_table.shape[1] - 1) // 2
    rel = torch.arange(num_globals, device=block_ids.device)[None, :] - block_ids.long()[:, None]
    return side_bias_table.to(dtype)[:, rel.clamp(-d, d) + d]


def local_prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    local_radius: int,
    scale: float = 1.0,
    bias_table: Optional[torch.Tensor] = None,
    side_key: Optional[torch.Tensor] = None,
    side_value: Optional[torch.Tensor] = None,
    cu_globals: Optional[torch.Tensor] = None,
    block_ids: Optional[torch.Tensor] = None,
    side_bias_table: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Local attention plus optional side keys within each packed sequence (see `reference.local_prefill`).

    Each sequence is cut into blocks of `local_radius + 1` queries; a block's keys are its own and
    its two neighbours' (the window holds every key within the radius), then the side keys.
    query, key, value: [total_tokens, num_heads, head_dim]; returns the same shape, query's dtype
    """
    total, num_heads, head_dim = query.shape
    dtype, device = _compute_dtype(query.dtype), query.device
    out = torch.empty_like(query)
    block = local_radius + 1
    rel = torch.arange(3 * block, device=device)[None, :] - block - torch.arange(block, device=device)[:, None]
    in_window = rel.abs() <= local_radius  # [block, 3 * block]: key - query of a block's window
    window_bias = None  # [num_heads, block, 3 * block]
    if bias_table is not None:
        d = (bias_table.shape[1] - 1) // 2
        window_bias = bias_table.to(dtype)[:, rel.clamp(-d, d) + d]
    bounds = cu_seqlens.tolist()
    g_bounds = cu_globals.tolist() if side_key is not None else None
    for b in range(len(bounds) - 1):
        start, end = bounds[b], bounds[b + 1]
        n = end - start
        if n == 0:
            continue
        blocks = -(-n // block)
        # [blocks + 2 blocks of keys]: one zero block before, the tail and one zero block after
        pad = (0, 0, 0, 0, block, blocks * block - n + block)
        q = F.pad(query[start:end].to(dtype), (0, 0, 0, 0, 0, blocks * block - n))
        q = q.view(blocks, block, num_heads, head_dim).transpose(1, 2)  # [blocks, heads, block, head_dim]
        k_win = F.pad(key[start:end].to(dtype), pad).unfold(0, 3 * block, block)  # [blocks, heads, head_dim, 3 * block]
        v_win = F.pad(value[start:end].to(dtype), pad).unfold(0, 3 * block, block)
        k_pos = (torch.arange(blocks, device=device)[:, None] - 1) * block + torch.arange(3 * block, device=device)
        live = in_window[None] & ((k_pos >= 0) & (k_pos < n))[:, None, :]  # [blocks, block, 3 * block]
        num_globals, side_k, side_v, side_bias = 0, None, None, None
        if g_bounds is not None:
            g0, g1 = g_bounds[b], g_bounds[b + 1]
            num_globals = g1 - g0
            side_k = side_key[g0:g1].to(dtype).transpose(0, 1)  # [heads, globals, head_dim]
            side_v = side_value[g0:g1].to(dtype).transpose(0, 1)
            ids = F.pad(block_ids[start:end], (0, blocks * block - n))
            side_bias = _side_rows(side_bias_table, ids, num_globals, dtype)  # [heads, blocks * block, globals]
        keys = 3 * block + num_globals
        step = max(1, LOCAL_CHUNK_ELEMENTS // (num_heads * keys * (block + 2 * head_dim)))
        for c0 in range(0, blocks, step):
            c1 = min(c0 + step, blocks)
            mask = torch.zeros(c1 - c0, 1, block, 3 * block, dtype=dtype, device=device)
            mask.masked_fill_(~live[c0:c1, None], float("-inf"))
            if window_bias is not None:
                mask = mask + window_bias[None]
            k, v = k_win[c0:c1].transpose(2, 3), v_win[c0:c1].transpose(2, 3)  # [chunk, heads, 3 * block, head_dim]
            if num_globals:
                expand = (c1 - c0, num_heads, num_globals, head_dim)
                k = torch.cat([k, side_k[None].expand(expand)], dim=2)
                v = torch.cat([v, side_v[None].expand(expand)], dim=2)
                side = torch.zeros((), dtype=dtype, device=device) if side_bias is None else (
                    side_bias[:, c0 * block:c1 * block].unflatten(1, (c1 - c0, block)).transpose(0, 1))
                mask = mask.expand(c1 - c0, num_heads, block, 3 * block)
                mask = torch.cat([mask, side.expand(c1 - c0, num_heads, block, num_globals)], dim=3)
            o = F.scaled_dot_product_attention(q[c0:c1], k, v, attn_mask=mask, scale=scale)  # [chunk, heads, block, d]
            rows = o.transpose(1, 2).reshape(-1, num_heads, head_dim)
            lo, hi = start + c0 * block, min(start + c1 * block, end)
            out[lo:hi] = rows[: hi - lo].to(query.dtype)
    return out
