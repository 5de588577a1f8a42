"""Offline demo and test assets: real T5 shapes, a locally trained tokenizer, random-weight models.

Nothing here touches the network. `build_tokenizer` trains a small BPE tokenizer on an embedded
English corpus; `build_model` builds a T5-family model with seeded random weights at a real or a
tiny shape; `save_demo_checkpoint` writes both to a directory that `AutoTokenizer` and
`AutoModelForSeq2SeqLM.from_pretrained` load offline.
"""

import logging
import os
import string
from collections.abc import Iterable, Mapping
from types import MappingProxyType

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    MT5Config,
    MT5ForConditionalGeneration,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    T5Config,
    T5ForConditionalGeneration,
    UMT5Config,
    UMT5ForConditionalGeneration,
)

logger = logging.getLogger(__name__)

PAD_TOKEN, EOS_TOKEN, UNK_TOKEN = "<pad>", "</s>", "<unk>"
# Order matters: the trainer gives special tokens the first ids, so pad=0, eos=1, unk=2 as in T5.
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN, UNK_TOKEN)
DEFAULT_VOCAB_SIZE = 512
# T5 checkpoints accept 512 tokens; keeping it makes `truncation=True` behave as with t5-small.
MODEL_MAX_LENGTH = 512
_ACCENTED = "äöüÄÖÜßàâçéèêëîïôûùÿœæÀÂÇÉÈÊÎÔÛ"


def _shape(d_model, d_ff, d_kv, num_heads, num_layers, feed_forward_proj, tie, vocab_size=32128):
    """One immutable set of T5 config kwargs (encoder and decoder have the same depth)."""
    return MappingProxyType(
        {
            "vocab_size": vocab_size,
            "d_model": d_model,
            "d_ff": d_ff,
            "d_kv": d_kv,
            "num_heads": num_heads,
            "num_layers": num_layers,
            "num_decoder_layers": num_layers,
            "feed_forward_proj": feed_forward_proj,
            "tie_word_embeddings": tie,
        }
    )


# Config kwargs by name, usable as `T5Config(**SHAPES["t5-small"])`.
SHAPES: Mapping[str, Mapping] = MappingProxyType(
    {
        "tiny": _shape(64, 128, 16, 4, 2, "relu", True, vocab_size=DEFAULT_VOCAB_SIZE),
        "t5-small": _shape(512, 2048, 64, 8, 6, "relu", True),
        "t5-base": _shape(768, 3072, 64, 12, 12, "relu", True),
        "t5-large": _shape(1024, 4096, 64, 16, 24, "relu", True),
        "flan-t5-xl": _shape(2048, 5120, 64, 32, 24, "gated-gelu", False),
    }
)

# T5 v1.1, mT5 and UMT5 checkpoints are all gated-gelu and say tie_word_embeddings=False.
_V1_1 = MappingProxyType({"feed_forward_proj": "gated-gelu", "tie_word_embeddings": False})
# family -> (config class, model class, config kwargs the family imposes on any shape)
_FAMILIES = MappingProxyType(
    {
        "t5": (T5Config, T5ForConditionalGeneration, MappingProxyType({})),
        "t5v1_1": (T5Config, T5ForConditionalGeneration, _V1_1),
        "mt5": (MT5Config, MT5ForConditionalGeneration, _V1_1),
        "umt5": (UMT5Config, UMT5ForConditionalGeneration, _V1_1),
    }
)
FAMILIES = tuple(_FAMILIES)

# The task prefixes and generation defaults that the original t5-small/base/large configs carry.
T5_TASK_SPECIFIC_PARAMS = MappingProxyType(
    {
        "summarization": {
            "early_stopping": True,
            "length_penalty": 2.0,
            "max_length": 200,
            "min_length": 30,
            "no_repeat_ngram_size": 3,
            "num_beams": 4,
            "prefix": "summarize: ",
        },
        "translation_en_to_de": {
            "early_stopping": True,
            "max_length": 300,
            "num_beams": 4,
            "prefix": "translate English to German: ",
        },
        "translation_en_to_fr": {
            "early_stopping": True,
            "max_length": 300,
            "num_beams": 4,
            "prefix": "translate English to French: ",
        },
        "translation_en_to_ro": {
            "early_stopping": True,
            "max_length": 300,
            "num_beams": 4,
            "prefix": "translate English to Romanian: ",
        },
    }
)

# HF's T5 init (factor 1.0) makes the decoder nearly blind to the input: greedy decoding repeats one
# token, the same for every input. A larger factor makes the output depend on the input...
INIT_FACTOR = 4.0
# ...but also makes the next-token distribution nearly one-hot (logit std grows as factor**2), so
# beam hypotheses tie on log-probabilities ~0. The decoder's last norm is rescaled to this logit std,
# which leaves the top token at ~45% on average: varied, yet no near-certain tokens.
LOGIT_STD = 4.0

