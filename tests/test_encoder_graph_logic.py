"""The bookkeeping of encoder graphs (model/encoder_graphs.py) on the CPU: a stand-in for the CUDA
capture replays the captured forward eagerly, so what is tested here is everything around a
graph: which call captures, which replays, that the captured forward (its bias tables gathered
from the weights) gives the eager forward's bits, and that every change a user can make to the
weights or modules drops the graphs or keeps the call eager. tests/test_encoder_graphs.py runs
real graphs on a GPU."""

from __future__ import annotations

import pytest
import torch
from transformers import T5EncoderModel, UMT5EncoderModel

import hf_paged_t5 as hp
from hf_paged_t5 import tiny
from hf_paged_t5.model import encoder_graphs

ENCODERS = {"t5v1_1": T5EncoderModel, "umt5": UMT5EncoderModel}
CPU = hp.PagedCacheConfig(backend="cpu")


@pytest.fixture(autouse=True)
def cpu_graphs(cpu_encoder_graphs):  # conftest: encoder graphs "captured" on the CPU
    pass


def encoder(family="t5v1_1"):
    torch.manual_seed(0)
    return ENCODERS[family](tiny.build_config("tiny", family=family, num_layers=3)).eval()


def ids_of(batch, length, seed=0):
    return torch.randint(2, 100, (batch, length), generator=torch.Generator().manual_seed(seed))


def call(model, ids, mask=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask)[0]


def eager(model, ids, mask=None):
    hp.patch_model(model, hp.PagedCacheConfig(backend="cpu", cuda_graphs=False))
    try:
        return call(model, ids, mask)
    finally:
        hp.unpatch_model(model)


def graphs_of(model):
    return model._hf_paged_t5.encoder_graphs


@pytest.mark.parametrize("family", ["t5v1_1", "umt5"])
def test_second_call_captures_later_calls_replay(family):
    model = encoder(family)
    ids, other = ids_of(2, 20), ids_of(2, 20, seed=1)
    want, want_other = eager(model, ids), eager(model, other)
    hp.patch_model(model, CPU)
    try:
        outs = [call(model, ids)]
        assert graphs_of(model).captures == 0  # a shape seen once runs eagerly
        outs += [call(model, ids), call(model, other), call(model, ids)]
        assert (graphs_of(model).captures, graphs_of(model).replays) == (1, 3)
        with torch.enable_grad():  # gradients on: never a graph (stock HF, for autograd)
            assert model(ids)[0].requires_grad
        assert graphs_of(model).replays == 3
    finally:
        hp.unpatch_model(model)
    assert all(torch.equal(o, w) for o, w in zip(outs, [want, want, want_other, want]))


@pytest.mark.parametrize("family", ["t5v1_1", "umt5"])
def test_every_change_to_the_weights_is_seen(family):
    model = encoder(family)
    ids = ids_of(1, 24)
    ff = model.encoder.block[1].layer[-1].DenseReluDense
    bias = model.encoder.block[-1 if family == "umt5" else 0].layer[0].SelfAttention.relative_attention_bias
    changes = {  # what: (change, whether the graphs must be dropped and captured again)
        "new Parameter": (lambda: setattr(ff.wo, "weight", torch.nn.Parameter(ff.wo.weight.detach() * 0.5)), True),
        ".data =": (lambda: setattr(ff.wi_1.weight, "data", ff.wi_1.weight.data * 1.25), True),
        "in place": (lambda: ff.wi_0.weight.mul_(1.5), False),
        "bias in place": (lambda: bias.weight.data.add_(0.3), False),
        "module swapped": (lambda: setattr(ff, "wo", torch.nn.Linear(ff.wo.in_features, ff.wo.out_features,
                                                                     bias=False)), True),
    }
    for what, (change, recaptured) in changes.items():
        hp.patch_model(model, CPU)
        try:
            for _ in range(2):
                call(model, ids)
            with torch.no_grad():
                change()
            got = [call(model, ids) for _ in range(3)]
            replays, captures = graphs_of(model).replays, graphs_of(model).captures
        finally:
            hp.unpatch_model(model)
        want = eager(model, ids)
        assert all(torch.equal(g, want) for g in got), what
        # in place: the same graph replays all three; else dropped, the next call captures again
        assert (captures, replays) == ((2, 4) if recaptured else (1, 4)), what


