"""Every generation option the paged path serves gives stock HF's answer on it.

`hf/policy.py`'s `SERVED_OPTIONS` lists the `GenerationConfig` fields a call may set and still be
served: the paged forward gives the logits and HF's own processors, warpers, stopping criteria
and output assembly do the rest. Here each of them is set (to a value that changes the output
where it can) in the modes it acts in, on the CPU backend that `backend="auto"` picks there, and
compared with stock HF (`oracle.compare_with_stock`: tokens equal, scores and logits within
stock's own fp32 error against fp64); the call must run on the pool. An option a future release
adds to `SERVED_OPTIONS` fails `test_every_served_option_has_a_case` until it has a case here.
Where stock HF raises for a setting, the patched call must raise the same.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from conftest import make_batch, make_model
from oracle import BACKENDS, assert_exact_in_float64, case_seed, compare_with_stock, stock_copy
from transformers import CompileConfig, WatermarkingConfig

import hf_paged_t5 as hp
from hf_paged_t5.hf.policy import SERVED_OPTIONS

MODES = {
    "greedy": {},
    "beam": dict(num_beams=3, num_return_sequences=2),
    "sample": dict(do_sample=True, top_k=0),
    "beam_sample": dict(do_sample=True, num_beams=2, top_k=0),
}
SEARCH, SAMPLING, ALL = ("greedy", "beam"), ("sample", "beam_sample"), tuple(MODES)


def _allowed(batch: int, ids: torch.Tensor) -> list[int]:
    """prefix_allowed_tokens_fn: a window of tokens that moves with the last one."""
    first = 2 + int(ids[-1]) % 40
    return list(range(first, first + 12))


# option -> (the kwargs that set it, the modes it is checked in). Options that only size or shape
# the call (lengths, beams, ids, outputs) are set to values other than the defaults.
CASES = {
    "max_length": (dict(max_length=6, max_new_tokens=None), SEARCH),
    "max_new_tokens": (dict(max_new_tokens=5), ("greedy",)),
    "min_length": (dict(min_length=7), SEARCH),
    "min_new_tokens": (dict(min_new_tokens=6), ("greedy", "beam_sample")),
    "early_stopping": (dict(early_stopping="never", length_penalty=1.5), ("beam",)),
    "max_time": (dict(max_time=600.0), ("greedy",)),  # a limit the call never reaches
    "do_sample": (dict(do_sample=True), ("sample",)),
    "num_beams": (dict(num_beams=4), ("greedy",)),
    "use_cache": (dict(use_cache=True), ("greedy",)),
    "temperature": (dict(temperature=0.7), SAMPLING),
    "top_k": (dict(top_k=5), SAMPLING),
    "top_p": (dict(top_p=0.6), SAMPLING),
    "min_p": (dict(min_p=0.05), SAMPLING),
    "typical_p": (dict(typical_p=0.5), SAMPLING),
    "epsilon_cutoff": (dict(epsilon_cutoff=0.002), SAMPLING),
    "eta_cutoff": (dict(eta_cutoff=0.002), SAMPLING),
    "top_h": (dict(top_h=0.5), SAMPLING),
    "repetition_penalty": (dict(repetition_penalty=1.8), ALL),
    "encoder_repetition_penalty": (dict(encoder_repetition_penalty=1.5), SEARCH),
    "length_penalty": (dict(length_penalty=-0.5), ("beam",)),
    "no_repeat_ngram_size": (dict(no_repeat_ngram_size=2), ALL),
    "encoder_no_repeat_ngram_size": (dict(encoder_no_repeat_ngram_size=2), SEARCH),
    "bad_words_ids": (dict(bad_words_ids=[[5], [6, 7], [8, 9, 10]]), SEARCH),
    "renormalize_logits": (dict(renormalize_logits=True, repetition_penalty=1.5), ALL),
    "forced_bos_token_id": (dict(forced_bos_token_id=7), SEARCH),
    "forced_eos_token_id": (dict(forced_eos_token_id=1, max_new_tokens=5), SEARCH),
    "remove_invalid_values": (dict(remove_invalid_values=True), SEARCH),
    "exponential_decay_length_penalty": (dict(exponential_decay_length_penalty=(2, 1.6)), SEARCH),
    "suppress_tokens": (dict(suppress_tokens=[5, 6, 7, 8, 9, 10]), SEARCH + ("sample",)),
    "begin_suppress_tokens": (dict(begin_suppress_tokens=[1, 5, 6, 7]), SEARCH),
    "sequence_bias": (dict(sequence_bias={(5,): 4.0, (6, 7): -3.0}), SEARCH),
    "num_return_sequences": (dict(num_return_sequences=3), ("sample", "beam")),
    "output_scores": (dict(output_scores=True, output_logits=False), ("greedy", "beam")),
    "output_logits": (dict(output_scores=False, output_logits=True), ("greedy", "beam")),
    "return_dict_in_generate": (dict(return_dict_in_generate=False, output_scores=False, output_logits=False),
                                ("greedy", "beam")),
    "pad_token_id": (dict(pad_token_id=3, eos_token_id=[1, 4]), SEARCH),
    "bos_token_id": (dict(bos_token_id=5), ("greedy",)),
    "eos_token_id": (dict(eos_token_id=[1, 4, 9]), SEARCH),
    "decoder_start_token_id": (dict(decoder_start_token_id=4), SEARCH),
    "is_assistant": (dict(is_assistant=True), ("greedy",)),
    "compile_config": (dict(compile_config=CompileConfig(fullgraph=False)), ("greedy",)),
    "disable_compile": (dict(disable_compile=True), ("greedy",)),
    "diversity_penalty": (dict(diversity_penalty=0.5), ("beam",)),  # acts only with num_beam_groups
    "low_memory": (dict(low_memory=True), ("greedy", "beam")),  # stock raises for beams
    "watermarking_config": (dict(watermarking_config=WatermarkingConfig(bias=2.5, seeding_scheme="selfhash")), ALL),
    "guidance_scale": (dict(guidance_scale=1.5), ("greedy",)),  # stock raises for encoder-decoders
    "stop_strings": (None, ()),  # needs a tokenizer: test_contract_api.py::test_stop_strings_with_tokenizer
}
# generate() kwargs beside the config that no other test sets
KWARG_CASES = {
    "prefix_allowed_tokens_fn": (dict(prefix_allowed_tokens_fn=_allowed), ALL),
}
OUTPUTS = dict(return_dict_in_generate=True, output_scores=True, output_logits=True)


@pytest.fixture(scope="module")
def models():
    """(patched model, stock copy): one t5 layout for every case (the options act on the logits)."""
    model = make_model("t5", seed=case_seed("options"))
    stock = stock_copy(model)
    hp.patch_model(model, BACKENDS["cpu"])
    return model, stock


def _params(cases):
    return [pytest.param(option, mode, id=f"{option}-{mode}") for option, (kw, modes) in cases.items()
            if kw is not None for mode in modes]


def _compare_served(model, stock, monkeypatch, seed, **kwargs):
    """compare_with_stock on the module's patched model, and this call ran on the paged path: a
    patched model's pool outlives its calls, so a fallback is told by the reason it logs."""
    reasons = []
    monkeypatch.setattr(model._hf_paged_t5, "warn_once", lambda reason, what=None: reasons.append(reason))
    stock_out, _ = compare_with_stock(model, seed=seed, stock_model=stock, stock_may_raise=True, **kwargs)
    if not isinstance(stock_out, Exception):
        assert reasons == [], f"fell back to stock HF: {reasons}"


