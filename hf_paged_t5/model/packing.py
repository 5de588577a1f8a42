"""Projection groups laid out as row slices of one tensor, so each group runs as one GEMM.

An attention's q/k/v, a cross-attention's k/v and a gated feed-forward's wi_0/wi_1 read the same
input. With their weights side by side in one [sum(out_features), in_features] tensor, one GEMM
computes the whole group: one launch instead of two or three, and a wider GEMM that fills the
GPU better at a few hundred rows (T5 v1.1 XXL's encoder at 1 x 512, a batch-64 decode step).

`pack_model` moves each group's weights into one new tensor and points every Linear's weight at
its slice: the same Parameter objects with the same values, bit for bit, and the old tensors are
freed (memory does not grow; one group's worth is allocated at a time). `packed_weight` reads the
layout back from the weights' own pointers, so nothing is kept on the side: a `.to()`, `.half()`
or `load_state_dict(assign=True)` that gives a weight a tensor of its own simply ends that
group's packing (its GEMMs run one by one again) and frees the old buffer with the weights.
`unpack` gives every weight its own tensor again (`unpatch_model`).

What else sees the slices: `state_dict()` of a patched model gives each packed weight a tensor
of its own (`own_tensors`, called by the patched model's `state_dict`), so savers that refuse
or drop tensors sharing a storage (safetensors' `save_file`; accelerate's `save_model`, which
keeps one name per storage) see what they saw before packing; `torch.save(model)` stores the
slices of one storage; an optimizer's in-place update writes through them.

Only half-precision weights on a GPU are packed by default: a float32 model keeps HF's own
GEMMs, so its tokens stay HF's bit for bit, and a CPU model has no launches to save.
"""

from __future__ import annotations

from collections import Counter
import logging
from typing import Iterable, Optional, Sequence

import torch
from torch import nn

logger = logging.getLogger(__name__)

Group = tuple[nn.Linear, ...]
_HALF = (torch.float16, torch.bfloat16)


def unhooked(module: nn.Module) -> bool:
    """Whether calling `module` runs its class's forward and nothing else: no accelerate hook, no
    forward hook or pre-hook of its own or global (a user's, a quantizer's), no replaced forward."""
    return (
        not hasattr(module, "_hf_hook") and "forward" not in module.__dict__
        and not module._forward_hooks and not module._forward_pre_hooks
        and not nn.modules.module._global_forward_hooks and not nn.modules.module._global_forward_pre_hooks
    )


# The modules of a T5 stack the paged path calls as modules when they are hooked, so that their
# hooks run as in stock HF: projections (`plain_linear`), norms (`attention.plain_rms_norm`), the
# embedding, and the dropouts of a stack and of its sub-layers (a LoRA or quantized layer in one of
# those places runs its own forward, its inner modules included); in the encoder also the
# feed-forward module (`stacks._dense` calls it whenever anything in it is hooked). It calls none
# of the others: blocks, sub-layers, attention modules, the relative-position embeddings, the
# decoder's feed-forward modules (their own dropout and activation included: the fused decode
# layer runs neither), and the decoder stack itself.
_CALLED = frozenset({"q", "k", "v", "o", "wi", "wi_0", "wi_1", "wo", "layer_norm", "final_layer_norm",
                     "embed_tokens", "dropout"})
_CALLED_IN_ENCODER = _CALLED | {"DenseReluDense"}
_CALLED_IN_FEED_FORWARD = frozenset({"wi", "wi_0", "wi_1", "wo"})


class Registrations:
    """How many parameters and submodules any module of this process has registered: torch's
    global registration hooks (installed at the first `now()`) count them, so a watch
    (`encoder_graphs.WeightWatch`, `HookWatch`) knows in O(1) that no weight was replaced nor
    module swapped since it looked."""

    count = 0
    _installed = False

    @classmethod
    def now(cls) -> int:
        if not cls._installed:
            nn.modules.module.register_module_parameter_registration_hook(cls._bump)
            nn.modules.module.register_module_module_registration_hook(cls._bump)
            cls._installed = True
        return cls.count

    @classmethod
    def _bump(cls, *_args) -> None:
        cls.count += 1