def test_hooks_keep_calls_eager_and_masks():
    model = encoder()
    ids = ids_of(2, 16)
    ones, padded = torch.ones_like(ids), torch.ones_like(ids)
    padded[1, 10:] = 0
    want_padded = eager(model, ids, padded)
    hp.patch_model(model, CPU)
    seen = []
    try:
        for _ in range(3):
            full = call(model, ids, ones)  # an all-ones mask: the unmasked graph
            out = call(model, ids, padded)  # a padded mask: a graph of its own
        assert (graphs_of(model).captures, graphs_of(model).replays) == (2, 4)
        hook = model.encoder.block[0].layer[-1].DenseReluDense.register_forward_hook(lambda *_: seen.append(1))
        try:
            for _ in range(2):
                hooked = call(model, ids)
                hooked_padded = call(model, ids, padded)
        finally:
            hook.remove()
        assert graphs_of(model).replays == 4 and len(seen) == 4  # the hook ran on every call
        call(model, ids)
        assert graphs_of(model).replays == 5  # hook gone: replayed again
    finally:
        hp.unpatch_model(model)
    assert torch.equal(full, eager(model, ids)) and torch.equal(hooked, full)
    assert torch.equal(out, want_padded) and torch.equal(hooked_padded, want_padded)


def test_a_padded_batch_replays_only_for_its_own_mask():
    """The graph of a padded call packs that mask's positions: the same mask with other tokens
    replays it (the eager bits, zeros where padded), another mask of the shape (right or left
    padded) is counted and captured on its own; each output is the eager one."""
    model = encoder()
    masks = [torch.ones(3, 12, dtype=torch.long) for _ in range(3)]
    masks[0][1, 7:] = 0
    masks[1][1, 8:] = 0  # one token more in row 1
    masks[2][2, :5] = 0  # left padding
    feeds = [(ids_of(3, 12, seed=s), m) for s in range(3) for m in masks]
    want = [eager(model, i, m) for i, m in feeds]
    hp.patch_model(model, CPU)
    try:
        got = [call(model, i, m) for _ in range(2) for i, m in feeds]
        graphs = graphs_of(model)
        assert (graphs.captures, graphs.replays) == (3, 3 * 6 - 3)  # each mask: eager once, captured at its second
        stats = hp.runtime_stats(model)
        assert (stats["encoder_graphs"], stats["encoder_graphs_captured"], stats["encoder_replays"]) == (3, 3, 15)
    finally:
        hp.unpatch_model(model)
    assert all(torch.equal(g, w) for g, w in zip(got, want + want))
    assert all(float(g[1, 7:].abs().max()) == 0.0 for g in got[0:9:3])  # padded positions are zeros


def test_counted_keys_stay_bounded(monkeypatch):
    """A stream of masks that never recur does not grow the count without bound."""
    monkeypatch.setattr(encoder_graphs, "MAX_SEEN", 4)
    graphs = encoder_graphs.EncoderGraphs()
    for k in range(10):
        graphs.seen(("shape", k))
        assert len(graphs._seen) <= 4
    graphs.seen(("shape", 9))
    assert graphs._seen[("shape", 9)] == 2


def test_many_shapes_at_once_stay_eager():
    """A stream of more recent shapes than graphs kept (one generate() per request of any length)
    captures none; once the recent calls' shapes fit again, a recurring one is captured."""
    graphs = encoder_graphs.EncoderGraphs()
    many = [("shape", k % (encoder_graphs.MAX_GRAPHS + 2)) for k in range(3 * (encoder_graphs.MAX_GRAPHS + 2))]
    for key in many:
        graphs.seen(key)
        assert not graphs.would_capture(key)  # each seen 2-3 times, but 10 shapes in the window
    for k in range(encoder_graphs.RECENT_CALLS):
        graphs.seen(("hot", k % 2))
    assert graphs.would_capture(("hot", 0)) and graphs.would_capture(("hot", 1))
    assert not graphs.would_capture(("hot", 2))  # seen never: eager


