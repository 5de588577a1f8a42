"""End to end on the GPU: Triton kernels + CUDA graphs under generate(), against stock HF."""

from __future__ import annotations

import pytest
import torch
from oracle import assert_within_stock_error, compare_with_stock, fp64_twin, stock_and_paged, teacher_forced_logits
from transformers import T5Config, T5ForConditionalGeneration

import hf_paged_t5 as hp
from hf_paged_t5.tiny import SHAPES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def real_shape_model(name, dtype, layers=None):
    shape = dict(SHAPES[name])
    if layers is not None:
        shape.update(num_layers=layers, num_decoder_layers=layers)
    cfg = T5Config(decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **shape)
    with torch.device("cuda"):
        torch.manual_seed(0)
        model = T5ForConditionalGeneration(cfg)
    return model.to(dtype).eval()


def batch(rows, src_len, seed=1):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ids = torch.randint(2, 32000, (rows, src_len), device="cuda", generator=g)
    mask = torch.ones_like(ids)
    mask[1::3, src_len // 3:] = 0
    mask[2::5, : src_len // 4] = 0  # left padding too
    return ids, mask


def both(model, config=None, compare=True, **kw):
    """compare_with_stock (tests/oracle.py) with the package's default config: Triton kernels and CUDA
    graphs. With `compare=False` (half precision: tokens may differ at near ties) the two calls only."""
    run = compare_with_stock if compare else stock_and_paged
    return run(model, config or hp.PagedCacheConfig(), **kw)


@pytest.mark.parametrize("name", ["t5-small", "t5-large"])
def test_fp32_greedy_identical(name):
    model = real_shape_model(name, torch.float32)
    ids, mask = batch(16, 300)
    both(model, input_ids=ids, attention_mask=mask, max_new_tokens=40, min_new_tokens=40)


def test_fp32_beam_identical():
    model = real_shape_model("t5-small", torch.float32)
    ids, mask = batch(4, 200)
    both(model, input_ids=ids, attention_mask=mask, max_new_tokens=30, num_beams=4, num_return_sequences=2,
         length_penalty=0.8)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_scores_close(dtype):
    model = real_shape_model("t5-small", dtype)
    ids, mask = batch(8, 128)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=1, output_logits=True, return_dict_in_generate=True)
    ref, out = both(model, compare=False, **kw)
    assert torch.isfinite(out.logits[0]).all()
    # within stock's own half-precision error against fp64 (the first step: the same inputs everywhere)
    exact = teacher_forced_logits(fp64_twin(model), ref.sequences, input_ids=ids, attention_mask=mask)[:, 0]
    assert_within_stock_error(out.logits[0], ref.logits[0], exact, f"{dtype} first-step logits")


def test_graph_and_eager_agree():
    model = real_shape_model("t5-small", torch.bfloat16)
    ids, mask = batch(5, 100)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24)
    hp.patch_model(model, hp.PagedCacheConfig(cuda_graphs=False))
    eager = model.generate(**kw)
    hp.patch_model(model, hp.PagedCacheConfig(cuda_graphs=True))
    graphed = model.generate(**kw)
    graphed_again = model.generate(**kw)  # replays the captured graph
    assert torch.equal(eager, graphed) and torch.equal(graphed, graphed_again)
    assert hp.runtime_stats(model)["decode_graphs"] >= 1


