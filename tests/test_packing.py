"""Packed projection groups (`model/packing.py`): q/k/v, cross k/v and wi_0/wi_1 laid out as
slices of one tensor, each group one GEMM; the user's parameters keep their identity and values,
everything that reads or writes them keeps working, and the paged path's results do not change."""

from __future__ import annotations

import pytest
import torch
from conftest import make_batch, make_model
from transformers import T5ForConditionalGeneration

import hf_paged_t5 as hp
from hf_paged_t5 import tiny
from hf_paged_t5.model import packing

CPU = ("cpu",)  # pack_model packs GPU weights only; the tests lay CPU weights out the same way


def storages(model) -> int:
    return len({p.untyped_storage().data_ptr() for p in model.parameters()})


def buffers(groups) -> int:
    """The tensors the weights of packed `groups` lie in (a chain of cross groups shares one)."""
    return len({g[0].weight.untyped_storage().data_ptr() for g in groups})


def packed_fp16(family="t5v1_1", **kw):
    model = make_model(family, dtype=torch.float16, **kw)
    return model, packing.pack_model(model, device_types=CPU)


def test_pack_keeps_parameters_and_values():
    model = make_model("t5v1_1", dtype=torch.float16)
    params = dict(model.named_parameters())
    values = {name: p.detach().clone() for name, p in params.items()}
    count = storages(model)
    groups = packing.pack_model(model, device_types=CPU)
    # per layer: encoder q/k/v and wi_0/wi_1; decoder q/k/v, cross k/v and wi_0/wi_1 (2 + 2 layers)
    assert len(groups) == 2 * 2 + 2 * 3
    # each group one tensor, the decoder's two cross (k, v) groups one tensor together
    assert buffers(groups) == len(groups) - 1
    assert storages(model) == count - sum(len(g) for g in groups) + buffers(groups)
    cross = [(b.layer[1].EncDecAttention.k, b.layer[1].EncDecAttention.v) for b in model.decoder.block]
    with torch.no_grad():
        (run,) = packing.packed_runs(cross)
    assert run[:2] == (0, 2) and torch.equal(run[2], torch.cat([layer.weight for group in cross for layer in group]))
    after = dict(model.named_parameters())
    assert after.keys() == params.keys() and all(after[n] is params[n] for n in params)
    assert all(torch.equal(p, values[n]) for n, p in after.items())
    with torch.no_grad():
        for group in groups:
            whole = packing.packed_weight(group)
            assert whole.data_ptr() == group[0].weight.data_ptr()
            assert torch.equal(whole, torch.cat([layer.weight for layer in group]))
    assert packing.pack_model(model, device_types=CPU) == []  # already packed


def test_a_full_gpu_leaves_the_rest_unpacked(monkeypatch):
    """Packing moves each group through one new buffer: where none fits, that group and the rest
    stay as they are (their GEMMs one by one) instead of patch_model failing."""
    model = make_model("t5v1_1", dtype=torch.float16)
    real_empty, calls = torch.empty, []

    def empty(*args, **kwargs):
        calls.append(args)
        if len(calls) > 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    groups = packing.pack_model(model, device_types=CPU)
    monkeypatch.setattr(torch, "empty", real_empty)
    assert len(groups) == 3
    with torch.no_grad():
        assert [packing.packed_weight(g) is not None for g in packing.groups(model)] == [True] * 3 + [False] * 7


def test_only_half_precision_on_allowed_devices():
    assert packing.pack_model(make_model("t5v1_1"), device_types=CPU) == []  # float32: HF's GEMMs stay
    assert packing.pack_model(make_model("t5v1_1", dtype=torch.float16)) == []  # CPU is not packed by default
    model = make_model("t5", dtype=torch.bfloat16)  # relu FF: q/k/v and cross k/v only
    assert len(packing.pack_model(model, device_types=CPU)) == 2 + 2 * 2