def _uncalled(module: nn.Module, prefix: str, called: frozenset, found: list) -> None:
    for name, child in module.named_children():
        if name in called:
            continue
        qualified = f"{prefix}.{name}"
        found.append((qualified, child))
        _uncalled(child, qualified, _CALLED_IN_FEED_FORWARD if name == "DenseReluDense" else called, found)


def uncalled_modules(stack: nn.Module, name: str, decoder: bool) -> list[tuple[str, nn.Module]]:
    """(qualified name, module) of the modules of the T5 stack `stack` (named `name` in its model)
    that the paged path does not call as modules (`_CALLED`): a hook on one of them would not run
    there. A decoder stack counts itself (the paged path does not call its forward)."""
    found = [(name, stack)] if decoder else []
    _uncalled(stack, name, _CALLED if decoder else _CALLED_IN_ENCODER, found)
    return found


def hooked_among(modules: Sequence[tuple[str, nn.Module]]) -> Optional[str]:
    """The first of `modules` (`uncalled_modules`) with a hook, said in a few words, or None: a
    forward hook or pre-hook of its own or global, or a forward replaced by other code than
    accelerate's (whose device hooks the paged path does the work of)."""
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return "a global module forward hook (register_module_forward_hook)"
    for qualified, module in modules:
        if module._forward_hooks or module._forward_pre_hooks or (
                "forward" in module.__dict__ and not hasattr(module, "_hf_hook")):
            return f"a hook on {qualified} (a module the paged path does not call)"
    return None


class HookWatch:
    """`hooked_among` the `uncalled_modules` of some stacks, listed once and again only for other
    stacks or after a module or parameter was registered anywhere (`Registrations`): a check per
    call then reads each listed module's hook dicts and nothing else (~400 modules at 24 + 24 layers)."""

    def __init__(self) -> None:
        self._listed: Optional[tuple[tuple, list]] = None

    def hooked(self, stacks: Sequence[tuple[nn.Module, str, bool]]) -> Optional[str]:
        """stacks: (stack, its name in the model, whether it is a decoder) for `uncalled_modules`."""
        key = (Registrations.now(), tuple(id(stack) for stack, _, _ in stacks))
        if self._listed is None or self._listed[0] != key:
            self._listed = (key, [entry for args in stacks for entry in uncalled_modules(*args)])
        return hooked_among(self._listed[1])


def plain_linear(layer: nn.Module) -> bool:
    """A bias-free `nn.Linear` whose call is exactly `x @ weight.T`."""
    return type(layer) is nn.Linear and layer.bias is None and unhooked(layer)


def groups(model: nn.Module) -> list[Group]:
    """The projection groups of a T5-family model's full-attention layers: each self-attention's
    (q, k, v), each cross-attention's (k, v) (its q reads another input), each gated
    feed-forward's (wi_0, wi_1). LongT5's local attention and non-T5 layers are left alone."""
    found: list[Group] = []
    for stack_name in ("encoder", "decoder"):
        stack = getattr(model, stack_name, None)
        for block in getattr(stack, "block", ()):
            layers = block.layer
            attn = getattr(layers[0], "SelfAttention", None)
            if attn is not None and all(hasattr(attn, n) for n in ("q", "k", "v")):
                found.append((attn.q, attn.k, attn.v))
            cross = getattr(layers[1], "EncDecAttention", None) if len(layers) > 2 else None
            if cross is not None:
                found.append((cross.k, cross.v))
            dense = getattr(layers[-1], "DenseReluDense", None)
            if dense is not None and hasattr(dense, "wi_0") and hasattr(dense, "wi_1"):
                found.append((dense.wi_0, dense.wi_1))
    return found


