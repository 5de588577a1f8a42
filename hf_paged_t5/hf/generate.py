"""The patched `generate()`: the serve / fall back decision, the pool reservation and the cache
of one call, and the choice of decoding loop HF runs through `custom_generate`.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Any, Callable, Optional

import torch
from torch import nn
from transformers.generation import GenerationMode
from transformers.generation.stopping_criteria import MaxLengthCriteria, StopStringCriteria, StoppingCriteriaList

from ..decode import beam_graph, greedy_graph
from ..decode.graphs import predicted_key
from ..decode.loop import beam_loop, sample_loop
from ..model.attention import compile_elsewhere
from ..model.fused_layer import ROW_COUNTS
from ..model.stacks import EMPTY_ROW, known_mask, mask_rows, store_cross_ahead, weight_devices
from . import cache_export
from .cache import PagedEncoderDecoderCache
from .forward import like
from .policy import MASK_SHAPE, autocast_reason, cpu_stock_reason, fallback_reason
from .runtime import PagedRuntime

logger = logging.getLogger(__name__)


def make_generate(runtime: PagedRuntime, original):
    def generate(self, inputs=None, generation_config=None, **kwargs):
        # HF's own merge: the user's config (or the model's), unset fields from model.generation_config,
        # then the keyword arguments; what HF then runs is what the pool and the loop are sized for
        gen_config, model_kwargs = self._prepare_generation_config(generation_config, **kwargs)
        prepared = PreparedConfig(generation_config, kwargs, gen_config, model_kwargs)
        if inputs is not None:
            model_kwargs["input_ids"] = inputs
        with known_mask(model_kwargs.get("attention_mask")):
            return _generate(self, runtime, original, inputs, generation_config, prepared, model_kwargs, kwargs)

    return like(original, generate)


def _generate(model, runtime, original, inputs, generation_config, prepared: "PreparedConfig", model_kwargs, kwargs):
    """The paged call, or stock HF's for a reason it logs once."""
    gen_config = prepared.config
    reason = fallback_reason(gen_config, model_kwargs, model.training)
    devices = weight_devices(model)
    if reason is None and any(d.type == "meta" for d in devices):
        reason = "weights offloaded by accelerate (meta device) are served by stock HF"
    if reason is None:
        reason = autocast_reason(devices)
    if reason is None and runtime.runner.owned_here():
        reason = "a generate() nested in a running generate() of the same model is served by stock HF"
    if reason is None and (hooked := runtime.uncalled_hook(model)) is not None:
        reason = f"{hooked} is served by stock HF"
    if reason is None:
        source, source_lens, reason = _encoder_inputs(model, gen_config, model_kwargs)
    if reason is None:
        reason = cpu_stock_reason(runtime.config.backend, devices, runtime.d_model, gen_config.num_beams or 1,
                                  min(source_lens) < source.shape[1])
    if reason is not None:
        runtime.warn_once(reason)
        return original(inputs, generation_config, **kwargs)
    return _paged_generate(runtime, model, original, inputs, generation_config, prepared, model_kwargs, kwargs,
                           devices, source, source_lens)


def _encoder_inputs(model: nn.Module, gen_config, model_kwargs: dict):
    """(the encoder's input tensor, real tokens per row, None) of a generate() call, or
    (None, None, reason) where the paged path cannot serve its attention mask. Bad input raises.

    With neither input_ids nor inputs_embeds, HF starts the encoder from one BOS token per row
    (`_prepare_model_inputs`, which raises HF's own error when the model has no bos_token_id).
    """
    embeds = model_kwargs.get("input_ids") is None and model_kwargs.get("inputs_embeds") is not None
    name = "inputs_embeds" if embeds else "input_ids"
    source = model_kwargs.get(name)
    if source is None:
        source = model._prepare_model_inputs(None, gen_config.bos_token_id, dict(model_kwargs))[0]
    mask = model_kwargs.get("attention_mask")
    _check_shapes(name, source, mask, model_kwargs.get("decoder_input_ids"))
    if source.shape[0] == 0:
        raise ValueError("generate() got an empty batch (batch size 0); pass at least one input")
    if source.shape[1] == 0:
        raise ValueError("generate() got zero-length inputs; each input needs at least one token")
    _check_devices(model, source, mask)
    if mask is None:
        return source, [source.shape[1]] * source.shape[0], None
    if tuple(mask.shape) != tuple(source.shape[:2]):
        return None, None, MASK_SHAPE
    lens, reason = mask_rows(mask)
    if reason == EMPTY_ROW:  # HF's decoder attends over every encoder position of such a row
        return None, None, reason
    # (a hole, or LongT5 transient-global left padding: the encoder forward runs HF's, the decoder stays paged)
    return source, lens, None


