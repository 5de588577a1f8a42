"""The drop-in contract beyond generate()'s tokens: what HF's users and HF's own code read of a model.

Signatures, encoder models and their output flags, the output scale per class, weights edited in
place, stop strings, precomputed encoder outputs, generate() with no inputs, the returned cache,
copies and pickles, Seq2SeqTrainer, and projections that are not plain Linear layers (LoRA,
hooks). Each compares with stock HF on the same weights (tests/oracle.py).
"""

from __future__ import annotations

import copy
import inspect
import io
import logging

import pytest
import torch
from conftest import make_batch, make_model
from oracle import CONFIG, assert_same_tokens, assert_within_stock_error, case_seed, compare_with_stock, fp64_twin
from transformers import MT5EncoderModel, T5EncoderModel, UMT5EncoderModel
from transformers.cache_utils import EncoderDecoderCache
from transformers.modeling_outputs import BaseModelOutput

import hf_paged_t5 as hp
from hf_paged_t5 import tiny
from hf_paged_t5.model.probe import output_scale

ENCODERS = {"t5": T5EncoderModel, "mt5": MT5EncoderModel, "umt5": UMT5EncoderModel}


def _encoder_model(family, seed, **config):
    """An encoder-only model of `family` with the weights of make_model's; `config` is set on the
    config before the model is built (as HF's tests set output flags)."""
    seq2seq = make_model("t5v1_1" if family == "t5" else family, seed=seed)
    model_config = copy.deepcopy(seq2seq.config)
    if config.get("output_attentions"):
        model_config._attn_implementation = "eager"  # HF returns attention weights from eager attention only
    for key, value in config.items():
        setattr(model_config, key, value)
    model = ENCODERS[family](model_config).eval()
    model.load_state_dict(seq2seq.state_dict(), strict=False)
    return model


def _patched(model):
    return hp.patch_model(model, CONFIG)


# ---- what HF reads of the model ------------------------------------------------------------
def test_patched_methods_keep_their_signatures():
    model = make_model("t5", seed=case_seed("signature"))
    stock = {name: inspect.signature(getattr(model, name)) for name in ("forward", "generate")}
    stock_encoder = inspect.signature(model.encoder.forward)
    _patched(model)
    assert {name: inspect.signature(getattr(model, name)) for name in ("forward", "generate")} == stock
    assert inspect.signature(model.encoder.forward) == stock_encoder
    assert model.forward.__name__ == "forward" and model.generate.__doc__ == type(model).generate.__doc__


@pytest.mark.parametrize("family,tie", [("t5", True), ("t5", False), ("mt5", True), ("mt5", False),
                                        ("umt5", True), ("umt5", False)])
def test_output_scale_is_what_the_class_does(family, tie):
    """mT5's config forces tie_word_embeddings=True, but MT5ForConditionalGeneration never rescales:
    the scale is read from the class's forward, and the patched logits are the class's."""
    model = make_model(family, seed=case_seed("scale", family, tie), tie_word_embeddings=tie)
    ids, mask = make_batch([6, 3], seed=case_seed("scale", family, tie))
    dec = torch.zeros(2, 1, dtype=torch.long)
    stock = model(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
    hidden = model.decoder(input_ids=dec, encoder_hidden_states=model.encoder(ids, mask)[0],
                           encoder_attention_mask=mask)[0]
    unscaled = model.lm_head(hidden)
    scale = output_scale(model)
    expected = unscaled if scale is None else model.lm_head(hidden * scale)
    torch.testing.assert_close(stock, expected, rtol=0, atol=0)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, output_logits=True, return_dict_in_generate=True)
    stock_out, paged_out = compare_with_stock(model, **kw)  # logits within stock's fp32 error
    ratio = (paged_out.logits[0] / stock_out.logits[0]).median()
    assert abs(float(ratio) - 1) < 1e-3, f"paged logits are {float(ratio):.4f}x stock's"


