"""What the benchmark scripts share: where results go and the `env.json` beside them, tables and
JSON, timing (CUDA-synced, medians, interleaved rounds), the random-weight models and inputs, and
the few reads of hf_paged_t5's private state that the scripts still need, each in one function.

Results of one machine and day go to `benchmarks/results/<YYYY-MM-DD>-<gpu>/` (`<gpu>` a slug of
the GPU's name, e.g. `h200`, or `cpu` without CUDA), one JSON file per suite, and one `env.json`:
the GPU, versions, the git state and the exact command of every suite that wrote there.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import gc
import hashlib
import importlib.metadata
import inspect
import json
import logging
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Sequence

import torch

BENCH = pathlib.Path(__file__).resolve().parent
REPO = BENCH.parent
RESULTS = BENCH / "results"

# ----------------------------------------------------------------------------- machine and code


def gpu_names() -> list[str]:
    """Names of the CUDA devices torch sees ([] without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]


def gpu_slug(name: str | None) -> str:
    """'NVIDIA H200' -> 'h200'; None (no GPU) -> 'cpu'."""
    if not name:
        return "cpu"
    name = name.lower().removeprefix("nvidia").strip()
    return "-".join("".join(c if c.isalnum() else " " for c in name).split())


def results_dir(out: str | os.PathLike | None = None, day: datetime.date | None = None) -> pathlib.Path:
    """`out`, or benchmarks/results/<day>-<gpu slug>/ (created)."""
    if out:
        folder = pathlib.Path(out)
    else:
        names = gpu_names()
        folder = RESULTS / f"{(day or datetime.date.today()).isoformat()}-{gpu_slug(names[0] if names else None)}"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def git_state() -> dict:
    """The commit checked out, whether the tree differs from it and which files do (results left
    out: a run writes them); without a git checkout commit and dirty are None. `source_sha256`: a
    digest of the package's Python files, which names the measured code either way."""
    digest = hashlib.sha256()
    for path in sorted((REPO / "hf_paged_t5").rglob("*.py")):
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    state = {"commit": None, "dirty": None, "changed": None, "source_sha256": digest.hexdigest()[:16]}

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout

    try:  # porcelain lines are "XY path": two status letters, a space
        status = git("status", "--porcelain", "--", ".", ":(exclude)benchmarks/results")
        changed = [line[3:] for line in status.splitlines()]
        state.update(commit=git("rev-parse", "HEAD").strip(), dirty=bool(changed), changed=changed)
    except (OSError, subprocess.CalledProcessError):
        pass
    return state


def package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment() -> dict:
    """The machine, the versions and the code measured."""
    names = gpu_names()
    return {
        "gpu": names[0] if names else None,
        "gpus": names,
        "cuda": torch.version.cuda,
        "cpu": {"arch": platform.machine(), "count": os.cpu_count(), "processor": platform.processor() or None},
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": package_version("transformers"),
        "triton": package_version("triton"),
        "float32_math": float32_math(),
        "git": git_state(),
    }


def float32_math() -> dict:
    """What float32 matrix products run as in this process: torch's TF32 switches and the driver's
    NVIDIA_TF32_OVERRIDE (which makes cuBLAS use TF32 whatever torch says): stock HF's fp32 tokens
    on a GPU follow them."""
    return {
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "NVIDIA_TF32_OVERRIDE": os.environ.get("NVIDIA_TF32_OVERRIDE"),
    }


def command_line(argv: Sequence[str] | None = None) -> str:
    """This process's command as typed from the repository root: `python benchmarks/x.py ...`."""
    argv = list(sys.argv if argv is None else argv)
    script = pathlib.Path(argv[0]).resolve() if argv else None
    if script is not None and script.is_file() and script.is_relative_to(REPO):
        argv[0] = str(script.relative_to(REPO))
    return shlex.join(["python", *argv])


