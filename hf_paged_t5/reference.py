"""Plain-PyTorch versions of every kernel: the test oracle and the CPU backend.

Written for reading, not speed. Every function here has a Triton twin in `kernels/`
with the same name, the same keyword arguments in the same order, and the same result
up to floating-point rounding.

KV pool layout (one pair per decoder layer, made in `kv/pool.py`):
    key_cache, value_cache: [num_blocks, block_size, num_heads, head_dim]
A slot is `block_id * block_size + offset`; `block_table[row, i]` is the block holding
tokens `[i * block_size, (i + 1) * block_size)` of that row.

Bias tables (made in `model/bias.py`), float32 (float64 for a float64 model):
    causal:        [num_heads, max_distance + 1], index `min(q_pos - k_pos, max_distance)`
    bidirectional: [num_heads, 2 * max_distance + 1], index `clamp(k_pos - q_pos, ±max_distance) + max_distance`
Attention scores are `scale * q·k + bias`; T5 uses scale 1.0. Softmax and accumulation are
float32 (float64 for float64 inputs, so that a float64 model checks the algorithm against stock
HF in float64 with no float32 rounding in between); outputs have the query's dtype.
"""

from __future__ import annotations

import math
from typing import Optional

import torch


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write tokens' K/V into pool slots, in place.

    key, value: [num_tokens, num_heads, head_dim], or [layers, num_tokens, num_heads, head_dim]
    key_cache, value_cache: [num_blocks, block_size, num_heads, head_dim], or [layers, num_blocks,
        block_size, num_heads, head_dim] for layered K/V
    slot_mapping: [num_tokens] int, each in [0, num_blocks * block_size)
    """
    if key.dim() == 4:  # several layers of the same tokens: one indexed copy over the slot dimension
        layers, num_blocks, block_size = key_cache.shape[:3]
        slots = slot_mapping.long()
        key_cache.view(layers, num_blocks * block_size, *key_cache.shape[3:])[:, slots] = key.to(key_cache.dtype)
        value_cache.view(layers, num_blocks * block_size, *value_cache.shape[3:])[:, slots] = value.to(value_cache.dtype)
        return
    num_blocks, block_size = key_cache.shape[:2]
    slots = slot_mapping.long()
    key_cache.view(num_blocks * block_size, *key_cache.shape[2:])[slots] = key.to(key_cache.dtype)
    value_cache.view(num_blocks * block_size, *value_cache.shape[2:])[slots] = value.to(value_cache.dtype)


def gather_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_ids: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first `length` tokens of one row, contiguous: two [length, num_heads, head_dim]."""
    block_size = key_cache.shape[1]
    num = -(-length // block_size)
    ids = block_ids[:num].long()
    k = key_cache[ids].reshape(num * block_size, *key_cache.shape[2:])[:length]
    v = value_cache[ids].reshape(num * block_size, *value_cache.shape[2:])[:length]
    return k, v


def _bias_rows(
    bias_table: Optional[torch.Tensor],
    q_pos: torch.Tensor,
    k_pos: torch.Tensor,
    causal: bool,
) -> Optional[torch.Tensor]:
    """[num_heads, len(q_pos), len(k_pos)] bias from a distance table, or None."""
    if bias_table is None:
        return None
    rel = k_pos[None, :] - q_pos[:, None]  # [q, k]
    if causal:
        max_distance = bias_table.shape[1] - 1
        index = (-rel).clamp(0, max_distance)
    else:
        max_distance = (bias_table.shape[1] - 1) // 2
        index = rel.clamp(-max_distance, max_distance) + max_distance
    return bias_table[:, index]


def _attend(q, k, v, scale, bias, mask):
    """q [Lq, H, D], k/v [Lk, H, D], bias [H|1, Lq, Lk] or None, mask [Lq, Lk] bool or None."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = torch.einsum("qhd,khd->hqk", q.to(dtype), k.to(dtype)) * scale
    if bias is not None:
        scores = scores + bias.to(dtype)
    if mask is not None:
        scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.to(dtype))


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
    """Attention of one query token per row over that row's paged keys.

    query: [batch, num_heads, head_dim]
    key_cache, value_cache: [num_blocks, block_size, num_heads, head_dim]
    block_table: [batch, max_blocks] int32
    seq_lens: [batch] int32, keys of each row (>= 1); the query sits at position seq_len - 1
    bias_table: causal distance table [num_heads, max_distance + 1] (decoder self-attention),
        or None (cross-attention)
    dense_bias: generic additive bias [batch | 1, num_heads | 1, max_keys] with
        max_keys >= max(seq_lens), or None. At most one of bias_table / dense_bias.
    returns: [batch, num_heads, head_dim], query's dtype
    """
    out = torch.empty_like(query)
    lens = seq_lens.tolist()
    for row, length in enumerate(lens):
        k, v = gather_kv(key_cache, value_cache, block_table[row], length)
        k_pos = torch.arange(length, device=query.device)
        q_pos = k_pos[-1:]
        bias = _bias_rows(bias_table, q_pos, k_pos, causal=True)
        if dense_bias is not None:
            bias = dense_bias[min(row, dense_bias.shape[0] - 1), :, None, :length]
        out[row] = _attend(query[row][None], k, v, scale, bias, None)[0].to(query.dtype)
    return out


def grouped_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    group: int,
    scale: float = 1.0,
) -> torch.Tensor:
    """`paged_decode` without a bias where rows come in consecutive groups of `group` (the last may
    be shorter) and each group's first row's table and seq_len serve the whole group."""
    first = torch.arange(query.shape[0], device=block_table.device) // group * group
    return paged_decode(query, key_cache, value_cache, block_table[first], seq_lens[first.to(seq_lens.device)], scale)


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
    """Attention within each packed sequence (varlen, no padding), O(L) memory in the kernel.

    query, key, value: [total_tokens, num_heads, head_dim], sequences back to back
    cu_seqlens: [batch + 1] int32, sequence b is tokens [cu_seqlens[b], cu_seqlens[b + 1])
    max_seqlen: max length of any sequence (a host int, sizes the grid)
    causal: decoder (query attends to keys at or before it) or encoder (all keys)
    bias_table: causal table [num_heads, max_distance + 1] when causal, bidirectional
        table [num_heads, 2 * max_distance + 1] otherwise; or None
    dense_bias: [batch | 1, num_heads | 1, max_seqlen, max_seqlen] indexed by positions
        within the sequence, or None. At most one of bias_table / dense_bias.
    band_memo: the kernel's cache of what it derives from the table; unused here
    returns: [total_tokens, num_heads, head_dim], query's dtype
    """
    out = torch.empty_like(query)
    bounds = cu_seqlens.tolist()
    for b in range(len(bounds) - 1):
        start, end = bounds[b], bounds[b + 1]
        if end == start:
            continue
        pos = torch.arange(end - start, device=query.device)
        bias = _bias_rows(bias_table, pos, pos, causal=causal)
        if dense_bias is not None:
            bias = dense_bias[min(b, dense_bias.shape[0] - 1), :, : end - start, : end - start]
        mask = pos[None, :] <= pos[:, None] if causal else None
        o = _attend(query[start:end], key[start:end], value[start:end], scale, bias, mask)
        out[start:end] = o.to(query.dtype)
    return out



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
    """Local attention within each packed sequence, plus optional side keys (LongT5's encoder).

    query, key, value: [total_tokens, num_heads, head_dim], sequences back to back
    cu_seqlens: [batch + 1] int32; max_seqlen: host int >= every sequence length
    local_radius: query i attends key j of its sequence iff |i - j| <= local_radius
    bias_table: bidirectional table [num_heads, 2 * D + 1] at clamp(j - i, +-D) + D, or None
    side_key, side_value: [total_globals, num_heads, head_dim]; sequence b's side keys are rows
        [cu_globals[b], cu_globals[b + 1]) and every token of b attends all of them, in the same
        softmax as its local keys; None: local attention only
    block_ids: [total_tokens] int32, each token's global block (within its sequence)
    side_bias_table: [num_heads, 2 * Ds + 1] at clamp(g - block_id, +-Ds) + Ds, or None
    returns: [total_tokens, num_heads, head_dim], query's dtype
    """
    out = torch.empty_like(query)
    bounds = cu_seqlens.tolist()
    g_bounds = cu_globals.tolist() if side_key is not None else None
    for b in range(len(bounds) - 1):
        start, end = bounds[b], bounds[b + 1]
        if end == start:
            continue
        pos = torch.arange(end - start, device=query.device)
        keys, values = key[start:end], value[start:end]
        mask = (pos[None, :] - pos[:, None]).abs() <= local_radius  # [q, k]
        bias = _bias_rows(bias_table, pos, pos, causal=False)
        if bias is None:
            bias = torch.zeros(query.shape[1], end - start, end - start, device=query.device)
        if g_bounds is not None:
            g0, g1 = g_bounds[b], g_bounds[b + 1]
            keys, values = torch.cat([keys, side_key[g0:g1]]), torch.cat([values, side_value[g0:g1]])
            mask = torch.cat([mask, mask.new_ones(end - start, g1 - g0)], dim=1)
            side = _bias_rows(side_bias_table, block_ids[start:end].long(), torch.arange(g1 - g0, device=query.device),
                              causal=False)
            if side is None:
                side = bias.new_zeros(query.shape[1], end - start, g1 - g0)
            bias = torch.cat([bias.to(side.dtype), side], dim=2)
        o = _attend(query[start:end], keys, values, scale, bias, mask)
        out[start:end] = o.to(query.dtype)
    return out


def sum_partials(partials: torch.Tensor) -> torch.Tensor:
    """The partials [S, ...] added in slice order (S - 1 adds in their dtype): the sum that
    `kernels.rms_norm(partials=...)` forms before its one rounding."""
    total = partials[0].clone()
    for part in partials[1:]:
        total += part
    return total


def rms_norm(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: Optional[torch.Tensor] = None,
    partials: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """T5 layer norm of `hidden (+ residual)`, step for step as HF's `T5LayerNorm`.

    hidden: [..., d_model]; residual: same shape and dtype, or None; weight: [d_model]
    partials: instead of `residual`, float32 [S, ..., d_model] summed in slice order and rounded to
        hidden's dtype (`kernels.rms_norm`'s twin)
    returns: (normed [..., d_model], the sum hidden + residual (or hidden))
    """
    if partials is not None:
        if residual is not None:
            raise ValueError("give the residual as `residual` or as `partials`, not both")
        residual = sum_partials(partials).to(hidden.dtype)
    total = hidden if residual is None else hidden + residual
    variance = total.to(torch.float32).pow(2).mean(-1, keepdim=True)
    normed = total * torch.rsqrt(variance + eps)
    if weight.dtype in (torch.float16, torch.bfloat16):
        normed = normed.to(weight.dtype)
    return weight * normed, total


def gated_gelu(gate: torch.Tensor, linear: torch.Tensor) -> torch.Tensor:
    """`kernels.gated_gelu`: HF's gelu_new of `gate` times `linear`, in float32 (float64 for
    float64 inputs), rounded once to gate's dtype."""
    compute = torch.promote_types(gate.dtype, torch.float32)
    x, y = gate.to(compute), linear.to(compute)
    gelu = 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))
    return (gelu * y).to(gate.dtype)


