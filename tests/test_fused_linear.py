"""`kernels.fused_linear` against `reference.fused_linear`, and the fused decode layer under generate().

On a CPU-only machine the kernel runs in Triton's interpreter (which truncates where the GPU rounds
to nearest in bf16: tolerances below allow for it); `@pytest.mark.gpu` tests run it compiled, with
programmatic dependent launches, and the fused step against stock HF's bf16 error.
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first triton import

import conftest  # noqa: E402
from conftest import make_batch, make_model  # noqa: E402

import hf_paged_t5 as hp  # noqa: E402
from hf_paged_t5 import kernels, reference  # noqa: E402
from hf_paged_t5.model import fused_layer  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")


def gpu_test(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")(fn))


def operands(rows, n, k, dtype, weights, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g).to(dtype)
    ws = [(torch.randn(n, k, generator=g) / k**0.5).to(dtype) for _ in range(weights)]
    norm = (torch.rand(k, generator=g) + 0.5).to(dtype)
    residual = torch.randn(rows, n, generator=g).to(dtype)
    return [t.to(DEVICE) for t in (x, norm, residual)], [w.to(DEVICE) for w in ws]


def error(out, ref):
    return float((out.double() - ref.double()).norm() / ref.double().norm())


EPILOGUES = {
    "plain": (1, {}),
    "norm": (1, {"norm": True}),
    "residual": (1, {"residual": True}),
    "relu": (1, {"norm": True, "activation": "relu"}),
    "gelu": (2, {"norm": True, "activation": "gelu_tanh"}),
}


def op_by_op(ops, x, ws, norm_weight, eps, residual, activation):
    """The op-by-op layer's kernels for what `fused_linear` does in one."""
    if norm_weight is not None:
        x = ops.rms_norm(hidden=x, weight=norm_weight, eps=eps)[0]
    ys = [ops.gemv(x, w) for w in ws]
    if activation == "gelu_tanh":
        return ops.gated_gelu(gate=ys[0], linear=ys[1])
    if activation == "relu":
        return torch.relu(ys[0])
    if residual is None:
        return ys[0]
    # the op-by-op step adds the residual inside the next norm's kernel (`attention.add_norm`)
    return ops.rms_norm(hidden=residual, weight=torch.ones_like(residual[0]), eps=0.0, residual=ys[0])[1]


