"""A cold generate()'s first decode step compiled in its encoder's pass: the predicted graph key and the wiring.

On a GPU the first call of a process runs its encoder once compile-only (`kernels/ahead.py`), and
with it the call's cross K/V store and first decode step, so every kernel of the call compiles on
one pool at once. What a CPU can check: the key predicted before the encoder runs is the key the
first step's graph gets, and the encoder's pass runs the call's extra work only inside that call.
"""

from __future__ import annotations

import pytest
import torch

import hf_paged_t5 as hp
from hf_paged_t5.decode.graphs import graph_key, predicted_key
from hf_paged_t5.hf.cache import PagedEncoderDecoderCache
from hf_paged_t5.kv.pool import KVPool, LayerSpec

from conftest import make_batch, make_model, run_cold


@pytest.mark.parametrize("source_lens,expand,max_self_tokens,block_size", [
    ([7], 1, 20, 4), ([300, 12, 77], 4, 63, 16), ([1, 1], 2, 1, 16), ([513, 40], 1, 129, 16), ([16], 3, 64, 16),
])
def test_predicted_key_is_the_first_steps(source_lens, expand, max_self_tokens, block_size):
    config = hp.PagedCacheConfig(block_size=block_size, num_blocks=8, backend="torch")
    pool = KVPool(config, [LayerSpec(torch.device("cpu"), torch.float32, num_heads=2, head_dim=8)])
    pool.reserve(PagedEncoderDecoderCache.blocks_needed(source_lens, expand, max_self_tokens, pool.block_size))
    cache = PagedEncoderDecoderCache(pool, len(source_lens), expand, max_self_tokens)
    predicted = predicted_key(cache, cache.num_rows, cache.max_self_blocks * block_size, max(source_lens))
    cache.store_cross_plan(source_lens)  # what the encoder's call does next
    assert predicted == graph_key(cache, cache.num_rows, cache.host_tables(), capture=True)
    cache.release()


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 16, 33])
def test_static_step_views_are_16_byte_aligned(batch):
    """Every view of a captured step's packed metadata starts 16-byte aligned at any batch, so a
    1-row step's kernels get the pointer specialization a 16-row step's do (the same binaries)."""
    from hf_paged_t5.decode.graphs import _lane, _views

    for self_width, cross_width in ((4, 4), (8, 32)):
        packed = torch.zeros(4 * _lane(batch) + batch * (self_width + cross_width), dtype=torch.int32)
        views = _views(packed, batch, self_width, cross_width)
        assert [tuple(v.shape) for v in views] == [(batch,)] * 3 + [(batch, self_width), (batch, cross_width)]
        assert all(v.data_ptr() % 16 == 0 for v in views)
        ends = sorted((v.data_ptr(), v.data_ptr() + v.numel() * 4) for v in views)
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ends, ends[1:]))  # disjoint
        assert ends[-1][1] <= packed.data_ptr() + packed.numel() * 4


def test_op_by_op_decode_launches_like_the_fused_layer():
    """A step of more than 4 rows passes paged_decode the fused layer's launch options (dependent
    launch where the GPU has it, the step's counters, which keys were written before the step),
    so both launch the same binaries. A step of several new tokens per row builds its tables and
    key counts just before the attention: no counters, no dependent launch, no ready keys.
    Backends without those options get none."""
    from hf_paged_t5 import kernels, reference
    from hf_paged_t5.kv.pool import StepMetadata
    from hf_paged_t5.model.attention import _decode_launch

    tickets = torch.zeros(8, dtype=torch.int32)
    one = torch.zeros(2, dtype=torch.int32)
    meta = StepMetadata(1, one, one[:, None], one, one[:, None], one, tickets)
    query = torch.zeros(2, 4, 8)
    launch = _decode_launch(kernels, query, meta, "past")
    assert launch == dict(pdl=kernels.pdl_available(query.device), tickets=tickets, keys_ready="past")
    assert _decode_launch(kernels, query, meta, "all")["keys_ready"] == "all"
    meta.num_new = 3
    assert _decode_launch(kernels, query, meta, "all") == dict(pdl=False, tickets=None, keys_ready=None)
    assert _decode_launch(reference, query, meta, "all") == {}