def gemv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T (twin of `kernels.gemv`). x: [..., K]; weight: [N, K]; returns [..., N]."""
    return x @ weight.T


def gemv_supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The torch backend leaves every projection to the model's own Linear layers."""
    return False


def relu_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """relu(x @ weight.T) (twin of `kernels.relu_linear`). x: [..., K]; weight: [N, K]; returns [..., N]."""
    return torch.relu(x @ weight.T)


def relu_linear_supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The torch backend leaves the feed-forward to the model's own modules."""
    return False


def split_k_linear(x: torch.Tensor, weight: torch.Tensor, splits: int = 2) -> torch.Tensor:
    """The float32 partial products of x @ weight.T over `splits` equal slices of K (twin of
    `kernels.split_k_linear`). x: [..., K]; weight: [N, K]; returns [splits, ..., N]."""
    K = weight.shape[1]
    if K % splits:
        raise ValueError(f"K {K} does not split into {splits} equal slices")
    xs, ws = x.float().split(K // splits, dim=-1), weight.float().split(K // splits, dim=-1)
    return torch.stack([xi @ wi.T for xi, wi in zip(xs, ws)])


def split_k_supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The torch backend leaves the feed-forward to the model's own modules."""
    return False


def fused_linear(
    x: torch.Tensor,
    weights,
    norm_weight: Optional[torch.Tensor] = None,
    eps: float = 0.0,
    residual: Optional[torch.Tensor] = None,
    activation: Optional[str] = None,
    key_cache: Optional[torch.Tensor] = None,
    value_cache: Optional[torch.Tensor] = None,
    slot_mapping: Optional[torch.Tensor] = None,
    pdl: bool = False,
) -> torch.Tensor:
    """`kernels.fused_linear` as the ops HF runs one after another: the layer norm, each Linear
    rounded to x's dtype, then the residual add, ReLU, gated GELU or K/V store. `pdl` is the
    kernel's launch mode and changes nothing here.

    x: [..., K]; weights: 1-3 [N, K]; returns [..., N] (q when K/V are stored)
    """
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)[0]
    ys = [x @ w.T for w in weights]
    if residual is not None:
        return residual + ys[0]
    if activation == "relu":
        return torch.relu(ys[0])
    if activation == "gelu_tanh":
        return gated_gelu(ys[0], ys[1])
    if key_cache is not None:
        num_heads, head_dim = key_cache.shape[2:]
        k, v = (y.reshape(-1, num_heads, head_dim) for y in ys[1:])
        keep = slot_mapping >= 0  # a negative slot stores nothing, as in the kernel
        store_kv(k[keep], v[keep], key_cache, value_cache, slot_mapping[keep])
    return ys[0]