def record_graph_use(monkeypatch, step_cls) -> dict[str, list]:
    """Record, per call: captures of `step_cls` (a resident loop's update), whether each of its runs
    replayed a graph, and whether each decode step did (`DecodeGraphs.replay`)."""
    from hf_paged_t5.decode import graphs

    seen: dict[str, list] = {"captured": [], "updates": [], "decodes": []}
    real_capture, real_run, real_replay = step_cls.capture, step_cls.run, graphs.DecodeGraphs.replay
    monkeypatch.setattr(step_cls, "capture", lambda self, side: seen["captured"].append(1) or real_capture(self, side))
    monkeypatch.setattr(step_cls, "run", lambda self: seen["updates"].append(self._graph is not None) or real_run(self))
    monkeypatch.setattr(graphs.DecodeGraphs, "replay", staticmethod(
        lambda static, fn: seen["decodes"].append(static.graph is not None) or real_replay(static, fn)))
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_beam_bookkeeping_runs_as_a_captured_graph(monkeypatch, caplog, dtype):
    """Beam search with min-length and several EOS ids takes beam_graph's path, its update is
    captured (no "could not be captured" fallback) and replayed every step, in fp32 and bf16;
    in fp32 the tokens are HF's."""
    from hf_paged_t5.decode import beam_graph

    seen = record_graph_use(monkeypatch, beam_graph.BeamStep)
    model = real_shape_model("t5-small", dtype, layers=3)
    ids, mask = batch(5, 120, seed=3)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=37, min_new_tokens=9, num_beams=3,
              num_return_sequences=2, length_penalty=0.7, eos_token_id=[1, 5])
    with caplog.at_level("WARNING"):
        both(model, compare=dtype == torch.float32, **kw)  # fp32: HF's tokens
    assert seen["captured"] == [1] and seen["updates"] and all(seen["updates"])
    assert seen["decodes"] and all(seen["decodes"])
    assert "could not be captured" not in caplog.text


def test_beam_bookkeeping_not_captured_when_graphs_are_off(monkeypatch):
    """PagedCacheConfig(cuda_graphs=False) keeps beam search eager too: same tokens, no capture."""
    from hf_paged_t5.decode import beam_graph

    captured = []
    real_capture = beam_graph.BeamStep.capture
    monkeypatch.setattr(beam_graph.BeamStep, "capture", lambda self: captured.append(1) or real_capture(self))
    model = real_shape_model("t5-small", torch.float32, layers=2)
    ids, mask = batch(3, 50, seed=4)
    both(model, hp.PagedCacheConfig(cuda_graphs=False), input_ids=ids, attention_mask=mask, max_new_tokens=12,
         num_beams=3)
    assert captured == []


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_selection_runs_as_a_captured_graph(monkeypatch, caplog, dtype):
    """Greedy search with min-length and several EOS ids (rows end at different steps) takes
    greedy_graph's path: its update is captured and replayed every step, the decode step replays
    its graph, and in fp32 the tokens are HF's; a second call with another batch size too."""
    from hf_paged_t5.decode import greedy_graph

    seen = record_graph_use(monkeypatch, greedy_graph.GreedyStep)
    model = real_shape_model("t5-small", dtype, layers=3)
    for rows, seed in ((5, 3), (1, 4)):
        ids, mask = batch(rows, 120, seed=seed)
        kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=40, min_new_tokens=7, eos_token_id=[1, 5, 9])
        with caplog.at_level("WARNING"):
            both(model, compare=dtype == torch.float32, **kw)  # fp32: HF's tokens
        assert "could not be captured" not in caplog.text
    assert seen["captured"] == [1, 1] and seen["updates"] and all(seen["updates"])
    assert seen["decodes"] and all(seen["decodes"])


def test_beam_cross_kv_stored_once():
    model = real_shape_model("t5-small", torch.bfloat16, layers=2)
    ids, mask = batch(3, 64)
    hp.patch_model(model, hp.PagedCacheConfig(block_size=16))
    pool = model._hf_paged_t5
    seen = []
    orig = hp.PagedEncoderDecoderCache.store_cross_plan

    def spy(self, lens):
        seen.append(list(lens))
        return orig(self, lens)

    hp.PagedEncoderDecoderCache.store_cross_plan = spy
    try:
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=8, num_beams=4)
    finally:
        hp.PagedEncoderDecoderCache.store_cross_plan = orig
    assert seen == [mask.sum(1).tolist()]  # 3 sources stored, not 12 beams
    assert pool.pool.is_idle()


