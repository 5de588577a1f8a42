"""`patch_model` / `unpatch_model`: put the paged path under a T5-family model's `generate()`.

Patching is explicit and reversible: it sets instance attributes only (`forward` of the model
and of its encoder stack, `generate` of the model, and `_hf_paged_t5`), never class
attributes, and `unpatch_model` restores exactly what was there.
"""

from __future__ import annotations

import copy
import logging
import types
from typing import Any, Optional

from torch import nn

from .. import triton_start
from ..config import PagedCacheConfig
from ..model import packing
from ..model.bias import SELF_ATTENTION_NAMES
from .forward import make_encoder_forward, make_forward
from .generate import make_generate
from .runtime import PagedRuntime, set_attr

logger = logging.getLogger(__name__)

_ATTR = "_hf_paged_t5"
# An encoder whose layers are not all one attention kind the paged encoder knows
STOCK_ENCODER = "the encoder's layers are not all T5 or LongT5 self-attention: the encoder runs on stock HF"
SUPPORTED_CLASSES = (
    "T5ForConditionalGeneration", "MT5ForConditionalGeneration", "UMT5ForConditionalGeneration",
    "LongT5ForConditionalGeneration", "T5EncoderModel", "MT5EncoderModel", "UMT5EncoderModel", "LongT5EncoderModel",
)


def _check_model(model: Any) -> None:
    names = {cls.__name__ for cls in type(model).__mro__}
    if not names.intersection(SUPPORTED_CLASSES):
        raise TypeError(
            f"hf_paged_t5 supports {', '.join(SUPPORTED_CLASSES)} (T5, Flan-T5, T5 v1.1, mT5, UMT5, ByT5, "
            f"MADLAD, LongT5 checkpoints load as these); got {type(model).__name__}. Load the model with "
            "AutoModelForSeq2SeqLM or T5EncoderModel (LongT5EncoderModel)."
        )
    if getattr(model.config, "is_gated_act", None) is None and not hasattr(model.config, "feed_forward_proj"):
        raise TypeError(f"{type(model).__name__} has no T5 configuration")


def _paged_encoder(encoder: nn.Module) -> bool:
    """Whether the paged encoder serves `encoder`: T5's full self-attention in every layer, or
    LongT5's local or transient-global attention in every layer."""
    kinds = {next((n for n in SELF_ATTENTION_NAMES if hasattr(block.layer[0], n)), None) for block in encoder.block}
    return len(kinds) == 1 and None not in kinds


def patch_model(model: nn.Module, config: Optional[PagedCacheConfig] = None) -> nn.Module:
    """Make `model.generate()` (and the encoder's forward) run on the paged KV cache and kernels.

    Returns the same model object. Patching an already patched model re-patches it with the
    new config. With `config.pack_projections` (the default), the weights of a half-precision
    model on a GPU are also laid out in groups (`model/packing.py`): the same Parameters and
    values, in fewer tensors.
    """
    _check_model(model)
    if config is None:
        config = PagedCacheConfig()
    if not isinstance(config, PagedCacheConfig):
        raise TypeError(f"config must be a PagedCacheConfig, got {type(config).__name__}")
    if getattr(model, _ATTR, None) is not None:
        unpatch_model(model)
    triton_start.start()  # (a process that imported torch after hf_paged_t5)
    runtime = PagedRuntime(model, config)
    if config.pack_projections:
        runtime.packed = packing.pack_model(model)
    if runtime.packed:
        own = _own_state_dict(model.state_dict, model, runtime)
        set_attr(runtime, model, "state_dict", types.MethodType(own, model))
    encoder = model.encoder if hasattr(model, "encoder") else model.get_encoder()
    if _paged_encoder(encoder):
        set_attr(runtime, encoder, "forward", types.MethodType(make_encoder_forward(runtime, encoder.forward), encoder))
    else:
        logger.info("hf_paged_t5: %s", STOCK_ENCODER)
    if runtime.is_seq2seq:
        set_attr(runtime, model, "forward", types.MethodType(make_forward(runtime, model.forward), model))
        set_attr(runtime, model, "generate", types.MethodType(make_generate(runtime, model.generate), model))
    for module in {id(m): m for m, _, _ in runtime.originals.values()}.values():
        set_attr(runtime, module, "__reduce_ex__", _unpatched_reduce(runtime, module))
    set_attr(runtime, model, "__deepcopy__", _patched_deepcopy(runtime, model))
    setattr(model, _ATTR, runtime)
    return model