def _paged_generate(runtime, model, original, inputs, generation_config, prepared: "PreparedConfig", model_kwargs,
                    kwargs, devices, source, source_lens):
    gen_config = prepared.config
    if kwargs.get("streamer") is not None:
        # HF checks the streamer against the mode for the loops it picks itself, not for the
        # `custom_generate` callable the paged path hands it: its own check, before any work
        mode = gen_config.get_generation_mode()
        model._validate_generation_mode(mode, gen_config, {"streamer": kwargs["streamer"]})
    expand = max(gen_config.num_beams or 1, gen_config.num_return_sequences or 1)
    dec_ids = model_kwargs.get("decoder_input_ids")
    start_len = (dec_ids.shape[1] + 1) if dec_ids is not None else 1  # at most: HF may not prepend the start
    # HF's `_prepare_generated_length`: max_new_tokens counts new tokens; a max_length set anywhere
    # counts the whole decoder sequence; neither set: its default max_length of new tokens
    has_default_max_length = (
        kwargs.get("max_length") is None
        and (generation_config is None or generation_config.max_length is None)
        and model.generation_config.max_length is None
    )
    if gen_config.max_new_tokens is not None:
        total = start_len + gen_config.max_new_tokens
    elif has_default_max_length or gen_config.max_length is None:
        total = start_len + (gen_config.max_length or _default_max_length())
    else:
        total = gen_config.max_length
    # the last new token is returned, never fed back; the prompt is stored whatever the length
    max_self_tokens = max(total - 1, start_len)
    # a user's MaxLengthCriteria replaces HF's default one, and may allow more (total decoder length)
    for c in kwargs.get("stopping_criteria") or ():
        if isinstance(c, MaxLengthCriteria):
            max_self_tokens = max(max_self_tokens, c.max_length - 1)
    if model_kwargs.get("decoder_attention_mask") is not None:
        kwargs = {k: v for k, v in kwargs.items() if k != "decoder_attention_mask"}  # all ones: same as none
    with runtime.runner.owning(devices), _generation_stream(runtime, devices) as hand_over:
        cache = None
        try:
            runtime.check_weights()
            pool = runtime.get_pool(model.decoder)
            needed = PagedEncoderDecoderCache.blocks_needed(source_lens, expand, max_self_tokens, pool.block_size)
            pool.reserve(needed)
            cache = PagedEncoderDecoderCache(pool, len(source_lens), expand, max_self_tokens)
            loop = _lean_loop(runtime, cache, gen_config, kwargs.get("streamer"), model)
            if loop is not None:
                kwargs = {**_stop_strings_as_criteria(kwargs, gen_config), "custom_generate": loop}
            ahead = _first_step_ahead(runtime, model, cache, source, source_lens)
            with _encoder_outputs_per_source(model, expand), runtime.also_ahead(ahead), prepared.reused_by(model):
                result = original(inputs, generation_config, **kwargs, **{runtime.cache_kwarg: cache})
            # an output that holds the cache gets HF's own, filled from the blocks released below
            result = cache_export.replace_paged_cache(result, cache, model_kwargs.get("attention_mask"), source.shape[1])
            return hand_over(result)
        finally:
            if cache is not None:
                cache.release()