# ---- encoder models and the output flags HF reads from the config --------------------------
@pytest.mark.parametrize("family", list(ENCODERS))
def test_encoder_model_matches_stock(family):
    seed = case_seed("encoder", family)
    model = _encoder_model(family, seed)
    ids, mask = make_batch([11, 5, 8], padding_side="left" if seed % 2 else "right", seed=seed)
    with torch.no_grad():  # with autograd on, the encoder is stock HF's (the kernels have no backward)
        stock = model(input_ids=ids, attention_mask=mask).last_hidden_state
        ref = fp64_twin(model)(input_ids=ids, attention_mask=mask).last_hidden_state
        paged = _patched(model)(input_ids=ids, attention_mask=mask).last_hidden_state
    real = mask.bool()
    assert_within_stock_error(paged[real], stock[real], ref[real], "last_hidden_state")
    # the paged encoder ran: it leaves padded positions at zero (stock HF: values no one reads; README)
    assert torch.equal(paged[~real], torch.zeros_like(paged[~real]))


def test_encoder_stack_returns_stocks_output_class():
    """The same output type on the paged path as on stock (a torch.compile'd generate() whose calls
    mix both, e.g. a mask with a hole in one batch only, would otherwise recompile)."""
    model = make_model("t5", seed=case_seed("output class"))
    ids, mask = make_batch([6, 4])
    with torch.no_grad():
        stock = model.encoder(input_ids=ids, attention_mask=mask)
        paged = _patched(model).encoder(input_ids=ids, attention_mask=mask)
    assert type(paged) is type(stock)
    assert not paged.last_hidden_state[~mask.bool()].any(), "the paged encoder ran"


@pytest.mark.parametrize("family", list(ENCODERS))
@pytest.mark.parametrize("flag", ["output_hidden_states", "output_attentions"])
@pytest.mark.parametrize("where", ["config", "call"])
def test_encoder_output_flags_match_stock(family, flag, where):
    """A flag set on the config (not passed) is read as HF reads it: the call runs stock HF."""
    seed = case_seed("flags", family, flag, where)
    model = _encoder_model(family, seed, **({flag: True} if where == "config" else {}))
    if flag == "output_attentions":
        model.set_attn_implementation("eager")  # HF returns attention weights from eager attention only
    ids, mask = make_batch([7, 4], seed=seed)
    kwargs = {} if where == "config" else {flag: True}
    with torch.no_grad():
        stock = model(input_ids=ids, attention_mask=mask, **kwargs)
        paged = _patched(model)(input_ids=ids, attention_mask=mask, **kwargs)
    name = flag.removeprefix("output_")
    assert getattr(stock, name) is not None and len(getattr(paged, name)) == len(getattr(stock, name))
    for a, b in zip(getattr(stock, name), getattr(paged, name)):
        assert torch.equal(a, b)


def test_encoder_return_dict_from_config():
    model = _encoder_model("t5", case_seed("return_dict"))
    model.config.return_dict = False
    ids, mask = make_batch([5, 3])
    with torch.no_grad():
        stock = model(input_ids=ids, attention_mask=mask)
        paged = _patched(model)(input_ids=ids, attention_mask=mask)
    assert type(stock) is type(paged) is tuple and len(stock) == len(paged) == 1
    torch.testing.assert_close(paged[0][mask.bool()], stock[0][mask.bool()])
    assert not paged[0][~mask.bool()].any(), "the paged encoder ran (padded positions are zeros)"


def test_generate_with_config_output_flags():
    """model.config.output_hidden_states set after loading: generate()'s outputs stay stock's."""
    seed = case_seed("config flags generate")
    model = make_model("t5", seed=seed)
    model.config.output_hidden_states = True
    model.encoder.config.output_hidden_states = True
    ids, mask = make_batch([8, 6], seed=seed)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, return_dict_in_generate=True, output_scores=True)
    stock, paged = compare_with_stock(model, float64=True, **kw)
    assert set(stock.keys()) == set(paged.keys())


# ---- weights changed by the user -------------------------------------------------------------
@pytest.mark.parametrize("family", ["t5", "umt5"])
@pytest.mark.parametrize("how", ["data", "copy_", "assign"])
def test_bias_weight_edited_after_a_call(family, how):
    """A cached bias table must notice a change through .data (no version bump), in place, or a new Parameter."""
    seed = case_seed("bias edit", family, how)
    model = make_model(family, seed=seed)
    ids, mask = make_batch([10, 7], seed=seed)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, output_logits=True, return_dict_in_generate=True)
    _patched(model).generate(**kw)
    for stack in (model.encoder, model.decoder):
        bias = stack.block[0].layer[0].SelfAttention.relative_attention_bias
        new = torch.randn_like(bias.weight) * 2
        if how == "data":
            bias.weight.data.copy_(new)
        elif how == "copy_":
            with torch.no_grad():
                bias.weight.copy_(new)
        else:
            bias.weight = torch.nn.Parameter(new)
    compare_with_stock(model, **kw)  # patched: stock HF on an unpatched copy of the edited weights


