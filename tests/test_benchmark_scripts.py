"""The benchmark scripts are not run in CI (the GPU ones cannot be, the CPU ones take minutes), but
they must at least compile, show --help and fail in one line where CUDA is missing: a script that
fails on the device wastes a call of a 30-minute budget. Also the runner's argument routing and
the shared helpers, and that only benchmarks/common.py reads hf_paged_t5's private state."""

import inspect
import json
import pathlib
import py_compile
import re
import subprocess
import sys
import time

import pytest
import torch

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_"))
MAINS = [p for p in SCRIPTS if p.name != "common.py"]  # every other script has main(argv)
ENV = {"PYTHONPATH": f"{BENCH.parent}:{BENCH}", "PATH": ""}

sys.path.insert(0, str(BENCH))
import common  # noqa: E402
import run  # noqa: E402


def python(*args, timeout=120):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=BENCH.parent, env=ENV,
                          timeout=timeout)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_script_compiles(script):
    py_compile.compile(str(script), doraise=True)


def test_every_script_shows_its_help():
    # one interpreter for all of them: torch and transformers load once
    code = f"""
import contextlib, io, runpy, sys
failed = []
for name in {[p.stem for p in MAINS]!r}:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            __import__(name).main(["--help"])
        failed.append(name + ": no SystemExit")
    except SystemExit as exc:
        if exc.code not in (0, None) or "usage" not in out.getvalue():
            failed.append(f"{{name}}: exit {{exc.code}}")
    except Exception as exc:
        failed.append(f"{{name}}: {{type(exc).__name__}}: {{exc}}")
print("FAILED:", failed)
"""
    proc = python("-c", code, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FAILED: []" in proc.stdout, proc.stdout[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_gpu_suites_fail_in_one_line_without_cuda(tmp_path):
    proc = python("benchmarks/run.py", "--suite", "gpu-tests,generate", "--out", str(tmp_path),
                  "--generate.models", "t5-small", "--commit", "abc1234-dirty")
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = [line for line in proc.stdout.splitlines() if "needs a CUDA GPU" in line]
    assert len(lines) == 2 and lines[0].startswith("run.py: suite gpu-tests") and \
        lines[1].startswith("bench_generate.py:"), proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["command"].startswith("python benchmarks/run.py --suite gpu-tests,generate")
    assert env["suites"]["gpu-tests"]["returncode"] == 2 and env["suites"]["generate"]["returncode"] == 1
    assert env["suites"]["generate"]["command"] == (
        f"python benchmarks/bench_generate.py --out {tmp_path} --models t5-small")
    assert env["git"]["commit"] == env["suites"]["generate"]["commit"] == "abc1234" and env["git"]["dirty"]


def test_runner_routes_suite_options():
    suites = ["gpu-tests", "generate"]
    assert run.route(["--gpu-tests.k", "contract and not slow", "--generate.models", "t5-small", "--quick", "-x"],
                     suites) == {"gpu-tests": ["-k", "contract and not slow", "--quick", "-x"],
                                 "generate": ["--models", "t5-small", "--quick", "-x"]}
    assert run.route(["--generate.repeats=1", "--generate.help"], suites) == {
        "gpu-tests": [], "generate": ["--repeats=1", "--help"]}
    assert run.route(["--rows", "tiny-b1", "--threads", "-1"], ["cpu"]) == {
        "cpu": ["--rows", "tiny-b1", "--threads", "-1"]}
    with pytest.raises(ValueError, match="not in --suite"):
        run.route(["--batch.quick"], suites)


def test_runner_rejects_unknown_suites(capsys):
    with pytest.raises(SystemExit):
        run.parse_args(["--suite", "generate,nope"])
    assert "unknown suite nope" in capsys.readouterr().err


def test_helpers():
    assert common.gpu_slug("NVIDIA H200") == "h200"
    assert common.gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert common.gpu_slug(None) == "cpu"
    order = []
    runs = common.interleaved(["a", "b"], 3, lambda name: order.append(name) or len(order))
    assert order == ["a", "b", "b", "a", "a", "b"] and runs == {"a": [1, 4, 5], "b": [2, 3, 6]}
    assert common.upper_median([{"s": 3}, {"s": 1}], key=lambda r: r["s"]) == {"s": 3}
    state = common.git_state()
    assert set(state) >= {"commit", "dirty", "source_sha256"}


def test_triton_compiles_names_each_binary():
    """TritonCompiles chains Triton's post-compile hook while entered (restoring it after) and
    records which kernel each compile was, with its launch knobs and when it finished."""
    from types import SimpleNamespace

    from triton import knobs

    seen = []
    previous = knobs.runtime.jit_post_compile_hook = lambda **kw: seen.append(kw["fn"].name)
    try:
        with common.TritonCompiles() as compiles:
            knobs.runtime.jit_post_compile_hook(key=None, repr="", fn=SimpleNamespace(name="_paged_decode_kernel"),
                                                compile={"num_warps": 4, "num_stages": 2}, is_manual_warmup=False,
                                                already_compiled=False)
        assert compiles.count == 1 and seen == ["_paged_decode_kernel"]
        (entry,) = compiles.compiled
        assert entry["kernel"] == "_paged_decode_kernel" and (entry["num_warps"], entry["num_stages"]) == (4, 2)
        assert entry["at"] <= time.perf_counter()
        assert knobs.runtime.jit_post_compile_hook is previous
    finally:
        knobs.runtime.jit_post_compile_hook = None


def test_private_state_reads_resolve():
    # each read of hf_paged_t5's private state (benchmarks/common.py) finds what it reads, so a move
    # in the package fails here and not on the device
    import hf_paged_t5 as hp
    from hf_paged_t5 import tiny

    model = tiny.build_model("tiny")
    assert common.graphs_captured(model) == 0
    hp.patch_model(model)
    ids, mask = common.random_inputs(2, 8, "cpu", model.config.vocab_size)
    parts = common.call_host_parts(model)
    targets = common.call_phases(model) + common.batch_run_phases() + common.step_launches() + parts
    before = [inspect.getattr_static(owner, attr) for owner, attr, _ in targets]
    with common.timers(targets, synced=True) as (_, calls), common.on_callers_stream(), torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3)
    assert out.shape == (2, 4)
    assert {"HF: generation config", "inputs and mask", "cross K/V store", "step buffers"} <= set(calls)
    assert [inspect.getattr_static(owner, attr) for owner, attr, _ in targets] == before  # all restored
    assert common.graphs_captured(model) == 0 and common.decode_graphs(model) == {}
    assert common.kv_pool(model) is not None
    assert common.padded_head_dim(24) == 32
    assert common.cross_span_layers(512, 24, 16, 64, 2) == 24 and common.cross_span_layers(32768, 24, 16, 64, 2) == 1
    eager, graphed = common.batch_encode_paths(model)
    with torch.no_grad():
        assert eager([5, 6, 7]).shape == (3, model.config.d_model) and graphed([5, 6, 7]) is None  # CPU: no graphs
    hp.unpatch_model(model)