def test_packing_ends_where_the_layout_or_module_changes():
    model, groups = packed_fp16()
    qkv = groups[0]
    assert torch.is_grad_enabled() and packing.packed_weight(qkv) is None  # autograd needs the Parameters
    with torch.no_grad():
        assert packing.packed_weight(qkv) is not None
        handle = qkv[1].register_forward_hook(lambda *a: None)  # a user's (or peft's, accelerate's) hook
        assert packing.packed_weight(qkv) is None
        handle.remove()
        assert packing.packed_weight(qkv) is not None
        model.float()  # every weight gets a tensor of its own
        assert all(packing.packed_weight(g) is None for g in groups)
        model.half()
        assert all(packing.packed_weight(g) is None for g in groups)


def test_tied_storage_is_not_packed():
    model = make_model("t5v1_1", dtype=torch.float16)
    attn = model.encoder.block[0].layer[0].SelfAttention
    attn.v.weight = torch.nn.Parameter(attn.k.weight.detach()[:, :])  # another Parameter on k's storage
    groups = packing.pack_model(model, device_types=CPU)
    assert (attn.q, attn.k, attn.v) not in groups and len(groups) == 2 * 2 + 2 * 3 - 1


def test_unpack_gives_each_weight_its_own_tensor():
    model = make_model("t5v1_1", dtype=torch.float16)
    count = storages(model)
    groups = packing.pack_model(model, device_types=CPU)
    values = {n: p.detach().clone() for n, p in model.named_parameters()}
    packing.unpack(groups)
    assert storages(model) == count
    assert all(torch.equal(p, values[n]) for n, p in model.named_parameters())


def test_unpatch_unpacks(monkeypatch):
    model = make_model("t5v1_1", dtype=torch.float16)
    count = storages(model)
    real = packing.pack_model
    monkeypatch.setattr(packing, "pack_model", lambda m: real(m, device_types=CPU))
    hp.patch_model(model, hp.PagedCacheConfig(backend="cpu"))
    assert storages(model) < count
    hp.unpatch_model(model)
    assert storages(model) == count


def test_pack_projections_off(monkeypatch):
    model = make_model("t5v1_1", dtype=torch.float16)
    count = storages(model)
    real = packing.pack_model
    monkeypatch.setattr(packing, "pack_model", lambda m: real(m, device_types=CPU))
    hp.patch_model(model, hp.PagedCacheConfig(backend="cpu", pack_projections=False))
    assert storages(model) == count


def _patched_packed(monkeypatch, family="t5v1_1"):
    model = make_model(family, dtype=torch.float16)
    real = packing.pack_model
    monkeypatch.setattr(packing, "pack_model", lambda m: real(m, device_types=CPU))
    return hp.patch_model(model, hp.PagedCacheConfig(backend="cpu"))


def test_state_dict_gives_each_weight_its_own_tensor(monkeypatch, tmp_path):
    """Savers that refuse (safetensors' save_file) or silently drop (accelerate's save_model keeps
    one name per storage) tensors sharing a storage see separate tensors from a patched model."""
    from accelerate.utils import clean_state_dict_for_safetensors
    from safetensors.torch import load_file, save_file

    model = _patched_packed(monkeypatch)
    params = dict(model.named_parameters())
    assert len({p.untyped_storage().data_ptr() for p in params.values()}) < len(params)  # packed
    state = model.state_dict()  # (also names tied weights that named_parameters lists once)
    assert len({state[n].untyped_storage().data_ptr() for n in params}) == len(params)
    assert all(torch.equal(state[n], p) for n, p in params.items())
    untied = {n: state[n] for n in params}
    assert clean_state_dict_for_safetensors(dict(untied)).keys() == untied.keys()  # nothing dropped
    save_file(untied, tmp_path / "model.safetensors")
    loaded = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(loaded[n], p) for n, p in params.items())
    # keep_vars asks for the Parameters themselves; a prefix (a parent module's call) is honoured
    assert all(model.state_dict(keep_vars=True)[n] is p for n, p in params.items())
    nested = model.state_dict(None, "t5.")
    assert len({nested["t5." + n].untyped_storage().data_ptr() for n in params}) == len(params)
    hp.unpatch_model(model)
    assert "state_dict" not in model.__dict__