def write_env(folder: str | os.PathLike, suite: str | None = None, commit: str | None = None,
              **fields) -> pathlib.Path:
    """Write `folder`/env.json: this machine and code and this process's command line at the top;
    under "suites", `fields` added to the entry of `suite`. Fields with a "command" start a new
    entry (when it started, the commit and dirty flag too). Entries of other suites are kept, so
    one folder holds one env.json for all the runs that wrote there. `commit` (`git describe
    --always --dirty` output, a "-dirty" suffix for uncommitted changes) replaces the tree's own
    git state, for a copied tree whose .git may lag."""
    path = pathlib.Path(folder) / "env.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    # keys this function does not write (a folder's hand-written "commands", "note") are kept
    env = {**old, "date": datetime.date.today().isoformat(), **environment(), "command": command_line(),
           "suites": old.get("suites", {})}
    if commit is not None:
        env["git"] = {"commit": commit.removesuffix("-dirty"), "dirty": commit.endswith("-dirty"),
                      "given": True, "source_sha256": env["git"]["source_sha256"]}
    if suite is not None:
        entry = env["suites"].setdefault(suite, {})
        if "command" in fields:
            entry.clear()
            entry["started_utc"] = utc_now()
        if "command" in fields or commit is not None:
            entry.update(commit=env["git"]["commit"], dirty=env["git"]["dirty"])
        entry.update(fields)
    return write_json(path, env, quiet=True)


def start_suite(out: str | os.PathLike | None, suite: str) -> pathlib.Path:
    """The results folder of a suite's script (see `results_dir`), with its env.json entry written."""
    folder = results_dir(out)
    write_env(folder, suite, command=command_line())
    return folder


def ab_side(label: str, results: dict) -> None:
    """One side's line of a two-checkout A/B (`ab_generate.py`, `ab_batch.py`): the label, the
    package file this process imported (which checkout it ran) and the results as JSON."""
    import importlib.util

    print(label, importlib.util.find_spec("hf_paged_t5").origin, json.dumps(results), flush=True)


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def require_cuda(script: str, device: str | torch.device = "cuda") -> None:
    """Exit with one line when `device` is a CUDA device and torch sees none."""
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        sys.exit(f"{script}: needs a CUDA GPU, and torch {torch.__version__} sees none "
                 f"(torch.cuda.is_available() is False)")


# ----------------------------------------------------------------------------- output


def write_json(path: str | os.PathLike, obj, quiet: bool = False) -> pathlib.Path:
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=1, default=str) + "\n", encoding="utf-8")
    if not quiet:
        print(f"wrote {path}", flush=True)
    return path


def cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def fmt(value, spec: str) -> str | None:
    """`value` formatted with `spec`; None stays None (a '-' cell)."""
    return None if value is None else format(value, spec)


def print_table(header: Sequence[str], rows: Iterable[Sequence], title: str | None = None) -> None:
    """A Markdown table, columns padded to their widest cell; None prints as '-'."""
    cells = [[str(h) for h in header]] + [[cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    if title:
        print(f"\n{title}")
    for i, row in enumerate(cells):
        print("| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |")
        if i == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    sys.stdout.flush()


# ----------------------------------------------------------------------------- timing


def sync(device: str | torch.device | Sequence | None = None) -> None:
    """Wait for the GPU when `device` (default: the current one, if any) is a CUDA device; for
    each of them when it is a list."""
    if isinstance(device, (list, tuple)):
        for one in device:
            sync(one)
    elif device is None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: str | torch.device | Sequence | None = None) -> tuple[float, object]:
    """(seconds, result) of `fn()`, the GPU synced before and after."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


def median(values: Iterable[float]) -> float:
    return statistics.median(list(values))


def upper_median(items: Sequence, key: Callable) -> object:
    """The item at the median of `key`; of an even count, the larger of the middle two."""
    return sorted(items, key=key)[len(items) // 2]


def interleaved(names: Sequence[str], rounds: int, run: Callable[[str], object]) -> dict[str, list]:
    """`run(name)` for every name, `rounds` times, the order reversed every other round, so drift
    of the machine (clock, cache, a busy neighbour) falls on every name alike; name -> results."""
    results: dict[str, list] = {name: [] for name in names}
    for i in range(rounds):
        for name in names if i % 2 == 0 else reversed(names):
            results[name].append(run(name))
    return results


def fresh_workspaces() -> None:
    """Free every cuBLAS workspace and cached block, so a case's peak memory counts the workspaces
    (32 MiB per stream on an H200) its own system makes, not those an earlier case left. Call it
    where no CUDA graph is alive: a graph replays into the workspace it captured."""
    gc.collect()
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()


def kernel_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 200, cpu_calls: int = 3) -> float:
    """Median ms of `fn()`: triton's do_bench on a GPU (L2 cleared before each call); on CPU (the
    Triton interpreter) one warm-up call and the median of `cpu_calls`."""
    if torch.cuda.is_available():
        import triton

        return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
    fn()
    return 1e3 * median(timed(fn, "cpu")[0] for _ in range(cpu_calls))


def copy_bandwidth(device: torch.device, nbytes: int) -> float:
    """GB/s of a device-to-device copy, counting bytes read plus bytes written."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = kernel_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / ms / 1e6