class PreparedConfig:
    """The generation config this wrapper prepared with HF's own `_prepare_generation_config`,
    handed to the same call inside HF's generate() instead of preparing it again (HF builds and
    validates a default model config, deep-copies the generation config and merges it twice:
    ~1-2 ms of host time, a sixth of a short call's). HF's call gets it where its arguments are
    this wrapper's: the same config object, every keyword that set a generation field with the
    same value, and only keywords that set none added (the cache). Anything else runs HF's own.

    config, model_kwargs: what `_prepare_generation_config(generation_config, **kwargs)` returned.
    """

    def __init__(self, generation_config, kwargs: dict, config, model_kwargs: dict) -> None:
        self.given, self.config = generation_config, config
        # the keywords HF's merge took as generation fields (`GenerationConfig.update`)
        self.fields = {k: v for k, v in kwargs.items() if k not in model_kwargs}

    def serves(self, args: tuple, kwargs: dict) -> bool:
        return (
            len(args) == 1 and args[0] is self.given
            and all(k in kwargs and kwargs[k] is v for k, v in self.fields.items())
            and not any(hasattr(self.config, k) for k in kwargs if k not in self.fields)
        )

    def result(self, kwargs: dict) -> tuple:
        """What HF's `_prepare_generation_config(self.given, **kwargs)` returns for `serves` arguments."""
        model_kwargs = {k: v for k, v in kwargs.items() if k not in self.fields}
        for flag in ("output_attentions", "output_hidden_states"):
            if getattr(self.config, flag):
                model_kwargs[flag] = getattr(self.config, flag)
        return self.config, model_kwargs

    @contextlib.contextmanager
    def reused_by(self, model: nn.Module):
        """While entered, the next `model._prepare_generation_config` call is answered by this one
        where it `serves` (once: a later call is HF's own); another thread's call is HF's own."""
        thread = threading.get_ident()

        def prepare(*args, **kwargs):
            if threading.get_ident() == thread:
                model.__dict__.pop("_prepare_generation_config", None)
                if self.serves(args, kwargs):
                    return self.result(kwargs)
            return type(model)._prepare_generation_config(model, *args, **kwargs)

        if "_prepare_generation_config" in model.__dict__:  # a user's own stays as it is
            yield
            return
        model._prepare_generation_config = prepare
        try:
            yield
        finally:
            model.__dict__.pop("_prepare_generation_config", None)


# Row counts past the fused layer's whose op-by-op step a cold first call also sends to the compile
# workers: a later call at a new batch size loads that step's binaries (the feed-forward's norm of
# K-slice partials, `kernels.split_k`, is the op-by-op step's alone), few rows (decode attention's
# few-pair binary, shared up to ~4 programs per SM) and many (its many-row binaries, K/V stored).
OP_ROW_COUNTS = (8, 64)


def _first_step_ahead(runtime: PagedRuntime, model: nn.Module, cache: PagedEncoderDecoderCache, source: torch.Tensor,
                      source_lens) -> Callable[[], None]:
    """What a cold process's encoder pass compiles besides the encoder (`PagedRuntime.compile_ahead`):
    the cross K/V store of this call's real tokens and its first decode step, so their kernels
    compile on the pool together with the encoder's, not in a second pass after it; and, where
    the process has compile workers, the step at the fused layer's other row counts (a one-source
    beam call's 4 first, whose cross-attention is a greedy step's: `PagedEncoderDecoderCache.cross_group`)
    and at `OP_ROW_COUNTS`, compiled there for the calls that come later while this one runs."""

    def ahead() -> None:
        packed = torch.zeros(int(sum(source_lens)), runtime.d_model, dtype=model.decoder.embed_tokens.weight.dtype,
                             device=source.device)
        store_cross_ahead(model.decoder, runtime.ops_for, cache.pool, packed)
        self_tokens, cross_tokens = cache.max_self_blocks * cache.block_size, max(source_lens)
        key = predicted_key(cache, cache.num_rows, self_tokens, cross_tokens)
        runtime.runner.step_ahead(model, cache, source.device, cache.num_rows, key)
        greedy_graph.update_ahead(runtime.ops_for(source.device), cache.num_rows, model.lm_head.out_features,
                                  model.decoder.embed_tokens.weight.dtype, source.device)
        with compile_elsewhere(source.device) as sending:
            if sending:  # a later beam call's update (its binaries serve every beam count)
                beam_graph.update_ahead(runtime.ops_for(source.device), model.lm_head.out_features,
                                        model.decoder.embed_tokens.weight.dtype, source.device)
            for rows in (*sorted(ROW_COUNTS, reverse=True), *OP_ROW_COUNTS) if sending else ():
                other = predicted_key(cache, rows, self_tokens, cross_tokens, 1)
                if other != key:
                    runtime.runner.step_ahead(model, cache, source.device, cache.num_rows, other)

    return ahead


def _stop_strings_as_criteria(kwargs: dict, gen_config) -> dict:
    """generate()'s kwargs with `stop_strings` turned into HF's own `StopStringCriteria`, given
    with the other stopping criteria. HF drops the tokenizer when `custom_generate` is a callable
    (it pops `tokenizer` before picking the callable's extra arguments), so it would not find one
    for the stop strings. Without a tokenizer, HF's own error is left to say so."""
    if not gen_config.stop_strings or kwargs.get("tokenizer") is None:
        return kwargs
    criteria = StoppingCriteriaList(kwargs.get("stopping_criteria") or [])
    criteria.append(StopStringCriteria(stop_strings=gen_config.stop_strings, tokenizer=kwargs["tokenizer"]))
    return {**kwargs, "stopping_criteria": criteria, "stop_strings": None}


