"""The gated feed-forward kernel (`kernels.gated_gelu`) against its reference and HF's own
`gelu_new(gate) * linear`, and its use in the FF where `fused_gated_gelu` allows it."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.activations import NewGELUActivation

from hf_paged_t5 import kernels, reference
from hf_paged_t5.model import attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def pair(shape, dtype, scale=3.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate = (torch.randn(shape, generator=g, dtype=torch.float64) * scale)
    linear = torch.randn(shape, generator=g, dtype=torch.float64)
    return gate, linear, gate.to(dtype).to(DEVICE), linear.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (3, 50), (2, 5, 2049), (7, 4097)])  # around the 2,048-element block
def test_gated_gelu_matches_reference(dtype, shape):
    """Half precision: within one ulp of the exact value (float32 math, one rounding). Float32:
    within 8 ulps where x >= -3 (HF: ~100 near -3), and in the negative tail (where float32's exp of a rounded
    argument is off by tens of ulps, and HF's `1 + tanh` by far more) no worse than the
    reference, which is HF's formula."""
    _, _, gate, linear = pair(shape, dtype)
    out = kernels.gated_gelu(gate=gate, linear=linear)
    assert out.dtype == dtype and out.shape == gate.shape
    x, y = gate.double().cpu(), linear.double().cpu()  # x * sigmoid(2z): exact also past x = -7, where
    exact = x * torch.sigmoid(2 * math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)) * y  # float64's 1 + tanh is 0
    err = (out.double().cpu() - exact).abs()
    info = torch.finfo(dtype)
    step = info.eps * exact.abs().clamp_min(info.smallest_normal)  # subnormals: a fixed step
    if dtype != torch.float32:
        assert (err <= step).all()
        return
    assert (err[x >= -3] <= 8 * step[x >= -3]).all()
    tail = x < -3
    if tail.any():
        hf_err = (reference.gated_gelu(gate=gate, linear=linear).double().cpu() - exact).abs()
        assert err[tail].max() <= hf_err[tail].max()


@pytest.mark.parametrize("layout", ["halves", "3d_halves", "permuted"])
def test_gated_gelu_reads_strided_inputs(layout):
    """The two halves of a packed [tokens, 2 * d_ff] projection are read in place, leading dims
    that are not one stride apart through a copy: the result is the contiguous kernel's, bit for bit."""
    g = torch.Generator().manual_seed(5)
    cols = 1029  # not a multiple of the column block: the masked tail of each row
    if layout == "permuted":
        gate = torch.randn(5, 3, cols, generator=g).half().to(DEVICE).transpose(0, 1)
        linear = torch.randn(5, 3, cols, generator=g).half().to(DEVICE).transpose(0, 1)
    else:
        shape = (3, 5, 2 * cols) if layout == "3d_halves" else (13, 2 * cols)
        both = torch.randn(shape, generator=g).half().to(DEVICE)
        gate, linear = both[..., :cols], both[..., cols:]
    out = kernels.gated_gelu(gate=gate, linear=linear)
    assert out.is_contiguous() and out.shape == gate.shape
    assert torch.equal(out, kernels.gated_gelu(gate=gate.contiguous(), linear=linear.contiguous()))


@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else []))
def test_gated_gelu_no_less_accurate_than_hf(dtype):
    """Against float64, the kernel's error is at most HF's own half-precision one (op-by-op rounding)."""
    gate64, linear64, gate, linear = pair((64, 1000), dtype, seed=3)
    exact = NewGELUActivation()(gate64) * linear64
    hf = (NewGELUActivation()(gate) * linear).double().cpu()
    out = kernels.gated_gelu(gate=gate, linear=linear).double().cpu()
    hf_err, err = (hf - exact).abs(), (out - exact).abs()
    assert err.max() <= hf_err.max() and err.pow(2).mean() <= hf_err.pow(2).mean()


def test_reference_is_hf_in_float32():
    _, _, gate, linear = pair((5, 300), torch.float32)
    gate, linear = gate.cpu(), linear.cpu()
    assert torch.equal(reference.gated_gelu(gate=gate, linear=linear), NewGELUActivation()(gate) * linear)


def test_gated_gelu_rejects_mismatched_inputs():
    gate = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="one shape and dtype"):
        kernels.gated_gelu(gate=gate, linear=torch.randn(2, 9, device=DEVICE))
    with pytest.raises(ValueError, match="one shape and dtype"):
        kernels.gated_gelu(gate=gate, linear=gate.half())


def test_fused_only_for_half_precision_hf_gated_ff_as_it_is():
    from hf_paged_t5 import cpu_ops, tiny

    dense = tiny.build_model("tiny", family="t5v1_1").encoder.block[0].layer[-1].DenseReluDense.eval()
    assert attention.fused_gated_gelu(kernels, dense, torch.bfloat16)
    assert not attention.fused_gated_gelu(kernels, dense, torch.float32)  # fp32 stays HF's op for op
    assert not attention.fused_gated_gelu(cpu_ops, dense, torch.bfloat16)  # a backend without the kernel
    handle = dense.act.register_forward_hook(lambda *_: None)
    assert not attention.fused_gated_gelu(kernels, dense, torch.bfloat16)
    handle.remove()
    relu = tiny.build_model("tiny", family="t5").encoder.block[0].layer[-1].DenseReluDense
    assert not attention.fused_gated_gelu(kernels, relu, torch.bfloat16)


def test_fused_feed_forward_matches_hf_module():
    """The FF with the kernel in the middle against HF's module, both half precision, and against
    float64: no less accurate than the module."""
    from hf_paged_t5 import tiny
    from hf_paged_t5.model import stacks

    model = tiny.build_model("tiny", family="t5v1_1", dtype=torch.float64)
    dense64 = model.encoder.block[0].layer[-1].DenseReluDense.eval()
    dense = tiny.build_model("tiny", family="t5v1_1").encoder.block[0].layer[-1].DenseReluDense.eval()
    dense = dense.to(DEVICE, torch.float16)
    x64 = torch.randn(37, dense.wi_0.in_features, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    x = x64.to(DEVICE, torch.float16)
    with torch.no_grad():
        exact = dense64(x64.to(torch.float16).double())
        hf = dense(x).double().cpu()
        fused = stacks._dense(kernels, dense, x).double().cpu()
    assert (fused - exact).abs().max() <= 1.1 * (hf - exact).abs().max()