def read_bandwidth(device: torch.device, nbytes: int) -> float:
    """GB/s of a read-only pass (a sum over `nbytes`): what a decode step's weight and K/V reads
    can reach, where `copy_bandwidth` also pays for the writes."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    ms = kernel_ms(lambda: src.sum())
    return src.numel() * src.element_size() / ms / 1e6


def gemm_tflops(device: torch.device, n: int = 8192) -> float:
    """TFLOP/s of one bf16 [n, n] x [n, n] matrix product: the rate a floor's matrix products take."""
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    return 2 * n**3 / kernel_ms(lambda: a @ a) / 1e9


def capture_graph(calls: Sequence[Callable[[], object]]) -> "torch.cuda.CUDAGraph":
    """`calls` captured back to back as one CUDA graph, replayed once: the first two are run
    before on a side stream (Triton compiles, cuBLAS picks happen outside the capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for fn in calls[:2]:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_us(calls: Sequence[Callable[[], object]], replays: int = 7) -> float:
    """Median µs per call of `calls` replayed back to back in one CUDA graph, over `replays`
    replays (NaN without CUDA): no host launch cost in the number, as a captured decode step runs
    them."""
    if not torch.cuda.is_available():
        return float("nan")
    graph = capture_graph(calls)
    times = replay_times_us(graph, replays)
    del graph
    return median(times) / len(calls)


def graph_kernels(graph) -> tuple[int, dict]:
    """CUDA kernels in one replay of a captured graph: their count, and per kernel name (cut to
    100 characters) [launches, µs of GPU time], most time first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict = {}
    for e in kernels:
        entry = by_name.setdefault(e.name[:100], [0, 0.0])
        entry[0] += 1
        entry[1] += e.time_range.elapsed_us()
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])
    return len(kernels), {name: [n, round(us, 1)] for name, (n, us) in ranked}


def replay_times_us(graph, replays: int) -> list[float]:
    """µs of each of `replays` replays of a captured CUDA graph, one after another (CUDA events:
    the GPU time of one replay, the host's launch not counted)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return times


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (132, an H200's, without CUDA)."""
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132