def test_pickled_and_copied_patched_model(monkeypatch, tmp_path):
    """torch.save of a packed patched model loads unpatched (no patched state_dict), with the same
    weights; a deep copy is patched and packed on its own."""
    import copy

    model = _patched_packed(monkeypatch)
    torch.save(model, tmp_path / "model.pt")
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    assert not hp.is_patched(loaded) and "state_dict" not in loaded.__dict__
    assert all(torch.equal(p, dict(model.named_parameters())[n]) for n, p in loaded.named_parameters())
    clone = copy.deepcopy(model)
    assert hp.is_patched(clone) and clone._hf_paged_t5.packed
    with torch.no_grad():
        assert all(packing.packed_weight(g) is not None and g[0].weight.data_ptr() != h[0].weight.data_ptr()
                   for g, h in zip(clone._hf_paged_t5.packed, model._hf_paged_t5.packed))


def test_save_pretrained_round_trip(tmp_path):
    model, _ = packed_fp16()
    model.save_pretrained(tmp_path)
    loaded = T5ForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.float16)
    saved = dict(loaded.named_parameters())
    assert all(torch.equal(p, saved[n]) for n, p in model.named_parameters())


@pytest.mark.parametrize("family, backend", [("t5v1_1", "cpu"), ("t5v1_1", "triton"), ("umt5", "cpu")])
def test_paged_results_unchanged(monkeypatch, backend, family):
    """The patched encoder and greedy generate() on packed weights (one GEMM per group, the
    gated GELU reading the halves in place) against the same model unpacked."""
    model = make_model(family, dtype=torch.float16)
    hp.patch_model(model, hp.PagedCacheConfig(block_size=4, backend=backend))
    ids, mask = make_batch([7, 3, 5])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        encoded = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        tokens = model.generate(**kw)
    packing.pack_model(model, device_types=CPU)
    served = []
    real = packing.packed_weight
    monkeypatch.setattr(packing, "packed_weight", lambda g: served.append(real(g) is not None) or real(g))
    with torch.no_grad():
        packed_encoded = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        packed_tokens = model.generate(**kw)
    assert served and all(served)
    real_rows = mask.bool()
    torch.testing.assert_close(packed_encoded[real_rows], encoded[real_rows], rtol=2e-3, atol=2e-3)
    assert torch.equal(packed_tokens, tokens)


def _gpu_model(family, dtype):
    return tiny.build_model("t5-small", family=family, vocab_size=1000, dtype=dtype, device="cuda", seed=3)


def _live_bytes() -> int:
    """Bytes the live CUDA tensors asked for (the caching allocator's blocks may be larger: a
    1.5 MiB buffer placed in a freed 2 MiB block counts 2 MiB in `memory_allocated`)."""
    torch.cuda.synchronize()
    return torch.cuda.memory_stats()["requested_bytes.all.current"]


def _patch_growth(model, pack: bool) -> int:
    """Bytes of live GPU tensors `patch_model` adds (then unpatches)."""
    before = _live_bytes()
    hp.patch_model(model, hp.PagedCacheConfig(pack_projections=pack))
    grown = _live_bytes() - before
    hp.unpatch_model(model)
    return grown


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["t5v1_1", "umt5"])
def test_gpu_patch_packs_without_growing_memory(family):
    """Packing moves weights, it does not copy them: patching allocates what it allocates without
    packing (its bias tables and counters), no more."""
    unpacked = _patch_growth(_gpu_model(family, torch.bfloat16), pack=False)
    model = _gpu_model(family, torch.bfloat16)
    count = storages(model)
    hp.patch_model(model)
    groups = model._hf_paged_t5.packed
    assert len(groups) == 6 * 2 + 6 * 3 and storages(model) == count - sum(len(g) for g in groups) + buffers(groups)
    hp.unpatch_model(model)
    assert storages(model) == count
    assert _patch_growth(model, pack=True) <= unpacked + (64 << 10)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["t5v1_1", "umt5"])
