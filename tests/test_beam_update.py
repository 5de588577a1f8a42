"""The beam-search step kernels (`kernels.beam_update`) against their plain-PyTorch twin
(`reference.beam_update`), and the twin inside patched generate() against stock HF's beam search.

State level: random logits with EOS made likely (candidates finish, rows stop early), several EOS
ids, the min-length rule, early_stopping True / False, beam counts that are not powers of two,
vocabularies of one and several 4,096-entry chunks, exact ties (the lower flat index first, in
both), the block-table reorder and the step counter; every tensor the step writes is compared.
End to end: the resident beam loop with `beam_update` (the twin on CPU, the kernels under Triton's
interpreter) gives stock HF's tokens for the length-penalty / early-stopping / min-length /
num_return_sequences cases of test_resident_loops.py."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import ends_early, make_batch, make_model
from oracle import compare_with_stock

import hf_paged_t5 as hp
from hf_paged_t5 import cpu_ops, kernels, reference
from hf_paged_t5.decode import beam_graph
from hf_paged_t5.decode.beam_state import BeamState
from hf_paged_t5.kernels import beam as beam_kernels

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
_OUTPUTS = {"workspace"}


def _state(batch, beams, vocab, eos=(1,), minimum=None, prompt_len=2, max_len=12, width=4, block_size=4,
           early=False, seed=0, penalty=1.3):
    g = torch.Generator().manual_seed(seed)
    keep = max(2, 1 + len(eos)) * beams
    rows = batch * beams
    prompt = torch.randint(0, vocab, (batch, beams, prompt_len), generator=g)
    st = BeamState(prompt, max_len, 0, len(eos))
    lengths = range(prompt_len, max_len)
    factor = [1.0 / float((c + 1 - prompt_len) ** penalty) for c in lengths]
    until = None
    if minimum is not None:
        until = torch.zeros(vocab, dtype=torch.int32)
        until[list(eos)] = minimum
    t = dict(
        step=torch.zeros((), dtype=torch.int64),
        int_table=torch.tensor([[c, c - prompt_len, int(c + 1 >= max_len)] for c in lengths], dtype=torch.int64),
        float_table=torch.tensor([[f, f] for f in factor], dtype=torch.float32),
        running_sequences=st.running_sequences, sequences=st.sequences, running_beam_scores=st.running_beam_scores,
        beam_scores=st.beam_scores, running_beam_indices=st.running_beam_indices, beam_indices=st.beam_indices,
        is_sent_finished=st.is_sent_finished, heuristic=st.is_early_stop_heuristic_unsatisfied,
        beam_idx=torch.zeros(rows, dtype=torch.int64), next_tokens=torch.zeros(rows, 1, dtype=torch.int64),
        unfinished=torch.ones((), dtype=torch.bool),
        table=torch.randint(0, 99, (rows, width), generator=g, dtype=torch.int32),
        owned=torch.randperm(rows * width, generator=g).view(rows, width).to(torch.int32),
        slot_mapping=torch.zeros(rows, dtype=torch.int32), self_seq_lens=torch.zeros(rows, dtype=torch.int32),
        input_ids=torch.zeros(rows, 1, dtype=torch.int64), copy_src=torch.zeros(rows, dtype=torch.int64),
        copy_dst=torch.zeros(rows, dtype=torch.int64), block_size=block_size, keep=keep, early_stopping_true=early,
        eos_until=until, eos=torch.tensor(eos, dtype=torch.int64),
    )
    return {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in t.items()}


def _logits(rows, vocab, eos, g, dtype, tie=False):
    x = torch.randn(rows, 1, vocab, generator=g) * 2
    if tie:  # every beam the same scores, and equal values inside a row
        x = x[:1].expand(rows, 1, vocab).clone()
        x[..., 1::3] = x[..., 0:1]
    x[..., list(eos)] += 2.5 * torch.rand(rows, 1, len(eos), generator=g)  # EOS often among the best
    return x.to(dtype).to(DEVICE)


def _run(batch, beams, vocab, steps, dtype=torch.float32, tie=False, **kw):
    ref = _state(batch, beams, vocab, **kw)
    out = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in ref.items()}
    ws = beam_kernels.workspace(batch, beams, ref["keep"], vocab, ref["running_sequences"].shape[2],
                                ref["running_beam_indices"].shape[2], ref["table"].shape[1], torch.device(DEVICE))
    g = torch.Generator().manual_seed(11)
    for step in range(steps):
        logits = _logits(batch * beams, vocab, kw.get("eos", (1,)), g, dtype, tie)
        reference.beam_update(logits=logits, **ref)
        kernels.beam_update(logits=logits, workspace=ws, **out)
        for name, want in ref.items():
            if not isinstance(want, torch.Tensor):
                continue
            got = out[name]
            if want.dtype.is_floating_point:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4, msg=f"step {step}: {name}")
            else:
                assert torch.equal(got, want), f"step {step}: {name}\n{got}\n{want}"
        assert int(ws["tickets"]) == 0
    return ref


@pytest.mark.parametrize(
    "batch,beams,vocab,kw",
    [
        (2, 3, 37, dict(eos=(1,), early=True)),
        (3, 4, 5000, dict(eos=(2,), minimum=6, penalty=-0.7)),
        (1, 2, 8200, dict(eos=(0, 3), early=False)),
        (2, 5, 300, dict(eos=(1,), early=True, minimum=9, max_len=14)),
    ],
    ids=["v37-early", "v5000-min", "v8200-2eos", "b5-early-min"],
)
def test_kernel_matches_twin(batch, beams, vocab, kw):
    final = _run(batch, beams, vocab, steps=kw.get("max_len", 12) - 2, **kw)
    assert int(final["step"]) == kw.get("max_len", 12) - 2
    assert not bool(final["unfinished"])  # the last step hits max length everywhere
    assert bool(final["is_sent_finished"].all())


def test_kernel_matches_twin_on_ties_and_bf16():
    """Equal scores across beams and inside rows: both take the lower flat index."""
    _run(2, 4, 301, steps=5, tie=True, dtype=torch.bfloat16, eos=(1,))


def test_twin_stops_rows_early_with_eos():
    """The EOS-heavy logits finish every source before max length (the flag goes False early)."""
    st = _state(2, 3, 40, eos=(1,), early=True, max_len=30)
    g = torch.Generator().manual_seed(3)
    for step in range(28):
        logits = torch.randn(6, 1, 40, generator=g)
        logits[..., 1] += 6.0
        reference.beam_update(logits=logits.to(DEVICE), **st)
        if not bool(st["unfinished"]):
            break
    assert step < 27 and bool(st["is_sent_finished"].all())


def test_supports_bounds():
    assert beam_kernels.supports(4, 8, 32128) and beam_kernels.supports(8, 16, 250112)
    assert not beam_kernels.supports(9, 18, 32128)  # more beams: the PyTorch update runs
    assert not beam_kernels.supports(8, 32, 32128)  # keep past MAX_KEEP
    assert not beam_kernels.supports(4, 8, 300000)  # past MAX_CHUNKS chunks


def test_workspace_required():
    st = _state(1, 2, 20)
    with pytest.raises(ValueError, match="workspace"):
        kernels.beam_update(logits=torch.zeros(2, 1, 20, device=DEVICE), **st)


# ---- end to end: the resident beam loop with `beam_update` against stock HF ----------------------
@pytest.fixture(scope="module")
def model():
    return make_model("t5", seed=4)


@pytest.fixture(scope="module")
def batch():
    return make_batch([12, 3, 9, 7], padding_side="left")


def _fused_with(monkeypatch, update) -> list:
    """cpu_ops with `beam_update` = `update`: the resident beam loop takes the fused path; the
    list records each update that ran it."""
    ran = []
    real = beam_graph.BeamStep._fused_update
    monkeypatch.setattr(cpu_ops, "beam_update", update, raising=False)
    monkeypatch.setattr(cpu_ops, "beam_update_supports", kernels.beam_update_supports, raising=False)
    monkeypatch.setattr(cpu_ops, "beam_workspace", kernels.beam_workspace, raising=False)
    monkeypatch.setattr(beam_graph.BeamStep, "_fused_update", lambda self, c: ran.append(c) or real(self, c))
    return ran


@pytest.fixture
def fused(monkeypatch):
    """The fused path with the twin."""
    return _fused_with(monkeypatch, reference.beam_update)


@pytest.mark.parametrize(
    "opts",
    [
        dict(num_beams=4, early_stopping=False, length_penalty=-0.8),
        dict(num_beams=4, early_stopping="never", length_penalty=-1.5),
        dict(num_beams=4, early_stopping=True, length_penalty=2),
        dict(num_beams=3, early_stopping=False, length_penalty=1.7, num_return_sequences=3, min_new_tokens=4),
    ],
    ids=["false-neg", "never-neg", "true-int", "nrs-min"],
)
def test_fused_path_gives_stock_tokens(model, batch, fused, opts):
    ids, mask = batch
    eos = ends_early(model, ids, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compare_with_stock(model, hp.PagedCacheConfig(block_size=2), input_ids=ids, attention_mask=mask,
                           max_new_tokens=14, eos_token_id=eos, **opts)
    assert fused, "the fused beam update did not run"


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter only (on a GPU: test_gpu_contract)")
def test_fused_kernels_in_generate(model, batch, monkeypatch):
    """The Triton kernels themselves (the interpreter on CPU) inside generate() on a CPU model."""
    ran = _fused_with(monkeypatch, kernels.beam_update)
    ids, mask = batch
    eos = ends_early(model, ids, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compare_with_stock(model, hp.PagedCacheConfig(block_size=4), input_ids=ids[:2], attention_mask=mask[:2],
                           max_new_tokens=8, num_beams=3, eos_token_id=eos, length_penalty=0.5)
    assert ran


_COMPILE = r"""
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hf_paged_t5.kernels import beam as kb