class TritonCompiles:
    """Counts Triton kernel compilations while entered (a JIT compile is a one-time stall of ~0.1-1 s);
    counts nothing where this Triton has no post-compile hook (or there is no Triton). `cache_hits`:
    the compiles that read their binary from Triton's cache (one a compile worker wrote, say),
    where this Triton has a compilation listener. `compiled`: one entry per compile, {at: its
    perf_counter when it finished, kernel: the @triton.jit function's name, num_warps, num_stages}
    (which binary a stall was)."""

    def __init__(self) -> None:
        self.count = 0
        self.cache_hits = 0
        self.compiled: list[dict] = []
        self._knobs = None
        self._previous = None
        self._listener = None

    def __enter__(self) -> TritonCompiles:
        try:
            from triton import knobs
        except ImportError:
            return self
        self._knobs, self._previous = knobs, knobs.runtime.jit_post_compile_hook
        previous = self._previous

        def hook(*args, **kwargs):
            self.count += 1
            fn, options = kwargs.get("fn"), kwargs.get("compile") or {}
            self.compiled.append(dict(at=time.perf_counter(), kernel=getattr(fn, "name", None),
                                      num_warps=options.get("num_warps"), num_stages=options.get("num_stages")))
            return previous(*args, **kwargs) if previous else None

        knobs.runtime.jit_post_compile_hook = hook
        if hasattr(knobs.compilation, "listener"):
            listener = self._listener = knobs.compilation.listener

            def listen(*args, **kwargs):
                self.cache_hits += bool(kwargs.get("cache_hit"))
                return listener(*args, **kwargs) if listener else None

            knobs.compilation.listener = listen
        return self

    def __exit__(self, *exc) -> None:
        if self._knobs is not None:
            self._knobs.runtime.jit_post_compile_hook = self._previous
            if hasattr(self._knobs.compilation, "listener"):
                self._knobs.compilation.listener = self._listener


class CallingThreadStalls:
    """Seconds the thread that makes it (a fresh benchmark process's main thread) spends, from then
    on, inside Triton compiles on that thread (one outside a compile-ahead pass, or the cache read of
    a binary a compile worker made; not a pass's wait for its pool), loading compiled binaries there
    (`CompiledKernel._init_handles`: the launcher, its C build where Triton makes one, the module
    load) and in CUDA graph captures: `seconds` {compile, load, capture}. Patches Triton and torch
    for the rest of the process (`hook_compiles_and_captures`)."""

    def __init__(self) -> None:
        import threading

        from triton.compiler.compiler import CompiledKernel

        self.seconds = dict(compile=0.0, load=0.0, capture=0.0)
        thread = threading.current_thread()

        def adder(key: str):
            def add(*args) -> None:
                if threading.current_thread() is thread:
                    self.seconds[key] += args[-1] - args[-2]
            return add

        hook_compiles_and_captures(adder("compile"), adder("capture"))
        real_init, add_load = CompiledKernel._init_handles, adder("load")

        def init_handles(kernel, *a, **kw):
            start = time.perf_counter()
            try:
                return real_init(kernel, *a, **kw)
            finally:
                add_load(start, time.perf_counter())

        CompiledKernel._init_handles = init_handles


class FallbackLog(logging.Handler):
    """Collects hf_paged_t5's "running ... on stock HF: reason" warnings while installed."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.reasons: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "on stock HF" in message:
            self.reasons.append(message)

    def __enter__(self) -> FallbackLog:
        logging.getLogger("hf_paged_t5").addHandler(self)
        return self

    def __exit__(self, *exc) -> None:
        logging.getLogger("hf_paged_t5").removeHandler(self)


# ----------------------------------------------------------------------------- models and inputs


def make_model(shape: str, attn: str = "sdpa", dtype: torch.dtype = torch.bfloat16, device="cuda"):
    """A T5 model with a real shape (`hf_paged_t5.tiny.SHAPES`) and HF's own random init (seed 0),
    HF attention `attn`: the model of bench_generate / bench_batch and the profiles. HF's init
    makes greedy decoding repeat one token (see `tiny.INIT_FACTOR`); `tiny.build_model` makes
    input-dependent outputs."""
    from transformers import T5Config, T5ForConditionalGeneration

    from hf_paged_t5.tiny import SHAPES

    config = T5Config(decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **SHAPES[shape])
    config._attn_implementation = attn
    with torch.device(device):
        torch.manual_seed(0)
        model = T5ForConditionalGeneration(config)
    return model.to(dtype).eval()


def error_vs_float64(model64, out, **inputs) -> float:
    """max |logit - float64 logit| over every step and row of a greedy `out` (return_dict_in_generate,
    output_logits), the float64 model teacher-forced along `out`'s own tokens, relative to the
    float64 logits' largest magnitude: how far that path's arithmetic strays, whichever tokens it
    picked. inputs: the call's input_ids / attention_mask."""
    logits = torch.stack(out.logits, dim=1).double()
    with torch.inference_mode():
        forced = model64(**inputs, decoder_input_ids=out.sequences[:, :-1]).logits
    return float((logits - forced).abs().max() / forced.abs().max())


