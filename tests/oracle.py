"""The tests' one compare-with-stock oracle.

A patched call is right when it gives what stock HF gives on the same weights:

- in float32, tokens equal, and every float within the error stock HF itself makes in float32.
  That error is measured, not guessed: an fp64 copy of the model gives the reference, and the
  paged result may be off it by a small multiple of stock fp32's own distance from it.
- in float64 (`assert_exact_in_float64`), the same algorithm: tokens equal and every float equal
  up to the one rounding HF itself applies at the end (scores and logits are cast to float32).
  The torch backend computes a float64 model in float64 throughout, so any difference in the
  computation (a wrong scale, a misplaced token, a stale table) shows, with no rounding noise.
- on a fallback (the paged path declined the call), stock HF ran: every output bit for bit.

One call does all of it:

    stock, paged = compare_with_stock(model, seed=..., float64=True, **generate_kwargs)

`stock_and_paged` (the two calls, without the checks) is for the few tests whose tokens may
differ by design (fp16 near-ties, the seed sweep's fp32 ties: see `compare_with_stock`'s
`near_ties`).
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


def stock_copy(model):
    """An unpatched copy of `model` (same weights); `model` itself is left as it is."""
    clone = copy.deepcopy(model)  # a patched model deep-copies to a patched clone with its own pool
    if hp.is_patched(clone):
        hp.unpatch_model(clone)
    return clone


def _generate(model, seed, stock_may_raise, kwargs):
    if seed is not None:
        torch.manual_seed(seed)
    if not stock_may_raise:
        return model.generate(**kwargs)
    try:
        return model.generate(**kwargs)
    except Exception as exc:  # compared with the stock call's by the caller
        return exc


def _check_pool(model, expect_paged) -> None:
    pool = model._hf_paged_t5.pool
    if expect_paged:
        assert pool is not None, "the paged path did not run"
    elif expect_paged is not None:
        assert pool is None, "expected a fallback to stock HF"
    assert pool is None or pool.is_idle(), "generate() leaked KV blocks"


def stock_and_paged(model, config=None, seed=None, expect_paged=True, stock_model=None, stock_may_raise=False,
                    while_patched=None, **kwargs):
    """(stock HF output, patched output) of the same generate(**kwargs) call, without comparing them.

    - `model` unpatched: stock HF runs on it, then it is patched with `config` (default `CONFIG`)
      for the second call and unpatched again.
    - `model` patched (its pool and graphs kept for the next call; `config` must be None): the
      patched call runs on it, stock HF on `stock_model`, an unpatched copy with the same weights
      (made here with `stock_copy` when not given).

    Checks that the patched call ran on the pool (`expect_paged=True`), or fell back to stock HF
    (False), or either (None), and that every block went back to the pool. With `seed`, both
    calls start from that RNG state. `while_patched(model)` runs after the patched call, before
    anything is unpatched (to inspect the pool). With `stock_may_raise`, an exception of either
    call is returned in place of its output.
    """
    if hp.is_patched(model):
        assert config is None, "a patched model runs with its own config"
        stock = _generate(stock_model if stock_model is not None else stock_copy(model), seed, stock_may_raise, kwargs)
        paged = _generate(model, seed, stock_may_raise, kwargs)
        _check_pool(model, expect_paged)
        if while_patched is not None:
            while_patched(model)
        return stock, paged
    assert stock_model is None, "an unpatched model is its own stock copy"
    stock = _generate(model, seed, stock_may_raise, kwargs)
    hp.patch_model(model, CONFIG if config is None else config)
    try:
        paged = _generate(model, seed, stock_may_raise, kwargs)
        _check_pool(model, expect_paged)
        if while_patched is not None:
            while_patched(model)
    finally:
        hp.unpatch_model(model)
    return stock, paged


def compare_with_stock(model, config=None, seed=None, expect_paged=True, stock_model=None, floats=True,
                       float64=False, near_ties=False, stock_may_raise=False, while_patched=None, **kwargs):
    """The compare-with-stock check of one generate(**kwargs) call; returns (stock, paged).

    Runs it on stock HF and patched on the same weights (`stock_and_paged`: config, seed,
    expect_paged, stock_model, while_patched as there), then:

    - tokens equal (`assert_same_tokens`);
    - a fallback (`expect_paged=False`): every float output bit for bit (stock HF ran both);
    - else, with `floats`, scores / logits / sequences_scores within stock's own fp32-vs-fp64
      error (`assert_generate_floats`);
    - with `float64`, the same call exact in float64 (`assert_exact_in_float64`).

    `near_ties`: for random cases, where fp32 itself may be at a tie. If the tokens differ and
    stock fp32 picked other tokens than an fp64 copy does (rounding decided a near tie), or a beam
    search returned hypotheses of the same score (`beam_hypotheses_tie`), the call is checked in
    float64 only; else differing tokens fail.
    `stock_may_raise`: if stock HF raises, the patched call must raise the same (type and message).
    """
    stock, paged = stock_and_paged(model, config=config, seed=seed, expect_paged=expect_paged,
                                   stock_model=stock_model, stock_may_raise=stock_may_raise,
                                   while_patched=while_patched, **kwargs)
    if isinstance(stock, Exception) or isinstance(paged, Exception):
        assert type(paged) is type(stock) and str(paged) == str(stock), f"stock HF: {stock!r}\npaged: {paged!r}"
        return stock, paged
    reference = stock_model if stock_model is not None else model
    differ = not torch.equal(sequences_of(stock), sequences_of(paged))
    tie = near_ties and differ and (not fp32_agrees_with_fp64(reference, stock, seed, kwargs)
                                    or beam_hypotheses_tie(reference, stock, paged, kwargs))
    if tie or float64:
        assert_exact_in_float64(reference, seed=seed, expect_paged=expect_paged, config=_config_of(model, config),
                                **kwargs)
    if tie:
        return stock, paged
    assert_same_tokens(stock, paged)
    if expect_paged is False:
        assert_same_floats(stock, paged)
    elif floats:
        assert_generate_floats(reference, stock, paged, seed=seed, **kwargs)
    return stock, paged


def _config_of(model, config):
    if hp.is_patched(model):
        return model._hf_paged_t5.config
    return CONFIG if config is None else config


def sequences_of(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.sequences


def assert_same_tokens(stock, paged) -> None:
    a, b = sequences_of(stock), sequences_of(paged)
    assert a.shape == b.shape, f"HF {tuple(a.shape)} vs paged {tuple(b.shape)}"
    assert torch.equal(a, b), f"\nHF:\n{a}\npaged:\n{b}"


def _tensors(value):
    """Every tensor in a (nested) tuple / list of tensors, in order."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    return []