def test_only_common_reads_private_state():
    # the scripts import the package's public modules only, and no `_`-names, `_hf_paged_t5` or `._graphs`
    public = re.compile(r"import hf_paged_t5 as hp|from hf_paged_t5 import (tiny|reference)(, (tiny|reference))*"
                        r"|from hf_paged_t5\.kernels(\.(decode|prefill|gemv|gated_gelu|rmsnorm))?"
                        r" import [A-Za-z]\w*(, [A-Za-z]\w*)*")
    private = re.compile(r"_hf_paged_t5\b|\._graphs\b|\bhp\._")
    offenders = []
    for path in MAINS:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#")[0].strip()
            imports = code.startswith(("import hf_paged_t5", "from hf_paged_t5"))
            if (imports and not public.fullmatch(code)) or private.search(code):
                offenders.append(f"{path.name}:{number}: {code}")
    assert offenders == []


def test_the_ctranslate2_row_decodes_what_hf_does(tmp_path):
    """bench_generate's CTranslate2 row (where ctranslate2 is installed): the tiny model converted
    by CTranslate2's own converter gives HF's greedy tokens on the same ids (fp32, CPU), so the
    row times the same work."""
    pytest.importorskip("ctranslate2")
    import bench_generate

    from hf_paged_t5 import tiny

    model = tiny.build_model("tiny", dtype=torch.float32)
    translator, vocabulary = bench_generate.ct2_translator(model, str(tmp_path), "cpu", "float32")
    ids = torch.randint(2, model.config.vocab_size, (3, 14), generator=torch.Generator().manual_seed(0))
    results = bench_generate.ct2_case(translator, bench_generate.ct2_tokens(vocabulary, ids), 7, 1)
    with torch.no_grad():
        want = model.generate(input_ids=ids, max_new_tokens=7, min_new_tokens=7, do_sample=False)
    index = {token: i for i, token in enumerate(vocabulary)}
    assert [[index[t] for t in r.hypotheses[0]] for r in results] == want[:, 1:].tolist()


