"""`kernels.split_k_linear` (a projection as float32 K-slice partials) and the decoder step's
feed-forward that leaves `wo`'s partials for the next add + norm kernel to sum.

On the CPU the backend never serves it (`split_k_supports` wants CUDA half precision and torch's
mixed-dtype bmm); the routing is checked there with a backend that says yes and runs the
reference. On a GPU the partials and the fused sum are checked against float64 and HF's module.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backends import saying_yes_to
from hf_paged_t5 import cpu_ops, kernels, reference, tiny
from hf_paged_t5.kernels import split_k
from hf_paged_t5.model import attention

CUDA = torch.cuda.is_available()


def _ff(family="t5", dtype=torch.bfloat16, device="cpu"):
    """A tiny model's first decoder T5LayerFF (HF's module), eval mode."""
    model = tiny.build_model("tiny", family=family, dtype=dtype).eval().to(device)
    return model.decoder.block[0].layer[-1], model.decoder.block[1].layer[0].layer_norm


def test_supports_only_half_precision_on_cuda_with_up_to_max_rows():
    w = torch.randn(8, 32)
    assert not kernels.split_k_supports(torch.randn(3, 32), w)  # CPU
    assert not kernels.split_k_supports(torch.randn(3, 32).bfloat16(), w.bfloat16())  # CPU, half
    assert not reference.split_k_supports(torch.randn(3, 32), w)
    assert not hasattr(cpu_ops, "split_k_supports")  # the CPU backend leaves the FF to HF's modules
    if CUDA and split_k.MIXED_BMM:
        x, wc = torch.randn(3, 32, device="cuda", dtype=torch.bfloat16), w.to("cuda", torch.bfloat16)
        assert kernels.split_k_supports(x, wc)
        assert not kernels.split_k_supports(x[:1], wc)  # one row: gemv's
        big = torch.randn(split_k.MAX_ROWS + 1, 32, device="cuda", dtype=torch.bfloat16)
        assert not kernels.split_k_supports(big, wc)  # beyond the measured rows: cuBLAS's own GEMM
        assert not kernels.split_k_supports(x.float(), wc.float())  # float32 keeps HF's own ops
        assert not kernels.split_k_supports(x, wc.half())
        assert not kernels.split_k_supports(x[:, :24], wc[:, :24])  # K / 2 not a multiple of 8


def test_split_k_linear_refuses_what_it_does_not_serve():
    device = "cuda" if CUDA else "cpu"  # float32: refused on either (the CPU runs the interpreter)
    with pytest.raises(ValueError, match="split_k_linear serves 2 to 128 rows"):
        kernels.split_k_linear(torch.randn(3, 32, device=device), torch.randn(8, 32, device=device))


@pytest.mark.parametrize("splits,rows,n,k", [(1, 1, 8, 16), (2, 7, 24, 96), (3, 5, 40, 96)])
def test_reference_partials_sum_to_the_product(splits, rows, n, k):
    """The twin: `splits` float32 products over K-slices whose sum is x @ W.T within float32's
    bound for a sum of k products."""
    g = torch.Generator().manual_seed(k + rows)
    x, w = torch.randn(2, rows, k, generator=g), torch.randn(n, k, generator=g)
    parts = reference.split_k_linear(x, w, splits)
    assert parts.shape == (splits, 2, rows, n) and parts.dtype == torch.float32
    exact = x.double() @ w.double().T
    bound = k * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T)
    assert ((parts.double().sum(0) - exact).abs() <= bound).all()
    with pytest.raises(ValueError, match="does not split"):
        reference.split_k_linear(x, w, 5)


@pytest.mark.parametrize("family", ["t5", "t5v1_1"])
def test_the_ff_leaves_wo_as_partials_that_the_next_norm_sums(family):
    """bf16, the plain and the gated FF: `ff_sublayer` gives `Partials`, `add_norm` of them is the
    backend's add + norm of their in-order sum (bit for bit), and that sum is HF's FF output up to
    one bf16 rounding of a differently ordered float32 sum (against float64: no worse than HF's
    own bf16 module plus one rounding)."""
    calls = []
    ops = saying_yes_to("split_k_linear", "split_k_supports", calls)
    ff, next_norm = _ff(family)
    g = torch.Generator().manual_seed(1)
    normed = torch.randn(2, 5, ff.layer_norm.weight.shape[0], generator=g).bfloat16()
    hidden = torch.randn(normed.shape, generator=g).bfloat16()
    with torch.no_grad():
        out = attention.ff_sublayer(ops, ff, normed, hidden)
        assert isinstance(out, attention.Partials) and calls == [(2, 5, ff.DenseReluDense.wo.in_features)]
        assert out.parts.shape == (2, 2, 5, normed.shape[-1]) and out.parts.dtype == torch.float32
        got = attention.add_norm(ops, next_norm, hidden, out)
        summed = out.total(torch.bfloat16)
        want = reference.rms_norm(hidden=hidden, weight=next_norm.weight, eps=next_norm.variance_epsilon,
                                  residual=summed)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])

        hf = ff.dropout(ff.DenseReluDense(normed)).double()
        dense64 = _ff(family, torch.float64)[0].DenseReluDense
        dense64.load_state_dict(ff.DenseReluDense.state_dict())
        exact = dense64(normed.double())
        ulp = torch.finfo(torch.bfloat16).eps * exact.abs()
        assert ((summed.double() - exact).abs() <= (hf - exact).abs().max() + ulp).all()


def test_partials_only_where_nothing_sits_between_wo_and_the_add():
    """Training dropout, a hooked dropout or `wo`, float16 / float32 activations and a residual of
    another dtype keep HF's op-by-op FF (a tensor); a norm on another device sums the partials first."""
    calls = []
    ops = saying_yes_to("split_k_linear", "split_k_supports", calls)
    ff, next_norm = _ff()
    normed = torch.randn(3, ff.layer_norm.weight.shape[0]).bfloat16()
    hidden = torch.randn(normed.shape).bfloat16()
    with torch.no_grad():
        assert isinstance(attention.ff_sublayer(ops, ff, normed, hidden), attention.Partials)
        ff.train()
        assert isinstance(attention.ff_sublayer(ops, ff, normed, hidden), torch.Tensor)
        ff.eval()
        for module in (ff.dropout, ff.DenseReluDense.wo, ff.DenseReluDense):
            handle = module.register_forward_hook(lambda *_: None)
            assert isinstance(attention.ff_sublayer(ops, ff, normed, hidden), torch.Tensor)
            handle.remove()
        assert isinstance(attention.ff_sublayer(ops, ff, normed, hidden.float()), torch.Tensor)
        ff16, _ = _ff(dtype=torch.float16)
        assert isinstance(attention.ff_sublayer(ops, ff16, normed.half(), hidden.half()), torch.Tensor)
        ff32, _ = _ff(dtype=torch.float32)
        assert isinstance(attention.ff_sublayer(ops, ff32, normed.float(), hidden.float()), torch.Tensor)
        # CPU tensors: the Triton backend declines
        assert not attention.split_wo(kernels, ff.DenseReluDense, normed)
        assert len(calls) == 1

        out = attention.ff_sublayer(ops, ff, normed, hidden)
        hooked = next_norm.register_forward_hook(lambda *_: None)  # a norm that runs its own forward
        normed_out, total = attention.add_norm(ops, next_norm, hidden, out)
        hooked.remove()
        assert torch.equal(total, hidden + out.total(torch.bfloat16))
        assert torch.equal(normed_out, next_norm(total))