def test_deferred_stop_matches_hf_when_rows_end_early():
    """The lean loop reads "all finished" one step late and drops the queued step: same tokens as HF
    when rows hit EOS at different steps, when all stop before max_new_tokens, and when sampling."""
    model = real_shape_model("t5-small", torch.float32)
    ids, mask = batch(6, 120)
    probe = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=30)
    eos = int(probe[0, 5])  # a token row 0 emits early: rows now end at different steps
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=60, eos_token_id=eos)
    ref, _ = both(model, **kw)
    assert ref.shape[1] < 61
    both(model, seed=3, **kw, do_sample=True, top_k=20)


def test_pool_growth_after_capture_recaptures():
    """A small call captures graphs on a small pool; a larger call grows (re-makes) the pool, which
    drops those graphs and their memory pool; capturing again must work and give the same tokens."""
    model = real_shape_model("t5-small", torch.bfloat16, layers=2)
    small, small_mask = batch(2, 16)
    large, large_mask = batch(12, 300)
    kw = dict(max_new_tokens=20, min_new_tokens=20)
    hp.patch_model(model)
    model.generate(input_ids=small, attention_mask=small_mask, **kw)
    grown = model.generate(input_ids=large, attention_mask=large_mask, **kw)
    again = model.generate(input_ids=large, attention_mask=large_mask, **kw)
    hp.patch_model(model, hp.PagedCacheConfig(cuda_graphs=False))
    eager = model.generate(input_ids=large, attention_mask=large_mask, **kw)
    assert torch.equal(grown, eager) and torch.equal(again, eager)


def test_generate_runs_on_the_generation_stream_and_hands_back():
    """The encoder, prefill and graphs all run on one stream (one cuBLAS workspace); the caller's
    stream is current again afterwards and sees the finished tokens, also from a user stream."""
    model = real_shape_model("t5-small", torch.bfloat16, layers=2)
    ids, mask = batch(3, 64)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=12, min_new_tokens=12)
    ref = model.generate(**kw)
    hp.patch_model(model)
    streams = model._hf_paged_t5.runner.graphs.streams
    seen = []
    hook = model.encoder.register_forward_hook(lambda *_: seen.append(torch.cuda.current_stream()))
    try:
        user = torch.cuda.Stream()
        for stream in (torch.cuda.current_stream(), user):
            with torch.cuda.stream(stream):
                out = model.generate(**kw)
                assert torch.cuda.current_stream() == stream
                same = torch.equal(out, ref)  # read on the caller's stream, no explicit sync
            assert same
    finally:
        hook.remove()
        hp.unpatch_model(model)
    assert seen == [streams.generation(ids.device)] * 2


def test_kept_greedy_update_is_refilled_per_call(monkeypatch):
    """A small batch's captured greedy update is kept with the decode graphs and reused by a later
    call of the same shape: its prompt, counters, blocks, EOS ids and min-length masks refilled,
    so each call still gives HF's tokens (rows ending at their EOS included); another
    min_new_tokens captures a new one."""
    from hf_paged_t5.decode import graphs as graphs_mod

    from hf_paged_t5 import tiny

    # well conditioned (see tests/test_soak.py): greedy tokens vary, so rows reach an EOS id early
    model = tiny.build_model("t5-small", vocab_size=32128, initializer_factor=1.5, device="cuda")
    captures = []
    real = graphs_mod.ResidentLoop.capture_update
    monkeypatch.setattr(graphs_mod.ResidentLoop, "capture_update",
                        lambda self, state, what: captures.append(what) or real(self, state, what))
    inputs = [batch(2, 40, seed=seed) for seed in (1, 2, 3)]
    forced = dict(max_new_tokens=16, min_new_tokens=16)
    first = model.generate(input_ids=inputs[0][0], attention_mask=inputs[0][1], **forced)
    second = model.generate(input_ids=inputs[1][0], attention_mask=inputs[1][1], **forced)
    # EOS ids one row produces first (no minimum): HF ends that row at once and pads it while the
    # other row goes on (this random model repeats a token per row)
    calls = [(0, forced), (1, forced), (0, dict(max_new_tokens=16, eos_token_id=int(first[0, 1]))),
             (1, dict(max_new_tokens=16, eos_token_id=int(second[1, 1]))), (2, forced)]
    refs = [model.generate(input_ids=inputs[i][0], attention_mask=inputs[i][1], **kw) for i, kw in calls]
    assert calls[2][1]["eos_token_id"] != calls[3][1]["eos_token_id"]
    for ref in refs[2:4]:
        assert ref.shape[1] < 17 or (ref[:, 2:] == 0).any()  # a row ended early (padded, or all ended)
    hp.patch_model(model)
    try:
        with torch.inference_mode():  # inference tensors too (bias tables, kept band tiles)
            for (i, kw), ref in zip(calls, refs):
                out = model.generate(input_ids=inputs[i][0], attention_mask=inputs[i][1], **kw)
                assert torch.equal(out, ref), kw
    finally:
        hp.unpatch_model(model)
    assert len(captures) == 2  # one per signature: forced (a min-length processor), EOS only



