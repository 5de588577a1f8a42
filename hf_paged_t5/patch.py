"""`patch_model` / `unpatch_model`: put the paged path under a T5-family model's `generate()`.

Patching is explicit and reversible: it sets instance attributes only (`forward` of the model
and of its encoder stack, `generate` of the model, and `_hf_paged_t5`), never class
attributes, and `unpatch_model` restores exactly what was there.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import threading
import types
from typing import Any, Optional

import torch
from torch import nn
from transformers.generation import GenerationMode
from transformers.generation.stopping_criteria import MaxLengthCriteria, StopStringCriteria, StoppingCriteriaList
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions, Seq2SeqLMOutput

from . import beam_graph, greedy_graph, hf_cache
from . import bias as bias_mod
from .attention import OnDevice, backend_ops, project
from .cache import KVPool, LayerSpec, PagedEncoderDecoderCache
from .config import PagedCacheConfig
from .loop import beam_loop, sample_loop
from .modes import fallback_reason
from .probe import output_scale
from .graphs import DecodeGraphs, generation_stream, graphable
from .stacks import EMPTY_ROW, decoder_layers, encoder_forward, mask_rows, module_device, store_cross

logger = logging.getLogger(__name__)

_ATTR = "_hf_paged_t5"
SUPPORTED_CLASSES = (
    "T5ForConditionalGeneration", "MT5ForConditionalGeneration", "UMT5ForConditionalGeneration",
    "T5EncoderModel", "MT5EncoderModel", "UMT5EncoderModel",
)


def _check_model(model: Any) -> None:
    names = {cls.__name__ for cls in type(model).__mro__}
    if not names.intersection(SUPPORTED_CLASSES):
        raise TypeError(
            f"hf_paged_t5 supports {', '.join(SUPPORTED_CLASSES)} (T5, Flan-T5, T5 v1.1, mT5, UMT5, ByT5, "
            f"MADLAD checkpoints load as these); got {type(model).__name__}. Load the model with "
            "AutoModelForSeq2SeqLM or T5EncoderModel."
        )
    if getattr(model.config, "is_gated_act", None) is None and not hasattr(model.config, "feed_forward_proj"):
        raise TypeError(f"{type(model).__name__} has no T5 configuration")


class PagedRuntime:
    """Everything `patch_model` attaches to one model: config, pool, bias tables, originals."""

    def __init__(self, model: nn.Module, config: PagedCacheConfig) -> None:
        self.config = config
        self.is_seq2seq = hasattr(model, "decoder")
        self.originals: dict[tuple[int, str], tuple[nn.Module, Any, bool]] = {}
        self.pool: Optional[KVPool] = None
        self.graphs = DecodeGraphs()
        self.lock = threading.Lock()
        # Thread running a paged generate() (holding `lock`): a generate() it nests, from a streamer
        # or logits processor, must not wait on the lock (deadlock) nor take blocks promised to it.
        self.owner: Optional[int] = None
        # The devices of the model's weights, read once per paged generate() (set with `owner`):
        # walking every parameter costs ~1 ms of host time per walk on a large model.
        self.call_devices: Optional[frozenset] = None
        self.warned: set[str] = set()
        self.tables = bias_mod.BiasTableCache(on_rebuild=self.graphs.clear)  # captured steps read them
        self._device_ops: dict[tuple[str, torch.device], OnDevice] = {}
        sig = inspect.signature(type(model).forward).parameters if self.is_seq2seq else {}
        self.cache_kwarg = "cache" if "cache" in sig else "past_key_values"
        # what the class's forward multiplies the decoder output by before lm_head (probe.py)
        self.output_scale = output_scale(model) if self.is_seq2seq else None

    # ---- per-layer resources ------------------------------------------------------------
    def ops_for(self, device: torch.device):
        """The kernel namespace for a layer on `device`; with several GPUs, one that makes `device`
        current around each call (see `attention.OnDevice`)."""
        ops = backend_ops(self.config.resolve_backend(device))
        if device.type == "cuda" and torch.cuda.device_count() > 1:
            key = (ops.__name__, device)
            if key not in self._device_ops:
                self._device_ops[key] = OnDevice(ops, device)
            return self._device_ops[key]
        return ops

    def bias_tables(self, stack: nn.Module, causal: bool) -> list[torch.Tensor]:
        """Each layer's bias table of `stack` (`bias.BiasTableCache`; no host sync)."""
        return self.tables.get(stack, causal)

    def check_weights(self) -> None:
        """Once per generate() call and batch job: drop bias tables whose weights were written in
        place (one host sync); never per decode step."""
        self.tables.check()

    def layer_specs(self, decoder: nn.Module) -> list[LayerSpec]:
        """One pool spec per decoder layer: its device, the model's dtype, its head shape."""
        specs = []
        for i, block in enumerate(decoder.block):
            attn = block.layer[0].SelfAttention
            weight = attn.k.weight
            if self.config.dtype is not None and self.config.dtype != weight.dtype:
                raise ValueError(
                    f"PagedCacheConfig(dtype={self.config.dtype}) does not match decoder layer {i}'s weights "
                    f"({weight.dtype}); the kernels need K/V in the model's dtype. Use dtype=None, or "
                    f"convert the model with model.to({self.config.dtype})"
                )
            specs.append(LayerSpec(weight.device, weight.dtype, attn.n_heads, attn.key_value_proj_dim))
        return specs

    def get_pool(self, decoder: nn.Module) -> KVPool:
        specs = self.layer_specs(decoder)
        if self.pool is None or self.pool.specs != specs:
            if self.pool is not None:
                logger.info("re-creating the KV pool: the decoder's devices or dtypes changed")
            self.pool = KVPool(self.config, specs)
        return self.pool

    def warn_once(self, reason: str, what: str = "this generate()") -> None:
        """Log once per model and reason that `what` runs on stock HF, and why (a generate() that
        falls back for a reason its encoder shares logs it once)."""
        if reason not in self.warned:
            self.warned.add(reason)
            logger.warning("hf_paged_t5: running %s on stock HF: %s", what, reason)