# ---- generate() arguments that stock HF serves -----------------------------------------------
def test_stop_strings_with_tokenizer():
    tok = tiny.build_tokenizer()
    model = tiny.build_model("tiny", vocab_size=len(tok), seed=case_seed("stop strings"))
    enc = tok(list(tiny.CORPUS[:1]), return_tensors="pt")
    probe = model.generate(**enc, max_new_tokens=12)
    stop = tok.decode(probe[0, 3:5])  # a string the model does produce
    kw = dict(**enc, max_new_tokens=12, stop_strings=[stop], tokenizer=tok)
    stock, _ = compare_with_stock(model, **kw)
    assert stock.shape[1] < probe.shape[1], f"the stop string {stop!r} ended the call early"


def test_precomputed_encoder_outputs():
    seed = case_seed("encoder_outputs")
    model = make_model("t5", seed=seed)
    ids, mask = make_batch([9, 5], seed=seed)
    encoder_outputs = model.get_encoder()(input_ids=ids, attention_mask=mask)
    kw = dict(encoder_outputs=BaseModelOutput(last_hidden_state=encoder_outputs.last_hidden_state),
              attention_mask=mask, max_new_tokens=6)
    compare_with_stock(model, expect_paged=False, **kw)


def test_generate_without_inputs():
    """HF starts the encoder from one BOS token."""
    model = make_model("t5", seed=case_seed("no inputs"), bos_token_id=5)
    compare_with_stock(model, max_new_tokens=6)
    model.config.bos_token_id = model.generation_config.bos_token_id = None
    with pytest.raises(ValueError, match="bos_token_id"):
        _patched(model).generate(max_new_tokens=6)


def test_labels_are_ignored_as_stock_ignores_them():
    seed = case_seed("labels")
    model = make_model("t5", seed=seed)
    ids, mask = make_batch([6, 4], seed=seed)
    compare_with_stock(model, input_ids=ids, attention_mask=mask, labels=ids, max_new_tokens=5)


# ---- the cache handed back ------------------------------------------------------------------
@pytest.mark.parametrize("num_beams", [1, 2])
def test_returned_cache_is_hfs_and_continues(num_beams):
    seed = case_seed("returned cache", num_beams)
    model = make_model("t5", seed=seed)
    ids, mask = make_batch([9, 6], padding_side="left", seed=seed)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5, return_dict_in_generate=True,
              num_beams=num_beams)
    stock, paged = compare_with_stock(model, **kw)
    ref = fp64_twin(model).generate(**kw)
    assert_same_tokens(stock, ref)  # a well-conditioned case: the fp64 cache holds the same rows
    key = "cache" if "cache" in stock else "past_key_values"
    a, b, r = stock[key], paged[key], ref[key]
    assert isinstance(b, EncoderDecoderCache) and b.get_seq_length() == a.get_seq_length()
    real = mask.bool().repeat_interleave(num_beams, 0)[:, None, :, None]  # HF's padded cross K/V: never read

    def tensors(cache, part, masked=False):
        layers = getattr(cache, part).layers
        return [t * real if masked else t for layer in layers for t in (layer.keys, layer.values)]

    assert_within_stock_error(tensors(b, "self_attention_cache"), tensors(a, "self_attention_cache"),
                              tensors(r, "self_attention_cache"), "self-attention K/V")
    cross = [tensors(c, "cross_attention_cache", masked=True) for c in (b, a, r)]
    assert_within_stock_error(*cross, "cross-attention K/V")
    if num_beams == 1:  # continue both from their own cache: stock HF serves a given cache
        more = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=stock.sequences, max_new_tokens=3,
                    min_new_tokens=3)
        cont_stock = model.generate(**more, **{key: a})
        cont_paged = model.generate(**more, **{key: b})
        assert_same_tokens(cont_stock, cont_paged)


