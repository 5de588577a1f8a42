"""fp16 safety: a T5 whose residual stream overflows fp16 stays finite on the paged path.

T5 checkpoints from t5-large up grow hidden states past fp16's 65504. Stock HF survives that in
two ways, and the paged path must keep both working:
- `model.half()`: every weight fp16. `T5Block` clamps the hidden states to +-(65504 - 1000)
  after each sub-layer once any of them is inf (the FF's `wo` output overflows first).
- `from_pretrained(..., dtype=torch.float16)`: `_keep_in_fp32_modules = ["wo"]` keeps `wo` in
  fp32, so from the first FF on the residual stream is fp32 and never overflows.
Here the FF weights are scaled until the fp32 residual stream passes 65504 (asserted, so the
test cannot pass without provoking the overflow). The patched model, on the torch backend and
on the Triton kernels (Triton's interpreter on CPU), must then give finite logits close to
stock HF's fp16 logits, with the same greedy tokens.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_batch, make_model
from oracle import stock_and_paged
from transformers import AutoModelForSeq2SeqLM

import hf_paged_t5 as hp

CUDA = torch.cuda.is_available()
FP16_MAX = torch.finfo(torch.float16).max
# ||patched - HF|| / ||HF|| over every step's fp16 logits: both round to fp16 in different
# orders (measured <= 1.2e-2 for the torch backend, whose attention core is fp32).
LOGITS_TOLERANCE = 3e-2
# FF weight scale per family: the fp32 residual stream reaches ~1e5 (t5) / ~2e5 (gated t5v1_1),
# past fp16's range, while stock HF fp16 still gives finite logits. Much larger scales make HF's
# fp16 output itself NaN (gated-GELU products overflow before any clamp).
FF_SCALE = {"t5": 30.0, "t5v1_1": 6.0}


def overflowing_model(family: str, scale: float | None = None, device="cpu", **overrides):
    """An fp32 model of `family` whose FF weights are scaled so hidden states pass fp16's range."""
    model = make_model(family, seed=11, device=device, **overrides)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".DenseReluDense." in name:
                p.mul_(FF_SCALE[family] if scale is None else scale)
    return model


def max_block_output(model, ids, mask) -> float:
    """Largest |hidden state| after any encoder or decoder block in one forward."""
    seen = []
    hooks = [
        block.register_forward_hook(lambda _m, _i, out: seen.append(out[0].abs().max().float().item()))
        for block in list(model.encoder.block) + list(model.decoder.block)
    ]
    try:
        with torch.no_grad():
            model(input_ids=ids, attention_mask=mask, decoder_input_ids=torch.zeros_like(ids[:, :3]))
    finally:
        for h in hooks:
            h.remove()
    return max(seen)


def fp16_variant(fp32_model, variant: str, tmp_path):
    """fp16 copy of `fp32_model`: "half" (every weight fp16) or "keep_wo_fp32" (HF's loader)."""
    if variant == "half":
        return fp32_model.half()
    fp32_model.save_pretrained(tmp_path / "ckpt")
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path / "ckpt", dtype=torch.float16).eval()
    return model.to(fp32_model.device)


def count_inf_wo_outputs(model):
    """Hooks counting `wo` outputs (FF results) that hold an inf; returns (counter list, hook handles)."""
    hits = []
    handles = [
        m.register_forward_hook(lambda _m, _i, out: hits.append(bool(torch.isinf(out).any())))
        for name, m in model.named_modules() if name.endswith("DenseReluDense.wo")
    ]
    return hits, handles