def test_greedy_parity_tells_rounding_from_a_wrong_path(monkeypatch):
    """bench_generate's fp32 parity verdict: a well-conditioned model passes with identical tokens; a
    paged path that shifts one logit by far more than rounding fails it."""
    import copy

    import hf_paged_t5 as hp
    from hf_paged_t5 import tiny

    model = tiny.build_model("tiny", initializer_factor=1.5, seed=3)
    model64 = copy.deepcopy(model).double()
    ids, mask = common.random_inputs(3, 24, device="cpu", vocab_size=model.config.vocab_size)
    mask[1, 12:] = 0
    inputs = dict(input_ids=ids, attention_mask=mask)
    good = common.greedy_parity(model, model64, inputs, max_new_tokens=8, min_new_tokens=8)
    assert good["passed"] and good["identical"] and good["stock_vs_float64"] == 1.0
    assert good["paged_error"] < 1e-4

    patch, unpatch, hooks = hp.patch_model, hp.unpatch_model, []

    def wrong_patch(m, *args, **kwargs):  # the paged call's lm_head favours token 7 by 50 logits
        hooks.append(m.lm_head.register_forward_hook(lambda mod, inp, out: out.index_add(
            -1, torch.tensor([7]), torch.full((*out.shape[:-1], 1), 50.0))))
        return patch(m, *args, **kwargs)

    def plain_unpatch(m):
        hooks.pop().remove()
        return unpatch(m)

    monkeypatch.setattr(hp, "patch_model", wrong_patch)
    monkeypatch.setattr(hp, "unpatch_model", plain_unpatch)
    bad = common.greedy_parity(model, model64, inputs, max_new_tokens=8, min_new_tokens=8)
    assert not bad["passed"] and bad["rows_differing"] == 3 and bad["near_ties"] == 0


def test_bench_generate_takes_fewer_stock_rows_and_cases():
    """`--hf sdpa` and `--cases` shorten a run to what a device call's time allows; anything else
    is refused in one line before the GPU is touched."""
    import bench_generate

    args = bench_generate.parse_args(["--hf", "sdpa", "--cases", "1x1,8x4"])
    assert args.hf == "sdpa" and args.cases == [(1, 1), (8, 4)]
    assert bench_generate.parse_args([]).cases == bench_generate.CASES
    for bad in (["--hf", "eager"], ["--cases", "1x"], ["--cases", "0x1"], ["--cases", ""]):
        with pytest.raises(SystemExit):
            bench_generate.parse_args(bad)


@pytest.mark.parametrize("variant,block_n,warps,splits", [("one-split", 512, 16, 1), ("wide-tiles", 256, 8, 2),
                                                        ("narrow-tiles", 64, 4, 8)])