# ---- copies and pickles ----------------------------------------------------------------------
def test_deepcopy_gives_a_patched_copy_with_its_own_pool():
    seed = case_seed("deepcopy")
    model = make_model("t5", seed=seed)
    ids, mask = make_batch([8, 5], seed=seed)
    stock = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6)
    _patched(model).generate(input_ids=ids, attention_mask=mask, max_new_tokens=6)
    clone = copy.deepcopy(model)
    assert hp.is_patched(clone) and clone._hf_paged_t5 is not model._hf_paged_t5
    assert clone.forward.__self__ is clone and clone.encoder.forward.__self__ is clone.encoder
    assert clone._hf_paged_t5.config == model._hf_paged_t5.config
    assert torch.equal(clone.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6), stock)
    assert clone._hf_paged_t5.pool is not model._hf_paged_t5.pool
    hp.unpatch_model(clone)
    assert not any(k in clone.__dict__ for k in ("forward", "generate", "__reduce_ex__", "__deepcopy__"))


def test_torch_save_loads_an_unpatched_model():
    seed = case_seed("pickle")
    model = make_model("t5", seed=seed)
    ids, mask = make_batch([8, 5], seed=seed)
    stock = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6)
    _patched(model)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    assert not hp.is_patched(loaded)
    assert "forward" not in loaded.__dict__ and "forward" not in loaded.encoder.__dict__
    assert torch.equal(loaded.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6), stock)
    assert hp.is_patched(model), "pickling leaves the model itself patched"


def test_unpatch_then_del_frees_the_model_without_a_collection():
    """Stock HF frees a model at `del model`. A patched model's runtime is a reference cycle; after
    `unpatch_model` it holds nothing of the model (pool, graphs, tables, modules), so `del model`
    frees the weights at once, before any garbage collection, as stock's does."""
    import gc
    import weakref

    seed = case_seed("del")
    model = make_model("t5", seed=seed)
    ids, mask = make_batch([8, 5], seed=seed)
    enabled = gc.isenabled()
    gc.disable()
    try:
        hp.patch_model(model)
        with torch.no_grad():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4, num_beams=2)
            model.get_encoder()(input_ids=ids, attention_mask=mask)
        hp.unpatch_model(model)
        weight, whole = weakref.ref(model.shared.weight), weakref.ref(model)
        del model
        assert whole() is None and weight() is None
    finally:
        if enabled:
            gc.enable()


# ---- Seq2SeqTrainer -------------------------------------------------------------------------
@pytest.mark.parametrize("remove_unused_columns", [True, False])
def test_seq2seq_trainer_predict_with_generate(tmp_path, remove_unused_columns):
    from transformers import DataCollatorForSeq2Seq, Seq2SeqTrainer, Seq2SeqTrainingArguments

    tok = tiny.build_tokenizer()
    model = tiny.build_model("tiny", vocab_size=len(tok), seed=case_seed("trainer"))
    texts = list(tiny.CORPUS[:10])
    data = [{**tok("summarize: " + t), "labels": tok(t[:30])["input_ids"]} for t in texts]

    def predict(m):
        args = Seq2SeqTrainingArguments(
            output_dir=str(tmp_path), per_device_eval_batch_size=4, predict_with_generate=True,
            generation_max_length=12, generation_num_beams=2, report_to=[], use_cpu=True,
            remove_unused_columns=remove_unused_columns,
        )
        trainer = Seq2SeqTrainer(model=m, args=args, data_collator=DataCollatorForSeq2Seq(tok, model=m),
                                 processing_class=tok)
        return trainer.predict(data)

    stock = predict(model)
    patched = _patched(copy.deepcopy(model))
    paged = predict(patched)
    assert patched._hf_paged_t5.pool is not None, "generation ran on the paged path"
    assert (stock.predictions == paged.predictions).all()
    assert stock.metrics["test_loss"] == pytest.approx(paged.metrics["test_loss"], rel=1e-5)


# ---- projections that are not plain Linear layers -------------------------------------------
class _Shifted(torch.nn.Module):
    """A projection that is not an nn.Linear: the base layer plus a low-rank delta (like LoRA)."""

    def __init__(self, base: torch.nn.Linear, rank: int = 2) -> None:
        super().__init__()
        self.base = base
        self.down = torch.nn.Linear(base.in_features, rank, bias=False)
        self.up = torch.nn.Linear(rank, base.out_features, bias=False)
        torch.nn.init.normal_(self.up.weight, std=0.5)

    @property
    def weight(self):
        return self.base.weight

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def _wrap_projections(model):
    for stack in (model.encoder, model.decoder):
        for block in stack.block:
            for layer in block.layer[:-1]:
                attn = getattr(layer, "SelfAttention", None) or layer.EncDecAttention
                for name in ("q", "k", "v", "o"):
                    setattr(attn, name, _Shifted(getattr(attn, name)))
    model.lm_head = _Shifted(model.lm_head)