@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA and split_k.MIXED_BMM), reason="needs a GPU and torch's mixed-dtype bmm")
@pytest.mark.parametrize("rows,n,k", [(2, 64, 32), (16, 1024, 4096), (77, 2048, 5120), (128, 1000, 336)])
def test_split_k_partials_sum_to_the_product_on_a_gpu(rows, n, k):
    """The partials' in-order sum against float64: within float32's bound for a sum of k products
    of the bf16 operands; rounded to bf16, no worse than F.linear plus one rounding."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=g).to("cuda", torch.bfloat16)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to("cuda", torch.bfloat16)
    parts = kernels.split_k_linear(x, w)
    assert parts.shape == (split_k.SPLITS, rows, n) and parts.dtype == torch.float32
    exact = x.double().cpu() @ w.double().cpu().T
    bound = k * 2.0 ** -24 * (x.double().cpu().abs() @ w.double().cpu().abs().T)
    summed = attention.Partials(parts).total(torch.float32).double().cpu()
    assert ((summed - exact).abs() <= bound).all()
    rounded = attention.Partials(parts).total(torch.bfloat16).double().cpu()
    hf = torch.nn.functional.linear(x, w).double().cpu()
    ulp = torch.finfo(torch.bfloat16).eps * exact.abs()
    assert ((rounded - exact).abs() <= (hf - exact).abs().max() + ulp).all()


@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA and split_k.MIXED_BMM), reason="needs a GPU and torch's mixed-dtype bmm")
@pytest.mark.parametrize("family", ["t5", "t5v1_1"])
def test_the_step_ff_uses_the_partials_on_a_gpu_and_stays_within_hfs_error(family):
    """bf16 FF + the next add + norm at 16 rows on the Triton backend: `split_k_linear` runs (spy),
    the norm kernel's sum is bit for bit the reference's add of the partials, and the normed output's
    error against float64 is at most 1.1x that of HF's modules in bf16."""
    ff, next_norm = _ff(family, device="cuda")
    ff64, norm64 = _ff(family, torch.float64)
    ff64.load_state_dict(ff.state_dict())
    norm64.load_state_dict(next_norm.state_dict())
    g = torch.Generator().manual_seed(3)
    normed = torch.randn(16, next_norm.weight.shape[0], generator=g).to("cuda", torch.bfloat16)
    hidden = torch.randn(normed.shape, generator=g).to("cuda", torch.bfloat16)
    calls = []
    spy = SimpleNamespace(**{name: getattr(kernels, name) for name in kernels.__all__})
    spy.split_k_linear = lambda *a: calls.append(1) or kernels.split_k_linear(*a)
    with torch.no_grad():
        out = attention.ff_sublayer(spy, ff, normed, hidden)
        assert isinstance(out, attention.Partials) and calls == [1]
        ours, total = attention.add_norm(spy, next_norm, hidden, out)
        assert torch.equal(total, hidden + out.total(torch.bfloat16))
        hf_total = hidden + ff.dropout(ff.DenseReluDense(normed))
        hf = next_norm(hf_total)
        exact = norm64(hidden.double().cpu() + ff64.DenseReluDense(normed.double().cpu()))
    assert (ours.double().cpu() - exact).abs().max() <= 1.1 * (hf.double().cpu() - exact).abs().max()