def test_ab_replay_variants_pick_their_decode_launch(monkeypatch, variant, block_n, warps, splits):
    """ab_replay's variants replace decode_config's pick only at few programs over <= 512 keys."""
    import importlib

    import ab_replay

    decode = importlib.import_module("hf_paged_t5.kernels.decode")
    default = decode.decode_config
    monkeypatch.setattr(decode, "decode_config", default)  # restored after the test
    ab_replay.few_programs_config(variant)
    cfg = decode.decode_config(1, 16, 64, 512, 132)
    assert (cfg.block_n, cfg.num_warps, cfg.num_splits) == (block_n, warps, splits)
    assert decode.decode_config(64, 16, 64, 512, 132) == default(64, 16, 64, 512, 132)
    assert decode.decode_config(1, 16, 64, 2048, 132) == default(1, 16, 64, 2048, 132)


@pytest.mark.parametrize("variant", ["launches", "counters"])
def test_diag_handoff_stages_compute_the_chain(variant):
    """diag_handoff's kernels give torch's chain of GEMVs (interpreter: one persistent program runs
    every task in order, so each stage's count is complete before it is read); --programs must
    divide --dim."""
    import diag_handoff

    weights, vectors = diag_handoff.build(stages=3, dim=24, device="cpu")
    want = diag_handoff.expected(weights, vectors[0])
    diag_handoff.launcher(variant, weights, vectors, programs=3, persistent=1)()
    torch.testing.assert_close(vectors[1:], want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="divide"):
        diag_handoff.launcher(variant, weights, vectors, programs=5, persistent=1)


def test_diag_stages_chains_run_each_launch_kind():
    """diag_stages builds a dependent chain of every fused-layer launch kind (interpreter, tiny
    layout, no dependent launches): each runs and gives finite outputs of the input's shape."""
    import diag_stages

    shape = diag_stages.shape_of("tiny")
    for kind in diag_stages.KINDS:
        run, nbytes = diag_stages.chain(kind, shape, rows=2, launches=2, keys=20, device="cpu", pdl=False)
        out = run()
        assert nbytes > 0 and torch.isfinite(out.float()).all()
        assert out.shape == ((2, 4, 16) if kind in ("self", "cross") else (2, 64))
    with pytest.raises(ValueError, match="unknown kind"):
        diag_stages.chain("lm_head", shape, rows=1, launches=2, keys=20, device="cpu")


def test_the_generate_floor_counts_reads_at_the_read_bandwidth():
    """bench_generate's floor is the decoder weights a step reads (not the cross k / v projections,
    which run once per source) plus the K/V it reads, at the measured read bandwidth (not half a
    copy's), and the launch floor is kernels x launch cost, apart."""
    import bench_generate

    from hf_paged_t5 import tiny

    model = tiny.build_model("tiny", dtype=torch.bfloat16)
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for n, p in model.named_parameters()
                  if n.startswith(("decoder.block", "lm_head", "decoder.final")) and "EncDecAttention.k." not in n
                  and "EncDecAttention.v." not in n)
    cross_kv = sum(p.numel() for n, p in model.named_parameters() if ".EncDecAttention.k." in n or ".EncDecAttention.v." in n)
    assert cross_kv == 2 * cfg.num_decoder_layers * cfg.d_model * cfg.num_heads * cfg.d_kv  # none left out by a typo
    kv_token = cfg.num_decoder_layers * 2 * cfg.num_heads * cfg.d_kv * 2
    got = bench_generate.floor_ms(model, 3, 2, 40, 10, kernels=250, read_gbps=2.0, launch=0.8)
    want_bytes = weights + 3 * 40 * kv_token + 3 * 2 * 5 * kv_token
    assert got["floor_ms"] == pytest.approx(want_bytes / 2e9 * 1e3)
    assert got["launch_floor_ms"] == pytest.approx(250 * 0.8e-3) and got["kernels_per_step"] == 250
    assert common.read_bandwidth(torch.device("cpu"), 1 << 20) > 0