def test_non_linear_projections_run_their_own_forward():
    seed = case_seed("wrapped projections")
    model = make_model("t5v1_1", seed=seed)
    torch.manual_seed(seed)
    _wrap_projections(model)
    ids, mask = make_batch([9, 6], seed=seed)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, num_beams=2, output_logits=True,
              return_dict_in_generate=True)
    compare_with_stock(model, float64=True, **kw)


def test_forward_hooks_on_plain_linears_run():
    """A forward hook on a plain Linear (a user's, a quantizer's) runs as in stock HF."""
    seed = case_seed("hooks")
    model = make_model("t5", seed=seed)
    ids, mask = make_batch([7, 4], seed=seed)
    calls = []

    def hook(module, args, output):
        calls.append(1)
        return output * 1.5

    model.decoder.block[0].layer[0].SelfAttention.q.register_forward_hook(hook)
    model.lm_head.register_forward_hook(hook)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, output_logits=True, return_dict_in_generate=True)
    compare_with_stock(model, float64=True, **kw)
    assert calls


def _hook_runs(model, name: str, call) -> tuple[int, object]:
    """(how often a forward hook on `model`'s module `name` ran during `call()`, its result)."""
    runs = []
    handle = model.get_submodule(name).register_forward_hook(lambda *_: runs.append(1))
    try:
        out = call()
    finally:
        handle.remove()
    return len(runs), out


def _no_grad_encoder(model, ids, mask) -> torch.Tensor:
    with torch.no_grad():  # (with autograd the encoder runs on stock HF anyway)
        return model.get_encoder()(input_ids=ids, attention_mask=mask)[0]


# The modules whose hooks the paged path runs by calling them (`packing._CALLED`; the encoder stack,
# whose forward is the patched one, and its feed-forward modules): a hook on one of them keeps
# the call paged; a hook anywhere else sends it to stock HF.
_CALLED_SLOTS = ("q", "k", "v", "o", "wi", "wi_0", "wi_1", "wo", "layer_norm", "final_layer_norm", "embed_tokens",
                 "shared", "lm_head", "dropout")


@pytest.mark.parametrize("family", ["t5", "t5v1_1", "umt5"])
def test_a_hook_on_any_module_runs_as_in_stock(family, monkeypatch):
    """A forward hook on each module of the model in turn: where stock HF's generate() or encoder
    runs it, the patched call runs it too, with stock's tokens. A hook on a module the paged path
    does not call (a block, a sub-layer, an attention or feed-forward module, a bias embedding, the
    decoder stack) sends the call to stock HF with a logged reason; one on a projection, a norm, a
    dropout, an embedding or an encoder feed-forward keeps it paged."""
    seed = case_seed("hook on any module", family)
    model = make_model(family, seed=seed)
    stock = copy.deepcopy(model)
    hp.patch_model(model, CONFIG)
    ids, mask = make_batch([7, 4], seed=seed)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, num_beams=2)
    reasons = []
    monkeypatch.setattr(model._hf_paged_t5, "warn_once", lambda reason, what=None: reasons.append(reason))
    for name, _ in stock.named_modules():
        if not name:
            continue
        for what, call in (("generate", lambda m: m.generate(**kw)),
                           ("encoder", lambda m: _no_grad_encoder(m, ids, mask))):
            ran_stock, want = _hook_runs(stock, name, lambda: call(stock))
            reasons.clear()
            ran_paged, got = _hook_runs(model, name, lambda: call(model))
            assert bool(ran_paged) == bool(ran_stock), f"{what}: a hook on {name} ran {ran_paged} times, stock {ran_stock}"
            if what == "generate":
                assert torch.equal(got, want), f"a hook on {name}: other tokens than stock's"
            else:  # (the paged encoder leaves padded positions at 0; nothing reads them)
                torch.testing.assert_close(got * mask[..., None], want * mask[..., None])
            slot = name.rsplit(".", 1)[-1]
            in_decoder_ff = name.startswith("decoder.") and ".DenseReluDense." in name  # only its projections
            called = (name == "encoder" or (name.startswith("encoder.") and "DenseReluDense" in name)
                      or (slot in _CALLED_SLOTS and not (in_decoder_ff and slot == "dropout")))
            if called:
                assert not any("hook" in r for r in reasons), f"{what}: a hook on {name} sent the call to stock HF"
            elif ran_stock:
                assert any(name in r for r in reasons), f"{what}: a hook on {name} ran without a logged fallback"
    assert model._hf_paged_t5.pool.is_idle()