def test_the_encoder_pass_runs_the_calls_extra_work_only_inside_that_call(monkeypatch):
    """generate() registers its first step and cross store for its encoder's compile pass; a pass
    outside a call (a standalone encoder call) runs only the encoder; the work is gone after the call."""
    from hf_paged_t5.hf import runtime as runtime_mod

    passes = []

    def fake_pass(device, backend, forward, what, before=None):
        passes.append(what)
        forward()

    monkeypatch.setattr(runtime_mod, "run_compiled_ahead", fake_pass)
    model = hp.patch_model(make_model("t5"), hp.PagedCacheConfig(block_size=4, backend="torch"))
    runtime = model._hf_paged_t5  # private: the runtime patch_model attaches
    ran = []
    with runtime.runner.owning(), runtime.also_ahead(lambda: ran.append("extra")):
        runtime.compile_ahead(torch.device("cpu"), "kind-a", lambda: ran.append("encoder"))
    assert ran == ["encoder", "extra"] and passes == ["kind-a"]
    with runtime.also_ahead(lambda: ran.append("extra")):  # not owning: a standalone call
        runtime.compile_ahead(torch.device("cpu"), "kind-b", lambda: ran.append("encoder"))
    assert ran == ["encoder", "extra", "encoder"]
    assert runtime._also_ahead is None
    ids, mask = make_batch([5, 3])
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3)  # wiring in place: no error
    assert runtime._also_ahead is None