@pytest.mark.parametrize("family", ["t5", "t5v1_1"])
def test_a_bf16_generate_passes_every_layers_partials_to_the_next_norm(monkeypatch, family):
    """Patched `generate()` in bf16 on the reference backend told to take the partials: each decode
    step's every decoder layer leaves its `wo` as `Partials` (the last one to the final norm), and the
    call gives the tokens of the same call without them, scores within bf16's rounding of them."""
    from conftest import make_model

    import hf_paged_t5 as hp

    model = make_model(family, dtype=torch.bfloat16)
    hp.patch_model(model, hp.PagedCacheConfig(block_size=8, backend="torch"))
    ids = torch.randint(3, model.config.vocab_size, (3, 11), generator=torch.Generator().manual_seed(4))
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, output_scores=True,
                  return_dict_in_generate=True)
    with torch.no_grad():
        plain = model.generate(input_ids=ids, **kwargs)
        calls = []
        twin = reference.split_k_linear
        monkeypatch.setattr(reference, "split_k_supports", lambda x, w: True)
        monkeypatch.setattr(reference, "split_k_linear",
                            lambda x, w: calls.append(tuple(x.shape)) or twin(x, w))
        split = model.generate(input_ids=ids, **kwargs)
    assert len(calls) == 6 * model.config.num_decoder_layers  # every step, every layer
    assert torch.equal(split.sequences, plain.sequences)
    # The partials are float32 sums of the same products in another order, rounded once to bf16 as the
    # GEMM rounds its own (at this width they give the same bits: scores equal on torch 2.13's CPU);
    # the bound is one bf16 rounding of the largest score.
    eps = torch.finfo(torch.bfloat16).eps
    for ours, theirs in zip(split.scores, plain.scores):
        finite = torch.isfinite(theirs)
        assert ours.dtype == theirs.dtype and torch.equal(finite, torch.isfinite(ours))
        bound = eps * theirs[finite].abs().max()
        torch.testing.assert_close(ours[finite], theirs[finite], rtol=eps, atol=bound)
