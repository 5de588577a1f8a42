"""Compile workers (`kernels/compile_workers.py`): Triton compiles in processes of their own.

On the CPU a worker compiles for an sm_90 target (Triton's compiler and ptxas need no GPU), so
the protocol, the cache hand-over and every way a compile comes back to the parent run here; the
GPU test runs the whole path: a cold generate() sends the other row counts' decode binaries to
the workers, and the beam and 2-row calls after it read them from Triton's cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from hf_paged_t5.kernels import compile_workers

_SCRIPT = r"""
import importlib, json, os, sys, time
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import get_cache_key, get_cache_invalidating_env_vars
from hf_paged_t5.kernels import compile_workers

gelu = importlib.import_module("hf_paged_t5.kernels.gated_gelu")._gated_gelu_kernel
hits = []
listener = getattr(triton.knobs.compilation, "listener", "absent")
if listener != "absent":
    triton.knobs.compilation.listener = lambda **kw: hits.append(bool(kw.get("cache_hit")))


def closure(block):
    # what Triton's JIT hands an async-compile mode: a closure over src, target, options, env_vars
    names = gelu.arg_names
    signature = {n: "*bf16" for n in names[:3]} | {n: "i32" for n in names[3:7]} | {n: "constexpr" for n in names[7:]}
    src = ASTSource(gelu, signature, {(7,): 0.7978845608028654, (8,): block},
                    {(i,): [["tt.divisibility", 16]] for i in range(3)})
    target = GPUTarget("cuda", 90, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": 4})
    env_vars = get_cache_invalidating_env_vars()

    def async_compile():
        return triton.compile(src, target=target, options=options.__dict__, _env_vars=env_vars)

    return get_cache_key(src, backend, options, env_vars), async_compile


def wait(future):
    while not future._job.finished.is_set():
        time.sleep(0.02)


report = {}
compile_workers.start()
report["running"] = compile_workers.running()
key, fn = closure(512)
report["spec"] = compile_workers.spec_of(fn)["name"]
report["not_ours"] = compile_workers.spec_of(lambda: None)
first = compile_workers.submit(key, fn)
wait(first)
hits.clear()
kernel = first.result()
import hashlib
report["first"] = dict(ok=first._job.ok, state=first._job.state, hits=list(hits),
                       hash_equal=kernel.hash == hashlib.sha256(key.encode()).hexdigest())
# one worker: the second is running when the third is asked for, which nobody has begun
busy, idle = compile_workers.submit(*closure(256)), compile_workers.submit(*closure(128))
report["pending"] = compile_workers.pending()
hits.clear()
idle.result()
report["taken"] = dict(state=idle._job.state, hits=list(hits))
busy.result()
report["busy"] = dict(ok=busy._job.ok, state=busy._job.state)
report["history"] = [(j["name"], j["ok"], j["asked"] <= j["began"] <= j["ended"] <= time.perf_counter())
                     for j in compile_workers.history()]
# a compile the worker fails (a block that is not a power of two): the parent compiles it and raises
bad = compile_workers.submit(*closure(384))
wait(bad)
try:
    bad.result()
    report["bad"] = "no error"
except Exception as exc:
    report["bad"] = dict(ok=bad._job.ok, error=bool(bad._job.error), raised=type(exc).__name__)
# a worker that exits mid-compile: the parent compiles it
gone = compile_workers.submit(*closure(64))
while gone._job.state != "running":
    time.sleep(0.01)
compile_workers.stop()
report["gone"] = dict(kernel=gone.result().hash is not None, ok=gone._job.ok, running=compile_workers.running())
late = compile_workers.submit(*closure(32))
report["late"] = dict(state=late._job.state, kernel=late.result().hash is not None)
print(json.dumps(report))
"""


def test_a_worker_compiles_into_the_cache_and_every_other_way_comes_back_here(tmp_path):
    """One worker, an sm_90 target compiled on this machine: its binary is the parent's cache hit
    under the parent's own key, its times in `history()`; a compile nobody began is taken back; a failed one raises the
    parent's error; one whose worker exited, or sent after the workers are gone, compiles here."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache"), "HF_PAGED_T5_COMPILE_WORKERS": "1"}
    env.pop("TRITON_INTERPRET", None)
    done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["running"] and report["spec"] == "_gated_gelu_kernel" and report["not_ours"] is None
    assert report["first"]["ok"] and report["first"]["state"] == "finished" and report["first"]["hash_equal"]
    assert report["first"]["hits"] in ([True], [])  # [] where this Triton has no compilation listener
    assert report["pending"] == 2
    assert report["taken"]["state"] == "taken" and report["taken"]["hits"] in ([False], [])
    assert report["busy"] == dict(ok=True, state="finished")
    # what the workers ran, with when on the machine's one clock: the first and the busy one, not the one taken back
    assert report["history"] == [["_gated_gelu_kernel", True, True]] * 2
    assert report["bad"] == dict(ok=False, error=True, raised=report["bad"]["raised"]) and report["bad"]["raised"]
    assert report["gone"] == dict(kernel=True, ok=False, running=False)
    assert report["late"] == dict(state="taken", kernel=True)


_IDLE = r"""
import json, time
from hf_paged_t5.kernels import compile_workers
compile_workers._Pool.idle_s = 0.5  # private: the idle time, short for the test
compile_workers.start()
workers = list(compile_workers._Pool.workers)
started = compile_workers.running()
deadline = time.time() + 120
while compile_workers.running() and time.time() < deadline:
    time.sleep(0.05)
time.sleep(0.2)
print(json.dumps(dict(started=started, count=len(workers), running=compile_workers.running(),
                      reaped=[w.process.returncode is not None for w in workers])))
"""


def test_a_worker_builds_the_launcher_beside_its_compile(monkeypatch):
    """A worker's compile (`_compile`) starts the kernel's C launcher build on a thread of its own
    before it compiles (the compile here waits until that build has begun: it fails if the build
    came after it) and returns once both are done; a build that fails is dropped (the binary's load
    builds it again). Without a launcher to build (Triton 3.9) the compile runs alone."""
    import threading

    import triton.compiler

    events, began = [], threading.Event()

    def build():
        events.append(("build", threading.current_thread() is not threading.main_thread()))
        began.set()
        if fail:
            raise RuntimeError("no C compiler")

    def compile(src, target, options, _env_vars):
        if expect_build:
            assert began.wait(10)
        events.append(("compile", src.fn.__name__))
        return type("Kernel", (), {"hash": "h", "src": src, "metadata": None})()

    monkeypatch.setattr(triton.compiler, "compile", compile)
    spec = dict(module="hf_paged_t5.kernels.gated_gelu", name="_gated_gelu_kernel", attrs={}, target=("cuda", 90, 32),
                options={}, env_vars={}, constants={}, signature={})
    for expect_build, fail in ((True, False), (True, True), (False, False)):
        events.clear()
        began.clear()
        monkeypatch.setattr(compile_workers, "launcher_build", lambda src: ("source", build) if expect_build else None)
        assert compile_workers._compile(spec) == "h"
        assert events == ([("build", True)] if expect_build else []) + [("compile", "_gated_gelu_kernel")], events


def test_an_idle_worker_exits_and_is_reaped(tmp_path):
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache"), "HF_PAGED_T5_COMPILE_WORKERS": "2"}
    done = subprocess.run([sys.executable, "-c", _IDLE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report == dict(started=True, count=2, running=False, reaped=[True, True])


def test_worker_count_comes_from_the_environment_or_the_cores(monkeypatch):
    monkeypatch.setenv("HF_PAGED_T5_COMPILE_WORKERS", "3")
    assert compile_workers.count() == 3
    monkeypatch.setenv("HF_PAGED_T5_COMPILE_WORKERS", "0")
    assert compile_workers.count() == 0
    monkeypatch.setenv("HF_PAGED_T5_COMPILE_WORKERS", "many")
    with pytest.raises(ValueError, match="HF_PAGED_T5_COMPILE_WORKERS must be a whole number"):
        compile_workers.count()
    monkeypatch.delenv("HF_PAGED_T5_COMPILE_WORKERS")
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert compile_workers.count() == 0
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert compile_workers.count() == 8
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert compile_workers.count() == 3
    monkeypatch.setattr(os, "cpu_count", lambda: 128)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # 8 processes of one torchrun launch share the cores
    assert compile_workers.count() == 8
    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    assert compile_workers.count() == 2
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert compile_workers.count() == 0


# A fresh process's start: its compiles (True: a cache hit) and a t5-small model builder.
_COLD_START = r"""
import json, time, torch, triton
import hf_paged_t5 as hp
from hf_paged_t5 import tiny
from hf_paged_t5.kernels import compile_workers

compiles = []
triton.knobs.compilation.listener = lambda **kw: compiles.append(bool(kw.get("cache_hit")))
config = tiny.build_config("t5-small", vocab_size=1000)
from transformers import T5ForConditionalGeneration
def build(dtype):
    with torch.device("cuda"):
        torch.manual_seed(0)
        return T5ForConditionalGeneration(config).to(dtype).eval()
"""

_COLD_ROWS = _COLD_START + r"""
cold, warm = hp.patch_model(build(torch.bfloat16)), build(torch.bfloat16)
def ids(rows):
    return torch.randint(2, 1000, (rows, 40), device="cuda", generator=torch.Generator(device="cuda").manual_seed(rows))
kw = dict(max_new_tokens=8, min_new_tokens=8)
deadline = time.monotonic() + 120  # the workers started up, so the first call's pass can use them
while compile_workers.free() < 4 and time.monotonic() < deadline:
    time.sleep(0.05)
first = cold.generate(input_ids=ids(1), **kw)
first_compiles, sent = list(compiles), compile_workers.sent()
while compile_workers.pending():
    time.sleep(0.05)
before = len(compiles)
beam = cold.generate(input_ids=ids(1), num_beams=4, **kw)
two = cold.generate(input_ids=ids(2), **kw)
wider = {rows: cold.generate(input_ids=ids(rows), **kw) for rows in (16, 64)}  # op-by-op steps
later = compiles[before:]
hp.patch_model(warm)
equal = [torch.equal(beam, warm.generate(input_ids=ids(1), num_beams=4, **kw)),
         torch.equal(two, warm.generate(input_ids=ids(2), **kw))]
equal += [torch.equal(out, warm.generate(input_ids=ids(rows), **kw)) for rows, out in wider.items()]
print(json.dumps(dict(sent=sent, running=compile_workers.running(), first=first_compiles, later=later,
                      equal=equal)))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cold_generate_sends_the_other_row_counts_to_the_workers(tmp_path):
    """A fresh process, an empty Triton cache, 4 workers: the first generate() loads some of its
    binaries from the workers (its pass compiled them there) and sends the fused layer's 2- and
    4-row binaries and the op-by-op step's there too; the beam call and the 2-, 16- and 64-row
    calls after it find every binary they load in Triton's cache, and give a second model's tokens."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache"), "HF_PAGED_T5_COMPILE_WORKERS": "4"}
    done = subprocess.run([sys.executable, "-c", _COLD_ROWS], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["running"] and report["sent"] > 0, report
    assert any(report["first"]), report  # the first call's pass: some of its binaries from the workers
    assert report["later"] and all(report["later"]), report  # every load a cache hit
    assert report["equal"] == [True] * 4, report


_COLD_JOB = _COLD_START + r"""
model = build(torch.float32)  # float32: the job's tokens equal generate()'s...
with torch.no_grad():  # ...where fp32 is well conditioned: at this init's query scale the scores over
    for name, p in model.named_parameters():  # 1,100 keys are so large that rounding flips the softmax
        if name.endswith(".q.weight"):  # (stock HF's fp32 and fp64 tokens differ); smaller queries
            p.mul_(0.03)  # keep stock fp32 within ~1e-3 of fp64 in the logits
model = hp.patch_model(model)
g = torch.Generator().manual_seed(0)
# 140 rows over 1,100-token sources: the first steps' graph serves 256 rows, whose decode launches
# pipeline their loads; 80 rows finish after 4 tokens, and the other 60 run on the 64-row graph,
# whose launches are the register-prefetch ones (kernels.launch.decode_config)
inputs = [torch.randint(2, 1000, (1100,), generator=g).tolist() for _ in range(140)]
news = [4] * 80 + [12] * 60
requests = [hp.BatchRequest(ids, max_new_tokens=n, min_new_tokens=n) for ids, n in zip(inputs, news)]
results, later = {}, None
for index, result in hp.BatchGenerator(model).as_completed(requests):
    results[index] = result.sequences[0]
    if later is None:  # the first rows are done: wait for the workers, then count what loads
        sent = compile_workers.sent()
        while compile_workers.pending():
            time.sleep(0.05)
        later = len(compiles)
ending = compiles[later:]
alone = [model.generate(input_ids=torch.tensor([inputs[i]], device="cuda"), max_new_tokens=news[i],
                        min_new_tokens=news[i])[0].tolist() for i in (0, 139)]
print(json.dumps(dict(sent=sent, later=ending, equal=[results[0] == alone[0], results[139] == alone[1]])))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cold_batch_job_sends_its_last_rows_step_to_the_workers(tmp_path):
    """A fresh process, an empty Triton cache, 4 workers: a BatchGenerator job's compile-ahead pass
    sends the step of its 64-row graph to the workers; when its last rows run on that graph,
    every binary they load is in Triton's cache, and they give generate()'s tokens."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache"), "HF_PAGED_T5_COMPILE_WORKERS": "4"}
    done = subprocess.run([sys.executable, "-c", _COLD_JOB], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["sent"] > 0, report
    assert report["later"] and all(report["later"]), report  # the 64-row graph's loads: cache hits
    assert report["equal"] == [True, True], report


_COLD_TWIN = _COLD_START + r"""
import logging
from transformers import T5EncoderModel
from hf_paged_t5.kernels.prefill import _ONE_LOOP_TWINS as twins
said = []
class Keep(logging.Handler):
    def emit(self, record):
        said.append(record.getMessage())
log = logging.getLogger("hf_paged_t5.kernels.ahead")
log.addHandler(Keep())
log.setLevel(logging.DEBUG)
with torch.device("cuda"):
    torch.manual_seed(0)
    encoder = hp.patch_model(T5EncoderModel(config).to(torch.bfloat16).eval())
deadline = time.monotonic() + 120  # the workers started up: every compile of the first call's pass goes there
while compile_workers.free() < 6 and time.monotonic() < deadline:
    time.sleep(0.05)
ids = torch.randint(2, 1000, (1, 300), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
with torch.no_grad():
    first = encoder(input_ids=ids)[0]
    twin = sum("twin" in message for message in said)
    pending_at_capture = len(twins)  # the default binary still compiling: the capture keeps the twin (1 x 300)
    outs = [encoder(input_ids=ids)[0]]  # the second call: the graph's capture
    while compile_workers.pending():
        time.sleep(0.05)
    outs += [encoder(input_ids=ids)[0] for _ in range(2)]  # replayed
    encoder(input_ids=ids[:, :299])  # a launch outside a graph: the default binary, the twin dropped
print(json.dumps(dict(twin=twin, waiting=len(twins), pending_at_capture=pending_at_capture,
                      equal=[torch.equal(first, o) for o in outs])))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_cold_encoder_runs_the_one_loop_twin_while_a_worker_compiles_the_prefill(tmp_path):
    """A fresh process, an empty Triton cache, 6 workers: a text encoder's first call runs the
    prefill kernel's one-loop twin (its pass sent both compiles to the workers, the twin's the
    shorter); the second captures a graph (of the twin where the default binary is still
    compiling: 1 x 300 tokens is a size where it is as fast), replayed after the workers are
    done: the same bits throughout."""
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "cache"), "HF_PAGED_T5_COMPILE_WORKERS": "6"}
    done = subprocess.run([sys.executable, "-c", _COLD_TWIN], env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["twin"] >= 1 and report["waiting"] == 0 and report["equal"] == [True, True, True], report


def test_free_counts_ready_idle_workers_less_the_queue(monkeypatch):
    """`free()`: workers started up with no job, less the jobs queued for them; none in a forked child."""
    class Worker:
        def __init__(self, ready, job):
            self.ready, self.job = ready, job

    monkeypatch.setattr(compile_workers._Pool, "pid", os.getpid())
    monkeypatch.setattr(compile_workers._Pool, "workers", [Worker(True, None), Worker(True, None),
                                                           Worker(False, None), Worker(True, object())])
    monkeypatch.setattr(compile_workers._Pool, "queue", compile_workers.collections.deque())
    assert compile_workers.free() == 2
    compile_workers._Pool.queue.append(object())
    assert compile_workers.free() == 1
    compile_workers._Pool.queue.extend([object(), object()])
    assert compile_workers.free() == 0
    monkeypatch.setattr(compile_workers._Pool, "pid", os.getpid() + 1)
    assert compile_workers.free() == 0


def test_a_passs_compiles_go_to_free_workers_and_the_rest_to_its_pool(monkeypatch):
    """Inside a pass, `compile_in_workers` sends each new compile to the workers while one is free
    and to the pass's own mode (its pool, which the pass waits for) once none is; a compile either
    already holds is not asked for again, and `compile_elsewhere` inside it still queues for the
    workers (a later call's binaries: the pass must not wait for them)."""
    import concurrent.futures

    from hf_paged_t5.kernels import ahead

    if ahead.AsyncCompileMode is None:
        pytest.skip("this Triton has no async-compile mode")

    class Pool:  # the pass's own mode
        def __init__(self):
            self.future_kernels = {"held": "the pool's"}

        def submit(self, key, compile_fn, finalize_fn, *cleanup):
            self.future_kernels[key] = f"pool {key}"
            return self.future_kernels[key]

    free, sent = [2], []

    def submit(key, compile_fn):
        sent.append(key)
        free[0] = max(0, free[0] - 1)
        return concurrent.futures.Future()

    monkeypatch.setattr(compile_workers, "free", lambda: free[0])
    monkeypatch.setattr(compile_workers, "submit", submit)
    monkeypatch.setattr(ahead, "elsewhere_available", lambda: True)
    kernel_cache = {}

    def finalizer(key):
        def finalize_compile(kernel):
            kernel_cache[key] = kernel
        return finalize_compile

    def ask(key):
        return ahead._active_mode.get().submit(key, lambda: None, finalizer(key), lambda kernel: None)

    with ahead.compile_in_workers() as sending:  # outside a pass: nothing changes
        assert sending is False and ahead._active_mode.get() is None
    pool = Pool()
    only, mode = ahead._COMPILE_ONLY.set(True), ahead._active_mode.set(pool)
    try:
        with ahead.compile_in_workers() as sending:
            assert sending
            first, second = ask("a"), ask("b")
            assert sent == ["a", "b"] and kernel_cache == {"a": first, "b": second}
            assert ask("c") == "pool c" and ask("a") is first and ask("held") == "the pool's"
            with ahead.compile_elsewhere():
                ask("d")  # no worker free, queued for them all the same
                assert ask("b") is second and ask("c") == "pool c"
            assert sent == ["a", "b", "d"] and set(pool.future_kernels) == {"held", "c"}
        assert ahead._active_mode.get() is pool
    finally:
        ahead._active_mode.reset(mode)
        ahead._COMPILE_ONLY.reset(only)

