"""The tests' one compare-with-stock oracle.

A patched call is right when it gives what stock HF gives on the same weights:

- in float64 (`assert_exact_in_float64`), the same algorithm: tokens equal and every float equal
  up to the one rounding HF itself applies at the end (scores and logits are cast to float32).
  The torch backend computes a float64 model in float64 throughout, so any difference in the
  computation (a wrong scale, a misplaced token, a stale table) shows, with no rounding noise.
- in float32, tokens equal, and every float within the error stock HF itself makes in float32.
  That error is measured, not guessed: an fp64 copy of the model gives the reference, and the
  paged result may be off it by a small multiple of stock fp32's own distance from it.

    stock, paged = stock_and_paged(model, seed=..., **generate_kwargs)
    assert_same_tokens(stock, paged)
    assert_generate_floats(model, stock, paged, seed=..., **generate_kwargs)
    assert_exact_in_float64(model, seed=..., **generate_kwargs)
"""

from __future__ import annotations

import copy
import zlib

import torch

import hf_paged_t5 as hp

CONFIG = hp.PagedCacheConfig(block_size=8, backend="torch")  # the reference backend, written for reading
# the backend `backend="auto"` runs on CPU, written for speed (tests/test_cpu_ops.py checks its ops)
CPU_CONFIG = hp.PagedCacheConfig(block_size=8, backend="cpu")
BACKENDS = {"reference": CONFIG, "cpu": CPU_CONFIG}

# How far past stock fp32's own error (against fp64) the paged result may be, for the root mean
# square and for the largest deviation. The paged path sums in another order (packed varlen
# encoder, paged attention), so it rounds differently; the ratio of two such rounding errors is
# itself noisy. Measured on the tests' models (random weights, chaotic: errors grow ~1e4-fold
# through the layers): HF's own eager vs sdpa attention, rms <= 1.5x and largest <= 1.7x over
# 40 calls; paged vs stock, rms <= 2.8x and largest <= 4.5x over the 160-call seed sweep, every
# one of them exact in float64. The errors this guards against (a wrong scale, a stale bias
# table, a token at a wrong distance) are 100x to 10^5x.
ERROR_FACTOR = {"rms": 4.0, "largest": 8.0}
# Floor of the allowed error, in fp32 ulps of the reference's largest value.
ULPS_FLOOR = 8


def case_seed(*parts) -> int:
    """A seed of its own for each test case (a crc of its parameters): cases do not share
    weights or inputs, so a tie that hides a wrong scale in one case does not hide it in all."""
    return zlib.crc32(repr(parts).encode()) % 100_000


def stock_and_paged(model, config=CONFIG, seed=None, expect_paged=True, **kwargs):
    """(stock HF output, patched output) of the same generate() call; leaves the model unpatched.

    Checks that the patched call did (or, with expect_paged=False, did not) run on the pool, and
    that every block went back to it. With `seed`, both calls start from that RNG state.
    """
    assert not hp.is_patched(model)
    if seed is not None:
        torch.manual_seed(seed)
    stock = model.generate(**kwargs)
    hp.patch_model(model, config)
    try:
        if seed is not None:
            torch.manual_seed(seed)
        paged = model.generate(**kwargs)
        pool = model._hf_paged_t5.pool
        if expect_paged:
            assert pool is not None, "the paged path did not run"
            assert pool.is_idle(), "generate() leaked KV blocks"
        else:
            assert pool is None, "expected a fallback to stock HF"
    finally:
        hp.unpatch_model(model)
    return stock, paged


