"""`kernels.relu_linear` (ReLU in cuBLASLt's GEMM epilogue) and where the feed-forward uses it.

On the CPU the backend never serves it (`relu_linear_supports` wants CUDA half precision); the
routing is checked there with a backend that says yes and runs the reference. On a GPU the
epilogue's result is checked against `relu(F.linear(...))` and float64.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from backends import saying_yes_to
from hf_paged_t5 import cpu_ops, kernels, reference, tiny
from hf_paged_t5.model import attention, stacks

CUDA = torch.cuda.is_available()


def _dense(family="t5", dtype=torch.float32, device="cpu"):
    return tiny.build_model("tiny", family=family, dtype=dtype).encoder.block[0].layer[-1].DenseReluDense.eval().to(device)


def test_supports_only_half_precision_on_cuda_with_several_rows():
    w = torch.randn(8, 4)
    assert not kernels.relu_linear_supports(torch.randn(3, 4), w)  # CPU
    assert not kernels.relu_linear_supports(torch.randn(3, 4).half(), w.half())  # CPU, half
    assert not reference.relu_linear_supports(torch.randn(3, 4), w)
    assert not hasattr(cpu_ops, "relu_linear_supports")  # the CPU backend leaves the FF to HF's modules
    if CUDA:
        x, wc = torch.randn(3, 4, device="cuda", dtype=torch.bfloat16), w.to("cuda", torch.bfloat16)
        assert kernels.relu_linear_supports(x, wc)
        assert not kernels.relu_linear_supports(x[:1], wc)  # one row: gemv's, and PyTorch's epilogue needs two
        assert not kernels.relu_linear_supports(x.float(), wc.float())  # float32 keeps HF's own ops
        assert not kernels.relu_linear_supports(x, wc.half())
        assert not kernels.relu_linear_supports(x[:, :3], wc)


def test_relu_linear_refuses_what_it_does_not_serve():
    device = "cuda" if CUDA else "cpu"  # float32: refused on either (the CPU runs the interpreter)
    with pytest.raises(ValueError, match="relu_linear serves more than one row"):
        kernels.relu_linear(torch.randn(3, 4, device=device), torch.randn(8, 4, device=device))


def test_feed_forward_routes_the_non_gated_ff_through_relu_linear():
    """Decoder step (`attention.feed_forward`) and encoder (`stacks._dense`): HF's module's result,
    bit for bit in float32 (the reference's relu(x @ W.T) is HF's wi then ReLU); the gated FF, a hooked
    ReLU and a hooked FF module keep their own paths."""
    calls = []
    ops = saying_yes_to("relu_linear", "relu_linear_supports", calls)
    dense = _dense()
    x = torch.randn(2, 5, dense.wi.in_features, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = dense(x)
        assert attention.relu_epilogue(ops, dense, x)
        assert torch.equal(attention.feed_forward(ops, dense, x), expected)
        assert torch.equal(stacks._dense(ops, dense, x.view(10, -1)), expected.view(10, -1))
        assert calls == [(2, 5, dense.wi.in_features), (10, dense.wi.in_features)]

        handle = dense.act.register_forward_hook(lambda *_: None)
        assert not attention.relu_epilogue(ops, dense, x)
        handle.remove()
        handle = dense.register_forward_hook(lambda *_: None)
        stacks._dense(ops, dense, x.view(10, -1))  # a hooked FF runs its own forward
        handle.remove()
        assert len(calls) == 2
        gated = _dense("t5v1_1")
        assert not attention.relu_epilogue(ops, gated, x)
        other = torch.nn.Module()  # a module with wi / act / wo but not HF's non-gated FF
        other.wi, other.act, other.wo = dense.wi, dense.act, dense.wo
        assert not attention.relu_epilogue(ops, other, x)
        assert not attention.relu_epilogue(kernels, dense, x)  # CPU tensors: the Triton backend declines


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows,n,k", [(2, 64, 32), (16, 4096, 1024), (77, 2048, 512), (513, 1000, 333)])
def test_relu_linear_is_relu_of_a_cublas_gemm(dtype, rows, n, k):
    """Against float64: no less accurate than `relu(F.linear(...))` (HF's two ops), up to one rounding
    of the output dtype (another GEMM algorithm may sum in another order); zeros where the product is negative."""
    g = torch.Generator().manual_seed(rows)
    x64, w64 = torch.randn(rows, k, generator=g, dtype=torch.float64), torch.randn(n, k, generator=g, dtype=torch.float64)
    x, w = x64.to("cuda", dtype), w64.to("cuda", dtype)
    exact = torch.relu(x.double().cpu() @ w.double().cpu().T)
    out = kernels.relu_linear(x, w)
    hf = torch.relu(F.linear(x, w))
    assert out.dtype == dtype and out.shape == (rows, n)
    err, hf_err = (out.double().cpu() - exact).abs(), (hf.double().cpu() - exact).abs()
    ulp = torch.finfo(dtype).eps * exact.abs().clamp_min(torch.finfo(dtype).tiny)
    assert (err <= hf_err.max() + ulp).all()
    assert (out.cpu()[exact == 0] == 0).all()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a GPU")
def test_the_ff_uses_the_epilogue_on_a_gpu_and_stays_within_hfs_error():
    """bf16 t5 FF at 16 rows: `relu_linear` runs (spy), and the FF's error against float64 is at most
    1.1x HF's module's own bf16 error."""
    dense64 = _dense(dtype=torch.float64)
    dense = _dense(dtype=torch.bfloat16, device="cuda")
    x64 = torch.randn(16, dense.wi.in_features, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    x = x64.to("cuda", torch.bfloat16)
    calls = []
    real = kernels.relu_linear
    spy = SimpleNamespace(**{name: getattr(kernels, name) for name in kernels.__all__})
    spy.relu_linear = lambda *a: calls.append(1) or real(*a)
    with torch.no_grad():
        exact = dense64(x.double().cpu())
        hf = dense(x).double().cpu()
        ours = attention.feed_forward(spy, dense, x).double().cpu()
    assert calls == [1]
    assert (ours - exact).abs().max() <= 1.1 * (hf - exact).abs().max()