def greedy_parity(model, model64, inputs: dict, **generate_kwargs) -> dict:
    """Greedy fp32 generate() of the unpatched `model`, of its float64 copy `model64`, and of `model`
    patched (unpatched again after), on `inputs` (input_ids / attention_mask): token agreement
    between each pair, and each path's logit error vs float64 along its own tokens
    (`error_vs_float64`). `passed`: every row where the tokens differ first differs on a near-tie
    (`hf_paged_t5.agreement.near_ties`: closer in float64 than twice stock fp32's own error
    there); on a well-conditioned model (stock fp32's tokens = float64's) that means identical."""
    import hf_paged_t5 as hp
    from hf_paged_t5 import agreement

    kw = dict(**inputs, **generate_kwargs, return_dict_in_generate=True, output_logits=True)
    with torch.inference_mode():
        ref = model.generate(**kw)
        ref64 = model64.generate(**kw)
        hp.patch_model(model)
        out = model.generate(**kw)
        ran = kv_pool(model) is not None
        hp.unpatch_model(model)
        ties = agreement.near_ties(model, model64, inputs, ref.sequences, out.sequences,
                                   eos_token_id=None, pad_token_id=model.config.pad_token_id)
    stock_error, paged_error = error_vs_float64(model64, ref, **inputs), error_vs_float64(model64, out, **inputs)
    return dict(
        identical=bool(torch.equal(ref.sequences, out.sequences)),
        agreement=float((ref.sequences == out.sequences).float().mean()), paged_ran=ran,
        distinct_tokens=int(ref.sequences[:, 1:].unique().numel()),
        stock_vs_float64=float((ref.sequences == ref64.sequences).float().mean()),
        paged_vs_float64=float((out.sequences == ref64.sequences).float().mean()),
        stock_error=stock_error, paged_error=paged_error,
        error_ratio=paged_error / stock_error if stock_error else None,
        rows_differing=len(ties), near_ties=sum(ties), passed=ran and all(ties))


def random_inputs(batch: int, src_len: int, device="cuda", vocab_size: int = 32000, seed: int = 1):
    """input_ids [batch, src_len] of random tokens >= 2 (no pad, no EOS), drawn on `device`, and an
    all-ones attention mask."""
    g = torch.Generator(device=device).manual_seed(seed)
    ids = torch.randint(2, vocab_size, (batch, src_len), device=device, generator=g)
    return ids, torch.ones_like(ids)


# ----------------------------------------------------------------------------- private state
# Each function below is the one place a benchmark reads hf_paged_t5's private state; the comment
# names the private attribute it reads. They go when the package has public counters for them.


def _runtime(model):
    # private: the runtime patch_model attaches as `model._hf_paged_t5` (None when unpatched)
    return getattr(model, "_hf_paged_t5", None)


def compiles_sent() -> int:
    """Compiles this process sent to hf_paged_t5's compile worker processes (0 where it has none)."""
    module = sys.modules.get("hf_paged_t5.kernels.compile_workers")
    sent = getattr(module, "sent", None)
    return sent() if sent is not None else 0


def graphs_captured(model) -> int:
    """CUDA graphs captured so far by the patched model (0 unpatched): `hf_paged_t5.runtime_stats`."""
    import hf_paged_t5

    if _runtime(model) is None:
        return 0
    stats = getattr(hf_paged_t5, "runtime_stats", None)
    if stats is not None:
        return stats(model)["graphs_captured"]
    return _runtime(model).graphs.captures  # private: a package without runtime_stats (A/B against one)