floats = {"cand_val_ptr", "stats_ptr", "row_stats_ptr", "top_val_ptr", "rscore_ptr", "score_ptr", "float_table_ptr"}
int32s = {"bi_buf_ptr", "table_buf_ptr", "flags_ptr", "ticket_ptr", "rbi_ptr", "bi_ptr", "table_ptr", "owned_ptr",
          "slot_ptr", "lens_ptr", "eos_until_ptr"}
int8s = {"fin_ptr", "heur_ptr", "unfinished_ptr"}
for kernel, constexprs, warps in [
    (kb._beam_candidates_kernel, {"CHUNK": kb._CHUNK}, 8),
    (kb._beam_top_kernel, {"KP": kb._KP, "CP": kb._CP, "NB": kb._NB}, 4),
    (kb._beam_select_kernel, {"KP": kb._KP, "KEEPP": kb._KEEPP, "MP": kb._MP}, 4),
    (kb._beam_rows_kernel, {"KP": kb._KP, "BL": kb._BL, "ROWS_CHUNK": kb._ROWS_CHUNK}, 4),
]:
    names = kernel.arg_names
    def kind(n):
        if n in constexprs:
            return "constexpr"
        if not n.endswith("_ptr"):
            return "i32"
        if n == "logits_ptr":
            return "*bf16"
        return "*fp32" if n in floats else "*i32" if n in int32s else "*i8" if n in int8s else "*i64"
    signature = {n: kind(n) for n in names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=warps, num_stages=1))
    assert compiled.asm.get("cubin"), kernel.__name__
    print(kernel.__name__, "ok")
"""


def test_kernels_compile_for_a_gpu(tmp_path):
    """The interpreter runs what a GPU compile may refuse (a plain global inside a kernel, say):
    each kernel compiled for sm_90 with this machine's Triton and its ptxas, no GPU needed."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton")
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count(" ok") == 4


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_backends_without_the_kernels_keep_the_pytorch_update(model, batch, backend, monkeypatch):
    """`reference` (backend "torch") has the twin but not the kernels' size rule, `cpu_ops` neither:
    both run the PyTorch-op update, stock's tokens."""
    ran = []
    monkeypatch.setattr(beam_graph.BeamStep, "_fused_update", lambda self, c: ran.append(c))
    ids, mask = batch
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compare_with_stock(model, hp.PagedCacheConfig(block_size=4, backend=backend), input_ids=ids,
                           attention_mask=mask, max_new_tokens=6, num_beams=3)
    assert not ran