@contextlib.contextmanager
def _generation_stream(runtime: PagedRuntime, devices: frozenset):
    """Run a paged generate() on the runner's generation stream (`graphs.Streams`), the stream its decode graphs are
    captured on, when those graphs can run (CUDA graphs on, the model on one CUDA device): cuBLAS
    keeps a workspace per stream (32 MiB on an H200), so an encoder and prefill on the caller's
    stream would hold a second one. Ordered after the caller's pending work at entry; at exit the
    caller's stream waits for the generation, and the returned tensors are marked used on the
    caller's stream (`hand_over`) so the allocator cannot reuse them while it still reads them.
    Yields `hand_over(result) -> result`. devices: those of the model's weights."""
    if not (runtime.config.cuda_graphs and _one_cuda_device(devices)):
        yield lambda result: result
        return
    device = next(iter(devices))
    caller, side = torch.cuda.current_stream(device), runtime.runner.graphs.streams.generation(device)
    if caller == side:
        yield lambda result: result
        return

    def hand_over(result):
        _record_stream(result, caller)
        return result

    side.wait_stream(caller)
    try:
        with torch.cuda.stream(side):
            yield hand_over
    finally:
        caller.wait_stream(side)


def _record_stream(value: Any, stream: torch.cuda.Stream) -> None:
    """`Tensor.record_stream(stream)` on every CUDA tensor in `value` (generate()'s output: a tensor
    or a ModelOutput of tuples of tensors)."""
    if isinstance(value, torch.Tensor):
        if value.is_cuda:
            value.record_stream(stream)
    elif isinstance(value, dict):
        for item in value.values():
            _record_stream(item, stream)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _record_stream(item, stream)


@contextlib.contextmanager
def _encoder_outputs_per_source(model: nn.Module, expand: int):
    """HF copies the encoder's output `expand` times (beams, num_return_sequences) before decoding;
    the paged forward reads it once per source (`stacks.store_cross`), so this call's expansion
    leaves `encoder_outputs` alone (t5-small, 8 sources x 4 beams x 512 tokens: 16 MiB not
    allocated). One-shot: a later call of the method in the same generate() is HF's own."""
    if expand == 1 or "_expand_inputs_for_generation" in model.__dict__:
        yield
        return
    original = model._expand_inputs_for_generation
    used = []

    def expand_inputs(*args, **kwargs):
        if not used and kwargs.get("is_encoder_decoder") and not args:
            used.append(True)
            kwargs["is_encoder_decoder"] = False  # HF then expands every tensor but encoder_outputs
        return original(*args, **kwargs)

    model._expand_inputs_for_generation = expand_inputs
    try:
        yield
    finally:
        del model.__dict__["_expand_inputs_for_generation"]


def _default_max_length() -> int:
    """HF's default `max_length` when neither it nor `max_new_tokens` is set (20)."""
    from transformers import GenerationConfig

    defaults = getattr(GenerationConfig, "_get_default_generation_params", None)
    return defaults()["max_length"] if defaults is not None else 20