def decode_graphs(model) -> dict:
    """The patched model's captured decode steps, key -> torch.cuda.CUDAGraph, oldest first."""
    # private: `model._hf_paged_t5.runner.graphs._graphs` (key -> _StaticStep, whose `.graph` is the
    # CUDA graph, None for a step that runs eagerly)
    runtime = _runtime(model)
    graphs = runtime.runner.graphs if hasattr(runtime, "runner") else runtime.graphs  # (A/B: either layout)
    steps = graphs._graphs.items()
    return {key: static.graph for key, static in steps if static.graph is not None}


def update_replay_ms(model, replays: int = 100) -> float | None:
    """ms per replay of the newest loop update the patched model keeps for later calls (greedy /
    beam token selection of small batches; None where none is kept), its length counter reset to
    the prompt's first so the replays stay inside its sequences, and put back after."""
    # private: `...graphs._updates` ((id(static), key) -> (static, state)); a state's `_graph`, `cur_len`
    runtime = _runtime(model)
    graphs = runtime.runner.graphs if hasattr(runtime, "runner") else runtime.graphs
    kept = [state for _, state in graphs._updates.values() if getattr(state, "_graph", None) is not None]
    if not kept or not hasattr(kept[-1], "cur_len"):
        return None
    state = kept[-1]
    saved = state.cur_len.clone()
    replays = min(replays, state.max_length - state.prompt_len - 1)
    state.cur_len.fill_(state.prompt_len)
    seconds, _ = timed(lambda: [state._graph.replay() for _ in range(replays)])
    state.cur_len.copy_(saved)
    return seconds / replays * 1e3


def kv_pool(model):
    """The patched model's KV pool (a `KVPool`; None before its first paged call)."""
    # private: `model._hf_paged_t5.pool`
    return _runtime(model).pool


def batch_run_phases() -> list[tuple]:
    """(owner, attribute, label) of a BatchGenerator job's host phases, for `timers`."""
    # private: the methods of `hf_paged_t5.batch.run.BatchRun`, and `decode.runner.DecodeRunner.decode`
    from hf_paged_t5.batch import run
    from hf_paged_t5.decode import runner

    names = ("_admit", "_encode", "_decode_step", "_rebuild_order", "_advance_rows", "_advance_beams", "_retire")
    return [(run.BatchRun, name, name) for name in names] + [(runner.DecodeRunner, "decode", "decode step launch")]


def hook_compiles_and_captures(on_compile: Callable[[str, float, float], object],
                               on_capture: Callable[[float, float], object]) -> None:
    """For the rest of the process (a diagnostic's fresh worker process): every Triton compile calls
    `on_compile(kernel name, start, end)` and every CUDA graph capture `on_capture(start, end)` as it
    ends (`time.perf_counter` seconds; compiles on any thread)."""
    import triton
    import triton.compiler

    real_compile = triton.compiler.compile

    def timed_compile(src, *a, **kw):
        start = time.perf_counter()
        try:
            return real_compile(src, *a, **kw)
        finally:
            fn = getattr(src, "fn", None)
            on_compile(getattr(getattr(fn, "fn", fn), "__name__", "?"), start, time.perf_counter())

    triton.compiler.compile = timed_compile
    triton.compile = timed_compile
    begin, end = torch.cuda.CUDAGraph.capture_begin, torch.cuda.CUDAGraph.capture_end
    began: list[float] = []

    def capture_begin(self, *a, **kw):
        began.append(time.perf_counter())
        return begin(self, *a, **kw)

    def capture_end(self, *a, **kw):
        try:
            return end(self, *a, **kw)
        finally:
            on_capture(began.pop(), time.perf_counter())

    torch.cuda.CUDAGraph.capture_begin, torch.cuda.CUDAGraph.capture_end = capture_begin, capture_end