def compare_with_hf(ref_seq, ref_logits, seq, logits, backend):
    """Logits close to HF's at every step of every row, up to the row's first differing token.

    fp16 greedy tokens may differ where HF's two best candidates nearly tie: a token may differ
    only where HF's margin between the two tokens is within twice the largest logit difference
    at that step (what rounding of that size can flip). Past that step the rows continue from
    different tokens and are not compared.
    """
    steps = ref_logits.shape[0]
    for row in range(ref_seq.shape[0]):
        for step in range(steps):
            a, b = ref_logits[step, row], logits[step, row]
            rel = ((b - a).norm() / a.norm()).item()
            assert rel < LOGITS_TOLERANCE, (
                f"{backend}: row {row} step {step}: logits differ from HF's by {rel:.3g}"
            )
            want, got = int(ref_seq[row, step + 1]), int(seq[row, step + 1])
            if want != got:
                margin = (a[want] - a[got]).item()
                delta = (b - a).abs().max().item()
                assert margin <= 2 * delta, (
                    f"{backend}: row {row} step {step}: token {got} instead of HF's {want}, but HF's margin "
                    f"{margin:.3g} exceeds what a logit error of {delta:.3g} can flip"
                )
                break


def check_patched_like_hf(model, ids, mask, backends, close=True):
    """Stock HF and patched (`stock_and_paged`: the paged path ran, no block leaked) on each backend,
    6 greedy steps with their logits: finite, and with `close` as close as `compare_with_hf` says.
    (Not `compare_with_stock`: in fp16 the tokens may differ at a near tie, and a clamped fp16
    residual stream has no higher-precision twin to measure stock's own error against.)"""
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, min_new_tokens=6, output_logits=True,
              return_dict_in_generate=True)
    for backend in backends:
        stock, paged = stock_and_paged(model, hp.PagedCacheConfig(block_size=8, backend=backend), **kw)
        ref_logits, logits = (torch.stack(out.logits).float() for out in (stock, paged))  # [steps, rows, vocab]
        assert torch.isfinite(ref_logits).all(), "premise: stock HF fp16 stays finite here"
        assert torch.isfinite(logits).all(), f"{backend}: inf/NaN logits where stock HF fp16 has none"
        if close:
            compare_with_hf(stock.sequences, ref_logits, paged.sequences, logits, backend)


BACKENDS = ["torch", "triton"]  # triton: the interpreter on CPU (conftest sets TRITON_INTERPRET=1)
# Five rows, padded. More than 4 rows also keeps the decoder's projections on torch's matmul rather
# than the small-batch Triton GEMV, which the interpreter runs ~50x slower than the whole test.
ROW_LENGTHS = [9, 14, 5, 11, 3]


# The Triton kernels run (interpreted, ~6 s a call) on the gated family only: the FF is HF's
# own module either way, and the kernels see the same attention/norm inputs.
@pytest.mark.parametrize(
    "family, variant, backends",
    [
        ("t5", "half", ["torch"]),
        ("t5", "keep_wo_fp32", ["torch"]),
        ("t5v1_1", "half", BACKENDS),
        ("t5v1_1", "keep_wo_fp32", BACKENDS),
    ],
    ids=lambda v: "+".join(v) if isinstance(v, list) else v,
)
def test_overflowing_fp16_model_stays_finite_and_close_to_hf(family, variant, backends, tmp_path):
    fp32_model = overflowing_model(family)
    ids, mask = make_batch(ROW_LENGTHS, padding_side="right")
    assert max_block_output(fp32_model, ids, mask) > 1.5 * FP16_MAX, "premise: residual stream past fp16"
    model = fp16_variant(fp32_model, variant, tmp_path)
    wo_dtype = model.encoder.block[0].layer[-1].DenseReluDense.wo.weight.dtype
    assert wo_dtype == (torch.float16 if variant == "half" else torch.float32)
    hits, handles = count_inf_wo_outputs(model)
    try:
        check_patched_like_hf(model, ids, mask, backends)
    finally:
        for h in handles:
            h.remove()
    if variant == "half":
        # The premise of HF's clamp: the FF output itself overflows to inf (in HF and in the paged path).
        assert any(hits), "no FF output overflowed: the test did not provoke the clamp"