def _set(runtime: PagedRuntime, module: nn.Module, name: str, value: Any) -> None:
    """Set an instance attribute, remembering what it replaced."""
    had = name in module.__dict__
    runtime.originals[(id(module), name)] = (module, module.__dict__.get(name), had)
    setattr(module, name, value)


def patch_model(model: nn.Module, config: Optional[PagedCacheConfig] = None) -> nn.Module:
    """Make `model.generate()` (and the encoder's forward) run on the paged KV cache and kernels.

    Returns the same model object. Patching an already patched model re-patches it with the
    new config.
    """
    _check_model(model)
    if config is None:
        config = PagedCacheConfig()
    if not isinstance(config, PagedCacheConfig):
        raise TypeError(f"config must be a PagedCacheConfig, got {type(config).__name__}")
    if getattr(model, _ATTR, None) is not None:
        unpatch_model(model)
    runtime = PagedRuntime(model, config)
    encoder = model.encoder if hasattr(model, "encoder") else model.get_encoder()
    _set(runtime, encoder, "forward", types.MethodType(_make_encoder_forward(runtime, encoder.forward), encoder))
    if runtime.is_seq2seq:
        _set(runtime, model, "forward", types.MethodType(_make_forward(runtime, model.forward), model))
        _set(runtime, model, "generate", types.MethodType(_make_generate(runtime, model.generate), model))
    for module in {id(m): m for m, _, _ in runtime.originals.values()}.values():
        _set(runtime, module, "__reduce_ex__", _unpatched_reduce(runtime, module))
    _set(runtime, model, "__deepcopy__", _patched_deepcopy(runtime, model))
    setattr(model, _ATTR, runtime)
    return model


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
    """Undo `patch_model`: stock HF behaviour, bit for bit; the KV pool is freed."""
    runtime = getattr(model, _ATTR, None)
    if runtime is None:
        raise ValueError("this model is not patched by hf_paged_t5")
    for (_, name), (module, value, had) in runtime.originals.items():
        if had:
            setattr(module, name, value)
        else:
            module.__dict__.pop(name, None)
    runtime.pool = None
    runtime.graphs.clear()  # captured steps and their memory pool go with the pool they read
    del model.__dict__[_ATTR]
    return model


def is_patched(model: nn.Module) -> bool:
    return getattr(model, _ATTR, None) is not None


# ---- the patched methods ------------------------------------------------------------------
def _like(original, fn):
    """`fn` (an unbound `(self, ...)` function standing in for the bound method `original`) with
    `original`'s name, docs and signature: HF (`_validate_model_kwargs`, the Trainer's column
    filter, `generate()`'s attention-mask check) reads `inspect.signature(model.forward)`."""
    functools.update_wrapper(fn, original)
    sig = inspect.signature(original)
    self_param = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    fn.__signature__ = sig.replace(parameters=[self_param, *sig.parameters.values()])
    return fn