def assert_same_floats(stock, paged) -> None:
    """Every tensor output but the cache (scores, logits, hidden states, attentions) bit for bit."""
    if isinstance(stock, torch.Tensor):
        return
    names = [k for k in stock.keys() if k not in ("sequences", "past_key_values", "cache")]
    assert names == [k for k in paged.keys() if k not in ("sequences", "past_key_values", "cache")]
    for name in names:
        a, b = _tensors(stock[name]), _tensors(paged[name])
        assert len(a) == len(b), f"{name}: {len(a)} vs {len(b)} tensors"
        for i, (x, y) in enumerate(zip(a, b)):
            assert x.shape == y.shape and torch.equal(x, y), f"{name}[{i}] differs from stock HF's"


# The generate() kwargs that feed the encoder (what a teacher-forced reference needs of a call).
SOURCE_INPUTS = ("input_ids", "inputs_embeds", "attention_mask")


def in_float64(kwargs: dict) -> dict:
    """generate() kwargs for the float64 twin: `inputs_embeds` cast up (exactly), the rest as is."""
    return {k: v.double() if k == "inputs_embeds" and v is not None else v for k, v in kwargs.items()}


def fp64_twin(model):
    """An unpatched float64 copy of `model` (same weights)."""
    return stock_copy(model).double()


