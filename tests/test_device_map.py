"""Models dispatched by accelerate with a device_map, patched: same tokens as stock HF with the same map.

accelerate runs a dispatched model through hooks on its modules (moving inputs to each
module's execution device). The paged forward calls the layers' own Linear modules and moves
hidden states itself, one layer at a time, so it must agree with HF through those hooks:
- CPU: every module hooked on "cpu" (`force_hooks`), a checkpoint loaded with a device_map,
  and modules offloaded to disk (weights on the meta device until their hook loads them).
- GPU (`-m gpu`): layers split between cuda:0 and the CPU. Each decoder layer's KV pool lives on
  its layer's device and runs the backend that device supports (Triton on cuda:0, torch on CPU).

Note on accelerate's meaning of "cpu": `dispatch_model` with a CUDA main device (what
`from_pretrained(device_map=...)` does) *offloads* "cpu" modules: their weights wait on the
meta device and run on cuda:0. The split here uses `main_device="cpu"`, so "cpu" layers run on
the CPU; the offloaded case is tested separately.
"""

from __future__ import annotations

import copy

import pytest
import torch
from accelerate import dispatch_model
from conftest import make_batch, make_model
from oracle import compare_with_stock, stock_and_paged
from transformers import AutoModelForSeq2SeqLM

import hf_paged_t5 as hp
from hf_paged_t5 import tiny

CUDA = torch.cuda.is_available()


def hf_then_paged(model, config=None, compare=True, **kwargs):
    """compare_with_stock on the same (dispatched) model, `config` defaulting to the package's
    default (with `compare=False`, the two calls only); returns (stock HF output, patched output,
    the device of each layer's pool)."""
    devices = []

    def pool_devices(patched):
        devices.extend(str(k.device) for k in patched._hf_paged_t5.pool.key_caches)

    run = compare_with_stock if compare else stock_and_paged
    stock, paged = run(model, config or hp.PagedCacheConfig(), while_patched=pool_devices, **kwargs)
    return stock, paged, devices


# ---- CPU ---------------------------------------------------------------------------------------
def test_all_cpu_map_through_accelerate_hooks():
    """Every module hooked by accelerate (as with a multi-device map); greedy and beam match HF."""
    model = make_model("t5v1_1", seed=21, num_layers=4, num_decoder_layers=4)
    model = dispatch_model(model, device_map=tiny.split_device_map(model, "cpu", "cpu"), main_device="cpu",
                           force_hooks=True)
    hooked = [name for name, m in model.named_modules() if hasattr(m, "_hf_hook")]
    assert "" in hooked and "decoder.block.3" in hooked, "premise: accelerate hooked the model"
    hooked_forward = model.forward
    ids, mask = make_batch([7, 19, 3, 12, 16], padding_side="right")
    config = hp.PagedCacheConfig(block_size=8)
    _, _, devices = hf_then_paged(model, config, input_ids=ids, attention_mask=mask, max_new_tokens=32,
                                  min_new_tokens=32)
    assert devices == ["cpu"] * 4
    beam = dict(input_ids=ids[:3], attention_mask=mask[:3], max_new_tokens=16, num_beams=4,
                num_return_sequences=2)
    ref, _, _ = hf_then_paged(model, config, **beam)
    # unpatch_model gives accelerate's hooked forward back, and stock HF still runs through it.
    assert model.forward == hooked_forward
    assert torch.equal(model.generate(**beam), ref)


def test_checkpoint_loaded_with_a_device_map(tmp_path):
    """`from_pretrained(path, device_map="auto")` then patch: the usual loading path (all CPU here)."""
    make_model("t5", seed=22).save_pretrained(tmp_path)
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, device_map="auto")
    ids, mask = make_batch([9, 4, 15, 11], padding_side="left")
    hf_then_paged(model, hp.PagedCacheConfig(block_size=4), input_ids=ids, attention_mask=mask, max_new_tokens=20,
                  min_new_tokens=20)


def test_offloaded_layers_give_hf_tokens(tmp_path):
    """accelerate offload (disk here; "cpu" with a CUDA main device is the same mechanism): weights
    live on the meta device until a module's own hook loads them. The patched generate() must give
    stock HF's tokens (by falling back, or by loading the weights itself)."""
    model = make_model("t5v1_1", seed=23, num_layers=2, num_decoder_layers=2)
    device_map = tiny.split_device_map(model, "cpu", "cpu")
    device_map["encoder.block.0"] = device_map["decoder.block.1"] = "disk"
    model = dispatch_model(model, device_map=device_map, main_device="cpu", offload_dir=str(tmp_path))
    assert all(p.device.type == "meta" for p in model.decoder.block[1].parameters())
    assert all(p.device.type == "meta" for p in model.encoder.block[0].parameters())
    ids, mask = make_batch([6, 13, 9], padding_side="right")
    # either way: expect_paged=None (the pool, if any, idle afterwards)
    compare_with_stock(model, hp.PagedCacheConfig(block_size=8), expect_paged=None, input_ids=ids,
                       attention_mask=mask, max_new_tokens=12, min_new_tokens=12)


# ---- GPU: cuda:0 + cpu ---------------------------------------------------------------------
requires_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")


def t5_small_shaped(dtype):
    """t5-small's layout (6+6 layers, d_model 512, 8 heads) with a 4096-token vocabulary, random weights.

    Init factor 1.5: at this depth larger random weights amplify rounding so much that stock HF's
    own fp32 logits differ from fp64 (factor 2: 2e-3; the suite's small models, x6: 2e-1), and
    then no two fp32 implementations agree on tokens. Here fp32 vs fp64 is ~6e-6, and the output
    still depends on the input row.
    """
    return tiny.build_model("t5-small", vocab_size=4096, dtype=dtype, initializer_factor=1.5)