_COLD_GENERATE = r"""
import contextlib, json, threading, torch, triton.compiler
from transformers import T5ForConditionalGeneration
import hf_paged_t5 as hp
from hf_paged_t5 import tiny
from hf_paged_t5.kernels import ahead

threads, passes, launchers = [], [], []
real = triton.compiler.compile
def compile(*a, **kw):
    threads.append(threading.current_thread().name)
    return real(*a, **kw)
triton.compiler.compile = compile
import triton.runtime.build as build
real_build = build._build
def built(name, *a, **kw):
    if name == "__triton_launcher":
        launchers.append(threading.current_thread().name)
    return real_build(name, *a, **kw)
build._build = built
real_pass = ahead.compile_ahead
@contextlib.contextmanager
def counted_pass(device):
    with real_pass(device):
        yield
    passes.append(len(threads))  # compiles so far, as each pass ends
ahead.compile_ahead = counted_pass
config = tiny.build_config("t5-small", vocab_size=1000)
def build():
    with torch.device("cuda"):
        torch.manual_seed(0)
        return T5ForConditionalGeneration(config).to(torch.bfloat16).eval()
models = [build(), build()]
ids = torch.randint(2, 1000, (1, 77), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
cold = hp.patch_model(models[0])
first = cold.generate(input_ids=ids, max_new_tokens=8, min_new_tokens=8)
first_threads, first_passes, first_launchers = list(threads), list(passes), list(launchers)
import triton.backends.nvidia.driver as driver
warm = hp.patch_model(models[1])
again = warm.generate(input_ids=ids, max_new_tokens=8, min_new_tokens=8)
print(json.dumps(dict(first_threads=first_threads, passes=first_passes, later=threads[len(first_threads):],
                      launchers=first_launchers, c_launchers=hasattr(driver, "make_launcher"),
                      equal=bool(torch.equal(first, again)))))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cold_generate_compiles_every_kernel_in_its_encoders_pass(tmp_path):
    """A fresh process with an empty Triton cache and no compile workers: the first generate()
    compiles every kernel on the pool, all of them in its encoder's pass (the decode step's own pass, at its capture, finds
    them compiled), and gives the tokens a second model gets once the kernels are compiled.
    Where Triton builds a C launcher per kernel signature, each was built on the pass's launcher
    threads, beside its compile (`ahead._launcher_build`), none at the binary's load after it."""
    report = run_cold(_COLD_GENERATE, tmp_path, HF_PAGED_T5_COMPILE_WORKERS="0")
    if report["c_launchers"]:
        assert report["launchers"], report
        assert all(name.startswith("hf_paged_t5-launcher") for name in report["launchers"]), report
    assert report["first_threads"], "the cold call compiled nothing: the Triton cache was not empty"
    assert all(name.startswith("hf_paged_t5-compile") for name in report["first_threads"]), report
    assert report["passes"] and report["passes"][0] == len(report["first_threads"]), report
    assert report["later"] == [] and report["equal"], report


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("blocks", [None, 1, 2])
def test_a_step_walk_of_the_first_blocks_layers(monkeypatch, fused, blocks):
    """`decoder_layers(blocks=k)` (op by op, and the fused layer's) walks the first k decoder layers
    and then the final norm, as a batch job's compile pass asks (`BatchRun._compile_ahead`: one
    layer requests each kernel of the step before the host walks the whole stack); None walks all."""
    from types import SimpleNamespace

    from hf_paged_t5.model import fused_layer, stacks

    model = make_model("t5", num_decoder_layers=3)
    decoder = model.decoder
    walked, normed = [], []
    pool = SimpleNamespace(key_caches=[0, 1, 2], value_caches=[0, 1, 2])
    ids = torch.zeros(2, 1, dtype=torch.long)
    if fused:
        def layer(ops, block, hidden, key_cache, *rest):
            walked.append(key_cache)
            return hidden

        def rms_norm(hidden, weight, eps, pdl):
            normed.append(weight is decoder.final_layer_norm.weight)
            return (hidden,)

        monkeypatch.setattr(fused_layer, "_layer", layer)
        ops = SimpleNamespace(pdl_available=lambda device: False, rms_norm=rms_norm)
        fused_layer.decoder_layers(decoder, ops, [None] * 3, pool, None, ids, blocks)
    else:
        def add_norm(ops, norm, hidden, out):
            normed.append(norm is decoder.final_layer_norm)
            return hidden, hidden

        def self_attention(ops, attention, normed_, kc, vc, meta, table, state):
            walked.append(kc)
            return normed_

        monkeypatch.setattr(stacks.attn_ops, "add_norm", add_norm)
        monkeypatch.setattr(stacks.attn_ops, "decoder_self_attention", self_attention)
        monkeypatch.setattr(stacks.attn_ops, "cross_attention", lambda ops, attention, x, *rest: x)
        monkeypatch.setattr(stacks.attn_ops, "ff_sublayer", lambda ops, ff, x, hidden: x)
        stacks.decoder_layers(decoder, lambda device: None, [torch.zeros(1)] * 3, pool, lambda device: None, ids,
                              blocks=blocks)
    assert walked == [0, 1, 2][:blocks]
    assert normed[-1] and sum(normed) == 1  # the final norm, once, last


def test_run_ahead_walks_the_first_blocks_then_the_whole_step_on_one_set_of_buffers():
    """`DecodeGraphs.run_ahead(first_blocks=k)` (a batch job's pass: `step_ahead(first_blocks=1)`)
    calls the step with `blocks=k` and then whole, both on the same static ids and metadata; without
    it, once whole; a key that already has a graph, not at all."""
    from hf_paged_t5.decode.graphs import DecodeGraphs

    config = hp.PagedCacheConfig(block_size=4, num_blocks=8, backend="torch")
    pool = KVPool(config, [LayerSpec(torch.device("cpu"), torch.float32, num_heads=2, head_dim=8)])
    calls = []

    def step(input_ids, meta_for, **kw):
        calls.append((input_ids, meta_for(None), kw))

    graphs = DecodeGraphs()
    graphs.run_ahead(step, pool, (2, 1, 1, 1), torch.device("cpu"), first_blocks=1)
    assert [kw for _, _, kw in calls] == [dict(blocks=1), {}]
    assert calls[0][0] is calls[1][0] and calls[0][1] is calls[1][1]
    calls.clear()
    graphs.run_ahead(step, pool, (2, 1, 1, 1), torch.device("cpu"))
    assert [kw for _, _, kw in calls] == [{}]
    calls.clear()
    graphs._graphs[(2, 1, 1, 1)] = object()
    graphs.run_ahead(step, pool, (2, 1, 1, 1), torch.device("cpu"), first_blocks=1)
    assert calls == []


