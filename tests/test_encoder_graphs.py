"""Standalone encoder calls replayed as CUDA graphs (model/encoder_graphs.py): a text encoder
called the way diffusion pipelines call it. The graph gives the eager patched forward's bits;
it notices replaced weights, in-place writes and hooks; a padded mask that recurs has a graph of
its own."""

from __future__ import annotations

import threading

import pytest
import torch
from conftest import run_cold
from oracle import assert_within_stock_error
from transformers import T5EncoderModel, UMT5EncoderModel

import hf_paged_t5 as hp
from hf_paged_t5 import tiny

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

ENCODERS = {"t5v1_1": T5EncoderModel, "umt5": UMT5EncoderModel}


def encoder(family="t5v1_1", dtype=torch.float32, **overrides):
    config = tiny.build_config("t5-small", family=family, vocab_size=1000, **overrides)
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = ENCODERS[family](config)
    return model.to(dtype).eval()


def ids_of(batch, length, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(2, 1000, (batch, length), device="cuda", generator=g)


def graphs_of(model):
    return model._hf_paged_t5.encoder_graphs


def pipeline_call(model, ids, mask=None):
    """What diffusers does: `text_encoder(input_ids, attention_mask=...)[0]`, no hidden states."""
    with torch.no_grad():
        return model(ids, attention_mask=mask, output_hidden_states=False)[0]


def eager_patched(model, ids, mask=None):
    """The patched encoder's eager result (no graphs) on the model's weights as they are now."""
    hp.patch_model(model, hp.PagedCacheConfig(cuda_graphs=False))
    try:
        return pipeline_call(model, ids, mask)
    finally:
        hp.unpatch_model(model)


@pytest.mark.parametrize("family", ["t5v1_1", "umt5"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurring_shape_is_replayed_with_the_eager_bits(family, dtype):
    model = encoder(family, dtype)
    ids, other = ids_of(2, 77), ids_of(2, 77, seed=1)
    want, want_other = eager_patched(model, ids), eager_patched(model, other)
    stock = pipeline_call(model, ids)
    with torch.no_grad():
        ref = encoder(family, torch.float64)(ids)[0]
    hp.patch_model(model)
    try:
        first = pipeline_call(model, ids)  # first call of the shape: eager
        assert graphs_of(model).captures == 0
        captured = pipeline_call(model, ids)  # second: captured, then replayed
        replayed = pipeline_call(model, other)  # same shape, new input: a replay
        with torch.inference_mode():  # a replay inside inference mode, into the same buffers
            again = model(ids)[0]
        assert graphs_of(model).captures == 1 and graphs_of(model).replays == 3
    finally:
        hp.unpatch_model(model)
    for got in (first, captured, again):
        assert torch.equal(got, want)
    assert torch.equal(replayed, want_other)
    if dtype == torch.float32:
        assert_within_stock_error(want, stock, ref, "last_hidden_state")


def test_masks_that_recur_are_replayed_with_the_eager_bits():
    """An all-ones mask replays the unmasked graph; a padded mask (PixArt's right padding, a
    left-padded row) that recurs replays a graph of its own, with the eager bits and zeros at
    padded positions; another mask of the same shape is not served by it."""
    model = encoder(dtype=torch.bfloat16)
    ids, other = ids_of(2, 64), ids_of(2, 64, seed=1)
    ones = torch.ones_like(ids)
    padded, left = ones.clone(), ones.clone()
    padded[1, 40:] = 0
    left[0, :9] = 0
    want = {name: (eager_patched(model, ids, m), eager_patched(model, other, m))
            for name, m in (("padded", padded), ("left", left))}
    hp.patch_model(model)
    try:
        for _ in range(3):
            full = pipeline_call(model, ids, ones)
            got = {name: (pipeline_call(model, ids, m), pipeline_call(model, other, m))
                   for name, m in (("padded", padded), ("left", left))}
        assert graphs_of(model).captures == 3  # the all-ones mask's shape, and each padded mask
        assert graphs_of(model).replays == 2 + 2 * 5
        no_mask = pipeline_call(model, ids)
    finally:
        hp.unpatch_model(model)
    assert torch.equal(full, no_mask)
    assert torch.count_nonzero(got["padded"][0][1, 40:]) == 0  # padded positions are zeros (docs/usage.md)
    assert torch.count_nonzero(got["left"][1][0, :9]) == 0
    for name in want:
        assert all(torch.equal(g, w) for g, w in zip(got[name], want[name])), name


@pytest.mark.parametrize("family", ["t5v1_1", "umt5"])
def test_graph_follows_the_weights(family):
    """After a shape's graph exists: a replaced weight, `.data =`, an in-place write (also to a
    bias table's weight: the graph gathers the table from it), a swapped module and a hook; each
    later call gives the eager patched result on the weights as they are then."""
    model = encoder(family)
    ids = ids_of(1, 50)
    ff = model.encoder.block[1].layer[-1].DenseReluDense
    # UMT5: the last layer's own table; T5: layer 0's, shared by every layer
    bias = model.encoder.block[-1 if family == "umt5" else 0].layer[0].SelfAttention.relative_attention_bias
    changes = {
        "new Parameter": lambda: setattr(ff.wo, "weight", torch.nn.Parameter(ff.wo.weight.detach() * 0.5)),
        ".data =": lambda: setattr(ff.wi_1.weight, "data", ff.wi_1.weight.data * 1.25),
        "in place": lambda: ff.wi_0.weight.mul_(1.5),
        "bias in place": lambda: bias.weight.data.add_(0.3),
        "module swapped": lambda: setattr(ff, "wo", torch.nn.Linear(ff.wo.in_features, ff.wo.out_features,
                                                                    bias=False, device="cuda")),
    }
    for what, change in changes.items():
        hp.patch_model(model)
        try:
            for _ in range(3):
                pipeline_call(model, ids)
            assert graphs_of(model).captures == 1, what
            with torch.no_grad():
                change()
            got = [pipeline_call(model, ids) for _ in range(3)]
        finally:
            hp.unpatch_model(model)
        want = eager_patched(model, ids)
        for g in got:
            assert torch.equal(g, want), what
    hp.patch_model(model)
    seen = []
    try:
        for _ in range(3):
            pipeline_call(model, ids)
        hook = ff.register_forward_hook(lambda *_: seen.append(1))
        try:
            for _ in range(3):
                pipeline_call(model, ids)
        finally:
            hook.remove()
    finally:
        hp.unpatch_model(model)
    assert len(seen) == 3  # the hook ran on every call: eager while it is there


def test_capture_while_another_thread_uses_the_gpu():
    model = encoder(dtype=torch.bfloat16)
    shapes = [(1, 77), (1, 120), (2, 77), (1, 512)]
    hp.patch_model(model)
    stop, errors = threading.Event(), []

    def busy():
        try:
            while not stop.is_set():
                torch.tensor(list(range(256)), device="cuda").sum().item()
        except Exception as exc:  # noqa: BLE001  (reported in the test's thread)
            errors.append(exc)

    thread = threading.Thread(target=busy, daemon=True)
    try:
        eager = {s: pipeline_call(model, ids_of(*s)) for s in shapes}
        thread.start()
        for _ in range(2):
            for s in shapes:
                assert torch.equal(pipeline_call(model, ids_of(*s)), eager[s])
        assert graphs_of(model).captures == len(shapes)
    finally:
        stop.set()
        if thread.is_alive():
            thread.join(timeout=30)
        hp.unpatch_model(model)
    assert not errors, errors


_COLD_SCRIPT = r"""
import json, threading, torch, triton.compiler
from transformers import T5EncoderModel
import hf_paged_t5 as hp
from hf_paged_t5 import tiny

threads = []
real = triton.compiler.compile
def compile(*a, **kw):
    threads.append(threading.current_thread().name)
    return real(*a, **kw)
triton.compiler.compile = compile
config = tiny.build_config("t5-small", family="t5v1_1", vocab_size=1000)
def build():
    with torch.device("cuda"):
        torch.manual_seed(0)
        return T5EncoderModel(config).to(torch.bfloat16).eval()
models = [build(), build()]
ids = torch.randint(2, 1000, (2, 77), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
cold = hp.patch_model(models[0])
with torch.inference_mode():
    first = cold(ids)[0].clone()
    first_threads = list(threads)
    warm = hp.patch_model(models[1])  # kernels compiled now: its own pass compiles nothing
    print(json.dumps(dict(first_threads=first_threads, later=threads[len(first_threads):],
                          equal=bool(torch.equal(first, warm(ids)[0])),
                          kinds=[str(k[1]) for k in cold._hf_paged_t5.compiled_ahead])))
"""


def test_a_cold_first_call_compiles_its_kernels_on_the_pool_and_gives_the_same_bits(tmp_path):
    """A fresh process with an empty Triton cache and no compile workers: every compile of the
    first encoder call runs on the compile pool (none on the caller's thread), and the output is the one a second model gets
    once the kernels are compiled."""
    report = run_cold(_COLD_SCRIPT, tmp_path, HF_PAGED_T5_COMPILE_WORKERS="0")
    assert report["first_threads"], "the cold call compiled nothing: the Triton cache was not empty"
    assert all(name.startswith("hf_paged_t5-compile") for name in report["first_threads"]), report
    assert report["later"] == [] and report["equal"], report
    assert report["kinds"] == ["('encoder', True)"]


def test_no_garbage_collection_runs_inside_a_capture():
    """A CUDA graph held only by a reference cycle (as a dropped runtime's graphs were) dies at a
    cyclic collection; one inside a capture destroys it on the capturing thread ("operation not
    permitted when stream is capturing (function reset)") and invalidates the capture. With a
    collection due at every allocation, none starts while the package captures, the cycle is
    freed after, and the capture replays."""
    import gc

    from hf_paged_t5.model import encoder_graphs

    x = torch.ones(4, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    old = torch.cuda.CUDAGraph()
    encoder_graphs.capture(old, lambda: x * 2, stream)

    class Cycle:
        pass

    cycle = Cycle()
    cycle.self, cycle.graph = cycle, old
    holder = [cycle]
    del cycle, old
    collections_while_capturing = []

    def watch(phase, info):
        if phase == "start":
            collections_while_capturing.append(torch.cuda.is_current_stream_capturing())

    def work():
        holder.clear()  # now only the cycle keeps the old graph alive
        _ = [[] for _ in range(1000)]  # tracked allocations: collections due
        return x + 1

    thresholds = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    gc.callbacks.append(watch)
    try:
        graph = torch.cuda.CUDAGraph()
        out = encoder_graphs.capture(graph, work, stream)
        _ = [[] for _ in range(1000)]  # after the capture: collections run again
    finally:
        gc.callbacks.remove(watch)
        gc.set_threshold(*thresholds)
    gc.collect()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(x, 2.0))
    assert collections_while_capturing and not any(collections_while_capturing)
