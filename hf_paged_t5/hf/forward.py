"""The patched forwards: the encoder stack's (paged for plain inference calls) and the model's,
which serves HF's own decoding loop over a `PagedEncoderDecoderCache` (`return_dict_in_generate`,
`low_memory`) and a caller's manual steps. Wrapped signatures are the originals' (`like`).
"""

from __future__ import annotations

import functools
import inspect
import logging

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutputWithPastAndCrossAttentions, Seq2SeqLMOutput

from ..model import longt5
from ..model import bias as bias_mod
from ..model.bias import is_local, self_attention
from ..model.encoder_graphs import MAX_GRAPH_TOKENS
from ..model.stacks import encoder_forward, mask_layout, pack_tokens, store_cross, weight_devices
from .cache import PagedEncoderDecoderCache
from .policy import MASK_SHAPE, autocast_reason, cpu_stock_reason
from .runtime import PagedRuntime

logger = logging.getLogger("hf_paged_t5.hf.patch")


def like(original, fn):
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
    if runtime.runner.owned_here() and not torch.is_grad_enabled():
        return True  # inside this thread's paged generate(), which checked the weights' devices
    if torch.is_grad_enabled() and any(p.requires_grad for p in module.parameters()):
        return False  # the kernels have no backward: keep autograd on stock HF
    return all(p.device.type != "meta" for p in module.parameters())


_ENCODER_KWARGS = frozenset({"output_attentions", "output_hidden_states", "use_cache"})
# Devices whose encoder calls replay graphs (tests add "cpu" with a stand-in for the capture)
GRAPH_DEVICE_TYPES = ("cuda",)


def _graph_key(runtime: PagedRuntime, stack: nn.Module, input_ids, inputs_embeds, kwargs: dict, layout=None):
    """The encoder-graph key of a call that may run as a captured graph (`model/encoder_graphs.py`),
    else None: a call without gradients or hooks' outputs (a call of its own, or generate()'s: at
    small batches its encoder is launch-bound, ~12 ms of host launches for ~2 ms of GPU work at
    t5-large x 512 tokens), one CUDA input of at most `MAX_GRAPH_TOKENS` tokens, CUDA graphs on,
    T5's full attention. A padded call's key holds its mask (`layout`: each row's first real
    position and length, which `mask_layout` read back for its checks; the mask has no hole), and
    its graph packs exactly those positions; an all-ones mask is dropped before this."""
    if (input_ids is None) == (inputs_embeds is None) or not runtime.config.cuda_graphs:
        return None
    source = input_ids if inputs_embeds is None else inputs_embeds
    if (source.device.type not in GRAPH_DEVICE_TYPES or source.shape[0] * source.shape[1] > MAX_GRAPH_TOKENS or stack.training
            or torch.is_grad_enabled() or set(kwargs) - _ENCODER_KWARGS
            or any(_output_flags(stack, kwargs)) or is_local(self_attention(stack.block[0].layer[0]))):
        return None
    return tuple(source.shape), source.dtype, source.device, inputs_embeds is not None, layout