@pytest.mark.parametrize("mode", ["greedy", "beam", "sample", "dict"])
def test_a_hook_on_the_model_runs_once_a_step(mode, monkeypatch):
    """A forward hook on the model itself, which stock HF's loop calls once a step: the patched
    call runs it as often, on outputs of the same shapes, with stock's tokens, on the paged path."""
    seed = case_seed("hook on the model", mode)
    model = make_model("t5", seed=seed)
    stock = copy.deepcopy(model)
    _patched(model)
    reasons = []
    monkeypatch.setattr(model._hf_paged_t5, "warn_once", lambda reason, what=None: reasons.append(reason))
    ids, mask = make_batch([7, 4], seed=seed)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6,
              **dict(greedy={}, beam=dict(num_beams=2), sample=dict(do_sample=True),
                     dict=dict(return_dict_in_generate=True))[mode])

    def run(m):
        shapes = []
        handle = m.register_forward_hook(lambda module, args, output: shapes.append(tuple(output.logits.shape)))
        torch.manual_seed(seed)
        try:
            return m.generate(**kw), shapes
        finally:
            handle.remove()

    (want, want_shapes), (got, got_shapes) = run(stock), run(model)
    assert got_shapes == want_shapes and len(want_shapes) == 6
    assert torch.equal(got if mode != "dict" else got.sequences, want if mode != "dict" else want.sequences)
    assert reasons == [] and model._hf_paged_t5.pool is not None


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_autocast_gives_stocks_answer(backend, caplog):
    """generate() and the encoder inside torch.autocast on a float32 model (HF's ops then run in
    bfloat16, the paged kernels would not): stock HF's own result, with the reason logged once, and
    the paged path again outside it. A batch job refuses autocast. (The Triton backend, a GPU's
    default, failed there on the bfloat16 query against the float32 pool; `triton` runs the same
    kernels in Triton's interpreter here.)"""
    seed = case_seed("autocast", backend)
    model = make_model("t5", seed=seed)
    stock = copy.deepcopy(model)
    hp.patch_model(model, hp.PagedCacheConfig(block_size=8, backend=backend))
    ids, mask = make_batch([7, 4, 5], seed=seed)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, num_beams=2)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad(), caplog.at_level(logging.WARNING):
        assert torch.equal(model.generate(**kw), stock.generate(**kw))
        assert torch.equal(model.encoder(input_ids=ids, attention_mask=mask)[0],
                           stock.encoder(input_ids=ids, attention_mask=mask)[0])
        with pytest.raises(ValueError, match="BatchGenerator cannot run inside torch.autocast"):
            list(hp.BatchGenerator(model, max_new_tokens=3).generate([[5, 6, 7]]))
    assert model._hf_paged_t5.pool is None
    assert [r.getMessage() for r in caplog.records if "autocast" in r.getMessage()] == [
        "hf_paged_t5: running this generate() on stock HF: torch.autocast is served by stock HF (the paged path "
        "runs in the weights' own dtype: cast the model instead, e.g. model.to(torch.bfloat16))"]  # once a reason
    assert torch.equal(model.generate(**kw), stock.generate(**kw))  # outside autocast: paged again
    assert model._hf_paged_t5.pool is not None


