"""Compiling a cold call's kernels at once (kernels/ahead.py) on the CPU: when the pass runs (the
first call of each kind per model and device), that the real call's output is untouched by it,
that a pass that fails leaves the real call as it was, and the launch overrides: compile-only in
the pass's own thread, normal launches everywhere else, removed when the last pass ends.
tests/test_gpu_e2e.py compiles real kernels ahead on a GPU."""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from transformers import T5EncoderModel
from triton.runtime.jit import JITFunction

import hf_paged_t5 as hp
from hf_paged_t5 import tiny
from hf_paged_t5.model import attention as attention_mod
from hf_paged_t5.kernels import ahead

CPU = hp.PagedCacheConfig(backend="cpu", cuda_graphs=False)


def encoder():
    torch.manual_seed(0)
    return T5EncoderModel(tiny.build_config("tiny", family="t5v1_1", num_layers=2)).eval()


@pytest.fixture
def passes(monkeypatch):
    """Records each pass's device; the pass itself is a plain context on the CPU."""
    seen = []

    @contextlib.contextmanager
    def fake(device):
        seen.append(device)
        yield

    monkeypatch.setattr(attention_mod, "compile_ahead_for", lambda device, backend: fake)
    return seen


def test_first_call_of_each_kind_compiles_ahead_once_and_output_is_unchanged(passes):
    ids = torch.randint(2, 100, (2, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    with torch.no_grad():
        plain = hp.patch_model(encoder(), CPU)
        plain._hf_paged_t5.compiled_ahead.update({(ids.device, ("encoder", True)), (ids.device, ("encoder", False))})
        want, want_masked = plain(ids)[0], plain(ids, attention_mask=mask)[0]
        model = hp.patch_model(encoder(), CPU)
        got = model(ids)[0]
        assert len(passes) == 1
        assert torch.equal(got, want) and torch.equal(model(ids)[0], want)
        assert len(passes) == 1  # the same kind again: no pass
        assert torch.equal(model(ids, attention_mask=mask)[0], want_masked)
        assert len(passes) == 2  # a masked call is a kind of its own
    assert model._hf_paged_t5.compiled_ahead == {(ids.device, ("encoder", True)), (ids.device, ("encoder", False))}


def test_a_batch_job_compiles_ahead_per_new_prefill_configuration_and_results_are_unchanged(passes, monkeypatch):
    """A BatchGenerator admission runs a pass (its encoder once per prefill configuration of its
    inputs' lengths, a cross K/V store onto scratch slots, its next decode step) when its inputs
    need more configurations than every pass before it: the first admission of the model's first
    job, then an input past a configuration boundary; other admissions and later jobs none. The
    pass's step has the graph key the next step gets, and the results are a job's without passes."""
    from transformers import T5ForConditionalGeneration

    from hf_paged_t5.batch import run as run_mod
    from hf_paged_t5.decode.graphs import graph_key

    def seq2seq():
        torch.manual_seed(0)
        return T5ForConditionalGeneration(tiny.build_config("tiny", num_layers=2, vocab_size=100)).eval()

    def lengths(attention, dtype, longest):  # a configuration boundary at 10 tokens (the CPU's fp32 has none)
        return [longest] if longest <= 10 else [10, longest]

    predicted, stepped = [], []

    def predict(cache, rows, self_tokens, cross_tokens):
        predicted.append(run_mod.predicted_key.__wrapped__(cache, rows, self_tokens, cross_tokens))
        return predicted[-1]

    predict.__wrapped__ = run_mod.predicted_key
    monkeypatch.setattr(run_mod, "prefill_lengths", lengths)
    monkeypatch.setattr(run_mod, "predicted_key", predict)
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randint(2, 100, (n,), generator=g).tolist() for n in (9, 4, 13, 6)]
    plain = hp.patch_model(seq2seq(), CPU)
    plain._hf_paged_t5.compiled_ahead.update({(torch.device("cpu"), ("batch job", n)) for n in (1, 2)})
    want = [r.sequences for r in hp.BatchGenerator(plain, max_new_tokens=5, max_batch_tokens=20).generate(inputs)]
    assert passes == []
    model = hp.patch_model(seq2seq(), CPU)
    runner = model._hf_paged_t5.runner
    decode = runner.decode

    def recording(model_, cache, ids):
        if len(stepped) < len(predicted):  # the first step after a pass
            stepped.append(graph_key(cache, ids.shape[0], cache.host_tables()))
        return decode(model_, cache, ids)

    monkeypatch.setattr(runner, "decode", recording)
    for _ in range(2):
        got = [r.sequences for r in hp.BatchGenerator(model, max_new_tokens=5, max_batch_tokens=20).generate(inputs)]
        assert got == want
    assert len(passes) == 2  # the 9-token input's admission, then the 13-token one's
    assert {k for _, k in model._hf_paged_t5.compiled_ahead if k[0] == "batch job"} == {("batch job", 1), ("batch job", 2)}
    assert stepped == predicted and len(predicted) == 2
    assert model._hf_paged_t5.pool.is_idle()


def test_a_pass_that_fails_leaves_the_real_call_as_it_was(monkeypatch):
    @contextlib.contextmanager
    def failing(device):
        yield
        raise RuntimeError("a compile that could not be done")

    monkeypatch.setattr(attention_mod, "compile_ahead_for", lambda device, backend: failing)
    ids = torch.randint(2, 100, (1, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hp.unpatch_model(hp.patch_model(encoder(), CPU))(ids)[0]
        model = hp.patch_model(encoder(), CPU)
        assert torch.allclose(model(ids)[0], want, atol=1e-5, rtol=1e-5)


def test_no_pass_off_cuda():
    assert attention_mod.compile_ahead_for(torch.device("cpu"), "cpu") is None
    assert not ahead.available(torch.device("cpu"))


def _kernel_source(x_ptr, n):
    pass


@pytest.fixture
def kernel(monkeypatch):
    """One JITFunction standing for the package's kernels, and its runs recorded (no GPU)."""
    jit = JITFunction(_kernel_source)
    runs = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *args, grid, warmup, **kw: runs.append(warmup))
    monkeypatch.setattr(ahead, "_kernels", lambda: [jit])
    monkeypatch.setattr(ahead, "_start_triton", lambda device: None)
    return jit, runs


def test_launches_compile_only_in_the_passs_own_thread(kernel):
    jit, runs = kernel
    jit[(1,)](None, 4)
    assert runs == [False]
    with ahead.compile_ahead(torch.device("cpu")):
        jit[(1,)](None, 4)
        other = threading.Thread(target=lambda: jit[(1,)](None, 4))
        other.start()
        other.join()
    assert runs == [False, True, False]
    assert "run" not in jit.__dict__  # the override is gone with the pass
    jit[(1,)](None, 4)
    assert runs[-1] is False


def test_overrides_stay_while_any_pass_runs(kernel):
    jit, _ = kernel
    entered, release = threading.Event(), threading.Event()

    def second():
        with ahead.compile_ahead(torch.device("cpu")):
            entered.set()
            release.wait(10)

    thread = threading.Thread(target=second)
    with ahead.compile_ahead(torch.device("cpu")):
        thread.start()
        assert entered.wait(10)
    assert "run" in jit.__dict__  # the other thread's pass still runs
    release.set()
    thread.join(10)
    assert "run" not in jit.__dict__


def _closure(src):
    """A compile closure over `src`, as Triton's JIT hands one to an async-compile mode."""
    def async_compile():
        return src
    return async_compile


def test_a_launcher_is_built_beside_its_compile_from_the_signature_the_load_uses(monkeypatch):
    """Where Triton's NVIDIA driver builds a C launcher per kernel signature (`make_launcher`,
    Triton 3.6), `_launcher_build` (the pool's; `compile_workers.launcher_build` of a compile
    closure's source, which the workers use too) makes the source its binary's load makes (`CudaLauncher`:
    constants keyed by argument index, the signature as compiled, no descriptor metadata) and
    builds it into Triton's cache as the load would; kernels with tensor-descriptor arguments,
    another driver and closures without a source get none."""
    import importlib
    import sys
    import types

    from triton.compiler import ASTSource

    made, built = [], []
    driver = types.ModuleType("triton.backends.nvidia.driver")

    def make_launcher(constants, signature, tensordesc_meta):
        made.append((constants, signature, tensordesc_meta))
        return f"launcher {sorted(constants.items())} {sorted(signature.items())}"

    driver.make_launcher = make_launcher
    driver.compile_module_from_src = lambda **kw: built.append(kw)
    driver.library_dirs = lambda: ["/cuda/lib"]
    driver.include_dirs, driver.libraries = ["/triton/include"], ["libcuda.so.1"]
    monkeypatch.setitem(sys.modules, "triton.backends.nvidia.driver", driver)

    kernel = importlib.import_module("hf_paged_t5.kernels.gated_gelu")._gated_gelu_kernel
    names = kernel.arg_names
    signature = {n: "*bf16" for n in names[:3]} | {n: "i32" for n in names[3:7]} | {n: "constexpr" for n in names[7:]}
    src = ASTSource(kernel, signature, {names[7]: 0.5, (8,): 512})
    source, build = ahead._launcher_build(_closure(src))
    assert made == [({(7,): 0.5, (8,): 512}, signature, None)]
    assert source == make_launcher({(7,): 0.5, (8,): 512}, signature, None)
    build()
    assert built == [dict(src=source, name="__triton_launcher", library_dirs=["/cuda/lib"],
                          include_dirs=["/triton/include"], libraries=["libcuda.so.1"])]

    with_descriptor = ASTSource(kernel, {**signature, names[0]: "tensordesc<bf16[64, 64]>"}, {})
    assert ahead._launcher_build(_closure(with_descriptor)) is None
    assert ahead._launcher_build(lambda: None) is None  # no source in the closure
    del driver.make_launcher  # Triton 3.9: one generic launcher
    assert ahead._launcher_build(_closure(src)) is None


def test_a_twin_runs_while_a_worker_compiles_its_binary_and_in_a_capture_only_where_as_fast(monkeypatch):
    """`Twins`: inside a pass, a binary whose compile went to a worker has its twin asked for
    beside it, once, where a worker is free; outside the pass the twin runs until that worker is
    done, a graph capture waits for the binary itself unless the caller says the twin is as fast
    at the launch's sizes (`in_graph`), and once the worker is done the binary runs
    and the twin is dropped. No twin for a binary already loaded, one no worker compiles, or
    where no worker is free."""
    from types import SimpleNamespace

    from hf_paged_t5.kernels import compile_workers

    def compiling():  # a compile's future, as `_Elsewhere` puts in a kernel's cache
        job = compile_workers._Job(1, "h", {}, lambda: "binary")
        job.state = "running"
        return job, SimpleNamespace(kernel=None, future=compile_workers.RemoteFuture(job))

    free, capturing = [1], [False]
    monkeypatch.setattr(compile_workers, "free", lambda: free[0])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    twins, launched = ahead.Twins(), []
    job, pending = compiling()
    returns = {False: pending, True: "twin"}

    def launch(twin):
        launched.append(twin)
        return returns[twin]

    only = ahead._COMPILE_ONLY.set(True)
    try:
        assert twins.launch("a", launch) is pending and launched == [False, True] and len(twins) == 1
        assert twins.launch("a", launch) is pending and launched[2:] == [False]  # asked for once
        returns[False] = SimpleNamespace(kernel="loaded", future=None)
        twins.launch("loaded", launch)
        returns[False] = SimpleNamespace(kernel=None, future=compile_workers.RemoteFuture(
            compile_workers._Job(2, "h", {}, lambda: "binary")))  # taken back: compiled here, no worker
        returns[False].future._job.state = "taken"
        returns[False].future._job.finished.set()
        twins.launch("here", launch)
        free[0] = 0
        returns[False] = compiling()[1]
        twins.launch("busy", launch)
        assert launched[3:] == [False, False, False] and len(twins) == 1
    finally:
        ahead._COMPILE_ONLY.reset(only)
    del launched[:]
    assert twins.launch("a", launch) == "twin" and twins.launch("other", launch) is returns[False]
    capturing[0] = True
    twins.launch("a", launch)
    assert twins.launch("a", launch, in_graph=True) == "twin"  # as fast at these sizes: the graph keeps it
    capturing[0] = False
    job.finished.set()  # the worker is done: its binary is read from Triton's cache
    twins.launch("a", launch)
    twins.launch("a", launch, in_graph=True)
    assert launched == [True, False, False, True, False, False] and len(twins) == 0