@pytest.mark.parametrize(
    "scale, variant, backends",
    [(12.0, "half", BACKENDS), (10.0, "keep_wo_fp32", ["torch"])],
    ids=["x12-half-torch+triton", "x10-keep_wo_fp32-torch"],
)
def test_far_past_fp16_range_no_inf_where_hf_has_none(scale, variant, backends, tmp_path):
    """Gated-GELU FFs 10-15x too large (residual stream ~1e6-3e6): HF's fp16 output is finite but
    chaotic (clamped values decide tokens), so only finiteness is required of the paged path."""
    fp32_model = overflowing_model("t5v1_1", scale=scale)
    ids, mask = make_batch(ROW_LENGTHS, padding_side="right")
    assert max_block_output(fp32_model, ids, mask) > 10 * FP16_MAX
    model = fp16_variant(fp32_model, variant, tmp_path)
    check_patched_like_hf(model, ids, mask, backends, close=False)


@pytest.mark.parametrize("variant", ["half", "keep_wo_fp32"])
def test_overflowing_fp16_encoder_matches_hf(variant, tmp_path):
    """The paged encoder forward alone (varlen, real tokens only) against HF's, left padding."""
    model = fp16_variant(overflowing_model("t5v1_1"), variant, tmp_path)
    ids, mask = make_batch([12, 4, 17], padding_side="left")
    real = mask.bool()
    with torch.no_grad():
        ref = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state.float()
        assert torch.isfinite(ref[real]).all(), "premise: stock HF's fp16 encoder stays finite here"
        for backend in BACKENDS:
            hp.patch_model(model, hp.PagedCacheConfig(backend=backend))
            try:
                out = model.encoder(input_ids=ids, attention_mask=mask).last_hidden_state.float()
            finally:
                hp.unpatch_model(model)
            assert torch.isfinite(out).all()
            rel = ((out[real] - ref[real]).norm() / ref[real].norm()).item()
            assert rel < LOGITS_TOLERANCE, f"{backend}: encoder output differs from HF's by {rel:.3g}"


def test_rms_norm_kernel_takes_fp16_values_near_the_limit():
    """T5's layer norm squares its input: the kernel must do that in fp32 (60000**2 overflows fp16)."""
    from hf_paged_t5 import kernels, reference

    x = torch.full((2, 64), 6.0e4, dtype=torch.float16)
    x[1, ::2] = -6.0e4
    w = torch.ones(64, dtype=torch.float16)
    out, _ = kernels.rms_norm(hidden=x, weight=w, eps=1e-6)
    ref, _ = reference.rms_norm(hidden=x, weight=w, eps=1e-6)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=1e-3, atol=1e-3)


# ---- on the GPU: compiled kernels and the CUDA-graph decode step -----------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("family", ["t5", "t5v1_1"])
@pytest.mark.parametrize("variant", ["half", "keep_wo_fp32"])
def test_gpu_overflowing_fp16_model_stays_finite_and_close_to_hf(family, variant, tmp_path):
    """The CPU test's models on the GPU: Triton kernels, CUDA graphs; 3 rows (the small-batch GEMV
    projections) and 5 rows (cuBLAS). Larger random models in fp16 are chaotic near 65504 (4% logit
    differences between two fp16 orders of summation even before any overflow), so the sizes stay."""
    fp32_model = overflowing_model(family, device="cuda")
    batches = [make_batch(n, padding_side="right", device="cuda") for n in ([9, 14, 5], ROW_LENGTHS)]
    for ids, mask in batches:
        assert max_block_output(fp32_model, ids, mask) > 1.5 * FP16_MAX
    model = fp16_variant(fp32_model, variant, tmp_path)  # "half" converts fp32_model itself
    for ids, mask in batches:
        # auto: Triton kernels + CUDA graphs on cuda; torch: the same paged path with HF's own math
        check_patched_like_hf(model, ids, mask, ["torch", "auto"])