def first_job_phases() -> list[tuple]:
    """(owner, attribute, label) of what a cold BatchGenerator job does before its first result:
    the KV pool's (re)allocation, the compile-ahead pass, each encoder chunk with its cross K/V
    store, and the decode step's host work (diag_first_job.py's timeline); inside the pass, each
    walk of the encoder (also an eager chunk's), of the decode step and of the cross K/V store."""
    # private: `hf_paged_t5.kv.pool.KVPool._allocate`, the methods of `hf_paged_t5.batch.run.BatchRun`,
    # the functions `batch.run` imported and `hf_paged_t5.decode.runner.DecodeRunner.step_ahead`
    from hf_paged_t5.batch import run
    from hf_paged_t5.decode import runner
    from hf_paged_t5.kv import pool

    return [(pool.KVPool, "_allocate", "KV pool allocate"), (run.BatchRun, "_compile_ahead", "compile-ahead pass"),
            (run.BatchRun, "_encode_chunk", "encoder chunk + cross store"),
            (run.BatchRun, "_decode_step", "decode step (host)"),
            (run, "encoder_forward", "encoder walk"), (runner.DecodeRunner, "step_ahead", "step walk (pass)"),
            (run, "store_cross_ahead", "cross store walk (pass)")]


def batch_encode_paths(model) -> tuple[Callable, Callable]:
    """(eager, graphed): the batch engine's two encoder paths for one lone input, a list of token
    ids -> its packed encoder output [n, d_model]: the eager packed forward, and the bucket graph
    (None where the graphs do not serve the input). Patches `model` if it is not."""
    # private: `hf_paged_t5.batch.run.BatchRun._encode_eager` / `._encode_graphed`
    from types import SimpleNamespace

    import hf_paged_t5 as hp
    from hf_paged_t5.batch.run import BatchRun

    gen = hp.BatchGenerator(model, max_new_tokens=1)
    run = BatchRun(gen, [])

    def eager(ids: list[int]) -> torch.Tensor:
        return run._encode_eager([SimpleNamespace(ids=ids)])

    def graphed(ids: list[int]):
        return run._encode_graphed([SimpleNamespace(ids=ids)])

    return eager, graphed


def step_launches() -> list[tuple]:
    """(owner, attribute, label) of the host launches of a device-resident decode step: the decode
    graph's replay and the greedy / beam update's run, for `timers`."""
    # private: `hf_paged_t5.decode.graphs.DecodeGraphs.replay`, `decode.greedy_graph.GreedyStep.run`,
    # `decode.beam_graph.BeamStep.run`
    from hf_paged_t5.decode import beam_graph, graphs, greedy_graph

    return [(graphs.DecodeGraphs, "replay", "decode graph replay"), (greedy_graph.GreedyStep, "run", "update run"),
            (beam_graph.BeamStep, "run", "update run")]


def call_phases(model) -> list[tuple]:
    """(owner, attribute, label) of the phases of a patched generate() call, for `timers`: the
    encoder, the loop's set-up (decoder prompt + static step buffers), the update's capture, the
    step state."""
    # private: `hf_paged_t5.decode.graphs.ResidentLoop.__init__` / `.capture_update`,
    # `decode.greedy_graph.GreedyStep.__init__`, `decode.beam_graph.BeamStep.__init__`
    from hf_paged_t5.decode import beam_graph, graphs, greedy_graph

    return [(model.encoder, "forward", "encoder"), (graphs.ResidentLoop, "__init__", "prompt + buffers"),
            (graphs.ResidentLoop, "capture_update", "update capture"),
            (greedy_graph.GreedyStep, "__init__", "step state"), (beam_graph.BeamStep, "__init__", "step state")]