def _lean_loop(runtime: PagedRuntime, cache: PagedEncoderDecoderCache, gen_config, streamer,
               model: nn.Module):
    """A `custom_generate` callable (HF's `_sample` signature) running `loop.sample_loop` or
    `loop.beam_loop` on `cache`, or None where HF's own loop runs over the paged forward
    (`return_dict_in_generate`, `low_memory`, and a forward hook on the model itself: HF's loop
    calls the model once a step, and so runs the hook as often as stock HF; these loops call its
    decoder).

    HF hands a custom callable only the keyword arguments `_sample` lacks, so the streamer
    comes through this closure. (synced_gpus never gets here: `policy` sends it to stock HF.)
    """
    mode = gen_config.get_generation_mode()
    if gen_config.return_dict_in_generate or gen_config.low_memory:
        return None
    if model._forward_hooks or model._forward_pre_hooks:
        return None
    if mode not in (GenerationMode.GREEDY_SEARCH, GenerationMode.SAMPLE, GenerationMode.BEAM_SEARCH,
                    GenerationMode.BEAM_SAMPLE):
        return None
    beams = mode in (GenerationMode.BEAM_SEARCH, GenerationMode.BEAM_SAMPLE)

    def paged_loop(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
        def prefill(ids):
            return model(
                decoder_input_ids=ids, encoder_outputs=model_kwargs["encoder_outputs"],
                attention_mask=model_kwargs.get("attention_mask"), use_cache=True, return_dict=True,
                **{runtime.cache_kwarg: cache},
            ).logits

        def step(ids):
            with torch.no_grad():
                return runtime.runner.decode(model, cache, ids)

        # the device-resident loops: every per-step number on the device (the model on one device)
        resident = None
        if _on_one_device(runtime.runner.call_devices):
            if beams and beam_graph.supported(generation_config, logits_processor, stopping_criteria):
                resident = functools.partial(beam_graph.resident_beam_loop, ops=runtime.ops_for(input_ids.device))
            elif (not beams and streamer is None
                  and greedy_graph.supported(generation_config, logits_processor, stopping_criteria)):
                resident = functools.partial(greedy_graph.graph_greedy_loop, ops=runtime.ops_for(input_ids.device))
        if resident is not None:
            plan = runtime.runner.plan(model, cache, input_ids.device, input_ids.shape[0])
            with torch.no_grad():
                return resident(runtime.runner.graphs, plan.step, cache, prefill, input_ids, logits_processor,
                                stopping_criteria, generation_config, capture=plan.use_graph)
        if beams and beam_graph.supported(generation_config, logits_processor, stopping_criteria):
            return beam_graph.graph_beam_loop(step, prefill, cache.reorder_cache, input_ids, logits_processor,
                                              stopping_criteria, generation_config, runtime.config.cuda_graphs,
                                              runtime.runner.graphs.streams)
        if beams:
            return beam_loop(model, step, prefill, cache.reorder_cache, input_ids, logits_processor,
                             stopping_criteria, generation_config)
        return sample_loop(step, prefill, input_ids, logits_processor, stopping_criteria, generation_config, streamer)

    return paged_loop


def _on_one_device(devices: frozenset) -> bool:
    return len(devices) == 1


def _one_cuda_device(devices: frozenset) -> bool:
    return len(devices) == 1 and next(iter(devices)).type == "cuda"


def _check_shapes(name: str, source: torch.Tensor, mask: Optional[torch.Tensor],
                  decoder_ids: Optional[torch.Tensor]) -> None:
    """The inputs' shapes, before any work (`name`: "input_ids" or "inputs_embeds", what `source`
    is): stock HF fails on these deep inside its forward with an indexing error, or, for a mask
    shorter than the inputs, only where its attention adds the mask. A mask that broadcasts over
    the inputs ([1, length], [batch, 1]) passes: stock HF serves it (`MASK_SHAPE`)."""
    layout = "[batch, sequence_length, d_model]" if name == "inputs_embeds" else "[batch, sequence_length]"
    if source.dim() != layout.count(",") + 1:
        hint = (f"; a single input needs a batch dimension ({name}[None])"
                if source.dim() == layout.count(",") else "")
        raise ValueError(f"{name} must be {layout}, got shape {tuple(source.shape)}{hint}")
    if mask is not None:
        if mask.dim() != 2:
            raise ValueError("`attention_mask` passed to `generate` must be 2D.")  # stock HF's own message
        try:
            torch.broadcast_shapes(mask.shape, source.shape[:2])
        except RuntimeError:
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)} but {name} is {tuple(source.shape[:2])} "
                             "(batch, sequence_length): one mask entry per input token") from None
    if decoder_ids is not None and decoder_ids.dim() != 2:
        hint = "; a single prompt needs a batch dimension (decoder_input_ids[None])" if decoder_ids.dim() == 1 \
            else ""
        raise ValueError(f"decoder_input_ids must be [batch, length], got shape {tuple(decoder_ids.shape)}"
                         f"{hint}")


def _check_devices(model: nn.Module, source: torch.Tensor, mask: Optional[torch.Tensor]) -> None:
    embed_device = model.get_input_embeddings().weight.device
    if source.dtype in (torch.long, torch.int) and source.device != embed_device:
        raise ValueError(
            f"input_ids are on {source.device} but the model's embeddings are on {embed_device}; "
            f"move the inputs with .to({str(embed_device)!r})"
        )
    if mask is not None and mask.device != source.device:
        raise ValueError(
            f"attention_mask is on {mask.device} but the inputs are on {source.device}; put both on one device"
        )