def _gathered_tables(runtime: PagedRuntime, stack: nn.Module):
    """For a capture: a function that gives the encoder's per-layer bias tables gathered from its
    weights (inside a graph: a replay sees in-place writes to them with no check) and a fresh band
    memo per table, made for that capture; checked once here against the tables HF's
    `compute_bias` gives; None (logged once) if they differ. Where each layer has a table of its
    own (UMT5), they are the rows of one stacked lookup, and their memos share a group: the first
    layer's prefill builds every layer's band tiles in one launch (a few launches per forward for
    all the tables, not four per layer)."""
    modules = bias_mod.layer_bias_modules(stack)
    distinct = {id(m): m for m in modules}
    buckets = {key: bias_mod.bidirectional_buckets(m) for key, m in distinct.items()}
    cached = dict(zip((id(m) for m in modules), runtime.bias_tables(stack, causal=False)))
    stacked = _stackable(list(distinct.values()), list(buckets.values()))

    def gathered():
        with torch.inference_mode(False):  # tables with a version counter: the prefill keeps its tiles in the memo
            if stacked:  # a table per layer (UMT5): all of them and their band tiles in a few launches
                rows = bias_mod.stacked_gathered_tables(list(distinct.values()), next(iter(buckets.values())))
                group = {"stacked": rows}
                tables = {key: rows[i] for i, key in enumerate(distinct)}
                memos = {key: {"capture_scoped": True, "group": group, "row": i} for i, key in enumerate(distinct)}
            else:
                tables = {key: bias_mod.gathered_table(m, buckets[key]) for key, m in distinct.items()}
                memos = {key: {"capture_scoped": True} for key in distinct}
        return [tables[id(m)] for m in modules], [memos[id(m)] for m in modules]

    with torch.no_grad():
        tables = dict(zip((id(m) for m in modules), gathered()[0]))
    if not all(torch.equal(tables[key], cached[key]) for key in distinct):
        reason = "the encoder's bias tables looked up from its weights differ from HF's compute_bias"
        if reason not in runtime.warned:
            runtime.warned.add(reason)
            logger.warning("hf_paged_t5: encoder calls run eagerly, not as CUDA graphs: %s", reason)
        return None
    return gathered


def _stackable(attentions: list, buckets: list) -> bool:
    """Whether the bias embeddings of `attentions` (more than one) can be looked up as one stacked
    tensor (`bias.stacked_gathered_tables`): one shape, dtype and device, the same buckets."""
    if len(attentions) < 2:
        return False
    weights = [a.relative_attention_bias.weight for a in attentions]
    first = weights[0]
    return (all(w.shape == first.shape and w.dtype == first.dtype and w.device == first.device for w in weights)
            and all(torch.equal(b, buckets[0]) for b in buckets))


def _graph_forward(runtime: PagedRuntime, stack: nn.Module, embeds: bool, mask=None, device=None):
    """`source -> last_hidden_state` for a capture (bias tables: `_gathered_tables`); None where
    those differ from HF's. With a padded call's `mask`, its packing (which positions are real) is
    made once here and read by every replay."""
    gathered = _gathered_tables(runtime, stack)
    if gathered is None:
        return None
    packing = None if mask is None else pack_tokens(mask, device)

    def forward(src):
        tables, memos = gathered()
        return encoder_forward(stack, runtime.ops_for, tables, src if embeds else None, None,
                               input_ids=None if embeds else src, band_memos=memos, packing=packing)

    return forward


def bucket_forward(runtime: PagedRuntime, stack: nn.Module, length: int):
    """`src -> packed last_hidden_state [length, d_model]` for a capture that serves every input of
    up to `length` tokens (the batch engine's encoder graphs, `batch/run.py`): src is int64
    [length + 3], the input's ids right-padded to `length`, then cu_seqlens [0, n, length]: the
    input is one packed sequence and its padding another, so every row of the output is defined
    and the first n rows are the input's. None where the bias tables differ from HF's (T5's full
    attention only: LongT5's local attention plans from host lengths)."""
    gathered = _gathered_tables(runtime, stack)
    if gathered is None:
        return None

    def forward(src):
        tables, memos = gathered()
        cu_seqlens = src[length:].to(torch.int32)
        return encoder_forward(stack, runtime.ops_for, tables, None, None, input_ids=src[:length].view(1, length),
                               packed=True, band_memos=memos, packing=(None, [length], cu_seqlens, length))

    return forward