def test_the_encoder_floor_takes_the_rates_of_the_run():
    """bench_encoder's floor: the weights (embeddings aside) read once at the read rate, or the
    products (2 FLOPs per weight per token, the attention's 4 per head dim per query-key pair in
    every layer) at the GEMM rate, whichever is longer; off a GPU, the encoder issue's H200 rates."""
    import bench_encoder

    model = bench_encoder.build("tiny-umt5", "cpu")
    c = model.config
    weights = sum(p.numel() for n, p in model.named_parameters() if "shared" not in n and "embed" not in n)
    slow_read = dict(hbm_bytes_per_s=1e6, bf16_flops=1e30)
    assert bench_encoder.floor_ms(model, (2, 16, False), slow_read) == pytest.approx(weights * 2 / 1e6 * 1e3)
    slow_math = dict(hbm_bytes_per_s=1e30, bf16_flops=1e9)
    flops = 2 * weights * (16 + bench_encoder.PADDED_LEN) + 4 * c.num_layers * c.num_heads * c.d_kv * 2 * 16 * 16
    assert bench_encoder.floor_ms(model, (2, 16, True), slow_math) == pytest.approx(flops / 1e9 * 1e3)
    assert bench_encoder.rates("cpu") == dict(hbm_bytes_per_s=4.3e12, bf16_flops=790e12, measured=False)


@pytest.mark.parametrize("family", ["t5", "t5v1_1"])
def test_the_batch_job_work_counts_every_weight_and_key(family):
    """bench_batch's job floor: the K/V a decode step reads, counted step by step, and the FLOPs
    of every linear layer's weights (from the model's parameters, not its config) per token that
    passes it, plus the encoder's attention products; no K/V and no floor figures off CUDA."""
    import bench_batch

    from hf_paged_t5 import tiny

    model = tiny.build_model("tiny", family=family)
    cfg = model.config
    items = [([5] * 7, 3), ([6] * 2, 1), ([7] * 11, 4)]
    keys = sum(len(ids) + t + 1 for ids, n in items for t in range(n))  # a step reads its input and itself
    inner = cfg.num_heads * cfg.d_kv

    def weights(prefix, skip=()):
        return sum(m.weight.numel() for name, m in model.named_modules()
                   if name.startswith(prefix) and isinstance(m, torch.nn.Linear) and not any(k in name for k in skip))

    cross_kv = ("EncDecAttention.k", "EncDecAttention.v")
    tokens = sum(len(ids) for ids, _ in items)
    encoder = 2 * weights("encoder.block") * tokens + sum(cfg.num_layers * 4 * len(ids) ** 2 * inner for ids, _ in items)
    decoder = 2 * (weights("decoder.block", cross_kv) + weights("lm_head")) * sum(n for _, n in items)
    got = bench_batch.job_floor(cfg, items, "cpu", static_tokens_per_s=1.0)
    assert got["kv_bytes"] == keys * cfg.num_decoder_layers * 2 * inner * 2
    assert got["flops_by_part"] == dict(encoder=encoder, cross_kv_projection=2 * weights("decoder.block") * tokens
                                        - 2 * weights("decoder.block", cross_kv) * tokens,
                                        decoder_and_lm_head=decoder)
    assert got["flops"] == sum(got["flops_by_part"].values()) and "seconds" not in got