def test_captures_while_another_thread_uses_the_gpu(caplog):
    """A server's request threads build input tensors on the GPU while another request's
    generate() captures graphs (the generate()-per-request server users write): no capture fails
    or is invalidated, and every call gives stock HF's tokens."""
    import threading

    model = real_shape_model("t5-small", torch.float32, layers=2)
    calls = [batch(rows, 40 + 7 * rows, seed=rows) for rows in (1, 2, 3, 5, 9, 17)]  # a new graph bucket each
    kw = dict(max_new_tokens=12, min_new_tokens=12)
    refs = [model.generate(input_ids=ids, attention_mask=mask, **kw) for ids, mask in calls]
    hp.patch_model(model)
    stop, errors, busy = threading.Event(), [], [0]

    def other_requests():  # what torch.tensor(prompt, device="cuda") and .tolist() of a reply do
        try:
            while not stop.is_set():
                ids = torch.tensor([list(range(300))], device="cuda")
                busy[0] += int((ids * 2).sum().item() > 0)
                (ids + 1).tolist()
        except Exception as exc:  # noqa: BLE001  (reported below, in the test's thread)
            errors.append(exc)

    thread = threading.Thread(target=other_requests, daemon=True)
    thread.start()
    try:
        with caplog.at_level("WARNING", logger="hf_paged_t5"):
            outs = [model.generate(input_ids=ids, attention_mask=mask, **kw) for ids, mask in calls]
        captured = model._hf_paged_t5.runner.graphs.captures
    finally:
        stop.set()
        thread.join(timeout=30)
        hp.unpatch_model(model)
    assert not errors, errors
    assert busy[0] > 0 and captured >= 3  # decode steps of three or more batch buckets
    assert not [r for r in caplog.records if "could not be captured" in r.getMessage()]
    for out, ref in zip(outs, refs):
        assert torch.equal(out, ref)


def test_failed_capture_runs_eagerly_and_later_captures_work(monkeypatch, caplog):
    """A decode-step capture that fails (here: a host sync inside it) logs one reason and runs
    that step eagerly with the same tokens; the failed capture's memory pool is not captured
    into again, so the next capture succeeds; CUDA's random generator is out of capture mode
    (a random op after it runs, and a seeded sampling call gives stock's tokens)."""
    from hf_paged_t5.decode import graphs as graphs_mod

    model = real_shape_model("t5-small", torch.float32, layers=2)
    ids, mask = batch(3, 50)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=10, min_new_tokens=10)
    ref = model.generate(**kw)
    real = graphs_mod.DecodeGraphs._capture
    failed = []

    def failing_once(self, step_fn, pool, key, device):
        def step(input_ids, meta_for):
            if not failed and torch.cuda.is_current_stream_capturing():
                failed.append(key)
                torch.cuda.synchronize()  # not allowed while capturing: the capture fails
            return step_fn(input_ids, meta_for)
        return real(self, step, pool, key, device)

    monkeypatch.setattr(graphs_mod.DecodeGraphs, "_capture", failing_once)
    hp.patch_model(model)
    try:
        with caplog.at_level("WARNING", logger="hf_paged_t5"):
            first = model.generate(**kw)
            torch.randn(8, device="cuda")  # raised "Offset increment outside graph capture" before
            second = model.generate(**kw)
            torch.manual_seed(0)
            sampled = model.generate(**kw, do_sample=True)
        graphs = model._hf_paged_t5.runner.graphs
        kept = graphs.num_steps
    finally:
        hp.unpatch_model(model)
    warned = [r for r in caplog.records if "could not be captured" in r.getMessage()]
    assert failed and len(warned) == 1
    assert kept >= 1  # the second call captured its step
    assert torch.equal(first, ref) and torch.equal(second, ref)
    torch.manual_seed(0)
    assert torch.equal(sampled, model.generate(**kw, do_sample=True))