def _check(models, monkeypatch, option, mode, kwargs):
    model, stock = models
    ids, mask = make_batch([9, 4, 13], padding_side="left" if len(option) % 2 else "right",
                           seed=case_seed(option, mode))
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=8, **OUTPUTS, **MODES[mode])
    kw.update(kwargs)
    kw = {k: v for k, v in kw.items() if v is not None}
    _compare_served(model, stock, monkeypatch, case_seed(option, mode, "rng"), **kw)


@pytest.mark.parametrize("option,mode", _params(CASES))
def test_served_option_matches_stock(models, monkeypatch, option, mode):
    _check(models, monkeypatch, option, mode, CASES[option][0])


@pytest.mark.parametrize("option,mode", _params(KWARG_CASES))
def test_served_kwarg_matches_stock(models, monkeypatch, option, mode):
    _check(models, monkeypatch, option, mode, KWARG_CASES[option][0])


@pytest.mark.parametrize("mode", ALL)
def test_inputs_embeds_match_stock(models, monkeypatch, mode):
    """inputs_embeds in place of input_ids: the encoder embeds nothing itself."""
    model, stock = models
    ids, mask = make_batch([9, 4, 13], seed=case_seed("embeds", mode))
    embeds = stock.get_input_embeddings()(ids).detach() * 0.5  # not the table's own rows
    kw = dict(inputs_embeds=embeds, attention_mask=mask, max_new_tokens=8, **OUTPUTS, **MODES[mode])
    _compare_served(model, stock, monkeypatch, case_seed("embeds", mode, "rng"), **kw)