def _output_flags(module: nn.Module, kwargs: dict) -> tuple[bool, bool]:
    """(output_attentions, output_hidden_states) as HF's stacks read them: the call's value, else
    the module's config (`capture_outputs`: `kwargs.get(name, config.name)`)."""
    return tuple(bool(kwargs.get(name, getattr(module.config, name, False)))
                 for name in ("output_attentions", "output_hidden_states"))


def _paged_allowed(runtime: PagedRuntime, module: nn.Module, kwargs: dict) -> bool:
    if module.training or any(_output_flags(module, kwargs)):
        return False
    if runtime.owner == threading.get_ident() and not torch.is_grad_enabled():
        return True  # inside this thread's paged generate(), which checked the weights' devices
    if torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()):
        return False  # the kernels have no backward: keep autograd on stock HF
    return all(p.device.type != "meta" for p in module.parameters())


def _make_encoder_forward(runtime: PagedRuntime, original):
    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, return_dict=None, **kwargs):
        unknown = set(kwargs) - {"output_attentions", "output_hidden_states", "use_cache"}
        stock = unknown or not _paged_allowed(runtime, self, kwargs)
        if not stock and attention_mask is not None:
            reason = mask_rows(attention_mask)[1]
            if reason is not None:
                runtime.warn_once(reason, "the encoder")
                stock = True
        if stock:
            return original(input_ids=input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                            return_dict=return_dict, **kwargs)
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        source = input_ids if inputs_embeds is None else inputs_embeds
        if source.shape[0] == 0 or source.shape[1] == 0:
            raise ValueError(f"empty input: the encoder got inputs of shape {tuple(source.shape[:2])}")
        if runtime.owner != threading.get_ident():  # a call of its own, not one inside generate()
            runtime.check_weights()
        tables = runtime.bias_tables(self, causal=False)
        # given input_ids, only the real tokens are embedded (inside encoder_forward)
        hidden = encoder_forward(self, runtime.ops_for, tables, inputs_embeds, attention_mask, input_ids=input_ids)
        # the class T5's stacks return (a caller that compiles generate() sees one type either way)
        out = BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        return out if return_dict is not False else (hidden,)

    return _like(original, forward)


def _make_forward(runtime: PagedRuntime, original):
    key = runtime.cache_kwarg

    def forward(self, *args, **kwargs):
        cache = kwargs.get(key)
        if args or not isinstance(cache, PagedEncoderDecoderCache):
            return original(*args, **kwargs)
        extra = {k for k, v in kwargs.items() if v is not None} - {
            "input_ids", "attention_mask", "decoder_input_ids", "decoder_attention_mask", "encoder_outputs",
            key, "use_cache", "return_dict", "inputs_embeds", "cache_position", "output_attentions",
            "output_hidden_states",
        }
        if extra or kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
            raise RuntimeError(f"the paged forward does not serve {sorted(extra)}; unpatch_model() to use them")
        encoder_outputs = kwargs.get("encoder_outputs")
        if encoder_outputs is None:
            encoder_outputs = self.encoder(
                input_ids=kwargs.get("input_ids"), attention_mask=kwargs.get("attention_mask"),
                inputs_embeds=kwargs.get("inputs_embeds"), return_dict=True,
            )
        enc_hidden = encoder_outputs[0]
        ids = kwargs["decoder_input_ids"]
        past = cache.get_seq_length()
        if past and ids.shape[1] > 1:
            ids = ids[:, past:]  # a caller that passes the whole history: keep the new tokens
        with torch.no_grad():
            if not cache.cross_blocks:
                store_cross(self.decoder, runtime.ops_for, cache, enc_hidden, kwargs.get("attention_mask"))
            logits = _decode(runtime, self, cache, ids)
        return Seq2SeqLMOutput(logits=logits, **{key: cache})

    return _like(original, forward)