def test_malformed_input_shapes_get_one_clear_error():
    """Inputs without a batch dimension, or a mask that does not fit them: one ValueError that
    says what to do, before the call touches the pool (stock HF fails inside its forward with an
    indexing error, or, for a mask shorter than the inputs, only where its attention adds it)."""
    model = _patched(make_model("t5", seed=case_seed("input shapes")))
    ids, mask = make_batch([7, 5, 3], seed=1)
    embeds = model.get_input_embeddings()(ids).detach()
    cases = [
        (dict(input_ids=ids[0]), r"input_ids must be \[batch, sequence_length\], got shape \(7,\); a single input "
                                 r"needs a batch dimension \(input_ids\[None\]\)"),
        (dict(input_ids=ids[None], attention_mask=None), r"input_ids must be \[batch, sequence_length\], got shape \(1, 3, 7\)$"),
        (dict(input_ids=None, inputs_embeds=embeds[0]), r"inputs_embeds must be \[batch, sequence_length, d_model\], "
                                                        r"got shape \(7, 64\); a single input needs a batch dimension"),
        (dict(attention_mask=mask[:, :6]), r"attention_mask has shape \(3, 6\) but input_ids is \(3, 7\) "
                                           r"\(batch, sequence_length\): one mask entry per input token"),
        (dict(attention_mask=mask[:2]), r"attention_mask has shape \(2, 7\) but input_ids is \(3, 7\)"),
        (dict(decoder_input_ids=torch.tensor([0, 5])), r"decoder_input_ids must be \[batch, length\], got shape "
                                                       r"\(2,\); a single prompt needs a batch dimension"),
    ]
    for change, message in cases:
        kw = {k: v for k, v in {**dict(input_ids=ids, attention_mask=mask), **change}.items() if v is not None}
        with pytest.raises(ValueError, match=message):
            model.generate(**kw, max_new_tokens=3)
        assert model._hf_paged_t5.pool is None, "the pool was made before the inputs were checked"


@pytest.mark.parametrize("num_beams", [1, 2])
@pytest.mark.parametrize("shape,zeros", [((1, 7), 0), ((1, 7), 2), ((3, 1), 0), ((1, 1), 0)])
def test_a_mask_that_broadcasts_gives_stocks_answer(shape, zeros, num_beams):
    """A mask of another shape that broadcasts over the inputs: stock HF's own answer (its tokens,
    or its error where a broadcast row has padding), from generate() and the encoder alike."""
    seed = case_seed("broadcast mask", shape, zeros)
    model = make_model("t5", seed=seed)
    ids, _ = make_batch([7, 7, 7], seed=seed)
    mask = torch.ones(shape, dtype=torch.long)
    if zeros:
        mask[:, -zeros:] = 0
    compare_with_stock(model, expect_paged=False, stock_may_raise=True, input_ids=ids, attention_mask=mask,
                       max_new_tokens=4, num_beams=num_beams)

    def encode():
        try:
            with torch.no_grad():
                return model.get_encoder()(input_ids=ids, attention_mask=mask).last_hidden_state
        except Exception as exc:  # stock's error, compared below
            return exc

    want = encode()
    _patched(model)
    got = encode()
    if isinstance(want, Exception):
        assert type(got) is type(want) and str(got) == str(want), f"stock HF: {want!r}\npaged: {got!r}"
    else:
        assert torch.equal(got, want)


def test_peft_lora_adapters_are_applied():
    """LoRA on every projection, non-zero adapters: the paged path serves them through peft's layers."""
    peft = pytest.importorskip("peft")
    seed = case_seed("lora")
    model = make_model("t5v1_1", seed=seed)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q", "k", "v", "o", "wi_0", "wi_1", "wo"],
                             init_lora_weights=False)
    torch.manual_seed(seed)
    peft_model = peft.get_peft_model(model, config)
    model = peft_model.base_model.model.eval()  # the HF model, its projections now LoRA layers
    ids, mask = make_batch([9, 6], seed=seed)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, output_logits=True, return_dict_in_generate=True)
    with peft_model.disable_adapter():
        without = model.generate(**kw)
    stock, _ = compare_with_stock(model, float64=True, **kw)
    shift = float((stock.logits[0] - without.logits[0]).abs().max())
    assert shift > 1e-2 * float(stock.logits[0].abs().max()), "the adapters change the logits"


def test_fallback_reasons_are_logged_once(caplog):
    seed = case_seed("log once")
    model = _patched(make_model("t5", seed=seed))
    ids, mask = make_batch([6, 6], seed=seed)
    mask[0, 2] = 0
    with caplog.at_level(logging.WARNING, logger="hf_paged_t5"):
        for _ in range(3):
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3)
    assert len([r for r in caplog.records if "hole" in r.getMessage()]) == 1