def test_generate_replays_its_encoder_for_a_recurring_shape():
    """generate()'s own encoder call takes a graph like a call of its own (at small batches it is
    launch-bound): the second call of a shape captures, the third replays, tokens unchanged."""
    model = tiny.build_model("tiny", num_layers=2, num_decoder_layers=2)
    ids, mask = ids_of(2, 12), torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=5, min_new_tokens=5)
    with torch.no_grad():
        want = model.generate(**kw)
    hp.patch_model(model, CPU)
    try:
        with torch.no_grad():
            outs = [model.generate(**kw) for _ in range(3)]
        assert (graphs_of(model).captures, graphs_of(model).replays) == (1, 2)  # captured (and run) once, replayed once
    finally:
        hp.unpatch_model(model)
    assert all(torch.equal(o, want) for o in outs)


def test_unpatch_releases_the_encoder_graphs_without_a_collection():
    """A patched model's runtime is a reference cycle, freed only by Python's cyclic collector; its
    encoder graphs (and on a GPU their memory pools) go at `unpatch_model`, not at that collection."""
    import gc
    import weakref

    model = encoder()
    hp.patch_model(model, CPU)
    for _ in range(2):
        call(model, ids_of(1, 7))
    assert hp.runtime_stats(model)["encoder_graphs"] == 1
    runtime = model._hf_paged_t5
    graph = weakref.ref(next(iter(runtime.encoder_graphs._graphs.values())).graph)
    enabled = gc.isenabled()
    gc.disable()
    try:
        del runtime
        hp.unpatch_model(model)
        assert graph() is None
    finally:
        if enabled:
            gc.enable()


def test_no_garbage_collection_inside_a_capture(monkeypatch):
    """`encoder_graphs.capture` (every CUDA graph capture of the package) keeps Python's cyclic
    collector off from capture_begin to capture_end, a failed end included, and as it was after."""
    import gc

    seen = []

    class Graph:
        def __init__(self, fail=False):
            self.fail = fail

        def capture_begin(self, *args, **kwargs):
            seen.append(("begin", gc.isenabled()))

        def capture_end(self):
            seen.append(("end", gc.isenabled()))
            if self.fail:
                raise RuntimeError("capture invalidated")

    monkeypatch.setattr(encoder_graphs, "_end_generator_capture", lambda: seen.append(("generator", gc.isenabled())))
    enabled = gc.isenabled()
    try:
        gc.enable()
        assert encoder_graphs.capture(Graph(), lambda: seen.append(("work", gc.isenabled())) or 7, None) == 7
        assert seen == [("begin", False), ("work", False), ("end", False)] and gc.isenabled()
        seen.clear()
        with pytest.raises(RuntimeError, match="invalidated"):
            encoder_graphs.capture(Graph(fail=True), lambda: seen.append(("work", gc.isenabled())), None)
        assert seen == [("begin", False), ("work", False), ("end", False), ("generator", False)] and gc.isenabled()
        gc.disable()
        encoder_graphs.capture(Graph(), lambda: None, None)
        assert not gc.isenabled()  # left as it was
    finally:
        (gc.enable if enabled else gc.disable)()


def test_the_collector_stays_off_until_the_last_of_overlapping_captures_ends():
    import gc
    import threading

    enabled = gc.isenabled()
    gc.enable()
    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def first():
        with encoder_graphs._no_collection():
            first_in.set()
            second_in.wait(5)
        first_out.set()

    try:
        thread = threading.Thread(target=first)
        thread.start()
        first_in.wait(5)
        with encoder_graphs._no_collection():
            second_in.set()
            first_out.wait(5)
            seen.append(gc.isenabled())  # the first capture ended; this one has not
        thread.join(5)
        assert seen == [False] and gc.isenabled()
    finally:
        (gc.enable if enabled else gc.disable)()