def _decode_step(runtime: PagedRuntime, model: nn.Module, cache, device: torch.device, rows: int):
    """(step_fn, use_graph) of this generate() call, built once per call: step_fn(input_ids,
    meta_for) -> logits runs the decoder stack and lm_head on given metadata (`DecodeGraphs`'
    contract); use_graph says whether single-token steps replay a captured graph."""
    plan = cache.__dict__.get("_decode_plan")
    if plan is None:  # the bias tables, the output scale, graphability
        use_graph = (
            runtime.config.cuda_graphs
            and rows <= runtime.config.max_graph_batch
            and (_one_cuda_device(runtime.call_devices) if runtime.call_devices is not None else graphable(model))
            and runtime.config.resolve_backend(device) == "triton"
        )
        scale = runtime.output_scale
        tables = runtime.bias_tables(model.decoder, causal=True)
        pool = cache.pool  # not `cache` itself: the plan is stored on the cache (no reference cycle)
        # A generate() call stores its cross K/V once, so the CPU backend reads them gathered once
        # (`cpu_ops.DecodeState`); a batch job's cache admits new sources between steps: not there.
        state = None
        if isinstance(cache, PagedEncoderDecoderCache) and all(
            runtime.config.resolve_backend(module_device(block)) == "cpu" for block in model.decoder.block
        ):
            from .cpu_ops import DecodeState

            state = DecodeState()

        def step(input_ids, meta_for):
            hidden = decoder_layers(model.decoder, runtime.ops_for, tables, pool, meta_for, input_ids, state)
            if scale is not None:
                hidden = hidden * scale
            head_device = module_device(model.lm_head)
            return project(runtime.ops_for(head_device), model.lm_head, hidden.to(head_device))

        plan = cache._decode_plan = (step, use_graph)
    return plan


def _decode(runtime: PagedRuntime, model: nn.Module, cache: PagedEncoderDecoderCache, ids: torch.Tensor):
    """Logits [rows, num_new, vocab] of the new decoder tokens; a captured graph serves single tokens."""
    step, use_graph = _decode_step(runtime, model, cache, ids.device, ids.shape[0])
    if use_graph and ids.shape[1] == 1:
        return runtime.graphs.run(step, cache, ids, ids.device)
    slots = cache.begin_step(ids.shape[1])
    metas: dict[torch.device, object] = {}

    def meta_for(dev):
        if dev not in metas:
            metas[dev] = cache.metadata(slots, ids.shape[1], dev)
        return metas[dev]

    return step(ids, meta_for)


def _make_generate(runtime: PagedRuntime, original):
    def generate(self, inputs=None, generation_config=None, **kwargs):
        # HF's own merge: the user's config (or the model's), unset fields from model.generation_config,
        # then the keyword arguments; what HF then runs is what the pool and the loop are sized for
        gen_config, model_kwargs = self._prepare_generation_config(generation_config, **kwargs)
        if inputs is not None:
            model_kwargs["input_ids"] = inputs
        reason = fallback_reason(gen_config, model_kwargs, self.training)
        devices = frozenset(p.device for p in self.parameters())
        if reason is None and any(d.type == "meta" for d in devices):
            reason = "weights offloaded by accelerate (meta device) are served by stock HF"
        if reason is None and runtime.owner == threading.get_ident():
            reason = "a generate() nested in a running generate() of the same model is served by stock HF"
        if reason is None:
            source, source_lens, reason = _encoder_inputs(self, gen_config, model_kwargs)
        if reason is not None:
            runtime.warn_once(reason)
            return original(inputs, generation_config, **kwargs)
        return _paged_generate(runtime, self, original, inputs, generation_config, gen_config, model_kwargs, kwargs,
                               devices, source, source_lens)

    return _like(original, generate)


def _encoder_inputs(model: nn.Module, gen_config, model_kwargs: dict):
    """(the encoder's input tensor, real tokens per row, None) of a generate() call, or
    (None, None, reason) where the paged path cannot serve its attention mask. Bad input raises.

    With neither input_ids nor inputs_embeds, HF starts the encoder from one BOS token per row
    (`_prepare_model_inputs`, which raises HF's own error when the model has no bos_token_id).
    """
    source = model_kwargs.get("input_ids")
    if source is None:
        source = model_kwargs.get("inputs_embeds")
    if source is None:
        source = model._prepare_model_inputs(None, gen_config.bos_token_id, dict(model_kwargs))[0]
    if source.shape[0] == 0:
        raise ValueError("generate() got an empty batch (batch size 0); pass at least one input")
    if source.shape[1] == 0:
        raise ValueError("generate() got zero-length inputs; each input needs at least one token")
    mask = model_kwargs.get("attention_mask")
    _check_devices(model, source, mask)
    if mask is None:
        return source, [source.shape[1]] * source.shape[0], None
    lens, reason = mask_rows(mask)
    if reason == EMPTY_ROW:  # HF's decoder attends over every encoder position of such a row
        return None, None, reason
    return source, lens, None  # (a hole: the encoder forward runs HF's, the decoder stays paged)