_COLD_GENERATE = r"""
import json, threading, torch, triton.compiler
from transformers import T5Config, T5ForConditionalGeneration
import hf_paged_t5 as hp
from hf_paged_t5.tiny import SHAPES

compiles = []
real = triton.compiler.compile
def compile(src, *a, **kw):
    fn = getattr(src, "fn", None)
    compiles.append((threading.current_thread().name, getattr(getattr(fn, "fn", fn), "__name__", "?")))
    return real(src, *a, **kw)
triton.compiler.compile = compile

def build():
    cfg = T5Config(decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, **dict(SHAPES["t5-small"]))
    with torch.device("cuda"):
        torch.manual_seed(0)
        return T5ForConditionalGeneration(cfg).to(torch.bfloat16).eval()

ids = torch.randint(2, 32000, (2, 60), device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))
kw = dict(input_ids=ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
cold = hp.patch_model(build()).generate(**kw)
first = list(compiles)
warm = hp.patch_model(build()).generate(**kw)
print(json.dumps(dict(first=first, later=compiles[len(first):], equal=bool(torch.equal(cold, warm)))))
"""


def test_a_cold_first_generate_compiles_its_step_kernels_on_the_pool(tmp_path):
    """A fresh process, empty Triton cache: the decode step's kernels (attention over the cache,
    the GEMVs) compile on the compile pool, ahead of the first graph capture; the tokens are those
    of a second model once everything is compiled."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton")}
    proc = subprocess.run([sys.executable, "-c", _COLD_GENERATE], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    step = [(thread, name) for thread, name in report["first"] if name in ("_paged_decode_kernel", "_gemv_kernel")]
    assert step, report
    assert all(thread.startswith("hf_paged_t5-compile") for thread, _ in step), report
    assert report["later"] == [] and report["equal"], report


def _spy_grouped(monkeypatch) -> list:
    """Record each grouped cross-attention launch (`kernels.grouped_decode`) as (group, relative
    error of its output against the reference attention of each row over its own table; None for
    a launch being captured). A cold process's compile-ahead pass launches without running: not
    recorded."""
    from hf_paged_t5 import kernels, reference
    from hf_paged_t5.kernels import ahead

    launches, real = [], kernels.grouped_decode

    def grouped(**kw):
        out = real(**kw)
        if ahead.compile_only():
            return out
        err = None
        if not torch.cuda.is_current_stream_capturing():
            up = {name: kw[name].float() for name in ("query", "key_cache", "value_cache")}
            ref = reference.paged_decode(**up, block_table=kw["block_table"], seq_lens=kw["seq_lens"],
                                         scale=kw["scale"])
            err = float((out.float() - ref).norm() / ref.norm())
        launches.append((kw["group"], err))
        return out

    monkeypatch.setattr(kernels, "grouped_decode", grouped)
    return launches


@pytest.mark.parametrize("sources,beams", [(3, 3), (2, 2)])
def test_gpu_beam_cross_attention_reads_each_source_once(monkeypatch, sources, beams):
    """bf16 beam search over several sources: cross-attention is one grouped launch per layer
    (`kernels.grouped_decode`, a source's beams in one program), in the op-by-op step (3 x 3: 9
    rows, a 16-row graph whose padded rows make groups of their own, the last one short) and the
    fused layer (2 x 2). Eager, every launch gives each row the reference attention over its own
    table (the kernel tests' bf16 tolerance); captured, the first step's logits are within stock's
    own bf16 error. (A cold process's compile-ahead pass launches without running: not counted.)"""
    launches = _spy_grouped(monkeypatch)
    model = real_shape_model("t5-small", torch.bfloat16, layers=3)
    ids, mask = batch(sources, 150, seed=5)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, num_beams=beams)
    hp.patch_model(model, hp.PagedCacheConfig(cuda_graphs=False))
    model.generate(**kw)
    errors = [err for _, err in launches]
    assert len(errors) == 6 * 3 and {group for group, _ in launches} == {beams} and max(errors) < 2e-2
    launches.clear()
    hp.unpatch_model(model)
    kw.update(max_new_tokens=1, min_new_tokens=1, output_logits=True, return_dict_in_generate=True)
    ref, out = both(model, compare=False, **kw)
    assert launches and {group for group, _ in launches} == {beams}  # captured with the graph
    exact = teacher_forced_logits(fp64_twin(model), ref.sequences, input_ids=ids, attention_mask=mask)[:, 0]
    assert_within_stock_error(out.logits[0][::beams], ref.logits[0][::beams], exact, "bf16 beam first-step logits")


def test_gpu_batch_beam_job_groups_cross_attention_per_input(monkeypatch):
    """A bf16 `BatchGenerator` beam job (4 beams, 7 inputs, 12 rows at most: inputs join and leave)
    reads each input's cross keys once per layer (`BatchCache.cross_group`). Eager, every grouped
    launch gives each row the reference attention over its own table (the kernel tests' bf16
    tolerance); with graphs, the launches are captured grouped, and the returned scores are as close
    to the fp64 scores of their sequences as those of the same job with the row kernel are to theirs
    (every step masks EOS and there is no length penalty: a score is the sum of its tokens'
    log-probabilities). (A cold process's compile-ahead pass launches without running: not counted.)"""
    from oracle import ERROR_FACTOR

    from hf_paged_t5 import kernels

    launches = _spy_grouped(monkeypatch)
    model = real_shape_model("t5-small", torch.bfloat16, layers=3)
    model64 = fp64_twin(model)
    g = torch.Generator().manual_seed(11)
    lengths, limits = [150, 40, 300, 90, 220, 60, 120], [6, 3, 8, 5, 4, 7, 2]
    inputs = [torch.randint(2, 32000, (n,), generator=g).tolist() for n in lengths]
    requests = [hp.BatchRequest(ids, max_new_tokens=m, min_new_tokens=m) for ids, m in zip(inputs, limits)]

    def job(graphs):
        hp.patch_model(model, hp.PagedCacheConfig(cuda_graphs=graphs))
        gen = hp.BatchGenerator(model, max_batch_rows=12, num_beams=4, length_penalty=0.0)
        return list(gen.generate(requests))

    job(False)
    errors = [err for _, err in launches]
    assert errors and {group for group, _ in launches} == {4} and max(errors) < 2e-2
    launches.clear()
    graphed = job(True)
    assert launches and {group for group, _ in launches} == {4}
    monkeypatch.setattr(kernels, "grouped_supports", lambda query, group: False)
    launches.clear()
    rows = job(True)
    assert launches == []

    def deviations(results):
        out = []
        for ids, result in zip(inputs, results):
            sequences = torch.tensor(result.sequences, device="cuda")
            logits = teacher_forced_logits(model64, sequences, input_ids=torch.tensor([ids], device="cuda"))
            logits[..., model.generation_config.eos_token_id] = float("-inf")
            exact = logits.log_softmax(-1).gather(-1, sequences[:, 1:, None])[..., 0].sum(-1)
            out.append((torch.tensor(result.scores, dtype=torch.float64, device="cuda") - exact).abs())
        return torch.cat(out)

    mine, theirs = deviations(graphed), deviations(rows)
    assert float(mine.max()) <= ERROR_FACTOR["largest"] * float(theirs.max())
    assert float(mine.pow(2).mean().sqrt()) <= ERROR_FACTOR["rms"] * float(theirs.pow(2).mean().sqrt())
