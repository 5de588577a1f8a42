"""The fused T5 layer-norm kernel against the reference (HF's T5LayerNorm, step for step)."""

from __future__ import annotations

import pytest
import torch
from transformers.models.t5.modeling_t5 import T5LayerNorm

from hf_paged_t5 import kernels, reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 64), (3, 50), (2, 5, 100)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_reference(dtype, shape, with_residual):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(DEVICE)
    r = (torch.randn(shape, generator=g) * 3).to(dtype).to(DEVICE) if with_residual else None
    w = (torch.rand(shape[-1], generator=g) + 0.5).to(dtype).to(DEVICE)
    out, total = kernels.rms_norm(hidden=x, weight=w, eps=1e-6, residual=r)
    ref_out, ref_total = reference.rms_norm(hidden=x, weight=w, eps=1e-6, residual=r)
    assert out.dtype == ref_out.dtype and out.shape == ref_out.shape
    torch.testing.assert_close(total, ref_total, rtol=0, atol=0)  # the sum is rounded like torch's add
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=tol, atol=tol)


def test_reference_is_hf_layer_norm():
    ln = T5LayerNorm(48, eps=1e-6)
    with torch.no_grad():
        ln.weight.uniform_(0.5, 1.5)
    x = torch.randn(4, 48) * 5
    assert torch.equal(reference.rms_norm(hidden=x, weight=ln.weight, eps=1e-6)[0], ln(x))


def test_rms_norm_rejects_mismatched_weight():
    x = torch.randn(2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="weight has 8 entries"):
        kernels.rms_norm(hidden=x, weight=torch.ones(8, device=DEVICE), eps=1e-6)
