"""What a model class does between its decoder and its lm_head, read from the class itself.

T5's `forward` multiplies the decoder's output by `d_model ** -0.5` before `lm_head` in some
classes and versions and not in others (transformers 5.17: `T5ForConditionalGeneration` reads
`config.scale_decoder_outputs`, `UMT5ForConditionalGeneration` reads `config.tie_word_embeddings`,
`MT5ForConditionalGeneration` never scales, while `MT5Config` forces `tie_word_embeddings=True`).
A config field is therefore no guide. `output_scale` calls the class's own `forward` once with a
stub decoder that returns ones, and reads what reaches `lm_head`: no layer runs, no weight is read.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput, BaseModelOutputWithPastAndCrossAttentions


class _Reached(Exception):
    """Raised by the lm_head pre-hook: the probe has what it needs, the forward stops there."""

    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__()
        self.hidden = hidden


def output_scale(model: nn.Module) -> Optional[float]:
    """The factor `type(model).forward` applies to the decoder's output before `lm_head`:
    None (none applied) or `model.model_dim ** -0.5`.

    Raises TypeError for a class that applies anything else (the paged decoder could not
    reproduce it) or whose forward does not reach `lm_head`.
    """
    d_model = model.config.d_model
    decoder = model.decoder
    param = next(decoder.parameters())
    device = param.device if param.device.type != "meta" else torch.device("cpu")
    ones = torch.ones(1, 1, d_model, dtype=torch.float32, device=device)

    def stub_decoder(*args, **kwargs):
        return BaseModelOutputWithPastAndCrossAttentions(last_hidden_state=ones)

    def reached(module, args):
        raise _Reached(args[0])

    had_forward = "forward" in decoder.__dict__
    saved_forward = decoder.__dict__.get("forward")
    decoder.forward = stub_decoder
    handle = model.lm_head.register_forward_pre_hook(reached)
    try:
        with torch.no_grad():
            type(model).forward(
                model,
                encoder_outputs=BaseModelOutput(last_hidden_state=torch.zeros(1, 1, d_model, device=device)),
                decoder_input_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
                use_cache=False,
                return_dict=True,
            )
    except _Reached as hit:
        seen = hit.hidden.detach().float().cpu()
    else:
        raise TypeError(f"{type(model).__name__}.forward does not call lm_head; it cannot be patched")
    finally:
        handle.remove()
        if had_forward:
            decoder.forward = saved_forward
        else:
            del decoder.forward
    factor = float(seen.reshape(-1)[0])
    if not torch.all(seen == factor):
        raise TypeError(f"{type(model).__name__}.forward transforms the decoder output elementwise; not supported")
    if factor == 1.0:
        return None
    scale = model.model_dim**-0.5
    if math.isclose(factor, scale, rel_tol=1e-6):
        return scale
    raise TypeError(
        f"{type(model).__name__}.forward scales the decoder output by {factor}, not by d_model ** -0.5; not supported"
    )