def assert_within_stock_error(paged, stock, ref, what: str) -> None:
    """The paged floats are as close to fp64 as stock fp32 is, up to ERROR_FACTOR: both the largest
    and the root-mean-square deviation, pooled over every entry of every tensor given (a tensor or
    a list of them: all steps of one output, so that one step's lucky stock rounding does not set
    the scale). The floor of the allowed error is ULPS_FLOOR fp32 ulps of the largest value.

    Infinite entries (masked scores) must be the same in paged's and stock's and are left out,
    with those the fp64 reference masks otherwise (its top-k at a near tie of the k-th value:
    stock fp32 and fp64 disagree there, whatever the paged path does).
    """
    as_list = (lambda x: list(x) if isinstance(x, (list, tuple)) else [x])
    paged, stock, ref = as_list(paged), as_list(stock), as_list(ref)
    assert len(paged) == len(stock) == len(ref), f"{what}: {len(paged)}, {len(stock)}, {len(ref)} tensors"
    deviations = {"paged": [], "stock": []}
    scale = 0.0
    for t, (p, s, r) in enumerate(zip(paged, stock, ref)):
        p, s, r = p.double(), s.double(), r.double().to(p.device)
        assert p.shape == s.shape == r.shape, f"{what}[{t}]: shapes {p.shape}, {s.shape}, {r.shape}"
        finite = torch.isfinite(s)
        assert torch.equal(torch.isfinite(p), finite), f"{what}[{t}]: masked (infinite) entries differ from stock's"
        # an fp64 run's own top-k may mask another entry at a near tie of the k-th value
        finite &= torch.isfinite(r)
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

    inputs: input_ids or inputs_embeds, and attention_mask, of the call (`SOURCE_INPUTS`),
    expanded to `sequences`' rows here.
    """
    inputs = {k: v for k, v in in_float64(inputs).items() if v is not None}
    source = inputs["input_ids"] if "input_ids" in inputs else inputs["inputs_embeds"]
    expand = sequences.shape[0] // source.shape[0]
    inputs = {k: v.repeat_interleave(expand, 0) for k, v in inputs.items()}
    eager_attention(model64)
    with torch.no_grad():
        return model64(**inputs, decoder_input_ids=sequences[:, :-1]).logits


def eager_attention(model) -> None:
    """`model` (a reference copy) on HF's eager attention, in every sub-config: in transformers
    5.16-5.17 the UMT5 decoder on sdpa lets a position attend to later ones in a forward over a
    whole sequence without a cache (gone in 5.18), so a teacher-forced reference must not use it."""
    model.set_attn_implementation("eager")
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_attn_implementation", "eager") != "eager":
            config._attn_implementation = "eager"


def _along_beams(out, name: str, rows: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """out.<name> (per step [rows x beams, vocab]) of the beam each returned sequence came from:
    [len(rows), vocab], the entries (rows[i], steps[i])."""
    per_step = torch.stack(getattr(out, name))  # [steps, rows x beams, vocab]
    return per_step[steps, out.beam_indices[rows, steps]]


def assert_beam_floats(model64, stock, paged, length_penalty, from_step=0, **inputs) -> None:
    """Beam search's floats along the returned beams against fp64 teacher-forced on the returned
    sequences (exact for any seed: no fp64 beam search has to follow fp32's choices).

    - `scores` (log-softmax, then the call's processors) and `logits` of the beam each returned
      token came from, at steps `from_step` on, pooled over all of them, within stock's own fp32
      error; entries a processor masked (-inf in stock's) are left out. For calls whose
      processors mask only (min lengths, top-k / top-p), not rescale (temperature, penalties).
    - `sequences_scores`: the sum of the chosen tokens' `scores` along each beam over (tokens
      generated) ** length_penalty, HF's arithmetic; stock's and paged's each equal it up to
      the fp32 rounding of that sum. (Not against fp64 directly: three sums of a few chosen
      tokens are too few to measure stock's own error by, and a near tie's chosen log-prob
      is the difference of two logits whose errors stock may cancel by luck.) A beam whose stock
      score is no such sum (a masked choice, HF's -1e9 start penalty kept): paged's equals
      stock's up to fp32 rounding at its magnitude.
    """
    generated = stock.beam_indices[:, : len(stock.scores)] >= 0  # [rows, steps]
    # The same steps generated. The beams themselves may differ where two beams held the same
    # tokens (fp32 rounds a saturated softmax to exact ties, which top-k breaks by position): the
    # floats below are each output's along its own beams, against fp64 teacher-forced on the
    # returned sequences, so a beam of another history fails there.
    assert torch.equal(paged.beam_indices >= 0, stock.beam_indices >= 0), "paged beams span other steps than stock's"
    lengths = generated.sum(1)
    prompt = stock.sequences.shape[1] - int(lengths.max())  # the start token, or a user's decoder prompt
    rows, steps = generated.nonzero(as_tuple=True)
    later = steps >= from_step
    if later.any():
        r, t = rows[later], steps[later]
        logits64 = teacher_forced_logits(model64, stock.sequences, **inputs)[r, prompt - 1 + t]  # [n, vocab]
        for name, ref in (("scores", torch.log_softmax(logits64, dim=-1)), ("logits", logits64)):
            if getattr(stock, name, None) is None:
                continue
            a, b = _along_beams(stock, name, r, t), _along_beams(paged, name, r, t)
            ref = torch.where(torch.isfinite(a), ref.to(a.device), a.double())  # what a processor masked
            assert_within_stock_error(b, a, ref, f"{name} along the returned beams from step {from_step}")
    tokens = stock.sequences[rows, prompt + steps]
    norm = lengths.double() ** length_penalty
    eps = torch.finfo(torch.float32).eps
    apart = None  # beams whose stock score is no sum of its chosen scores (below)
    for what, out in (("stock", stock), ("paged", paged)):
        chosen = torch.zeros(generated.shape, dtype=torch.float64, device=tokens.device)
        chosen[rows, steps] = _along_beams(out, "scores", rows, steps).gather(1, tokens[:, None]).squeeze(1).double()
        expected = chosen.sum(1) / norm
        # HF sums the chosen log-probs in fp32, one step at a time: each addition rounds
        rounding = (lengths + 1).double() * eps * chosen.abs().sum(1) / norm
        final = out.sequences_scores.double()
        if apart is None:
            # Decided on stock's output alone: a beam holding a choice a processor masked (-inf:
            # one forced token at a step leaves the other beams -inf candidates), or one that was
            # not the first beam at the start (HF's -1e9 start penalty stays in its score when no
            # other candidate was finite). Paged's score of such a beam must be stock's.
            apart = ~torch.isfinite(expected) | (final - expected < -1e8)
        error = (final - expected).abs()
        assert (error[~apart] <= rounding[~apart]).all(), (
            f"{what} sequences_scores are not the sums along their beams over length ** {length_penalty}: "
            f"off by {error[~apart].tolist()} (fp32 rounding {rounding[~apart].tolist()})"
        )
    if apart.any():
        s, p = stock.sequences_scores.double()[apart], paged.sequences_scores.double()[apart]
        same = (s == p) | ((s - p).abs() <= (lengths[apart] + 1).double() * eps * s.abs())
        assert same.all(), f"paged sequences_scores of beams outside the sum rule: {p.tolist()}, stock {s.tolist()}"


def assert_generate_floats(model, stock, paged, seed=None, **kwargs) -> None:
    """Scores and logits of a return_dict_in_generate call, paged vs stock, against fp64.

    - `logits` of greedy / sampling calls: against the fp64 model teacher-forced on the tokens
      both calls chose (exact for any seed: no fp64 generation has to follow fp32's choices).
    - `scores` of greedy / sampling and the per-step floats of beam search: against an fp64
      generate() with the same seed, at the steps where fp64 chose the same tokens (all steps,
      for beams, when its sequences and beam indices are stock's; else the first step only).
    - beam search's scores and logits along the returned beams at the steps the fp64 generate()
      did not check (it chose other beams), and `sequences_scores` (`assert_beam_floats`): every
      step is checked once.
    """
    if not float_outputs(stock):
        return
    model64 = fp64_twin(model)
    inputs = {k: v for k, v in kwargs.items() if k in SOURCE_INPUTS}
    beams = (kwargs.get("num_beams") or model.generation_config.num_beams or 1) > 1
    if getattr(stock, "logits", None) is not None and not beams:
        # the last steps: a user's decoder prompt comes first in the sequences
        ref = teacher_forced_logits(model64, stock.sequences, **inputs)[:, -len(stock.logits):]
        assert_within_stock_error(paged.logits, stock.logits, ref.unbind(1), "logits")
    if seed is not None:
        torch.manual_seed(seed)
    ref = model64.generate(**in_float64({k: v for k, v in kwargs.items() if k != "streamer"}))
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
        assert_beam_floats(model64, stock, paged, config.length_penalty, from_step=steps, **inputs)


def _agreeing_steps(stock, ref, beams: bool) -> int:
    """Steps at whose start fp64 and stock fp32 hold the same decoder rows."""
    a, r = stock.sequences, ref.sequences
    steps = len(stock.scores if stock.scores is not None else stock.logits)
    if beams:
        same = a.shape == r.shape and torch.equal(a, r)
        if same and getattr(stock, "beam_indices", None) is not None:
            same = torch.equal(stock.beam_indices, ref.beam_indices)
        return steps if same else 1
    prompt = a.shape[1] - steps  # the start token, or a user's decoder prompt
    n = min(a.shape[1], r.shape[1])
    differs = (a[:, :n] != r[:, :n]).any(0).nonzero()
    first = int(differs[0]) if len(differs) else n
    return first - prompt + 1  # step t's scores depend on tokens 0 .. prompt - 1 + t


def float_outputs(out) -> dict:
    """name -> tensor or tuple of tensors, for every float output of a generate() call."""
    if isinstance(out, torch.Tensor):
        return {}
    return {k: v for k, v in out.items()
            if k in ("scores", "logits", "sequences_scores") and v is not None}


def assert_exact_in_float64(model, seed=None, expect_paged=True, config=CONFIG, stock_may_raise=False,
                            **kwargs):
    """Stock and paged generate() on a float64 copy of `model`: same tokens, and the float outputs
    equal up to their float32 cast (HF casts the logits to float32: values that agree to ~1e-15
    may round to neighbouring float32 numbers, one ulp apart). `stock_may_raise`: if stock HF
    raises, the patched call must raise the same (type and message). Returns (stock, paged)."""
    model64 = fp64_twin(model)
    stock, paged = stock_and_paged(model64, config=config, seed=seed, expect_paged=expect_paged,
                                   stock_may_raise=stock_may_raise, **in_float64(kwargs))
    if isinstance(stock, Exception) or isinstance(paged, Exception):
        assert type(paged) is type(stock) and str(paged) == str(stock), f"stock HF: {stock!r}\npaged: {paged!r}"
        return stock, paged
    assert_same_tokens(stock, paged)
    floats_a, floats_b = float_outputs(stock), float_outputs(paged)
    assert floats_a.keys() == floats_b.keys()
    for name, a in floats_a.items():
        b = floats_b[name]
        for t, (x, y) in enumerate(zip(*(v if isinstance(v, tuple) else (v,) for v in (a, b)))):
            eps = torch.finfo(x.dtype).eps
            torch.testing.assert_close(y, x, rtol=2 * eps, atol=0.0, equal_nan=True, msg=lambda m: f"{name}[{t}]: {m}")
    return stock, paged


def beam_hypotheses_tie(model, stock, paged, kwargs) -> bool:
    """Whether a beam search's differing rows are hypotheses of one score: for each row whose tokens
    differ, the fp64 score of paged's hypothesis (teacher-forced along its own tokens, HF's length
    penalty) is within twice stock fp32's own error on that row (its `sequences_scores` against
    the fp64 score of its hypothesis) of stock's hypothesis' fp64 score. Fp32 rounds a saturated
    softmax to exact ties (log-probs of 0.0) that its top-k then breaks by position: stock and
    paged, a rounding apart elsewhere, may keep different ones of equally scored beams.

    For plain beam search (log-softmax scores, processors that only mask); False otherwise."""
    if (kwargs.get("num_beams") or 1) == 1 or kwargs.get("do_sample") or getattr(stock, "sequences_scores", None) is None:
        return False
    if any(k in kwargs for k in ("temperature", "repetition_penalty", "logits_processor", "decoder_input_ids")):
        return False
    a, b = stock.sequences, paged.sequences
    if a.shape != b.shape:
        return False
    config = model._prepare_generation_config(None, **kwargs)[0]
    model64 = fp64_twin(model)
    inputs = {k: v for k, v in kwargs.items() if k in SOURCE_INPUTS}

    def scores64(sequences):
        logp = torch.log_softmax(teacher_forced_logits(model64, sequences, **inputs), dim=-1)
        tokens = sequences[:, 1:]
        chosen = logp.gather(2, tokens[..., None]).squeeze(-1)
        eos = set(torch.as_tensor(config.eos_token_id).reshape(-1).tolist()) if config.eos_token_id is not None else set()
        out = []
        for row, toks in enumerate(tokens.tolist()):
            n = next((i + 1 for i, t in enumerate(toks) if t in eos), len(toks))
            out.append(chosen[row, :n].sum().item() / n ** config.length_penalty)
        return torch.tensor(out, dtype=torch.float64)

    s64, p64 = scores64(a), scores64(b)
    error = (stock.sequences_scores.double().cpu() - s64).abs()
    rows = (a != b).any(1).cpu()
    return bool(((p64 - s64).abs()[rows] <= 2 * error[rows]).all())


def fp32_agrees_with_fp64(model, stock, seed, kwargs) -> bool:
    """Whether stock fp32 generate() picked the tokens an fp64 copy picks (same seed)."""
    if seed is not None:
        torch.manual_seed(seed)
    ref = fp64_twin(model).generate(**in_float64(kwargs))
    a, r = sequences_of(stock), sequences_of(ref)
    return a.shape == r.shape and torch.equal(a, r)