@pytest.mark.parametrize("rows", [1, 8])
def test_gpu_packed_error_no_larger(family, rows):
    """bf16 encoder outputs and greedy step logits with packed groups: their distance from the
    float32 model's is no larger than the unpacked patched model's (1.1x, rounding noise)."""
    reference = _gpu_model(family, torch.float32)
    g = torch.Generator(device="cuda").manual_seed(rows)
    ids = torch.randint(2, 1000, (rows, 96), device="cuda", generator=g)
    kw = dict(input_ids=ids, max_new_tokens=8, min_new_tokens=8, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    with torch.no_grad():
        exact_enc = reference.encoder(input_ids=ids).last_hidden_state
    errors = {}
    for pack in (False, True):
        model = _gpu_model(family, torch.bfloat16)
        hp.patch_model(model, hp.PagedCacheConfig(pack_projections=pack))
        assert bool(model._hf_paged_t5.packed) == pack
        with torch.no_grad():
            enc = model.encoder(input_ids=ids).last_hidden_state.float()
        out = model.generate(**kw)
        with torch.no_grad():  # the float32 model's logits after the same tokens
            exact_logits = reference(input_ids=ids, decoder_input_ids=out.sequences[:, :-1]).logits
        logits = torch.stack(out.logits, dim=1).float()
        errors[pack] = ((enc - exact_enc).norm() / exact_enc.norm(),
                        (logits - exact_logits).norm() / exact_logits.norm())
    for unpacked, packed in zip(errors[False], errors[True]):
        assert packed <= 1.1 * unpacked + 1e-3


@pytest.mark.parametrize("span_bytes", [None, 1])
def test_cross_store_spans_the_layers(monkeypatch, span_bytes):
    """Where packing laid every decoder layer's cross (k, v) out back to back, their K/V are stored
    by one GEMM and one indexed copy (`span_bytes` 1: one layer at a time, the same path): the pool
    then holds what each layer's own store writes, at the given slots and nowhere else."""
    from hf_paged_t5.model import stacks

    model = make_model("t5v1_1", dtype=torch.float16)
    hp.patch_model(model, hp.PagedCacheConfig(block_size=4, backend="cpu"))
    packing.pack_model(model, device_types=CPU)
    runtime = model._hf_paged_t5
    pool = runtime.get_pool(model.decoder)
    pool.reserve(8)
    if span_bytes is not None:
        monkeypatch.setattr(stacks, "CROSS_SPAN_BYTES", span_bytes)
    tokens = torch.randn(5, model.config.d_model, generator=torch.Generator().manual_seed(0)).half()
    slots = torch.tensor([3, 9, 4, 17, 8])
    spans = []
    real_span = stacks._store_span
    monkeypatch.setattr(stacks, "_store_span", lambda *a: spans.append(a[3].shape[0]) or real_span(*a))

    def stored():
        for group in pool.groups:
            group.fill_(float("nan"))
        with torch.no_grad():
            stacks.store_cross_packed(model.decoder, runtime.ops_for, pool, tokens, slots)
        return torch.cat([g.flatten(0, 1) for g in pool.groups]).clone()

    spanned = stored()
    assert spans == [len(model.decoder.block)]
    monkeypatch.setattr(packing, "packed_runs", lambda found: [(i, i + 1, None) for i in range(len(found))])
    by_layer = stored()
    assert len(spans) == 1
    torch.testing.assert_close(spanned, by_layer, rtol=1e-3, atol=1e-3, equal_nan=True)
    written = torch.zeros(by_layer.shape[1] * by_layer.shape[2], dtype=torch.bool)
    written[slots] = True
    untouched = spanned.flatten(1, 2)[:, ~written]
    assert untouched.isnan().all() and not spanned.flatten(1, 2)[:, written].isnan().any()