@pytest.mark.parametrize("epilogue", list(EPILOGUES))
@pytest.mark.parametrize("rows,n,k", [(1, 24, 40), (3, 7, 1100), (4, 33, 64), (2, 130, 1024), (1, 5, 3000)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fused_linear_matches_reference(epilogue, rows, n, k, dtype):
    """Against float64, the kernel errs at most a little more than the same ops do one kernel
    each (they round at the same points; the kernel sums in another order): torch's ops, or on
    the CPU in bf16 the op-by-op Triton kernels (the interpreter truncates where torch rounds)."""
    check_against_float64(epilogue, rows, n, k, dtype, seed=rows * 7 + n + k)


def check_against_float64(epilogue, rows, n, k, dtype, seed):
    """`fused_linear` with `epilogue` on random operands: its error against float64 at most 1.5x
    the same ops' one kernel each (see test_fused_linear_matches_reference)."""
    count, opts = EPILOGUES[epilogue]
    (x, norm, residual), ws = operands(rows, n, k, dtype, count, seed=seed)
    kw = dict(norm_weight=norm if opts.get("norm") else None, eps=1e-6,
              residual=residual if opts.get("residual") else None, activation=opts.get("activation"))
    out = kernels.fused_linear(x=x, weights=ws, **kw)
    assert out.shape == (rows, n) and out.dtype == dtype
    exact = reference.fused_linear(x.double(), [w.double() for w in ws],
                                   **{k: v.double() if torch.is_tensor(v) else v for k, v in kw.items()})
    if CUDA or dtype == torch.float16:
        same_roundings = reference.fused_linear(x, ws, **kw)
    else:
        same_roundings = op_by_op(kernels, x, ws, **kw)
    assert error(out, exact) <= 1.5 * error(same_roundings, exact) + 1e-6


@pytest.mark.parametrize("rows,block_size", [(1, 16), (4, 4), (3, 1)])
def test_fused_linear_stores_k_and_v_to_their_slots(rows, block_size):
    """q returned; k and v in the pool at each row's slot (a negative slot stores nothing); every
    other slot untouched."""
    num_heads, head_dim, k = 3, 8, 40
    (x, norm, _), ws = operands(rows, num_heads * head_dim, k, torch.float16, 3, seed=rows)
    num_blocks = 6
    caches = [torch.randn(num_blocks, block_size, num_heads, head_dim, device=DEVICE).half() for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(rows))[:rows]
    slots[-1] = -1 if rows > 1 else slots[-1]
    slots = slots.to(device=DEVICE, dtype=torch.int32)
    kw = dict(weights=ws, norm_weight=norm, eps=1e-6, slot_mapping=slots)
    q = kernels.fused_linear(x=x, key_cache=caches[0], value_cache=caches[1], **kw)
    q_ref = reference.fused_linear(x, key_cache=ref_caches[0], value_cache=ref_caches[1], **kw)
    assert error(q, q_ref) < 1e-3
    for cache, ref in zip(caches, ref_caches):
        flat, flat_ref = cache.view(-1, num_heads, head_dim), ref.view(-1, num_heads, head_dim)
        written = slots[slots >= 0].long()
        assert error(flat[written], flat_ref[written]) < 1e-3
        untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
        untouched[written] = False
        assert torch.equal(flat[untouched], flat_ref[untouched])


@pytest.mark.parametrize("rows,k", [(1, 40), (3, 1100)])
def test_early_inputs_are_the_same_projection(rows, k):
    """`early_inputs` only moves the residual's and the slots' loads before the wait: the same bits
    for the residual epilogue and the K/V store (its cache writes too)."""
    num_heads, head_dim = 3, 8
    (x, norm, residual), ws = operands(rows, num_heads * head_dim, k, torch.bfloat16, 3, seed=k)
    outs = [kernels.fused_linear(x=x, weights=ws[:1], residual=residual, early_inputs=early) for early in (False, True)]
    assert torch.equal(*outs)
    slots = torch.tensor([2, -1, 7][:rows], device=DEVICE, dtype=torch.int32)  # -1 stores nothing
    stored = []
    for early in (False, True):
        caches = [torch.zeros(4, 4, num_heads, head_dim, device=DEVICE, dtype=torch.bfloat16) for _ in range(2)]
        q = kernels.fused_linear(x=x, weights=ws, norm_weight=norm, eps=1e-6, key_cache=caches[0],
                                 value_cache=caches[1], slot_mapping=slots, early_inputs=early)
        stored.append((q, *caches))
    assert all(torch.equal(a, b) for a, b in zip(*stored))
    keys = stored[0][1].flatten(0, 1)
    assert all(keys[slot].any() for slot in (2, 7)[:rows]) and not keys[0].any()


def test_one_row_takes_k_in_one_tile_where_the_tile_fits():
    """(BLOCK_N, BLOCK_K, warps) at t5-large / flan-t5-xl decode shapes: at one row K comes in one
    tile up to ONE_ROW_TILE_PER_THREAD elements per thread (on 4 warps and fewer weight rows if
    need be); more rows, or a tile that cannot fit, keep gemv_config's 1,024."""
    fused_config = importlib.import_module("hf_paged_t5.kernels.linear").fused_config
    assert fused_config(1, 1024, 4096) == (2, 4096, 4)  # t5-large wo
    assert fused_config(1, 1024, 1024) == (2, 1024, 4)  # t5-large q / k / v / o
    assert fused_config(2, 1024, 4096) == (2, 1024, 2)  # two rows: four K tiles, as before
    assert fused_config(1, 4096, 1024) == (8, 1024, 2)  # t5-large wi (K already one tile)
    # flan-t5-xl: 8 x 2048 on 2 warps would not fit; 4 x 2048 on 4 warps does
    assert fused_config(1, 2048, 2048) == (4, 2048, 4)  # q / k / v / o
    assert fused_config(1, 2048, 5120) == (1, 8192, 4)  # wo
    assert fused_config(1, 5120, 2048, paired=True) == (2, 2048, 4)  # the gated wi: two weights per program
    assert fused_config(1, 4096, 10240) == (4, 1024, 2)  # an XXL wo: 16,384 columns fit no tile
    assert fused_config(4, 1024, 1024) == (2, 1024, 2)  # 4 rows: 4 x 2 x 1024 products per program


def test_fused_linear_refuses_what_it_does_not_serve():
    (x, norm, residual), ws = operands(2, 8, 16, torch.float16, 3, seed=0)
    assert kernels.fused_linear_supports(x, ws)
    assert not kernels.fused_linear_supports(x.float(), [w.float() for w in ws])  # fp32 keeps cuBLAS
    assert not kernels.fused_linear_supports(x.repeat(3, 1), ws)  # more than MAX_ROWS rows
    assert not kernels.fused_linear_supports(x, [ws[0], ws[1][:4]])  # weights of two shapes
    big = torch.empty(4096, 2048, dtype=torch.float16, device="meta")  # past MULTI_ROW_ELEMENTS: cuBLAS at 2+ rows
    assert kernels.fused_linear_supports(torch.empty(1, 2048, dtype=torch.float16, device="meta"), [big])
    assert not kernels.fused_linear_supports(torch.empty(2, 2048, dtype=torch.float16, device="meta"), [big])
    with pytest.raises(ValueError, match="at most one of residual, activation"):
        kernels.fused_linear(x=x, weights=ws[:1], residual=residual, activation="relu")
    with pytest.raises(ValueError, match="takes 2 weight"):
        kernels.fused_linear(x=x, weights=ws[:1], activation="gelu_tanh")
    with pytest.raises(ValueError, match="activation must be one of"):
        kernels.fused_linear(x=x, weights=ws[:1], activation="swish")
    with pytest.raises(ValueError, match="norm_weight must be"):
        kernels.fused_linear(x=x, weights=ws[:1], norm_weight=norm[:5])
    with pytest.raises(ValueError, match="needs key_cache, value_cache and slot_mapping together"):
        kernels.fused_linear(x=x, weights=ws, slot_mapping=torch.zeros(2, dtype=torch.int32, device=DEVICE))


# ---- the fused decode layer under generate() ----------------------------------------------
def spy_fused(monkeypatch) -> list:
    calls = []
    real = fused_layer.decoder_layers
    monkeypatch.setattr(fused_layer, "decoder_layers", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("family,rows", [("t5", 1), ("t5v1_1", 3)])
def test_fused_step_gives_the_unfused_logits(monkeypatch, family, rows):
    """bf16, Triton kernels (interpreted on CPU): the fused layer rounds where the op-by-op layer
    rounds and sums each dot product in the same order, so the logits are the same bits; whether
    it serves is asked once per call."""
    calls = spy_fused(monkeypatch)
    asked = []
    real_serves = fused_layer.serves
    monkeypatch.setattr(fused_layer, "serves", lambda *a: asked.append(1) or real_serves(*a))
    model = make_model(family, dtype=torch.bfloat16, device=DEVICE, num_layers=1, num_decoder_layers=2)
    ids, mask = make_batch([9, 5, 12][:rows], device=DEVICE)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3, output_logits=True,
              return_dict_in_generate=True)
    outs = []
    for fused in (False, True):
        hp.patch_model(model, hp.PagedCacheConfig(block_size=4, backend="triton", fused_decode=fused,
                                                  cuda_graphs=False))
        outs.append(model.generate(**kw))
    assert len(calls) == 3  # every step of the fused run, none of the other
    assert len(asked) == 1  # its checks walk every layer: once per call, not per step
    assert torch.equal(outs[0].sequences, outs[1].sequences)
    for a, b in zip(outs[0].logits, outs[1].logits):
        assert torch.equal(a, b)


def test_the_fused_layer_loads_before_the_wait_only_what_two_launches_back_wrote(monkeypatch):
    """Each kernel of the dependent chain lets the next start only after its own wait, so a
    kernel may load before its wait what any but the kernel just before it wrote. Every launch
    of a generate() step: a residual loaded early is not the output of the launch just before,
    slots loaded early are the step's own; cross-attention ("all") follows no launch that stores
    keys, self-attention ("past") follows the one storing its newest key."""
    class Recorder:
        def __init__(self, ops, log):
            self._ops, self._log = ops, log

        def __getattr__(self, name):
            attr = getattr(self._ops, name)
            if name not in ("fused_linear", "paged_decode", "rms_norm"):
                return attr

            def run(**kw):
                out = attr(**kw)
                first = out[0] if isinstance(out, tuple) else out
                self._log.append((name, kw, first.data_ptr()))
                return out
            return run

    steps = []
    real = fused_layer.decoder_layers

    def spy(decoder, ops, *args, **kwargs):
        steps.append([])
        return real(decoder, Recorder(ops, steps[-1]), *args, **kwargs)

    monkeypatch.setattr(fused_layer, "decoder_layers", spy)
    model = make_model("t5v1_1", dtype=torch.bfloat16, device=DEVICE, num_layers=1, num_decoder_layers=2)
    ids, mask = make_batch([9, 5], device=DEVICE)
    hp.patch_model(model, hp.PagedCacheConfig(block_size=4, backend="triton", cuda_graphs=False))
    model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3, min_new_tokens=3)
    assert len(steps) == 3
    for log in steps:
        layer = ["fused_linear", "paged_decode", "fused_linear"] * 2 + ["fused_linear"] * 2
        assert [name for name, _, _ in log] == layer * 2 + ["rms_norm"]
        for (_, before, out_before), (name, kw, _) in zip(log, log[1:]):
            if name == "fused_linear" and kw.get("residual") is not None:
                assert kw["early_inputs"] and kw["residual"].data_ptr() != out_before
            if name == "fused_linear" and kw.get("slot_mapping") is not None:
                assert kw["early_inputs"] and kw["slot_mapping"].data_ptr() != out_before
            if name == "paged_decode":
                stores_keys = before.get("key_cache") is not None
                assert kw["keys_ready"] == ("past" if stores_keys else "all")
                assert stores_keys == (kw.get("bias_table") is not None)  # self-attention follows its store


def test_unserved_steps_run_op_by_op(monkeypatch):
    """What the fused layer does not serve runs the op-by-op layer: float16 (its residual clamp),
    more than four rows, hooks on a projection or the final norm, active dropout, another activation."""
    from torch import nn

    model = make_model("t5", dtype=torch.bfloat16, num_layers=1, num_decoder_layers=1)
    ops, pool = kernels, type("Pool", (), {"key_caches": [torch.empty(1, dtype=torch.bfloat16)]})()
    one = torch.zeros(1, 1, dtype=torch.long)
    assert fused_layer.serves(model.decoder, ops, pool, one)
    assert not fused_layer.serves(model.decoder, reference, pool, one)  # no fused_linear there
    assert not fused_layer.serves(model.decoder, ops, pool, torch.zeros(5, 1, dtype=torch.long))
    assert not fused_layer.serves(model.decoder, ops, pool, torch.zeros(1, 2, dtype=torch.long))
    handle = model.decoder.block[0].layer[0].SelfAttention.v.register_forward_hook(lambda *a: None)
    assert not fused_layer.serves(model.decoder, ops, pool, one)
    handle.remove()
    model.train()  # dropout of p = 0 changes nothing in training either
    assert fused_layer.serves(model.decoder, ops, pool, one)
    model.decoder.block[0].layer[1].dropout.p = 0.1
    assert not fused_layer.serves(model.decoder, ops, pool, one)
    model.eval()
    assert fused_layer.serves(model.decoder, ops, pool, one)
    handle = model.decoder.final_layer_norm.register_forward_pre_hook(lambda *a: None)
    assert not fused_layer.serves(model.decoder, ops, pool, one)
    handle.remove()
    model.decoder.block[0].layer[-1].DenseReluDense.act = nn.GELU()
    assert not fused_layer.serves(model.decoder, ops, pool, one)
    half = make_model("t5", dtype=torch.float16, num_layers=1, num_decoder_layers=1)
    assert not fused_layer.serves(half.decoder, ops, pool, one)


# ---- GPU ----------------------------------------------------------------------------------
@gpu_test
@pytest.mark.parametrize("epilogue", list(EPILOGUES))
def test_gpu_programmatic_dependent_launches_give_the_same_bits(epilogue):
    """Two kernels, the second reading the first's output, launched as dependent launches (each
    waits for the one before in-kernel; the second's residual loads before its wait), eagerly and
    captured in a graph: the bits of plain launches."""
    count, opts = EPILOGUES[epilogue]
    (x, norm, residual), ws = operands(3, 4096, 1024, torch.bfloat16, count, seed=5)
    back = (torch.randn(1024, 4096, device=DEVICE) / 64).bfloat16()
    kw = dict(norm_weight=norm if opts.get("norm") else None, eps=1e-6,
              residual=residual if opts.get("residual") else None, activation=opts.get("activation"))
    assert kernels.pdl_available(DEVICE) == (torch.cuda.get_device_capability()[0] >= 9)

    def chain(pdl):
        first = kernels.fused_linear(x=x, weights=ws, pdl=pdl, **kw)
        # the residual x, from before the first launch, loads before the second's wait when dependent
        return first, kernels.fused_linear(x=first, weights=[back], residual=x, pdl=pdl, early_inputs=pdl)

    plain = chain(False)
    eager = chain(True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = chain(True)
    graph.replay()
    torch.cuda.synchronize()
    for a, b, c in zip(plain, eager, captured):
        assert torch.equal(a, b) and torch.equal(a, c)


@gpu_test
@pytest.mark.parametrize("n,k,epilogue", [
    (1024, 4096, "residual"),  # t5-large wo: K in one tile
    (2048, 2048, "norm"),  # flan-t5-xl q: one tile on 4 warps, fewer weight rows per program
    (2048, 5120, "residual"),  # flan-t5-xl wo: one weight row per program, 8,192-column tile
    (5120, 2048, "gelu"),  # flan-t5-xl gated wi
    (4096, 10240, "residual"),  # an XXL wo: 1,024-column tiles
])
def test_gpu_one_row_at_decode_shapes(n, k, epilogue):
    """One row at the decode shapes whose launches `fused_config` gives K in one tile: within the
    error of the same ops against float64, as at the small shapes above."""
    check_against_float64(epilogue, 1, n, k, torch.bfloat16, seed=n + k)


def hf_init_model(family, **overrides):
    """`family` (conftest.FAMILIES) at a t5-small-like width with HF's own init: its greedy
    decoding repeats one token, so bf16 stock and paged pick the same tokens and every step's
    logits can be compared (conftest.make_model's sharper weights part them within a step)."""
    model_cls, config_cls, family_overrides = conftest.FAMILIES[family]
    kw = dict(vocab_size=32128, d_model=512, d_ff=1024, d_kv=64, num_heads=8, num_layers=3, num_decoder_layers=3,
              decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
    kw.update(family_overrides, **overrides)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        return model_cls(config_cls(**kw)).eval().to(torch.bfloat16)


@gpu_test
@pytest.mark.parametrize("family", ["t5", "t5v1_1", "umt5"])
def test_gpu_fused_step_within_stock_bf16_error(monkeypatch, family):
    """bf16 greedy, 2 rows, 24 steps: the fused step (graphed, dependent launches) is as close to
    float64 as stock HF's bf16 is (tests/oracle.py's factor), over every step where both picked
    the same tokens so far."""
    from oracle import assert_within_stock_error, fp64_twin, stock_and_paged, teacher_forced_logits

    calls = spy_fused(monkeypatch)
    model = hf_init_model(family)
    ids, mask = make_batch([40, 23], vocab=32000, device=DEVICE)
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=24, min_new_tokens=24, output_logits=True,
              return_dict_in_generate=True)
    stock, paged = stock_and_paged(model, hp.PagedCacheConfig(), **kw)
    assert calls, "the fused layer did not run"
    exact = teacher_forced_logits(fp64_twin(model), stock.sequences, input_ids=ids, attention_mask=mask)
    differs = (stock.sequences != paged.sequences).any(0).nonzero()
    steps = int(differs[0]) if len(differs) else len(stock.logits)  # step t's logits read tokens < t + 1
    assert steps >= 8, f"bf16 tokens part after {steps - 1} steps: too few to compare"
    assert_within_stock_error(list(paged.logits[:steps]), list(stock.logits[:steps]),
                              [exact[:, t] for t in range(steps)], f"{family} fused bf16 logits")