def test_tune_mixed_decode_shares_a_source_table_across_beams_in_either_layout(tmp_path):
    """tune_mixed_decode's pools: `beams` rows of a source share one table row (and their keys are
    counted once), a head-major pool holds [block, head, slot, dim] in memory; its --quick run
    (interpreter) matches the reference in every case and layout, and bad --layouts stop at once."""
    import tune_mixed_decode as tmd

    key, value, table, seq_lens = tmd.paged([20] * 6, "cpu", torch.float32, "head-major", group=3)
    assert table.shape[0] == 6 and torch.equal(table[0], table[2]) and not torch.equal(table[0], table[3])
    assert key.stride()[1:3] == (tmd.HEAD_DIM, tmd.BLOCK_SIZE * tmd.HEAD_DIM) and seq_lens.tolist() == [20] * 6
    tmd.main(["--quick", "--configs", "default", "--kinds", "beams,uniform", "--layouts", "slot-major,head-major",
              "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "mixed-decode.json").read_text())["rows"]
    assert {(r["kind"], r["layout"], r["rows_per_table_row"]) for r in rows} == {
        (kind, layout, group) for kind, group in (("beams", 3), ("uniform", 1))
        for layout in ("slot-major", "head-major")}
    assert max(r["rel_err"] for r in rows) < 1e-5
    # the beams case also times the grouped kernel (a source's keys read once for its beams)
    assert {r["config"] for r in rows if r["kind"] == "beams"} == {"default", "grouped default"}
    assert {r["config"] for r in rows if r["kind"] == "uniform"} == {"default"}
    # --configs tiles: the default and the async loop's tile / warp / depth grid, each checked
    tmd.main(["--quick", "--configs", "tiles", "--kinds", "self", "--rows", "3", "--orders", "random",
              "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "mixed-decode.json").read_text())["rows"]
    assert len(rows) == 15 and {r["knobs"]["prefetch"] for r in rows[2:]} == {"async"}
    assert {r["knobs"]["block_n"] for r in rows} >= {32, 64, 128, 256} and max(r["rel_err"] for r in rows) < 1e-5
    with pytest.raises(SystemExit, match="--layouts"):
        tmd.main(["--quick", "--layouts", "slot-major,column-major", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="SOURCESxBEAMSxKEYS"):
        tmd.main(["--quick", "--kinds", "beams", "--beams", "8x4", "--out", str(tmp_path)])


def test_bench_cross_store_times_both_stores_of_the_same_bits(tmp_path, capsys):
    """`--quick` (on CPU the Triton interpreter, which conftest turns on): both stores run, are
    checked equal, and the JSON holds each one's time and the layers a span holds as
    `stacks._store_span` cuts them."""
    import bench_cross_store

    bench_cross_store.main(["--quick", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "cross_store.json").read_text())["rows"]
    assert [r["case"] for r in rows] == ["tiny 2 x 7"] and rows[0]["layers_per_span"] == 3
    assert rows[0]["store_kv_us"] > 0 and rows[0]["indexed_copy_us"] > 0
    assert "cross K/V span store" in capsys.readouterr().out


_STALLS = r"""
import threading, time, json
import common
from triton.compiler.compiler import CompiledKernel
calls = []
CompiledKernel._init_handles = lambda self: (time.sleep(0.05), calls.append(threading.current_thread().name))
stalls = common.CallingThreadStalls()
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import importlib
kernel = importlib.import_module("hf_paged_t5.kernels.rmsnorm")._rms_norm_kernel
names = kernel.arg_names
const = dict(HAS_RESIDUAL=False, SPLITS=0, HALF_WEIGHT=True, BLOCK=256, PDL=False)
signature = {n: "constexpr" if n in const else ("*bf16" if n.endswith("_ptr") else "fp32" if n == "eps" else "i32")
             for n in names}
src = ASTSource(fn=kernel, signature=signature, constexprs={(names.index(k),): v for k, v in const.items()})
def compile_and_load():
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
    kernel._init_handles()
other = threading.Thread(target=compile_and_load)
other.start(); other.join()
after_other = dict(stalls.seconds)
compile_and_load()
print(json.dumps(dict(after_other=after_other, after_main=stalls.seconds)))
"""


def test_calling_thread_stalls_count_that_threads_compiles_and_loads(tmp_path):
    """`common.CallingThreadStalls` (bench_cold.py's per-call split): a compile and a binary load on
    another thread add nothing; the same on the thread that made it add their seconds."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    env["PYTHONPATH"] = os.pathsep.join([str(BENCH), str(BENCH.parent)])
    env["TRITON_ALWAYS_COMPILE"] = "1"  # the second compile compiles too (not a cache hit)
    done = subprocess.run([sys.executable, "-c", _STALLS], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["after_other"] == dict(compile=0.0, load=0.0, capture=0.0)
    assert report["after_main"]["compile"] > 0.01 and report["after_main"]["load"] >= 0.05
    assert report["after_main"]["capture"] == 0.0


def test_bench_batch_sweeps_each_system_on_two_batches_of_its_largest_size(tmp_path, one_thread):
    """bench_batch's static sweeps (--quick, CPU): each system's probe holds twice its largest batch
    size, so every size runs full batches of its own (on a one-batch probe the two largest sizes
    ran the same batch, and noise picked between them); the chosen size is the sweep's best."""
    import bench_batch

    bench_batch.main(["--quick", "--device", "cpu", "--static-batch-sizes", "2,4,8", "--hf-batch-sizes", "2,4",
                      "--out", str(tmp_path)])
    report = json.loads((tmp_path / "batch.json").read_text())
    assert report["probe_inputs"] == dict(static_paged=16, hf=8), report["probe_inputs"]
    for system, sizes in (("static_paged", ("2", "4", "8")), ("hf", ("2", "4"))):
        sweep = report["sweeps"][system]
        assert set(sweep) == set(sizes) and all(sweep[s]["inputs"] == report["probe_inputs"][system] for s in sizes)
        best = max(sizes, key=lambda s: sweep[s]["tokens_per_s"])
        assert report["runs"][system]["batch_size"] == int(best)


def test_bench_batch_reports_the_jobs_against_a_reference_static_size_too(tmp_path, one_thread):
    """bench_batch --defaults (--quick, CPU) with `--static-reference`: static batches of that size
    over the whole workload beside the sweep's pick, and each job's ratio to them; the other
    ratios stay against the sweep's pick."""
    import bench_batch

    bench_batch.main(["--quick", "--defaults", "--device", "cpu", "--static-batch-sizes", "2,4",
                      "--hf-batch-sizes", "2", "--static-reference", "3", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "batch.json").read_text())
    reference, static = report["static_reference"], report["runs"]["static_paged"]
    assert reference["batch_size"] == 3 and reference["inputs"] == static["inputs"] == report["num_inputs"]
    first, second = report["runs"]["batch_generator"]["repeats"]
    assert report["first_job_vs_static_reference"] == pytest.approx(first / reference["tokens_per_s"])
    assert report["second_job_vs_static_reference"] == pytest.approx(second / reference["tokens_per_s"])
    assert report["first_job_vs_static"] == pytest.approx(first / static["tokens_per_s"])


def test_bench_batch_halves_a_static_size_that_does_not_fit_the_whole_workload(monkeypatch):
    """The sweep's best static size runs out of memory on the whole workload (its longest inputs,
    which the probe may lack): the run is retried at half the size, warmed again, and says so."""
    import bench_batch

    warmed, ran = [], []

    def run_static(model, items, batch_size, device, deadline, compiles):
        ran.append(batch_size)
        if batch_size > 4:
            raise torch.OutOfMemoryError("CUDA out of memory (test)")
        return dict(batch_size=batch_size, inputs=len(items), tokens=1, seconds=1.0, tokens_per_s=1.0)

    monkeypatch.setattr(bench_batch, "run_static", run_static)
    got = bench_batch.run_static_halving(None, [1, 2, 3], 16, "cpu", float("inf"), None,
                                         warm=lambda model, items, size, device: warmed.append(size))
    assert ran == [16, 8, 4] and warmed == [16, 8, 4]
    assert got["batch_size"] == 4 and got["halved_from"] == 16
    assert "halved_from" not in bench_batch.run_static_halving(None, [1], 2, "cpu", float("inf"), None)


def test_diag_absorbed_cross_matches_both_references_at_awkward_sizes(tmp_path):
    """diag_absorbed_cross's kernel (the interpreter) gives float64's z = softmax(q' E^T) E over a
    paged, shuffled E pool at head counts below the dot's 16, a d_model that is no power of two and
    rows that end mid-block, with one split or several (empty splits included) and the scores'
    d_model sum whole or in batched chunks; the whole absorbed
    path and paged_decode over the K/V that E gives agree with one float64 cross-attention."""
    import diag_absorbed_cross as dac

    lens = [37, 1, 16, 70, 5]
    p = dac.problem(lens, heads=6, head_dim=16, d_model=48, device="cpu", dtype=torch.float32, seed=3)
    qa = dac.absorbed_query(p)  # a strided view, as a step makes it
    want = dac.reference(qa, p["e_pool"], p["table"], lens)
    for splits, block_n, split_d in ((1, 16, 1), (1, 32, 2), (3, 16, 4), (3, 32, 1)):
        got = dac.absorbed_attention(qa, p["e_pool"], p["table"], p["seq_lens"], max(lens), block_n=block_n,
                                     splits=splits, split_d=split_d)
        assert got.shape == qa.shape
        assert float((got.double() - want).abs().max()) < 1e-5 * float(want.abs().max()), (splits, block_n, split_d)
    ref = dac.sublayer_reference(p, lens)
    for got in (dac.absorbed_sublayer(p, max(lens), splits=2), dac.standard_sublayer(p, max(lens))):
        assert float((got.double() - ref).norm() / ref.norm()) < 1e-5
    dac.main(["--quick", "--rows", "3", "--uniform", "2x20", "--heads", "4", "--head-dim", "16", "--d-model", "32",
              "--splits", "1,2", "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "absorbed-cross.json").read_text())["rows"]
    assert len(rows) == 2 * 4 and all("failed" not in r for r in rows) and max(r["rel_err"] for r in rows) < 1e-5


@pytest.mark.parametrize("splits", [1, 3, 4])
def test_diag_wo_partials_kernel_is_the_package_add_norm_of_the_summed_partials(splits):
    """diag_wo_partials' add + norm of the partials (the package's `rms_norm(partials=...)`; the
    interpreter, float32: its bf16 casts do not round as the GPU's do; a width that is no power of two,
    7 rows) gives bit for bit the package's add + RMSNorm of the partials summed in slice order and
    given as a residual tensor, and its error against float64 stays within float32's bound for a sum
    of d_ff products."""
    import diag_wo_partials as dwp

    d_ff = 96
    wo, xs, hs, weight = dwp.build(d_model=40, d_ff=d_ff, rows=7, layers=1, device="cpu", dtype=torch.float32,
                                   seed=splits)
    partials = dwp.split_partials(xs[0], wo[0], splits)
    assert partials.shape == (splits, 7, 40) and partials.dtype == torch.float32
    summed = partials[0].clone()
    for s in range(1, splits):
        summed += partials[s]
    got_out, got_sum = dwp.partials_add_norm(partials, hs[0], weight)
    want_out, want_sum = dwp.rms_norm(hidden=hs[0], weight=weight, eps=dwp.EPS, residual=summed)
    assert torch.equal(got_sum, want_sum) and torch.equal(got_out, want_out)
    bound = d_ff * 2.0 ** -24  # a float32 sum of d_ff terms, relative to its largest magnitude
    for name, (normed, total) in dwp.errors(xs[0], wo[0], hs[0], weight, [splits]).items():
        assert normed <= bound and total <= bound, name
    with pytest.raises(ValueError, match="does not split"):
        dwp.split_partials(xs[0], wo[0], 5)


def test_profile_batch_names_where_an_operator_was_called_from():
    """profile_batch --stacks: each matching operator (not kernel) with its calls and the Python
    frames it was called from, on a CPU profile here."""
    import profile_batch
    from torch.profiler import ProfilerActivity

    def gather(x, i):
        return x[i]

    x, i = torch.randn(50, 4), torch.tensor([3, 1])
    with profile_batch.stack_profile([ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            gather(x, i)
        x.sum()
    lines = profile_batch.call_sites(prof, "index")
    assert lines[0].startswith("aten::index: 3 calls")
    assert any("gather" in line for line in lines[1:]), lines
    assert not any(line.startswith("aten::sum") for line in lines)
