"""Shared test helpers: small T5-family models with real structure and random weights, a spy on the
device-resident decode loops, and encoder graphs "captured" on the CPU. The compare-with-stock
oracle is tests/oracle.py."""

from __future__ import annotations

import contextlib
import os
import warnings

import pytest
import torch

if not torch.cuda.is_available():
    # Triton's interpreter runs the real kernels on CPU tensors; it must be set before triton loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # one of several pytest workers (`.ci/run`: two on two cores): one intra-op thread each, since
    # OpenMP's spin-waits across workers cost far more than the tiny matmuls' threads gain
    torch.set_num_threads(1)

from transformers import (  # noqa: E402
    MT5Config,
    MT5ForConditionalGeneration,
    T5Config,
    T5ForConditionalGeneration,
    UMT5Config,
    UMT5ForConditionalGeneration,
)

VOCAB = 384

# name -> (model class, config class, config overrides)
FAMILIES = {
    "t5": (T5ForConditionalGeneration, T5Config, dict(feed_forward_proj="relu", tie_word_embeddings=True)),
    "t5v1_1": (T5ForConditionalGeneration, T5Config, dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)),
    "mt5": (MT5ForConditionalGeneration, MT5Config, dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)),
    "umt5": (UMT5ForConditionalGeneration, UMT5Config, dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)),
    # ByT5 / MADLAD style: inner_dim (num_heads * d_kv) != d_model
    "inner_dim": (T5ForConditionalGeneration, T5Config, dict(feed_forward_proj="gated-gelu", d_kv=24, num_heads=4)),
    "d_kv128": (T5ForConditionalGeneration, T5Config, dict(feed_forward_proj="relu", d_kv=128, num_heads=2)),
}


def make_model(family: str = "t5", seed: int = 0, dtype=torch.float32, device="cpu", **overrides):
    """A small model of `family` with random weights scaled so greedy output varies with the input."""
    model_cls, config_cls, family_overrides = FAMILIES[family]
    kw = dict(
        vocab_size=VOCAB, d_model=64, d_ff=96, d_kv=16, num_heads=4, num_layers=2, num_decoder_layers=2,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0,
    )
    kw.update(family_overrides)
    kw.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "relative_attention_bias" not in name:
                p.mul_(6.0)
            elif "relative_attention_bias" in name:
                p.normal_(0.0, 2.0)
    return model.to(device=device, dtype=dtype)


def make_batch(lengths, seq_len=None, padding_side="right", seed=1, vocab=VOCAB, device="cpu"):
    """input_ids [batch, seq_len] of random tokens (>= 2) with padding, and their attention_mask."""
    seq_len = seq_len or max(lengths)
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(len(lengths), seq_len, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        toks = torch.randint(2, vocab, (n,), generator=g)
        sl = slice(0, n) if padding_side == "right" else slice(seq_len - n, seq_len)
        ids[row, sl] = toks
        mask[row, sl] = 1
    return ids.to(device), mask.to(device)


def run_cold(script: str, tmp_path, **env_vars: str) -> dict:
    """`script` run by a fresh Python with an empty Triton cache under `tmp_path` (and `env_vars`
    set); the JSON object of its last printed line (a cold process: what a new machine, container
    or CI job gives)."""
    import json
    import subprocess
    import sys

    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), **env_vars}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op threads set to `n` inside, restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


@pytest.fixture
def one_thread():
    """Tiny matmuls: one thread avoids OpenMP spin-waits on a busy 2-core machine (10-100x here)."""
    with torch_threads(1):
        yield


@pytest.fixture(scope="module")
def one_thread_per_module():
    """`one_thread` for a whole test module (`pytestmark = pytest.mark.usefixtures(...)`)."""
    with torch_threads(1):
        yield


class _ReplayedOnCpu:
    """Stands in for a captured encoder graph: replay() runs the captured forward on the static input."""

    def __init__(self, forward, static, out):
        self.forward, self.static, self.out = forward, static, out

    def replay(self):
        self.out.copy_(self.forward(self.static))


@pytest.fixture
def cpu_encoder_graphs(monkeypatch):
    """Encoder graphs on the CPU (`model/encoder_graphs.py`): calls on the CPU may take them, and a
    "capture" keeps the forward, which each replay runs eagerly; what is left to test is everything
    around a graph (which call captures, which replays, what the captured forward computes)."""
    from hf_paged_t5.hf import forward as forward_mod
    from hf_paged_t5.model import encoder_graphs

    def capture(self, forward, source):
        static = source.clone()
        out = forward(static)
        self.captures += 1
        return encoder_graphs._Captured(_ReplayedOnCpu(forward, static, out), static, out, forward)

    monkeypatch.setattr(forward_mod, "GRAPH_DEVICE_TYPES", ("cuda", "cpu"))
    monkeypatch.setattr(encoder_graphs.EncoderGraphs, "_capture", capture)


@pytest.fixture
def t5_model():
    return make_model("t5")


@pytest.fixture
def loops(monkeypatch):
    """Names of the device-resident decode loops each patched generate() ran, in order."""
    from hf_paged_t5.decode import beam_graph, greedy_graph

    calls = []
    for name, module in (("graph_greedy_loop", greedy_graph), ("resident_beam_loop", beam_graph)):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a, **k))
    return calls


def resident_loop(kw) -> str | None:
    """The resident loop a patched generate(**kw) on CPU runs for the calls the tests make of it:
    greedy or beam search returning plain sequences; None for sampling and dict outputs."""
    if kw.get("do_sample") or kw.get("return_dict_in_generate"):
        return None
    return "resident_beam_loop" if (kw.get("num_beams") or 1) > 1 else "graph_greedy_loop"


def ends_early(model, ids, mask, n=16):
    """Two token ids this model generates in different rows, first at a later step: as EOS ids they
    end rows at different steps (this deliberately sharp tiny model repeats itself otherwise)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        probe = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n)[:, 1:]
    picked = []
    for row in range(probe.shape[0]):
        for step in range(1, probe.shape[1]):
            tok = int(probe[row, step])
            if tok not in picked and tok > 1 and not (probe[:, :step] == tok).any():
                picked.append(tok)
                break
        if len(picked) == 2:
            break
    assert len(picked) == 2
    return picked