def call_host_parts(model) -> list[tuple]:
    """(owner, attribute, label) of the parts of a patched generate() call whose host time
    `profile_step.py --host` reports: HF's preamble pieces and the paged call's own set-up."""
    # private: `hf_paged_t5.hf.generate._generate` / `._encoder_inputs` / `._paged_generate`,
    # `hf.runtime.PagedRuntime.check_weights` / `.get_pool`, `hf.cache.PagedEncoderDecoderCache`,
    # `decode.graphs.ResidentLoop` / `DecodeGraphs.prepare`, `decode.greedy_graph.GreedyStep.reset`,
    # `decode.runner.DecodeRunner.plan`, `model.stacks.store_cross_packed`
    from transformers import GenerationMixin

    from hf_paged_t5.decode import graphs, greedy_graph, runner
    from hf_paged_t5.hf import cache, generate, runtime
    from hf_paged_t5.model import stacks

    parts = [
        (GenerationMixin, "_prepare_generation_config", "HF: generation config"),
        (GenerationMixin, "_prepare_special_tokens", "HF: special tokens"),
        (GenerationMixin, "_validate_model_kwargs", "HF: kwargs check"),
        (GenerationMixin, "_prepare_encoder_decoder_kwargs_for_generation", "HF: encoder call"),
        (model.encoder, "forward", "encoder forward"),
        (generate, "_encoder_inputs", "inputs and mask"),
        (runtime.PagedRuntime, "check_weights", "weights check"),
        (runtime.PagedRuntime, "get_pool", "pool"),
        (cache.PagedEncoderDecoderCache, "__init__", "cache"),
        (stacks, "store_cross_packed", "cross K/V store"),
        (graphs.ResidentLoop, "__init__", "prompt + buffers"),
        (graphs.DecodeGraphs, "prepare", "step buffers"),
        (greedy_graph.GreedyStep, "reset", "update state"),
        (runner.DecodeRunner, "plan", "plan"),
    ]
    return [part for part in parts if hasattr(part[0], part[1])]  # (HF renames its helpers between versions)


@contextlib.contextmanager
def on_callers_stream():
    """While entered, a patched generate() runs on the caller's stream instead of its own
    generation stream (the A/B of ab_stream.py)."""
    # private: replaces `hf_paged_t5.hf.generate._generation_stream(runtime, devices)`
    from hf_paged_t5.hf import generate

    @contextlib.contextmanager
    def callers_stream(runtime, devices):
        yield lambda result: result

    original = generate._generation_stream
    generate._generation_stream = callers_stream
    try:
        yield
    finally:
        generate._generation_stream = original


def padded_head_dim(head_dim: int) -> int:
    """The head dim the kernels pad to (a power of two >= 16)."""
    # private: `hf_paged_t5.kernels._checks.block_d`
    from hf_paged_t5.kernels._checks import block_d

    return block_d(head_dim)


def cross_span_layers(tokens: int, layers: int, heads: int, head_dim: int, element_size: int) -> int:
    """Decoder layers one span of a call's cross K/V store holds (one GEMM, one store), as
    `stacks._store_span` cuts them: at most `CROSS_SPAN_BYTES` of projected K/V."""
    # private: `hf_paged_t5.model.stacks.CROSS_SPAN_BYTES`
    from hf_paged_t5.model.stacks import CROSS_SPAN_BYTES

    return min(layers, max(1, CROSS_SPAN_BYTES // max(1, tokens * 2 * heads * head_dim * element_size)))


@contextlib.contextmanager
def timers(targets: Sequence[tuple], synced: bool = False):
    """Wrap each (owner, attribute, label) of `targets` with a timer while entered; yields
    (seconds, calls), Counters by label. `synced`: the GPU synced around every call (a phase's
    own time, at the price of the overlap); else host time only. Restored on exit."""
    spent, calls = collections.Counter(), collections.Counter()
    saved = []

    def wrap(fn, label):
        def wrapper(*args, **kwargs):
            if synced:
                sync()
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                if synced:
                    sync()
                spent[label] += time.perf_counter() - start
                calls[label] += 1
        return wrapper

    for owner, attr, label in targets:
        own = owner.__dict__.get(attr) if hasattr(owner, "__dict__") else None
        saved.append((owner, attr, own))
        raw = inspect.getattr_static(owner, attr)
        if isinstance(raw, staticmethod):
            setattr(owner, attr, staticmethod(wrap(raw.__func__, label)))
        else:
            setattr(owner, attr, wrap(getattr(owner, attr), label))
    try:
        yield spent, calls
    finally:
        for owner, attr, own in reversed(saved):
            if own is None:
                delattr(owner, attr)  # an attribute found on the class: the instance's copy goes
            else:
                setattr(owner, attr, own)