def test_every_served_option_has_a_case():
    assert set(CASES) == set(SERVED_OPTIONS), (
        f"served without a case here: {sorted(set(SERVED_OPTIONS) - set(CASES))}; "
        f"cases of options no longer served: {sorted(set(CASES) - set(SERVED_OPTIONS))}"
    )


class _Recorder:
    """A streamer that keeps what it is given."""

    def __init__(self) -> None:
        self.seen = []

    def put(self, value) -> None:
        self.seen.append(value.tolist())

    def end(self) -> None:
        self.seen.append("end")


@pytest.mark.parametrize("mode", ALL)
def test_streamer_gets_what_stock_gives_it(models, mode):
    """A streamer in each mode: the same puts as stock HF's (the prompt, then one token per row a
    step; nothing for beam sampling, which stock does not stream), or stock's error (beam search)."""
    model, stock = models
    ids, mask = make_batch([9, 4, 13], seed=case_seed("streamer", mode))
    runs = []
    for m in (stock, model):
        recorder = _Recorder()
        torch.manual_seed(case_seed("streamer", mode, "rng"))
        try:
            out = m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, streamer=recorder, **MODES[mode])
        except ValueError as exc:
            out = str(exc)
        runs.append((out if isinstance(out, str) else out.tolist(), recorder.seen))
    assert runs[1] == runs[0]
    if mode == "beam":
        assert "streamer` cannot be used with beam search" in runs[0][0]


# ---- options together ---------------------------------------------------------------------------
MIX_FAMILIES = ("t5", "t5v1_1", "umt5", "mt5", "inner_dim", "d_kv128")
CI_MIX_SEEDS = tuple(range(len(MIX_FAMILIES)))  # each family, both backends
SLOW_MIX_SEEDS = tuple(range(len(MIX_FAMILIES), 300))


def _mixed_options(rng: random.Random, stock, seed: int) -> dict:
    """generate() kwargs of one random call: a search mode and a random set of the processors and
    warpers HF applies over the paged logits, with token ids the model does produce."""
    rows = rng.randint(1, 4)
    ids, mask = make_batch([rng.randint(1, 14) for _ in range(rows)], padding_side=rng.choice(["left", "right"]),
                           seed=seed)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=rng.randint(1, 16))
    beams = rng.choice([1, 1, 2, 3])
    if beams > 1:
        kw.update(num_beams=beams, num_return_sequences=rng.randint(1, beams))
    if rng.random() < 0.3:
        kw.update(do_sample=True, top_k=rng.choice([0, 10, 50]))
        chances = (("top_p", 0.5, (0.5, 0.9)), ("temperature", 0.3, (0.7, 1.3)), ("typical_p", 0.2, (0.8,)),
                   ("epsilon_cutoff", 0.2, (3e-4,)))
        kw.update({name: rng.choice(values) for name, chance, values in chances if rng.random() < chance})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe = stock.generate(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10)
    tokens = sorted(set(probe[:, 1:].flatten().tolist()))  # not empty: 10 new tokens a row
    options = {
        "repetition_penalty": lambda: rng.choice([1.2, 0.8, 2.0]),
        "no_repeat_ngram_size": lambda: rng.choice([1, 2, 3]),
        "encoder_no_repeat_ngram_size": lambda: rng.choice([1, 2]),
        "encoder_repetition_penalty": lambda: 1.3,
        "bad_words_ids": lambda: [[t] for t in rng.sample(tokens, min(2, len(tokens)))],
        "suppress_tokens": lambda: rng.sample(tokens, min(2, len(tokens))),
        "begin_suppress_tokens": lambda: rng.sample(tokens, 1),
        "forced_eos_token_id": lambda: 1,
        "forced_bos_token_id": lambda: tokens[0],
        "sequence_bias": lambda: {(rng.choice(tokens),): -2.0},
        "renormalize_logits": lambda: True,
        "exponential_decay_length_penalty": lambda: (2, 1.5),
        "eos_token_id": lambda: rng.sample(tokens, min(len(tokens), rng.randint(1, 2))),
        "min_new_tokens": lambda: rng.randint(1, 6),
    }
    kw.update({name: value() for name, value in options.items() if rng.random() < 0.25})
    if rng.random() < 0.3:
        kw.update(return_dict_in_generate=True, output_scores=True, output_logits=rng.random() < 0.5)
    if beams > 1:
        kw.update({k: rng.choice(v) for k, v in (("length_penalty", (0.0, -0.7, 0.6, 2.0)),
                                                 ("early_stopping", (True, False, "never"))) if rng.random() < 0.5})
    # a decoder prompt (not UMT5: transformers 5.17's UMT5 decoder lets a prompt's tokens attend to
    # later ones, tests/test_soak.py), a total length in place of new tokens, another pad id
    if type(stock).__name__ != "UMT5ForConditionalGeneration" and rng.random() < 0.3:
        prompt = torch.randint(2, 300, (rows, rng.randint(1, 6)), generator=torch.Generator().manual_seed(seed))
        if rng.random() < 0.5:
            prompt[:, 0] = 0
        kw["decoder_input_ids"] = prompt
    if rng.random() < 0.3:
        kw["max_length"] = kw.pop("max_new_tokens") + (kw["decoder_input_ids"].shape[1] if "decoder_input_ids" in kw else 1)
    if rng.random() < 0.2:
        kw["pad_token_id"] = rng.choice([0, 3, 1])
    return kw