def packed_weight(group: Sequence[nn.Module]) -> Optional[torch.Tensor]:
    """The group's weights as one [sum(out_features), in_features] tensor (a view, no copy) when
    they lie back to back in one storage and each layer is a plain Linear; else None.

    Also None while autograd would need the separate Parameters (grad enabled and a weight
    requiring it): a GEMM over the view would not reach them.
    """
    # (asked per group on eager steps: the cheap dtype test first, so fp32 and CPU models,
    # never packed, pay almost nothing)
    first = getattr(group[0], "weight", None)
    if not isinstance(first, torch.Tensor) or first.dtype not in _HALF or first.dim() != 2 \
            or first.device.type == "meta" or not all(map(plain_linear, group)):
        return None
    weights = [layer.weight for layer in group]
    if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
        return None
    cols = first.shape[1]
    ptr = first.data_ptr()
    for w in weights:
        if (w.data_ptr() != ptr or w.dtype != first.dtype or w.device != first.device or w.dim() != 2
                or w.shape[1] != cols or not w.is_contiguous()):
            return None
        ptr += w.numel() * w.element_size()
    if weights[-1].untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
        return None  # back to back by chance in two allocations
    return first.detach().as_strided((sum(w.shape[0] for w in weights), cols), (cols, 1))


def _packable(group: Group, shared: Counter, device_types: Iterable[str]) -> bool:
    """Plain Linears with distinct, unshared, contiguous half-precision weights of one width on
    one device of an allowed type (a weight tied to another Parameter by storage stays as it is)."""
    if not all(map(plain_linear, group)):
        return False
    weights = [layer.weight for layer in group]
    first = weights[0]
    return (
        first.dtype in _HALF and first.device.type in tuple(device_types)
        and all(w.dtype == first.dtype and w.device == first.device and w.dim() == 2 and w.is_contiguous()
                and w.shape[1] == first.shape[1] for w in weights)
        and all(shared[w.untyped_storage().data_ptr()] == 1 for w in weights)
    )


# A chain of decoder layers' cross-attention (k, v) groups shares one buffer up to this size, so
# the cross K/V store runs one GEMM for many layers (`packed_runs`); a larger model packs several
# chains (T5 v1.1 XXL: 64 MiB a layer, 4 layers a chain), and packing holds at most one chain's
# worth of extra memory at a time.
CROSS_CHAIN_BYTES = 256 << 20


def _chains(model: nn.Module) -> list[list[Group]]:
    """`groups(model)` in buffers to pack: consecutive decoder layers' cross (k, v) groups of one
    device, dtype and width together up to `CROSS_CHAIN_BYTES`, every other group alone."""
    decoder = getattr(model, "decoder", None)
    cross = {id(block.layer[1].EncDecAttention.k) for block in getattr(decoder, "block", ())
             if len(block.layer) > 2 and hasattr(block.layer[1], "EncDecAttention")}
    chains: list[list[Group]] = []
    chain: list[Group] = []  # the open chain of cross groups (the layers' other groups lie between)
    size = 0
    for group in groups(model):
        weights = [getattr(layer, "weight", None) for layer in group]
        if id(group[0]) not in cross or not all(isinstance(w, torch.Tensor) for w in weights):
            chains.append([group])
            continue
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        before = chain[-1][0].weight if chain else None
        if (before is not None and size + nbytes <= CROSS_CHAIN_BYTES and before.dtype == weights[0].dtype
                and before.device == weights[0].device and before.shape[1:] == weights[0].shape[1:]):
            chain.append(group)
            size += nbytes
        else:
            chain, size = [group], nbytes
            chains.append(chain)
    return chains


def pack_model(model: nn.Module, device_types: Iterable[str] = ("cuda",)) -> list[Group]:
    """Lay out every packable group of `model` (`groups`) as slices of one tensor; returns the
    groups packed now (already packed groups are left as they are and not returned). Consecutive
    decoder layers' cross (k, v) groups share one tensor (`_chains`) where all of them pack."""
    shared = Counter(p.untyped_storage().data_ptr() for p in model.parameters())
    packed: list[Group] = []
    with torch.no_grad():
        for chain in _chains(model):
            todo = [g for g in chain if packed_weight(g) is None and _packable(g, shared, device_types)]
            buffers = [todo] if len(todo) == len(chain) else [[g] for g in todo]
            for buffer in buffers:
                if not _pack(buffer):
                    return packed
                packed.extend(buffer)
    return packed