def make_encoder_forward(runtime: PagedRuntime, original):
    def forward(self, input_ids=None, attention_mask=None, inputs_embeds=None, return_dict=None, **kwargs):
        # a padded call's key needs its mask read back: that one is looked up after the mask's checks
        key = None if attention_mask is not None else _graph_key(runtime, self, input_ids, inputs_embeds, kwargs)
        source = input_ids if inputs_embeds is None else inputs_embeds
        hidden = None if key is None else runtime.encoder_graphs.replay(key, self, source)
        if hidden is None:
            hidden = paged(self, input_ids, attention_mask, inputs_embeds, return_dict, kwargs)
            if not isinstance(hidden, torch.Tensor):
                return hidden  # stock HF's own output
        # the class T5's stacks return (a caller that compiles generate() sees one type either way)
        out = BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=hidden)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        return out if return_dict is not False else (hidden,)

    def paged(self, input_ids, attention_mask, inputs_embeds, return_dict, kwargs):
        """The last_hidden_state of a call the replay did not serve (eager, or captured now), or
        stock HF's whole output for a call the paged path does not serve."""
        unknown = set(kwargs) - _ENCODER_KWARGS
        stock = unknown or not _paged_allowed(runtime, self, kwargs)
        lens = None
        attention = self_attention(self.block[0].layer[0])
        # (inside a paged generate(), that call checked its hooks and autocast)
        inside = runtime.runner.owned_here()
        hooked = None if stock or inside else runtime.encoder_hook_watch.hooked([(self, "encoder", False)])
        if hooked is not None:
            runtime.warn_once(f"{hooked} is served by stock HF", "the encoder")
            stock = True
        autocast = None if stock or inside else autocast_reason([next(self.parameters()).device])
        if autocast is not None:
            runtime.warn_once(autocast, "the encoder")
            stock = True
        given = input_ids if input_ids is not None else inputs_embeds
        if not stock and attention_mask is not None and given is not None \
                and tuple(attention_mask.shape) != tuple(given.shape[:2]):
            runtime.warn_once(MASK_SHAPE, "the encoder")  # (stock HF raises where it does not broadcast)
            stock = True
        if not stock and is_local(attention):
            reason = longt5.unserved_reason(self, attention_mask)
            if reason is not None:
                runtime.warn_once(reason, "the encoder")
                stock = True
        if not stock and attention_mask is not None:
            lens, firsts, reason = mask_layout(attention_mask, right_padded=longt5.is_transient_global(attention))
            if reason is not None:
                runtime.warn_once(reason, "the encoder")
                stock = True
        # (inside a paged generate(), that call decided; weights not on the CPU: the rule cannot apply)
        if not stock and runtime.config.backend == "auto" and next(self.parameters()).device.type == "cpu" \
                and not runtime.runner.owned_here():
            padded = lens is not None and min(lens) < attention_mask.shape[1]
            reason = cpu_stock_reason(runtime.config.backend, weight_devices(self), runtime.d_model,
                                      1, padded)
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
        if not runtime.runner.owned_here():  # a call of its own, not one inside generate()
            runtime.check_weights()
        if lens is not None and min(lens) == source.shape[1]:
            attention_mask = None  # every position real: the same forward without packing
        layout = None if attention_mask is None else (tuple(firsts), tuple(lens))
        key = _graph_key(runtime, self, input_ids, inputs_embeds, kwargs, layout)
        if key is not None:  # (an all-ones mask, and a padded call whose mask recurs, reach their graph here)
            hidden = runtime.encoder_graphs.serve(key, self, source, lambda src: _graph_forward(
                runtime, self, inputs_embeds is not None, attention_mask, src.device))
            if hidden is not None:
                return hidden
        tables, sides = runtime.bias_tables(self, causal=False), runtime.side_tables(self)
        # a cold process: this kind of call's kernels compiled at once first (no memos: no tiles kept)
        runtime.compile_ahead(source.device, ("encoder", attention_mask is None), lambda: encoder_forward(
            self, runtime.ops_for, tables, inputs_embeds, attention_mask, input_ids=input_ids, side_tables=sides))
        # given input_ids, only the real tokens are embedded (inside encoder_forward)
        return encoder_forward(self, runtime.ops_for, tables, inputs_embeds, attention_mask, input_ids=input_ids,
                               band_memos=runtime.band_memos(self), side_tables=sides)

    return like(original, forward)


def make_forward(runtime: PagedRuntime, original):
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
            if not cache.cross_stored:
                store_cross(self.decoder, runtime.ops_for, cache, enc_hidden, kwargs.get("attention_mask"))
            logits = runtime.runner.decode(self, cache, ids)
        return Seq2SeqLMOutput(logits=logits, **{key: cache})

    return like(original, forward)