def test_runtime_stats_counts_the_pool_and_graphs():
    """`hf_paged_t5.runtime_stats`: the public counters benchmarks read (no private state)."""
    model = make_model("t5", seed=31)
    with pytest.raises(ValueError, match="not patched"):
        hp.runtime_stats(model)
    hp.patch_model(model, CONFIG)
    try:
        assert hp.runtime_stats(model) == dict(graphs_captured=0, decode_graphs=0, pool_blocks=0, pool_blocks_free=0,
                                               encoder_graphs=0, encoder_graphs_captured=0, encoder_replays=0,
                                               bucket_graphs=0, bucket_graphs_captured=0, bucket_replays=0)
        ids, mask = make_batch([5, 9])
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=4)
        stats = hp.runtime_stats(model)
        pool = model._hf_paged_t5.pool
        assert stats["pool_blocks"] == pool.num_blocks > 0
        assert stats["pool_blocks_free"] == pool.num_blocks - pool.num_reserved  # idle: only the scratch block held
        assert stats["graphs_captured"] == stats["decode_graphs"] == 0  # no CUDA graphs on the CPU
    finally:
        hp.unpatch_model(model)


_MASK = torch.ones(2, 5, dtype=torch.long)


@pytest.mark.parametrize("given, kwargs, served", [
    (None, dict(max_new_tokens=5), True),
    (None, dict(max_new_tokens=5, num_beams=3, attention_mask=_MASK, do_sample=False), True),
    ("config", dict(attention_mask=_MASK), True),
    (None, dict(output_scores=True, return_dict_in_generate=True, min_new_tokens=2, max_new_tokens=4), True),
    (None, dict(output_attentions=True, max_new_tokens=3), False),  # HF's own: it re-adds the flag
])
def test_generate_prepares_its_config_once(monkeypatch, given, kwargs, served):
    """HF's generate() prepares the generation config again inside a patched call; it gets the one
    the wrapper prepared (`PreparedConfig`) only where that is what its own preparation returns,
    on this transformers version."""
    from transformers import GenerationConfig

    from hf_paged_t5.hf.generate import PreparedConfig

    model = make_model("t5")
    given = GenerationConfig(max_length=9, num_beams=2) if given == "config" else given
    config, model_kwargs = model._prepare_generation_config(given, **kwargs)
    prepared = PreparedConfig(given, kwargs, config, model_kwargs)
    hf_kwargs = {**kwargs, "past_key_values": object()}  # what the paged call adds: its cache
    assert prepared.serves((given,), hf_kwargs) == served
    assert not prepared.serves((given,), {**hf_kwargs, "max_new_tokens": 7})
    if served:
        hf_config, hf_model_kwargs = model._prepare_generation_config(given, **hf_kwargs)
        ours, ours_kwargs = prepared.result(hf_kwargs)
        assert ours is config and ours.to_dict() == hf_config.to_dict()
        assert ours_kwargs.keys() == hf_model_kwargs.keys()
        assert all(ours_kwargs[k] is hf_model_kwargs[k] for k in ours_kwargs)


def test_a_patched_generate_prepares_one_config(monkeypatch):
    """One preparation per patched call (HF's own inside it answered by the wrapper's), the
    tokens stock HF's."""
    from transformers import GenerationMixin

    model = make_model("t5")
    ids, mask = make_batch([5, 3])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
    with torch.no_grad():
        stock = model.generate(**kw)
    hp.patch_model(model)
    real, calls = GenerationMixin._prepare_generation_config, []
    monkeypatch.setattr(GenerationMixin, "_prepare_generation_config",
                        lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    with torch.no_grad():
        paged = model.generate(**kw)
    assert len(calls) == 1 and "_prepare_generation_config" not in model.__dict__
    assert torch.equal(stock, paged)


def test_another_threads_call_prepares_its_own_config():
    """While a patched call holds its prepared config for HF's generate(), another thread's
    preparation (a stock call of the same model) is HF's own and leaves it in place."""
    import threading

    from hf_paged_t5.hf.generate import PreparedConfig

    model = make_model("t5")
    config, model_kwargs = model._prepare_generation_config(None, max_new_tokens=5)
    prepared = PreparedConfig(None, dict(max_new_tokens=5), config, model_kwargs)
    seen = []
    with prepared.reused_by(model):
        thread = threading.Thread(target=lambda: seen.append(model._prepare_generation_config(None, max_new_tokens=5)))
        thread.start()
        thread.join()
        assert seen[0][0] is not config and seen[0][0].max_new_tokens == 5
        assert model._prepare_generation_config(None, max_new_tokens=5)[0] is config  # this thread's, once
        assert model._prepare_generation_config(None, max_new_tokens=5)[0] is not config