def _launch_key(kernel, args, kwargs) -> tuple:
    """What tells one compiled binary of `kernel` (an interpreted Triton kernel) from another, as
    Triton specializes a launch: constexpr values, each tensor's dtype and 16-byte alignment, each
    integer's being 1 or a multiple of 16, the launch options."""
    import inspect

    params = inspect.signature(kernel.fn).parameters
    bound = dict(zip(kernel.arg_names, args)) | kwargs
    key = []
    for name, value in sorted(bound.items()):
        param = params.get(name)
        if param is not None and "constexpr" in str(param.annotation):
            key.append((name, value))
        elif isinstance(value, torch.Tensor):
            key.append((name, value.dtype, value.data_ptr() % 16 == 0))
        elif isinstance(value, bool) or value is None or param is None:
            key.append((name, value))
        elif isinstance(value, int):
            key.append((name, "int", value == 1, value % 16 == 0))
        else:
            key.append((name, type(value).__name__))
    return kernel.__name__, tuple(key)


def test_a_captures_step_walk_reaches_every_binary_of_the_whole_step(monkeypatch):
    """A capture's compile-only walk goes through `graphs.AHEAD_BLOCKS` decoder layers, not the
    whole stack: on the Triton backend (interpreted), the kernels a step launches through those
    layers, the final norm and the LM head carry every specialization (binary) the whole step's
    launches carry, over a 5-layer UMT5 decoder (a bias table per layer). A walk of no layer (the
    final norm and the LM head) launches fewer: the keys tell the step's binaries apart."""
    import triton.runtime.interpreter as interpreter

    from hf_paged_t5.decode import graphs
    from hf_paged_t5.decode.runner import DecodePlan

    model = make_model("umt5", num_layers=5, num_decoder_layers=5)
    hp.patch_model(model, hp.PagedCacheConfig(block_size=4, backend="triton", cuda_graphs=False))
    runner = model._hf_paged_t5.runner
    launched: list = []
    run = interpreter.InterpretedFunction.run

    def recording(self, *args, grid, warmup, **kwargs):
        launched.append(_launch_key(self, args, kwargs))
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording)
    walks: dict = {}
    build = runner._build_plan

    def build_plan(*args):
        plan = build(*args)

        def step(input_ids, meta_for, blocks=None):
            if not walks:  # the first step: walked through 0 and AHEAD_BLOCKS layers first (its K/V
                for k in (0, graphs.AHEAD_BLOCKS, None):  # rows written again with the same values)
                    launched.clear()
                    out = plan.step(input_ids, meta_for, blocks=k)
                    walks[k] = set(launched)
                return out
            return plan.step(input_ids, meta_for, blocks)

        return DecodePlan(step, plan.use_graph)

    monkeypatch.setattr(runner, "_build_plan", build_plan)
    ids, mask = make_batch([5, 9])
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2)
    assert walks[None] and walks[graphs.AHEAD_BLOCKS] == walks[None], walks[None] ^ walks[graphs.AHEAD_BLOCKS]
    assert walks[0] < walks[None]
    monkeypatch.undo()
    hp.unpatch_model(model)
    assert torch.equal(out, model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2))