def split_on_gpu_and_cpu(model):
    """Dispatch `model` with its first layers on cuda:0 and the rest running on the CPU."""
    device_map = tiny.split_device_map(model, "cuda:0", "cpu")
    return dispatch_model(model, device_map=device_map, main_device="cpu"), device_map


def cuda_batch(lengths):
    ids, mask = make_batch(lengths, padding_side="right", vocab=4096)
    return ids.cuda(), mask.cuda()


def expected_pool_devices(device_map, num_layers=6):
    return [str(torch.device(device_map[f"decoder.block.{i}"])) for i in range(num_layers)]


def test_kernels_of_a_layer_on_another_gpu_run_with_that_gpu_current(monkeypatch):
    """Triton launches on the current CUDA device, not the tensors' device: with several GPUs every
    kernel call of a layer must make the layer's GPU current (else cuda:1's layers run on cuda:0,
    unordered with cuda:1's stream). Checked on CPU by recording which device is made current."""
    import contextlib

    from hf_paged_t5.model.attention import OnDevice, backend_ops

    entered = []

    @contextlib.contextmanager
    def fake_device(device):
        entered.append(torch.device(device))
        yield

    monkeypatch.setattr(torch.cuda, "device", fake_device)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    model = hp.patch_model(make_model(), hp.PagedCacheConfig(backend="torch"))
    runtime = model._hf_paged_t5
    ops = runtime.ops_for(torch.device("cuda:1"))
    assert isinstance(ops, OnDevice) and runtime.ops_for(torch.device("cuda:1")) is ops
    assert runtime.ops_for(torch.device("cpu")) is backend_ops("torch")  # CPU: nothing to guard
    x, w = torch.randn(3, 8), torch.rand(8)
    normed, _ = ops.rms_norm(hidden=x, weight=w, eps=1e-6)
    assert entered == [torch.device("cuda:1")]
    torch.testing.assert_close(normed, backend_ops("torch").rms_norm(hidden=x, weight=w, eps=1e-6)[0])


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("num_beams", [1, 4])
def test_gpu_cuda_cpu_split_fp32_tokens_identical(num_beams):
    model, device_map = split_on_gpu_and_cpu(t5_small_shaped(torch.float32))
    if num_beams == 1:
        ids, mask = cuda_batch([40, 120, 7, 88, 63, 15])
        kw = dict(max_new_tokens=40, min_new_tokens=40, output_logits=True)
    else:
        ids, mask = cuda_batch([40, 120, 7, 63])
        kw = dict(max_new_tokens=32, num_beams=4, num_return_sequences=2, length_penalty=0.8,
                  output_scores=True)
    # tokens alone are weak evidence if a row repeats one token: logits / scores too, within stock's
    # own fp32 error against an fp64 copy dispatched with the same map (tests/oracle.py)
    _, _, devices = hf_then_paged(model, input_ids=ids, attention_mask=mask, return_dict_in_generate=True, **kw)
    assert devices == expected_pool_devices(device_map), "each layer's pool on its own device"
    assert devices[0] == "cuda:0" and devices[-1] == "cpu"


@pytest.mark.gpu
@requires_gpu
def test_gpu_cuda_cpu_split_bf16_runs_close_to_hf():
    """bf16 across the split runs, and its first-step logits are as close to fp32 as stock HF's bf16."""
    fp32_model = t5_small_shaped(torch.float32)
    model, device_map = split_on_gpu_and_cpu(copy.deepcopy(fp32_model).to(torch.bfloat16))
    ids, mask = cuda_batch([33, 70, 5, 51])
    kw = dict(input_ids=ids, attention_mask=mask, max_new_tokens=32, min_new_tokens=32, output_logits=True,
              return_dict_in_generate=True)
    ref, out, devices = hf_then_paged(model, compare=False, **kw)  # bf16: tokens may differ at near ties
    assert devices == expected_pool_devices(device_map)
    assert out.sequences.shape == ref.sequences.shape
    assert all(torch.isfinite(step).all() for step in out.logits)
    exact = fp32_model.cuda().generate(**{**kw, "max_new_tokens": 1, "min_new_tokens": 1}).logits[0].float()
    hf_err = (ref.logits[0].float() - exact).norm() / exact.norm()  # first step: same inputs everywhere
    paged_err = (out.logits[0].float() - exact).norm() / exact.norm()
    assert paged_err <= 1.5 * hf_err + 1e-3, (
        f"bf16 error vs fp32: paged {paged_err:.3g}, stock HF {hf_err:.3g}"
    )


@pytest.mark.gpu
@requires_gpu
def test_gpu_from_pretrained_cpu_entries_offload_and_match_hf(tmp_path, caplog):
    """`from_pretrained(device_map=...)` with "cpu" entries: accelerate offloads those layers (weights
    on meta, run on cuda:0). The patched generate() falls back to stock HF (one logged warning
    naming the reason) and gives its tokens."""
    t5_small_shaped(torch.float32).save_pretrained(tmp_path)
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path)
    device_map = tiny.split_device_map(model, "cuda:0", "cpu")
    model = AutoModelForSeq2SeqLM.from_pretrained(tmp_path, device_map=device_map)
    assert any(p.device.type == "meta" for p in model.parameters()), "premise: accelerate offloaded weights"
    ids, mask = cuda_batch([40, 9, 25, 60])
    with caplog.at_level("WARNING", logger="hf_paged_t5"):
        # offloaded weights must not reach the paged path: a fallback, stock HF's tokens
        compare_with_stock(model, hp.PagedCacheConfig(), expect_paged=False, input_ids=ids, attention_mask=mask,
                           max_new_tokens=32, min_new_tokens=32)
    assert "offloaded" in caplog.text