def fused_linear_supports(x: torch.Tensor, weights) -> bool:
    """The torch backend runs each decoder layer op by op with the model's own modules."""
    return False


def greedy_update(
    logits: torch.Tensor,
    sequences: torch.Tensor,
    cur_len: torch.Tensor,
    unfinished: torch.Tensor,
    done_at: torch.Tensor,
    step_ids: torch.Tensor,
    slot_mapping: torch.Tensor,
    self_seq_lens: torch.Tensor,
    owned: torch.Tensor,
    block_size: int,
    tickets: Optional[torch.Tensor] = None,
    eos_until: Optional[torch.Tensor] = None,
    pad: Optional[torch.Tensor] = None,
    eos: Optional[torch.Tensor] = None,
) -> None:
    """One greedy step of the device-resident loop, in place, as HF's `_sample` picks a token:
    the float32 scores of the last position, EOS at -inf where a min-length rule holds, argmax,
    the pad id in rows that had finished, the EOS criterion; then the next decode step's inputs.

    logits: [rows, positions, vocab]; sequences: [rows, capacity] int64, the token goes to column
    `cur_len` (0-d int64, then advanced by one); unfinished: [rows] bool; done_at: 0-d int64, -1 until every row has finished, then the column at
    which that first held; step_ids: [rows, 1] int64 (the token); slot_mapping, self_seq_lens:
    [rows] int32 (its cache slot in the row's blocks `owned` [rows, width] int32, and cur_len + 1);
    eos_until: [vocab] int32 or None, EOS forbidden while cur_len < eos_until[v]
    (`kernels.greedy.eos_until`); pad (0-d int64) and eos ([n] int64) together or neither: rows
    are padded and finished only with an EOS criterion, as in HF. `tickets` is the kernel's and
    unused here. The column and the block index are clamped to their tensors (a step queued after
    the last one writes inside them).
    """
    rows = logits.shape[0]
    cur = cur_len
    scores = logits[:, -1].to(torch.float32)
    if eos_until is not None:
        scores = scores.masked_fill(cur < eos_until, -math.inf)
    tokens = torch.argmax(scores, dim=-1)
    if pad is not None:
        tokens = torch.where(unfinished, tokens, pad)
    sequences.scatter_(1, cur.clamp(max=sequences.shape[1] - 1).expand(rows, 1), tokens[:, None])
    if eos is not None:
        unfinished &= ~(tokens[:, None] == eos).any(-1)
        done_at.copy_(torch.where(~unfinished.any() & (done_at < 0), cur, done_at))
    step_ids.copy_(tokens.view_as(step_ids))
    index = torch.div(cur, block_size, rounding_mode="floor").clamp(max=owned.shape[1] - 1).expand(rows, 1)
    block = torch.gather(owned, 1, index)
    slot_mapping.copy_(block[:, 0] * block_size + cur % block_size)
    self_seq_lens.copy_(cur + 1)
    cur_len += 1