@pytest.mark.parametrize("seed", [*CI_MIX_SEEDS, *(pytest.param(s, marks=pytest.mark.slow) for s in SLOW_MIX_SEEDS)])
def test_random_option_mix(monkeypatch, seed):
    """Eight random calls per case, each with a random set of the options HF applies over the
    paged logits (penalties, n-gram and word bans, forced and suppressed tokens, warpers, EOS
    ids, min lengths) in a random search mode, with decoder prompts, total lengths and pad ids,
    on a model of the case's family with its block size and backend: in float64
    (`assert_exact_in_float64`), stock HF's tokens and its scores and logits up to their float32
    cast, or stock's error (options it refuses together). (In float32 the paged path's other
    summation order moves scores by stock's own rounding error, and where a rescaling processor
    sits between two beams a rounding apart, no float32 oracle can tell such a near tie from a
    wrong choice.)"""
    from hf_paged_t5.hf import generate as paged_generate

    paged_runs = []
    real = paged_generate._paged_generate
    monkeypatch.setattr(paged_generate, "_paged_generate", lambda *a, **k: paged_runs.append(1) or real(*a, **k))
    rng = random.Random(case_seed("option mix", seed))
    model = make_model(MIX_FAMILIES[seed % len(MIX_FAMILIES)], seed=case_seed("option mix", seed))
    backend = BACKENDS[("reference", "cpu")[seed % 2]].backend
    config = hp.PagedCacheConfig(block_size=rng.choice([1, 4, 16]), backend=backend)
    answered = 0
    for call in range(8):
        call_seed = case_seed("option mix", seed, call)
        kw = _mixed_options(rng, model, call_seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stock, _ = assert_exact_in_float64(model, seed=call_seed, expect_paged=None, config=config,
                                               stock_may_raise=True, **kw)
        answered += not isinstance(stock, Exception)
    assert len(paged_runs) >= answered  # every call stock answers ran on the paged path (no fallback)


def test_beams_a_forced_first_token_leaves_behind():
    """A forced first token in a one-token beam search that returns every beam: only the first
    beam is live at the start, the others carry HF's -1e9 start penalty on the forced token (their
    `sequences_scores` are no sum of their chosen scores); the oracle holds paged's to stock's
    there, and to the sum rule on the first beam."""
    seed = case_seed("forced first token, every beam")
    model = make_model("t5", seed=seed)
    ids, mask = make_batch([9, 4], seed=seed)
    stock, paged = compare_with_stock(model, BACKENDS["cpu"], seed=seed, input_ids=ids, attention_mask=mask,
                                      max_new_tokens=1, num_beams=3, num_return_sequences=3, forced_bos_token_id=7,
                                      return_dict_in_generate=True, output_scores=True)
    # premise: each source's first beam took the forced token; the others kept the penalty (on the
    # forced token) or hold a masked choice (-inf: another token than the forced one)
    assert (stock.sequences.view(2, 3, -1)[:, 0, 1] == 7).all()
    assert (stock.sequences_scores.view(2, 3)[:, 1:] < -1e8).all()