CORPUS = (
    "The morning train to the coast was late again, so the office opened an hour after nine.",
    "A small bakery on the corner sells bread, cakes and coffee to people walking to work.",
    "The city council voted on Tuesday to build a new bridge across the river.",
    "Heavy rain is expected in the north tonight, and the roads may flood near the valley.",
    "Scientists measured the temperature of the lake every day for three years.",
    "The report says that most families spend more on housing than they did ten years ago.",
    "She wrote a short letter to her brother and posted it before the shop closed.",
    "The museum will stay open late on Friday so that students can visit after class.",
    "Our team fixed the bug in the parser and added a test that checks long inputs.",
    "Please translate this sentence into German before the meeting starts.",
    "The children planted tomatoes, beans and sunflowers in the school garden.",
    "A quiet road leads from the village through the forest to an old stone church.",
    "The company hired forty engineers and opened a second office in the spring.",
    "Summarize the article in two sentences and keep the names of the people in it.",
    "The doctor told him to drink more water, sleep longer and walk every evening.",
    "Prices of fruit and vegetables rose sharply after the dry summer.",
    "The library lends books, music and maps, and its reading room is free for everyone.",
    "Two cyclists crossed the mountain pass in the fog and reached the town at dusk.",
    "The new phone has a larger screen, a faster chip and a battery that lasts two days.",
    "Farmers in the region hope that the rain will come early this year.",
    "He forgot his umbrella on the bus, so he bought a new one at the station.",
    "The orchestra played a long symphony, and the audience stood up to applaud.",
    "Researchers found that the model translates short questions better than long stories.",
    "The hotel near the harbour has twelve rooms, a small garden and a view of the boats.",
    "Our neighbours painted their house blue and planted a cherry tree by the gate.",
    "The airport was closed for six hours because of strong winds and snow.",
    "Teachers asked for smaller classes and more time to prepare their lessons.",
    "The market opens at seven, and the best fish is sold before eight.",
    "A young fox ran across the field and disappeared into the tall grass.",
    "The minister said that the new law would make it easier to start a business.",
    "Write a summary of the meeting and send it to everyone who could not attend.",
    "The old clock in the hall stopped at midnight and nobody knew how to repair it.",
    "Tourists queued for hours to see the painting, which is smaller than they expected.",
    "The river is wide and slow here, and in summer people swim near the sandy bank.",
    "Engineers tested the engine for a week before the plane was allowed to fly.",
    "The recipe needs flour, butter, two eggs, sugar and a pinch of salt.",
    "After the storm, volunteers cleared the streets and helped to repair the roofs.",
    "The football match ended in a draw, and both teams will play again next month.",
    "My grandmother still writes her shopping list on the back of an envelope.",
    "Translate English to German: the weather is nice today and the sky is clear.",
    "The students read the text, answered the questions and discussed the answers.",
    "Electric buses will replace the old diesel ones on every line by next year.",
)


def build_tokenizer(
    texts: Iterable[str] | None = None, vocab_size: int = DEFAULT_VOCAB_SIZE
) -> PreTrainedTokenizerFast:
    """Train a T5-like tokenizer on `texts` (default: the embedded `CORPUS`).

    BPE over Metaspace pre-tokens ("▁word", as in T5's sentencepiece model), pad/eos/unk at ids
    0/1/2, `</s>` appended to every sequence. BPE rather than Unigram because the `tokenizers`
    Unigram trainer is not deterministic from run to run. The vocabulary always holds the special
    tokens and ~130 single characters (printable ASCII, common accented letters), so it is larger
    than a `vocab_size` below that; it is smaller when the texts are too short to fill it.
    """
    if vocab_size <= len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size must exceed the {len(SPECIAL_TOKENS)} special tokens, got {vocab_size}")
    tokenizer = Tokenizer(models.BPE(unk_token=UNK_TOKEN))
    # Like sentencepiece: every whitespace run becomes one space, none at the ends.
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Strip()]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tokenizer.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        # Every printable ASCII character and the common accented letters get an id, so unseen
        # English (or German, French) text rarely becomes <unk>.
        initial_alphabet=sorted(set(string.ascii_letters + string.digits + string.punctuation + _ACCENTED)),
        show_progress=False,
    )
    tokenizer.train_from_iterator(list(CORPUS if texts is None else texts), trainer)
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"$A {EOS_TOKEN}",
        pair=f"$A {EOS_TOKEN} $B {EOS_TOKEN}",
        special_tokens=[(EOS_TOKEN, eos_id)],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD_TOKEN,
        eos_token=EOS_TOKEN,
        unk_token=UNK_TOKEN,
        model_max_length=MODEL_MAX_LENGTH,
    )