def sequences_of(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.sequences


def assert_same_tokens(stock, paged) -> None:
    a, b = sequences_of(stock), sequences_of(paged)
    assert a.shape == b.shape, f"HF {tuple(a.shape)} vs paged {tuple(b.shape)}"
    assert torch.equal(a, b), f"\nHF:\n{a}\npaged:\n{b}"


def fp64_twin(model):
    """An unpatched float64 copy of `model` (same weights)."""
    return copy.deepcopy(model).double()


def assert_within_stock_error(paged, stock, ref, what: str) -> None:
    """The paged floats are as close to fp64 as stock fp32 is, up to ERROR_FACTOR: both the largest
    and the root-mean-square deviation, pooled over every entry of every tensor given (a tensor or
    a list of them: all steps of one output, so that one step's lucky stock rounding does not set
    the scale). The floor of the allowed error is ULPS_FLOOR fp32 ulps of the largest value.

    Infinite entries (masked scores) must be the same in all three and are left out.
    """
    as_list = (lambda x: list(x) if isinstance(x, (list, tuple)) else [x])
    paged, stock, ref = as_list(paged), as_list(stock), as_list(ref)
    assert len(paged) == len(stock) == len(ref), f"{what}: {len(paged)}, {len(stock)}, {len(ref)} tensors"
    deviations = {"paged": [], "stock": []}
    scale = 0.0
    for t, (p, s, r) in enumerate(zip(paged, stock, ref)):
        p, s, r = p.double(), s.double(), r.double().to(p.device)
        assert p.shape == s.shape == r.shape, f"{what}[{t}]: shapes {p.shape}, {s.shape}, {r.shape}"
        finite = torch.isfinite(r)
        assert torch.equal(torch.isfinite(s), finite) and torch.equal(torch.isfinite(p), finite), (
            f"{what}[{t}]: masked (infinite) entries differ"
        )
        deviations["paged"].append((p - r)[finite].abs())
        deviations["stock"].append((s - r)[finite].abs())
        if finite.any():
            scale = max(scale, float(r[finite].abs().max()))
    paged_dev, stock_dev = torch.cat(deviations["paged"]), torch.cat(deviations["stock"])
    if paged_dev.numel() == 0:
        return
    floor = ULPS_FLOOR * torch.finfo(torch.float32).eps * scale
    for name, stat in (("largest", torch.amax), ("rms", lambda d: d.pow(2).mean().sqrt())):
        paged_err, stock_err = float(stat(paged_dev)), float(stat(stock_dev))
        bound = ERROR_FACTOR[name] * max(stock_err, floor)
        assert paged_err <= bound, (
            f"{what}: {name} deviation from fp64 {paged_err:.3g} paged vs {stock_err:.3g} stock fp32 "
            f"(allowed {bound:.3g})"
        )


def teacher_forced_logits(model64, sequences: torch.Tensor, **inputs) -> torch.Tensor:
    """fp64 logits [rows, steps, vocab] at every generated position of `sequences` [rows, 1 + steps]:
    what a greedy / sampling call's `output_logits` must be, whatever tokens it picked.

    inputs: input_ids / attention_mask of the call, expanded to `sequences`' rows here.
    """
    rows = sequences.shape[0]
    ids, mask = inputs["input_ids"], inputs.get("attention_mask")
    expand = rows // ids.shape[0]
    ids = ids.repeat_interleave(expand, 0)
    mask = mask.repeat_interleave(expand, 0) if mask is not None else None
    with torch.no_grad():
        return model64(input_ids=ids, attention_mask=mask, decoder_input_ids=sequences[:, :-1]).logits


def teacher_forced_sequence_scores(model64, sequences, length_penalty, eos_token_id, **inputs) -> torch.Tensor:
    """fp64 `sequences_scores` [rows] of beam-search `sequences` [rows, 1 + steps] (a start token
    first): the sum of each generated token's log-probability up to its first EOS, over (tokens
    generated) ** length_penalty, as HF scores a finished beam. For calls whose processors leave
    the chosen tokens' log-probabilities alone (no temperature, penalties or biases)."""
    log_probs = torch.log_softmax(teacher_forced_logits(model64, sequences, **inputs), dim=-1)
    chosen = log_probs.gather(-1, sequences[:, 1:, None]).squeeze(-1)  # [rows, steps]
    eos = torch.as_tensor(eos_token_id, device=sequences.device).reshape(-1)
    is_eos = torch.isin(sequences[:, 1:], eos)
    # a token counts when no EOS came before it (the EOS itself counts)
    before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    counted = before == 0
    lengths = counted.sum(dim=1).double()
    return (chosen * counted).sum(dim=1) / lengths**length_penalty


def assert_generate_floats(model, stock, paged, seed=None, **kwargs) -> None:
    """Scores and logits of a return_dict_in_generate call, paged vs stock, against fp64.

    - `logits` of greedy / sampling calls: against the fp64 model teacher-forced on the tokens
      both calls chose (exact for any seed: no fp64 generation has to follow fp32's choices).
    - `scores` of greedy / sampling and the per-step floats of beam search: against an fp64
      generate() with the same seed, at the steps where fp64 chose the same tokens (all steps,
      for beams, when its sequences and beam indices are stock's; else the first step only).
    - `sequences_scores` of beam search: against the fp64 teacher-forced score of the returned
      sequences (`teacher_forced_sequence_scores`).
    """
    model64 = fp64_twin(model)
    inputs = {k: v for k, v in kwargs.items() if k in ("input_ids", "attention_mask")}
    beams = (kwargs.get("num_beams") or model.generation_config.num_beams or 1) > 1
    if getattr(stock, "logits", None) is not None and not beams:
        ref = teacher_forced_logits(model64, stock.sequences, **inputs)
        assert_within_stock_error(paged.logits, stock.logits, ref.unbind(1), "logits")
    if seed is not None:
        torch.manual_seed(seed)
    ref = model64.generate(**kwargs)
    steps = _agreeing_steps(stock, ref, beams)
    for name in ("scores", "logits") if beams else ("scores",):
        a_all, b_all, r_all = getattr(stock, name, None), getattr(paged, name, None), getattr(ref, name, None)
        if a_all is None:
            continue
        assert len(a_all) == len(b_all)
        n = min(steps, len(a_all))
        assert_within_stock_error(b_all[:n], a_all[:n], r_all[:n], f"{name}[:{n}]")
    if beams and getattr(stock, "sequences_scores", None) is not None:
        config = model._prepare_generation_config(None, **kwargs)[0]  # the call's effective settings
        ref_scores = teacher_forced_sequence_scores(
            model64, stock.sequences, config.length_penalty, config.eos_token_id, **inputs
        )
        assert_within_stock_error(paged.sequences_scores, stock.sequences_scores, ref_scores, "sequences_scores")


def _agreeing_steps(stock, ref, beams: bool) -> int:
    """Steps at whose start fp64 and stock fp32 hold the same decoder rows."""
    a, r = stock.sequences, ref.sequences
    if beams:
        same = a.shape == r.shape and torch.equal(a, r)
        if same and getattr(stock, "beam_indices", None) is not None:
            same = torch.equal(stock.beam_indices, ref.beam_indices)
        return len(stock.scores) if same else 1
    n = min(a.shape[1], r.shape[1])
    differs = (a[:, :n] != r[:, :n]).any(0).nonzero()
    first = int(differs[0]) if len(differs) else n
    return first  # step t's scores depend on tokens 0..t; token 0 is the start token


def float_outputs(out) -> dict:
    """name -> tensor or tuple of tensors, for every float output of a generate() call."""
    if isinstance(out, torch.Tensor):
        return {}
    return {k: v for k, v in out.items()
            if k in ("scores", "logits", "sequences_scores") and v is not None}


def assert_exact_in_float64(model, seed=None, expect_paged=True, config=CONFIG, **kwargs) -> None:
    """Stock and paged generate() on a float64 copy of `model`: same tokens, and the float outputs
    equal up to their float32 cast (HF casts the logits to float32: values that agree to ~1e-15
    may round to neighbouring float32 numbers, one ulp apart)."""
    model64 = fp64_twin(model)
    stock, paged = stock_and_paged(model64, config=config, seed=seed, expect_paged=expect_paged, **kwargs)
    assert_same_tokens(stock, paged)
    floats_a, floats_b = float_outputs(stock), float_outputs(paged)
    assert floats_a.keys() == floats_b.keys()
    for name, a in floats_a.items():
        b = floats_b[name]
        for t, (x, y) in enumerate(zip(*(v if isinstance(v, tuple) else (v,) for v in (a, b)))):
            eps = torch.finfo(x.dtype).eps
            torch.testing.assert_close(y, x, rtol=2 * eps, atol=0.0, equal_nan=True, msg=lambda m: f"{name}[{t}]: {m}")


def fp32_agrees_with_fp64(model, stock, seed, kwargs) -> bool:
    """Whether stock fp32 generate() picked the tokens an fp64 copy picks (same seed)."""
    if seed is not None:
        torch.manual_seed(seed)
    ref = fp64_twin(model).generate(**kwargs)
    a, r = sequences_of(stock), sequences_of(ref)
    return a.shape == r.shape and torch.equal(a, r)