def _best(values: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The `k` largest along the last dim, equal values by the lower index (a stable descending sort)."""
    ordered, index = torch.sort(values, dim=-1, descending=True, stable=True)
    return ordered[..., :k], index[..., :k]


def beam_update(
    logits: torch.Tensor,
    step: torch.Tensor,
    int_table: torch.Tensor,
    float_table: torch.Tensor,
    running_sequences: torch.Tensor,
    sequences: torch.Tensor,
    running_beam_scores: torch.Tensor,
    beam_scores: torch.Tensor,
    running_beam_indices: torch.Tensor,
    beam_indices: torch.Tensor,
    is_sent_finished: torch.Tensor,
    heuristic: torch.Tensor,
    beam_idx: torch.Tensor,
    next_tokens: torch.Tensor,
    unfinished: torch.Tensor,
    table: torch.Tensor,
    owned: torch.Tensor,
    slot_mapping: torch.Tensor,
    self_seq_lens: torch.Tensor,
    input_ids: torch.Tensor,
    copy_src: torch.Tensor,
    copy_dst: torch.Tensor,
    block_size: int,
    keep: int,
    early_stopping_true: bool,
    workspace: Optional[dict] = None,
    eos_until: Optional[torch.Tensor] = None,
    eos: Optional[torch.Tensor] = None,
) -> None:
    """One step of HF's `_beam_search` after the forward, in place, as `decode.beam_graph.BeamStep`
    runs it on the device (HF's helpers in HF's order), then the cache reorder and the next decode
    step's inputs. Equal scores are taken by the lower flat index (a stable descending sort).

    logits: [batch * beams, positions, vocab] (the last position read); step: 0-d int64, the row of
    int_table [steps, >= 3] int64 (cur_len, cur_len - prompt_len, at max length) and float_table
    [steps, 2] float32 (the multipliers of HF's length-penalty and heuristic divisions) this step
    reads (clamped to the last row), then advanced by one. HF's state, [batch, beams, ...] as in
    `decode.beam_state`; beam_idx [rows] int64, next_tokens [rows, 1] int64, unfinished 0-d bool:
    outputs. table [rows, width] int32 (the decode step's self block table) is reordered: row r
    takes row beam_idx[r]'s blocks before the cache position's block and its own `owned` [rows,
    width] int32 from there; copy_src / copy_dst [rows] int64: the block each row continues from
    and its own (the caller copies it); slot_mapping, self_seq_lens, input_ids [rows, 1]: the
    next step's inputs. keep: candidates per source (HF's beams_to_keep); early_stopping_true:
    `early_stopping is True`; eos_until: [vocab] int32 or None (`decode.min_length.eos_until`);
    eos: [n] int64 or None. `workspace` is the kernel's and unused here.
    """
    batch, beams, length = running_sequences.shape
    vocab = logits.shape[-1]
    rows = batch * beams
    s = step.clamp(max=int_table.shape[0] - 1)
    ints, floats = int_table[s], float_table[s]
    cur, col_idx, at_max = ints[0], ints[1], ints[2].bool()
    log_probs = torch.log_softmax(logits[:, -1].to(torch.float32), dim=-1)
    if eos_until is not None:
        log_probs = log_probs.masked_fill(cur < eos_until, -math.inf)
    scores = (log_probs.view(batch, beams, vocab) + running_beam_scores[:, :, None]).view(batch, beams * vocab)
    top_val, top_idx = _best(scores, keep)
    top_beam, top_tok = top_idx // vocab, top_idx % vocab
    offset = torch.arange(batch, device=logits.device)[:, None] * beams

    def take(tensor, index):  # [batch, n, width] rows `index` [batch, m] of each source
        return torch.take_along_dim(tensor, index[:, :, None], dim=1)

    cand_seq = take(running_sequences, top_beam)
    cand_seq.scatter_(2, cur.expand(batch, keep, 1), top_tok[:, :, None])
    cand_bi = take(running_beam_indices, top_beam)
    cand_bi.scatter_(2, col_idx.expand(batch, keep, 1), (top_beam + offset)[:, :, None].to(torch.int32))
    hits = at_max.expand(batch, keep)
    if eos is not None:
        hits = hits | (top_tok[:, :, None] == eos).any(-1)
    running_lp = top_val + hits.to(torch.float32) * -1.0e9
    pick = _best(running_lp, beams)[1]
    # finished hypotheses: HF's additions one by one (their rounding is HF's)
    just = hits & (torch.arange(keep, device=logits.device) < beams)
    cand_score = top_val * floats[0]
    cand_score = cand_score + (is_sent_finished.all(-1, keepdim=True) & early_stopping_true).to(torch.float32) * -1.0e9
    cand_score = cand_score + (~heuristic).to(torch.float32) * -1.0e9
    cand_score = cand_score + (~just).to(torch.float32) * -1.0e9
    merged_score = torch.cat((beam_scores, cand_score), dim=1)
    merge = _best(merged_score, beams)[1]
    new_fin_seq = take(torch.cat((sequences, cand_seq), dim=1), merge)
    new_fin_bi = take(torch.cat((beam_indices, cand_bi), dim=1), merge)
    new_fin = torch.cat((is_sent_finished, just), dim=1).gather(1, merge)
    new_score = merged_score.gather(1, merge)
    running_sequences.copy_(take(cand_seq, pick))
    running_beam_indices.copy_(take(cand_bi, pick))
    running_beam_scores.copy_(running_lp.gather(1, pick))
    sequences.copy_(new_fin_seq)
    beam_indices.copy_(new_fin_bi)
    beam_scores.copy_(new_score)
    is_sent_finished.copy_(new_fin)
    best_running = running_beam_scores[:, :1] * floats[1]
    worst = torch.where(is_sent_finished, beam_scores.min(dim=1, keepdim=True)[0], -1.0e9)
    heuristic &= (best_running > worst).any(-1, keepdim=True)
    open_beam = ~(is_sent_finished.all() & early_stopping_true)
    unfinished.copy_(heuristic.any() & open_beam & ~hits.all())
    # the cache reorder and the next step's inputs
    beam_idx.copy_((top_beam.gather(1, pick) + offset).reshape(rows))
    next_tokens.copy_(top_tok.gather(1, pick).reshape(rows, 1))
    width = owned.shape[1]
    current = torch.div(cur, block_size, rounding_mode="floor").clamp(max=width - 1)
    moved = table.index_select(0, beam_idx)
    own = owned[:, current]
    copy_src.copy_(moved[:, current])
    copy_dst.copy_(own)
    table.copy_(torch.where(torch.arange(width, device=table.device) >= current, owned, moved))
    slot_mapping.copy_(own.to(torch.int64) * block_size + cur % block_size)
    self_seq_lens.copy_(cur + 1)
    input_ids.copy_(next_tokens.view_as(input_ids))
    step += 1