def build_config(shape: str = "tiny", family: str = "t5", vocab_size: int | None = None, **config_overrides):
    """The config of a `family` model at `shape`; `config_overrides` are passed to the config class last.

    Family "t5" keeps the shape's activation and `tie_word_embeddings` and carries the original T5
    task prefixes; "t5v1_1", "mt5" and "umt5" are gated-gelu with `tie_word_embeddings=False`, as in
    their checkpoints' configs (transformers 5 reads that flag as "no decoder-output rescaling").
    """
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known shapes: {sorted(SHAPES)}")
    if family not in _FAMILIES:
        raise ValueError(f"unknown family {family!r}; known families: {list(_FAMILIES)}")
    config_class, _, family_kwargs = _FAMILIES[family]
    kwargs = {**SHAPES[shape], **family_kwargs}
    if vocab_size is not None:
        kwargs["vocab_size"] = vocab_size
    if family == "t5":
        kwargs["task_specific_params"] = {name: dict(p) for name, p in T5_TASK_SPECIFIC_PARAMS.items()}
    kwargs.update(
        decoder_start_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        pad_token_id=SPECIAL_TOKENS.index(PAD_TOKEN),
        eos_token_id=SPECIAL_TOKENS.index(EOS_TOKEN),
        initializer_factor=INIT_FACTOR,
    )
    kwargs.update(config_overrides)
    return config_class(**kwargs)


def build_model(
    shape: str = "tiny",
    family: str = "t5",
    vocab_size: int | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    **config_overrides,
) -> PreTrainedModel:
    """A `family` ("t5", "t5v1_1", "mt5", "umt5") seq2seq model at `shape`, random weights, eval mode.

    HF's init with `initializer_factor=INIT_FACTOR`, then the decoder's final norm scaled so the
    logits have std `LOGIT_STD` (see there why). The weights depend only on `seed` and the config;
    the caller's global RNG state is left as it was.
    `config_overrides` go to the config (e.g. `num_layers=1`, `task_specific_params=None`).
    """
    config = build_config(shape, family, vocab_size, **config_overrides)
    _, model_class, _ = _FAMILIES[family]
    devices = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        # Initialised directly on `device` in `dtype`: a t5-large in fp32 on the host is slow to build.
        with torch.device(device):
            model = model_class._from_config(config, dtype=dtype)
    model.eval()
    _calibrate_logits(model, LOGIT_STD)
    logger.info("built %s %s with %.1fM parameters", family, shape, model.num_parameters() / 1e6)
    return model


@torch.no_grad()
def _calibrate_logits(model: PreTrainedModel, logit_std: float) -> None:
    """Scale the decoder's final norm so that the logits of a fixed probe have std `logit_std`.

    The logits are linear in that norm's weight, whatever the family does between the norm and the
    lm_head (transformers versions differ on the d_model**-0.5 rescaling), so one probe suffices.
    """
    vocab_size = model.config.vocab_size
    input_ids = (torch.arange(24, device=model.device) % (vocab_size - 3) + 3).unsqueeze(0)  # [1, 24]
    decoder_input_ids = input_ids[:, :6].clone()  # [1, 6]
    decoder_input_ids[:, 0] = model.config.decoder_start_token_id
    logits = model(input_ids=input_ids, decoder_input_ids=decoder_input_ids).logits  # [1, 6, vocab_size]
    model.decoder.final_layer_norm.weight.mul_(logit_std / logits.float().std())


def save_demo_checkpoint(
    path: str | os.PathLike,
    shape: str = "tiny",
    family: str = "t5",
    vocab_size: int | None = None,
    seed: int = 0,
    **config_overrides,
) -> str:
    """Write a random-weight model and the local tokenizer to `path`; return `path` as a string.

    The directory loads offline with `AutoTokenizer.from_pretrained(path)` and
    `AutoModelForSeq2SeqLM.from_pretrained(path)`. At a real shape the model keeps the real
    vocabulary size (32128, for realistic lm_head cost) while the tokenizer has ~512 tokens:
    generated ids beyond the tokenizer's decode to nothing.
    """
    tokenizer = build_tokenizer(vocab_size=min(DEFAULT_VOCAB_SIZE, vocab_size or DEFAULT_VOCAB_SIZE))
    model = build_model(shape, family, vocab_size=vocab_size, seed=seed, **config_overrides)
    if len(tokenizer) > model.config.vocab_size:
        raise ValueError(f"the tokenizer has {len(tokenizer)} tokens, the model {model.config.vocab_size}")
    path = os.fspath(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def split_device_map(model: PreTrainedModel, first: str, second: str) -> dict[str, str]:
    """An accelerate device_map with the first half of the encoder's and of the decoder's layers on
    `first`, the rest on `second`; embeddings (tied to lm_head in T5) on `first`, each final norm
    with the last layer. For trying models split across devices without a real checkpoint's map."""
    device_map = {"shared": first, "lm_head": first}
    for stack_name in ("encoder", "decoder"):
        stack = getattr(model, stack_name)
        half = len(stack.block) // 2
        device_map[f"{stack_name}.embed_tokens"] = first
        for i in range(len(stack.block)):
            device_map[f"{stack_name}.block.{i}"] = first if i < half else second
        device_map[f"{stack_name}.final_layer_norm"] = second
        device_map[f"{stack_name}.dropout"] = second
    return device_map