def _pack(buffer: list[Group]) -> bool:
    """Move the weights of `buffer`'s groups into one new tensor, back to back; False (nothing
    moved) where the device has no room for it."""
    weights = [layer.weight for group in buffer for layer in group]
    try:
        whole = torch.empty((sum(w.shape[0] for w in weights), weights[0].shape[1]),
                            dtype=weights[0].dtype, device=weights[0].device)
    except torch.cuda.OutOfMemoryError:
        # the weights move through one new buffer; a GPU too full for it keeps the rest as they
        # are (separate GEMMs, the same results)
        logger.info("hf_paged_t5: projection weights left unpacked: no room on %s for a "
                    "%d-weight group", weights[0].device, len(weights))
        return False
    start = 0
    for layer, w in ((layer, layer.weight) for group in buffer for layer in group):
        rows = w.shape[0]
        whole[start:start + rows].copy_(w)
        layer.weight.data = whole[start:start + rows]
        start += rows
    return True


def packed_runs(found: Sequence[Group]) -> list[tuple[int, int, Optional[torch.Tensor]]]:
    """`found` (groups in order) as runs (start, stop, weight): consecutive groups whose weights
    lie back to back in one tensor, `weight` their [sum(out_features), in_features] view
    (`packed_weight` of all their layers), or a group alone with weight None where it is not
    packed with the next."""
    runs: list[tuple[int, int, Optional[torch.Tensor]]] = []
    i = 0
    while i < len(found):
        j = i + 1
        while j < len(found) and _back_to_back(found[j - 1][-1], found[j][0]):
            j += 1
        weight = packed_weight(tuple(layer for group in found[i:j] for layer in group)) if j - i > 1 else None
        if weight is None:
            runs.extend((k, k + 1, None) for k in range(i, j))
        else:
            runs.append((i, j, weight))
        i = j
    return runs


def _back_to_back(a: nn.Module, b: nn.Module) -> bool:
    wa, wb = getattr(a, "weight", None), getattr(b, "weight", None)
    return (isinstance(wa, torch.Tensor) and isinstance(wb, torch.Tensor) and wa.device.type != "meta"
            and wa.data_ptr() + wa.numel() * wa.element_size() == wb.data_ptr())


def unpack(packed: Iterable[Group]) -> None:
    """Give each weight of groups still packed its own tensor again (the values unchanged)."""
    with torch.no_grad():
        for group in packed:
            if not _still_sliced(group):
                continue
            for layer in group:
                layer.weight.data = layer.weight.data.clone()


def _still_sliced(group: Group) -> bool:
    """Whether the weights still share one storage (asked directly: `packed_weight` also wants
    plain, unhooked Linears, and a hook added since must not keep the group packed)."""
    storages = {layer.weight.untyped_storage().data_ptr() for layer in group if isinstance(layer, nn.Linear)}
    return len(storages) == 1 and len(group) > 1


def packed_names(model: nn.Module, packed: Iterable[Group]) -> list[str]:
    """The state_dict keys (no prefix) of the weights in `packed` groups of `model`."""
    names = {id(module): name for name, module in model.named_modules()}
    return [f"{names[id(layer)]}.weight" for group in packed for layer in group if id(layer) in names]


def own_tensors(state_dict: dict, keys: Iterable[str]) -> None:
    """Replace each of `keys` in `state_dict` that is a slice of a larger storage (a packed weight)
    by a copy of its own, in place (what `state_dict()` gave before packing)."""
    with torch.no_grad():
        for key in keys:
            tensor = state_dict.get(key)
            if isinstance(tensor, torch.Tensor) and not isinstance(tensor, nn.Parameter) and tensor.device.type != "meta" \
                    and tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
                state_dict[key] = tensor.clone()