def _own_state_dict(original, model: nn.Module, runtime: PagedRuntime):
    """`model.state_dict` while weights are packed: the same dict, each packed weight a tensor of
    its own (`packing.own_tensors`; not with keep_vars, whose caller asks for the Parameters)."""
    keys = packing.packed_names(model, runtime.packed)

    def state_dict(self, *args, **kwargs):
        result = original(*args, **kwargs)
        # state_dict(destination=None, prefix="", keep_vars=False), the first two also positional
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        if not kwargs.get("keep_vars", args[2] if len(args) > 2 else False):
            packing.own_tensors(result, [prefix + key for key in keys])
        return result

    return state_dict


def _unpatched_reduce(runtime: PagedRuntime, module: nn.Module):
    """`module.__reduce_ex__` while patched: pickle (`torch.save`) and `copy.deepcopy` see the
    module as it was before `patch_model` (the patched methods close over the runtime, its lock
    and pool, which neither can copy). A pickled patched model loads unpatched."""

    def reduce_ex(protocol):
        func, args, state, *rest = type(module).__reduce_ex__(module, protocol)
        state = dict(state)
        state.pop(_ATTR, None)
        for (_, name), (owner, value, had) in runtime.originals.items():
            if owner is module:
                if had:
                    state[name] = value
                else:
                    state.pop(name, None)
        return (func, args, state, *rest)

    return reduce_ex


def _patched_deepcopy(runtime: PagedRuntime, model: nn.Module):
    """`model.__deepcopy__` while patched: an unpatched deep copy (`_unpatched_reduce`), patched
    with the same config; the copy gets its own runtime, pool and graphs."""

    def deepcopy(memo):
        func, args, state, *_ = model.__reduce_ex__(4)
        new = func(*args)
        memo[id(model)] = new
        new.__setstate__(copy.deepcopy(state, memo))
        return patch_model(new, runtime.config)

    return deepcopy


def unpatch_model(model: nn.Module) -> nn.Module:
    """Undo `patch_model`: stock HF behaviour, bit for bit; the KV pool is freed and each packed
    weight gets its own tensor again."""
    runtime = getattr(model, _ATTR, None)
    if runtime is None:
        raise ValueError("this model is not patched by hf_paged_t5")
    for (_, name), (module, value, had) in runtime.originals.items():
        if had:
            setattr(module, name, value)
        else:
            module.__dict__.pop(name, None)
    packing.unpack(runtime.packed)
    runtime.release()  # its pool, graphs and hold on the model now, not at a garbage collection
    del model.__dict__[_ATTR]
    return model


def is_patched(model: nn.Module) -> bool:
    return getattr(model, _ATTR, None) is not None


def runtime_stats(model: nn.Module) -> dict[str, int]:
    """Public counters of a patched model, for benchmarks and monitoring:

    graphs_captured: CUDA graphs captured so far (decode steps and kept loop updates), ever;
    decode_graphs: captured decode steps kept now (one per batch / table-width bucket);
    pool_blocks / pool_blocks_free: KV pool blocks allocated / free now (0 before the first paged call;
        an idle pool holds its scratch block);
    encoder_graphs: standalone encoder forwards kept as graphs now (one per shape, or per padded
        mask, that recurred); encoder_graphs_captured / encoder_replays: captured / replayed, ever;
    bucket_graphs / bucket_graphs_captured / bucket_replays: the same of the batch engine's encoder
        graphs per padded input length (`BatchGenerator`, `OnlineEngine`).
    """
    runtime = getattr(model, _ATTR, None)
    if runtime is None:
        raise ValueError("this model is not patched by hf_paged_t5; call patch_model(model) first")
    graphs, pool, encoder = runtime.runner.graphs, runtime.pool, runtime.encoder_graphs
    return {
        "graphs_captured": graphs.captures,
        "decode_graphs": graphs.num_steps,
        "pool_blocks": pool.num_blocks if pool is not None else 0,
        "pool_blocks_free": pool.manager.num_free if pool is not None else 0,
        "encoder_graphs": encoder.num_graphs,
        "encoder_graphs_captured": encoder.captures,
        "encoder_replays": encoder.replays,
        "bucket_graphs": runtime.bucket_graphs.num_graphs,
        "bucket_graphs_captured": runtime.bucket_graphs.captures,
        "bucket_replays": runtime.bucket_graphs.replays,
    }