def _paged_generate(runtime, model, original, inputs, generation_config, gen_config, model_kwargs, kwargs, devices,
                    source, source_lens):
    expand = max(gen_config.num_beams or 1, gen_config.num_return_sequences or 1)
    dec_ids = model_kwargs.get("decoder_input_ids")
    start_len = (dec_ids.shape[1] + 1) if dec_ids is not None else 1
    new = gen_config.max_new_tokens if gen_config.max_new_tokens is not None else gen_config.max_length
    if new is None:  # neither set: HF generates its default max_length (20) new tokens
        new = _default_max_length()
    # the last new token is returned, never fed back: the cache holds start_len + new - 1 tokens
    max_self_tokens = start_len + new - 1
    # a user's MaxLengthCriteria replaces HF's default one, and may allow more (total decoder length)
    for c in kwargs.get("stopping_criteria") or ():
        if isinstance(c, MaxLengthCriteria):
            max_self_tokens = max(max_self_tokens, c.max_length - 1)
    if model_kwargs.get("decoder_attention_mask") is not None:
        kwargs = {k: v for k, v in kwargs.items() if k != "decoder_attention_mask"}  # all ones: same as none
    with runtime.lock, _generation_stream(runtime, devices) as hand_over:
        runtime.owner, runtime.call_devices = threading.get_ident(), devices
        cache = None
        try:
            runtime.check_weights()
            pool = runtime.get_pool(model.decoder)
            needed = PagedEncoderDecoderCache.blocks_needed(source_lens, expand, max_self_tokens, pool.block_size)
            pool.reserve(needed)
            cache = PagedEncoderDecoderCache(pool, len(source_lens), expand, max_self_tokens)
            loop = _lean_loop(runtime, cache, gen_config, kwargs.get("streamer"))
            if loop is not None:
                kwargs = {**_stop_strings_as_criteria(kwargs, gen_config), "custom_generate": loop}
            with _encoder_outputs_per_source(model, expand):
                result = original(inputs, generation_config, **kwargs, **{runtime.cache_kwarg: cache})
            # an output that holds the cache gets HF's own, filled from the blocks released below
            result = hf_cache.replace_paged_cache(result, cache, model_kwargs.get("attention_mask"), source.shape[1])
            return hand_over(result)
        finally:
            runtime.owner = runtime.call_devices = None
            if cache is not None:
                cache.release()


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
    """Run a paged generate() on `graphs.generation_stream`, the stream its decode graphs are
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
    caller, side = torch.cuda.current_stream(device), generation_stream(device)
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


def _lean_loop(runtime: PagedRuntime, cache: PagedEncoderDecoderCache, gen_config, streamer):
    """A `custom_generate` callable (HF's `_sample` signature) running `loop.sample_loop` or
    `loop.beam_loop` on `cache`, or None where HF's own loop runs over the paged forward
    (`return_dict_in_generate`, `low_memory`).

    HF hands a custom callable only the keyword arguments `_sample` lacks, so the streamer
    comes through this closure. (synced_gpus never gets here: `modes` sends it to stock HF.)
    """
    mode = gen_config.get_generation_mode()
    if gen_config.return_dict_in_generate or gen_config.low_memory:
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
                return _decode(runtime, model, cache, ids)

        # the device-resident loops: every per-step number on the device (the model on one device)
        resident = None
        if _on_one_device(runtime.call_devices):
            if beams and beam_graph.supported(generation_config, logits_processor, stopping_criteria):
                resident = beam_graph.resident_beam_loop
            elif (not beams and streamer is None
                  and greedy_graph.supported(generation_config, logits_processor, stopping_criteria)):
                resident = greedy_graph.graph_greedy_loop
        if resident is not None:
            step_fn, use_graph = _decode_step(runtime, model, cache, input_ids.device, input_ids.shape[0])
            with torch.no_grad():
                return resident(runtime.graphs, step_fn, cache, prefill, input_ids, logits_processor,
                                stopping_criteria, generation_config, capture=use_graph)
        if beams and beam_graph.supported(generation_config, logits_processor, stopping_criteria):
            return beam_graph.graph_beam_loop(step, prefill, cache.reorder_cache, input_ids, logits_processor,
                                              stopping_criteria, generation_config, runtime.config.cuda_graphs)
        if beams:
            return beam_loop(model, step, prefill, cache.reorder_cache, input_ids, logits_processor,
                             stopping_criteria, generation_config)
        return sample_loop(step, prefill, input_ids, logits_processor, stopping_criteria, generation_config, streamer)

    return paged_loop


def _on_one_device(devices: frozenset) -> bool:
    return len(devices) == 1


def _one_cuda_device(devices: frozenset) -> bool:
    return len(devices) == 1 and next(iter(devices)).type == "cuda"


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
