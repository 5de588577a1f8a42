"""Which `generate()` calls the paged path serves, and why the others fall back to stock HF.

The decision is made from the merged `GenerationConfig` and the model kwargs. Options are
checked against an explicit list of what the paged path has been verified to serve, so an
option that a newer transformers adds is never silently mishandled: anything not on the
list that differs from `GenerationConfig()`'s default sends the call to stock HF.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Optional

import torch
from transformers import GenerationConfig

# Options that only feed HF's logits processors, stopping criteria, beam scorer or output
# assembly: the paged path computes the same logits, so HF handles these unchanged.
SERVED_OPTIONS = frozenset(
    {
        "max_length", "max_new_tokens", "min_length", "min_new_tokens", "early_stopping", "max_time",
        "stop_strings", "do_sample", "num_beams", "use_cache", "temperature", "top_k", "top_p", "min_p",
        "typical_p", "epsilon_cutoff", "eta_cutoff", "top_h", "repetition_penalty", "encoder_repetition_penalty",
        "length_penalty", "no_repeat_ngram_size", "encoder_no_repeat_ngram_size", "bad_words_ids",
        "renormalize_logits", "forced_bos_token_id", "forced_eos_token_id", "remove_invalid_values",
        "exponential_decay_length_penalty", "suppress_tokens", "begin_suppress_tokens", "sequence_bias",
        "num_return_sequences", "output_scores", "output_logits", "return_dict_in_generate",
        "pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "is_assistant",
        "compile_config", "disable_compile", "diversity_penalty", "low_memory",
        "watermarking_config", "guidance_scale",
    }
)

# Configuration metadata, not generation behaviour.
METADATA = frozenset({"transformers_version", "_from_model_config", "_commit_hash", "_original_object_hash"})

# Options with a known reason to run on stock HF.
FALLBACK_OPTIONS = MappingProxyType({
    "output_attentions": "output_attentions needs the attention weights, which the fused kernels never form",
    "output_hidden_states": "output_hidden_states is served by stock HF",
    "cache_implementation": "a cache_implementation request asks for HF's own cache",
    "prompt_lookup_num_tokens": "prompt-lookup (assisted) decoding is served by stock HF",
    "assistant_early_exit": "assisted decoding is served by stock HF",
    "num_assistant_tokens": "assisted decoding is served by stock HF",
    "penalty_alpha": "contrastive search is served by stock HF",
    "dola_layers": "DoLa decoding is served by stock HF",
    "num_beam_groups": "group beam search is served by stock HF",
    "constraints": "constrained beam search is served by stock HF",
    "force_words_ids": "constrained beam search is served by stock HF",
    "custom_generate": "custom_generate is served by stock HF",
})

# Model kwargs of generate() that the paged forward serves.
SERVED_KWARGS = frozenset({"input_ids", "attention_mask", "inputs_embeds", "decoder_input_ids", "decoder_attention_mask"})
FALLBACK_KWARGS = MappingProxyType({
    "assistant_model": "assisted decoding is served by stock HF",
    "past_key_values": "a user-given cache is served by stock HF",
    "cache": "a user-given cache is served by stock HF",
    "encoder_outputs": "precomputed encoder_outputs are served by stock HF",
    "decoder_inputs_embeds": "decoder_inputs_embeds is served by stock HF",
    "custom_generate": "custom_generate is served by stock HF",
    "synced_gpus": "synced_gpus is served by stock HF",
    "negative_prompt_ids": "classifier-free guidance with a negative prompt is served by stock HF",
    "tokenizer": None,  # only used by stop_strings, which HF's stopping criteria handle
    "labels": None,  # never forwarded to the model by HF's generate() (Seq2SeqTrainer passes them)
    "streamer": None,
    "logits_processor": None,
    "stopping_criteria": None,
    "prefix_allowed_tokens_fn": None,
    "generation_config": None,
})


# An attention_mask of another shape than the inputs' [batch, sequence_length] (one that broadcasts
# over them, such as [1, length]): stock HF's attention adds it as it is.
MASK_SHAPE = ("an attention_mask of another shape than the inputs (one that broadcasts over them) is served by "
              "stock HF")

# Inside torch.autocast HF's ops run in the autocast dtype while the paged kernels and KV pool
# keep the weights' own.
AUTOCAST = ("torch.autocast is served by stock HF (the paged path runs in the weights' own dtype: cast the "
            "model instead, e.g. model.to(torch.bfloat16))")


def autocast_reason(devices) -> Optional[str]:
    """`AUTOCAST` where torch.autocast is on for the type of a device the weights are on, else None."""
    return AUTOCAST if any(torch.is_autocast_enabled(d.type) for d in devices if d.type != "meta") else None


# Values that mean "off" for an option whose default is None (model configs often write them).
_OFF = (None, False, 0, 1, "", (), [], {})

# Options HF turns on by any value but None (`is not None` in `GenerationConfig.get_generation_mode`):
# prompt_lookup_num_tokens=1 or assistant_early_exit=1 is assisted decoding, not "off".
_ON_UNLESS_NONE = frozenset(
    {"prompt_lookup_num_tokens", "assistant_early_exit", "dola_layers", "constraints", "force_words_ids"}
)


def _global_defaults() -> dict[str, Any]:
    """The values transformers 5.x fills into every call's config where neither the user nor the
    model set one (`_prepare_generation_config`); older versions keep them in `GenerationConfig()`."""
    get = getattr(GenerationConfig, "_get_default_generation_params", None)
    return get() if get is not None else {}


def _differs(config: GenerationConfig, default: GenerationConfig, key: str, filled: dict[str, Any]) -> bool:
    """Whether `key` asks for something other than the library default (`default`'s value, or the
    value `filled` says HF fills in by default)."""
    value, base = getattr(config, key, None), getattr(default, key, None)
    if value is None or value == base or (key in filled and value == filled[key]):
        return False
    if key in _ON_UNLESS_NONE:
        return True
    if base is None or isinstance(base, bool) or base == 1:
        return not any(value is off or (type(value) is type(off) and value == off) for off in _OFF)
    return True


def fallback_reason(config: GenerationConfig, model_kwargs: dict[str, Any], training: bool) -> Optional[str]:
    """Why this call must run on stock HF, or None when the paged path serves it."""
    if training:
        return "the model is in training mode (call model.eval() for the paged path)"
    for key, reason in FALLBACK_KWARGS.items():
        if reason is not None and model_kwargs.get(key) is not None and model_kwargs.get(key) is not False:
            return reason
    default, filled = GenerationConfig(), _global_defaults()
    for key, reason in FALLBACK_OPTIONS.items():  # before unknown kwargs: HF may pass these on as both
        if _differs(config, default, key, filled):
            return reason
    for key in model_kwargs:
        if key not in SERVED_KWARGS and key not in FALLBACK_KWARGS and model_kwargs[key] is not None:
            return f"generate() argument {key!r} is not served by the paged path"
    mask = model_kwargs.get("decoder_attention_mask")
    if isinstance(mask, torch.Tensor) and not bool(mask.bool().all()):
        return "a decoder_attention_mask with padding is served by stock HF"
    if config.use_cache is False:
        return "use_cache=False is served by stock HF"
    for key in config.to_dict():
        if key in SERVED_OPTIONS or key in METADATA or key in FALLBACK_OPTIONS:
            continue
        if _differs(config, default, key, filled):
            return f"generation option {key!r}={getattr(config, key)!r} is not known to the paged path"
    return None


# On a CPU, from this width on (every released T5 checkpoint: t5-small is 512), a call whose rows
# are all full length and that does not search beams runs the same matrix products on both paths
# (aten::mm is ~85% of either's time), and the two measured at parity; the paged path gains there
# only by the encoder skipping padding and by beams sharing their source's cross-attention K/V.
# With the default backend such calls run on stock HF: never slower, HF's exact result.
CPU_STOCK_FROM_D_MODEL = 512


def cpu_stock_reason(backend: str, devices, d_model: Optional[int], num_beams: int, padded: bool) -> Optional[str]:
    """Why a call of a model whose weights are all on the CPU runs on stock HF, or None.

    backend: `PagedCacheConfig.backend`; only "auto" leaves the choice to this rule.
    devices: the devices of the model's weights; padded: whether any input row is shorter than the batch.
    """
    if backend != "auto" or not devices or any(d.type != "cpu" for d in devices):
        return None
    if d_model is None or d_model < CPU_STOCK_FROM_D_MODEL or num_beams > 1 or padded:
        return None
    return (f"on a CPU, at d_model {d_model} (>= {CPU_STOCK_FROM_D_MODEL}), an unpadded call without beam search "
            "runs the same matrix products on both paths and is no faster paged, so stock HF runs it "
            "(PagedCacheConfig(backend='cpu') runs the paged CPU backend anyway)")
