"""`pipeline("summarization" | "translation[_xx_to_yy]" | "text2text-generation")` on transformers 5.

transformers 5 removed these three pipelines. `register_pipelines()` puts them back into
transformers' own registry, with the behaviour of transformers 4: one record per input
(`[{"summary_text": ...}]`), a list of records per input when `num_return_sequences > 1`,
`return_tensors` / `return_text`, T5 task prefixes and generation defaults from
`model.config.task_specific_params`, and the v4 length warnings. The pipelines only call
`model.generate(...)`, so a model patched by `hf_paged_t5.patch_model` runs its paged generate.

`import hf_paged_t5` does not import this module: `pipeline_hook` calls `register_pipelines()` once
`transformers.pipelines` is imported.

Two hooks are needed besides `PIPELINE_REGISTRY.register_pipeline`, both undone by
`unregister_pipelines()`:
- transformers >= 5.2x lists these task names in `transformers.pipelines.REMOVED_TASKS` and
  raises before the registry is asked; our names are taken out of that dict.
- "translation_en_to_de" style names carry their languages, so no fixed registry key matches
  them; `PIPELINE_REGISTRY.check_task` is wrapped (on the instance) to send them to "translation".
"""

import logging
import re
import warnings
from types import MappingProxyType

import torch
import transformers.pipelines as hf_pipelines
from transformers import AutoModelForSeq2SeqLM, Pipeline

from . import pipeline_hook

logger = logging.getLogger(__name__)

# "translation_en_to_de" -> ("en", "de"); language codes hold no underscore, as in transformers 4.
_TRANSLATION_TASK = re.compile(r"translation_([^_]+)_to_([^_]+)")
# What `pipeline(task)` loads when no model is given (as transformers 4 did, from the Hub).
_DEFAULT_MODEL = MappingProxyType({"model": ("google-t5/t5-small", "main")})
# The two forms, (in new tokens, in tokens), of the minimum and of the maximum output length.
_MIN_LENGTH = ("min_new_tokens", "min_length")
_MAX_LENGTH = ("max_new_tokens", "max_length")


def _new_tokens(kwargs: dict, names: tuple[str, str]) -> int | None:
    """The limit that `names` (`_MIN_LENGTH` or `_MAX_LENGTH`) set in `kwargs`, in new tokens; None if unset."""
    new_tokens_name, length_name = names
    if kwargs.get(new_tokens_name) is not None:
        return kwargs[new_tokens_name]
    if kwargs.get(length_name) is not None:
        return kwargs[length_name] - 1  # an encoder-decoder's length counts the decoder start token
    return None


def _without_overridden_lengths(defaults: dict, given: dict) -> dict:
    """A copy of `defaults` without the length limits that `given`, which takes priority, replaces or contradicts.

    A limit of a kind `given` sets (a minimum or a maximum, in tokens or in new tokens) goes, and so
    does a minimum above `given`'s maximum or a maximum below `given`'s minimum. Kept, generate()
    would pick one of two maxima and warn, or warn that the minimum cannot be reached, about
    lengths the user never asked for.
    """
    kept = dict(defaults)
    for names in (_MIN_LENGTH, _MAX_LENGTH):
        if _new_tokens(given, names) is not None:
            for name in names:
                kept.pop(name, None)
    given_min, given_max = _new_tokens(given, _MIN_LENGTH), _new_tokens(given, _MAX_LENGTH)
    kept_min, kept_max = _new_tokens(kept, _MIN_LENGTH), _new_tokens(kept, _MAX_LENGTH)
    contradicted = []
    if given_max is not None and kept_min is not None and kept_min > given_max:
        contradicted += _MIN_LENGTH
    if given_min is not None and kept_max is not None and kept_max < given_min:
        contradicted += _MAX_LENGTH
    for name in contradicted:
        kept.pop(name, None)
    return kept


def _translation_languages(task: str) -> tuple[str, str] | None:
    """("en", "de") for "translation_en_to_de", None for any other task name."""
    match = _TRANSLATION_TASK.fullmatch(task or "")
    return match.groups() if match else None


class Text2TextGenerationPipeline(Pipeline):
    """Generate text from text with a seq2seq model: `pipe(text_or_texts, **generate_kwargs)`.

    Returns one list of records per input (a single input: that list). A record holds
    `"<return_name>_text"` when `return_text` (default) and `"<return_name>_token_ids"`, a
    `[out_len]` tensor, when `return_tensors`. A list of inputs with one sequence each returns a
    flat list of records, as in transformers 4.

    Generation parameters, lowest priority first: the pipeline defaults below (only where the
    model's generation config leaves them unset), the task's `task_specific_params` entry, the
    kwargs given to `pipeline(...)`, the kwargs of the call. A length limit given by a higher
    source drops the lower sources' limits of the same kind (minimum or maximum, in tokens or new
    tokens) and those it contradicts (a task minimum above the user's maximum). A
    `generation_config` passed by the user is taken as complete: only explicit kwargs are added to it.
    """

    return_name = "generated"
    default_task = "text2text-generation"
    # transformers 4's defaults for this pipeline, used only where the model sets neither.
    generation_defaults = MappingProxyType({"max_new_tokens": 256, "num_beams": 4})

    # `pipeline()` reads these to decide what to load besides the model: a tokenizer only.
    _load_tokenizer = True
    _load_processor = False
    _load_image_processor = False
    _load_feature_extractor = False
    _load_video_processor = False
    # Generation parameters are handled here, not by Pipeline.__init__, whose handling differs
    # between transformers 5 releases (a GenerationConfig in 5.17, kwargs in 5.24).
    _pipeline_calls_generate = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # Resolved once: for plain "translation" this picks (and warns about) a language pair.
        self._default_task_key = self._task_key()

    def __call__(self, inputs, **kwargs):
        """Generate for `inputs` (a str, a list of str, a dataset or a generator of str).

        Besides `model.generate` kwargs: `return_text`, `return_tensors`,
        `clean_up_tokenization_spaces`, `truncation`, `stop_sequence`, `batch_size`.
        """
        result = super().__call__(inputs, **kwargs)
        if isinstance(inputs, list) and all(len(records) == 1 for records in result):
            return [records[0] for records in result]
        return result

    def _sanitize_parameters(
        self,
        return_tensors=None,
        return_text=None,
        clean_up_tokenization_spaces=None,
        truncation=None,
        stop_sequence=None,
        **generate_kwargs,
    ):
        """Split call kwargs into (preprocess, forward, postprocess) params; the rest go to generate."""
        preprocess_params = {} if truncation is None else {"truncation": truncation}
        postprocess_params = {}
        if return_tensors is not None:
            postprocess_params["return_tensors"] = return_tensors
            # As in transformers 4, asking for tensors alone returns tensors instead of text.
            postprocess_params["return_text"] = not return_tensors if return_text is None else return_text
        elif return_text is not None:
            postprocess_params["return_text"] = return_text
        if clean_up_tokenization_spaces is not None:
            postprocess_params["clean_up_tokenization_spaces"] = clean_up_tokenization_spaces
        if stop_sequence is not None:
            generate_kwargs["eos_token_id"] = self._stop_token_id(stop_sequence)
        return preprocess_params, generate_kwargs, postprocess_params

    def _stop_token_id(self, stop_sequence: str) -> int:
        """The first token of `stop_sequence`: generate stops on single tokens, as in transformers 4."""
        ids = self.tokenizer.encode(stop_sequence, add_special_tokens=False)
        if len(ids) > 1:
            warnings.warn(
                "Stopping on a multiple token sequence is not yet supported on transformers. The first token"
                " of the stop sequence will be used as the stop sequence string in the interim."
            )
        return ids[0]

    def _task_key(self, src_lang: str | None = None, tgt_lang: str | None = None) -> str:
        """The key of `model.config.task_specific_params` that applies (overridden for translation)."""
        return self.task or self.default_task

    def _task_params(self, task_key: str | None) -> dict:
        """A copy of the `task_specific_params` entry for `task_key` (its "prefix" included), or {}."""
        all_params = getattr(self.model.config, "task_specific_params", None) or {}
        return dict(all_params.get(task_key or self._default_task_key) or {})

    def preprocess(self, inputs: str, truncation=False, task_key: str | None = None):
        """Tokenize `prefix + inputs` -> {"input_ids": [1, seq_len], "attention_mask": [1, seq_len]}."""
        if not isinstance(inputs, str):
            name = type(self).__name__
            raise TypeError(f"{name} takes a str or a list of str, got {type(inputs).__name__}")
        prefix = self._task_params(task_key).get("prefix")
        if prefix is None:
            prefix = getattr(self.model.config, "prefix", None) or ""
        model_inputs = self.tokenizer(prefix + inputs, truncation=truncation, return_tensors="pt")
        # Some tokenizers produce it; generate() of seq2seq models does not accept it.
        model_inputs.pop("token_type_ids", None)
        return model_inputs

    def _generate_kwargs(self, task_key: str | None, call_kwargs: dict) -> dict:
        """The kwargs for `model.generate`: call > task params > pipeline defaults (see class docstring)."""
        if "generation_config" in call_kwargs:
            return dict(call_kwargs)
        task_params = self._task_params(task_key)
        task_params.pop("prefix", None)
        kwargs = {**_without_overridden_lengths(task_params, call_kwargs), **call_kwargs}
        model_set = self.model.generation_config.to_diff_dict()
        defaults = dict(self.generation_defaults)
        if self.model.generation_config.pad_token_id is None and self.tokenizer.pad_token_id is not None:
            defaults["pad_token_id"] = self.tokenizer.pad_token_id
        # A default max_new_tokens would override a max_length set by the task, the user or the model.
        defaults = _without_overridden_lengths(defaults, {**model_set, **kwargs})
        kwargs.update({k: v for k, v in defaults.items() if k not in kwargs and k not in model_set})
        return kwargs

    def _length_limits(self, generate_kwargs: dict) -> tuple[tuple[str, int], tuple[str, int]]:
        """((name, value) of the min length, (name, value) of the max length) generate will use."""
        config = generate_kwargs.get("generation_config") or self.model.generation_config

        def limit(new_tokens_name, length_name):
            for name in (new_tokens_name, length_name):
                value = generate_kwargs.get(name, getattr(config, name, None))
                if value is not None:
                    return name, value
            return length_name, 0

        return limit("min_new_tokens", "min_length"), limit("max_new_tokens", "max_length")

    def check_inputs(self, input_length: int, min_limit: tuple[str, int], max_limit: tuple[str, int]) -> None:
        """Warn about lengths that defeat the task (nothing to check for plain text2text)."""

    def _forward(self, model_inputs, task_key: str | None = None, **generate_kwargs):
        """Run `model.generate` -> {"output_ids": [batch, num_return_sequences, out_len]}."""
        batch_size, input_length = model_inputs["input_ids"].shape  # [batch, seq_len]
        generate_kwargs = self._generate_kwargs(task_key, generate_kwargs)
        self.check_inputs(input_length, *self._length_limits(generate_kwargs))
        output = self.model.generate(**model_inputs, **generate_kwargs)
        # return_dict_in_generate=True gives a ModelOutput; the records only need the sequences.
        output_ids = output if torch.is_tensor(output) else output.sequences  # [batch * n, out_len]
        return {"output_ids": output_ids.reshape(batch_size, -1, output_ids.shape[-1])}

    def postprocess(
        self, model_outputs, return_tensors=False, return_text=True, clean_up_tokenization_spaces=False
    ):
        """One record per returned sequence of the (single) input in `model_outputs`."""
        records = []
        for output_ids in model_outputs["output_ids"][0]:  # [num_return_sequences, out_len]
            record = {}
            if return_tensors:
                record[f"{self.return_name}_token_ids"] = output_ids
            if return_text:
                record[f"{self.return_name}_text"] = self.tokenizer.decode(
                    output_ids,
                    skip_special_tokens=True,
                    clean_up_tokenization_spaces=clean_up_tokenization_spaces,
                )
            records.append(record)
        return records


class SummarizationPipeline(Text2TextGenerationPipeline):
    """Summarize documents: records hold `summary_text` / `summary_token_ids`.

    With a T5 config, inputs get the "summarize: " prefix and the summarization generation defaults.
    """

    return_name = "summary"
    default_task = "summarization"

    def check_inputs(self, input_length: int, min_limit: tuple[str, int], max_limit: tuple[str, int]) -> None:
        """Warn, as transformers 4 did, when the output may be as long as the input or longer."""
        (min_name, min_length), (max_name, max_length) = min_limit, max_limit
        if max_length < min_length:
            logger.warning(
                f"Your {min_name}={min_length} must be inferior than your {max_name}={max_length}."
            )
        if input_length < max_length:
            logger.warning(
                f"Your {max_name} is set to {max_length}, but your input_length is only {input_length}."
                " Since this is a summarization task, where outputs shorter than the input are typically"
                f" wanted, you might consider decreasing {max_name} manually, e.g. summarizer('...',"
                f" {max_name}={input_length // 2})"
            )


class TranslationPipeline(Text2TextGenerationPipeline):
    """Translate texts: records hold `translation_text` / `translation_token_ids`.

    The languages come from the task name ("translation_en_to_de") or from `src_lang` / `tgt_lang`
    and pick the `task_specific_params` entry "translation_<src>_to_<tgt>" (prefix and generation
    defaults, e.g. "translate English to German: "). Plain "translation" without languages uses
    the model's first translation entry, as transformers 4 did.
    """

    return_name = "translation"
    default_task = "translation"

    def _sanitize_parameters(self, src_lang=None, tgt_lang=None, **kwargs):
        """As the parent, plus `src_lang` / `tgt_lang`, which choose the task entry for this call."""
        preprocess_params, forward_params, postprocess_params = super()._sanitize_parameters(**kwargs)
        if src_lang is not None or tgt_lang is not None:
            task_key = self._task_key(src_lang, tgt_lang)
            preprocess_params["task_key"] = forward_params["task_key"] = task_key
        return preprocess_params, forward_params, postprocess_params

    def _task_key(self, src_lang: str | None = None, tgt_lang: str | None = None) -> str:
        """"translation_<src>_to_<tgt>", languages from the arguments first, then from the task name."""
        task_src, task_tgt = _translation_languages(self.task) or (None, None)
        src_lang, tgt_lang = src_lang or task_src, tgt_lang or task_tgt
        if src_lang and tgt_lang:
            return f"translation_{src_lang}_to_{tgt_lang}"
        known = getattr(self.model.config, "task_specific_params", None) or {}
        first = next((key for key in known if _translation_languages(key)), None)
        if first is not None:
            logger.warning(
                f'"translation" task was used, instead of "translation_XX_to_YY", defaulting to "{first}"'
            )
            return first
        return "translation"

    def check_inputs(self, input_length: int, min_limit: tuple[str, int], max_limit: tuple[str, int]) -> None:
        """Warn, as transformers 4 did, when the output limit leaves little room over the input length."""
        max_name, max_length = max_limit
        if input_length > 0.9 * max_length:
            logger.warning(
                f"Your input_length: {input_length} is bigger than 0.9 * {max_name}: {max_length}. You might"
                f" consider increasing your {max_name} manually, e.g. translator('...', {max_name}=400)"
            )


# task name -> pipeline class
PIPELINE_CLASSES = MappingProxyType(
    {
        "text2text-generation": Text2TextGenerationPipeline,
        "summarization": SummarizationPipeline,
        "translation": TranslationPipeline,
    }
)


class _TaskCheckHook:
    """Stands in for `PIPELINE_REGISTRY.check_task` (an instance attribute) while registered.

    Sends "translation_xx_to_yy" to the "translation" entry and keeps what `unregister_pipelines`
    needs to restore: the original bound method and the `REMOVED_TASKS` entries taken out.
    """

    def __init__(self, registry, removed_entries: dict):
        self.registry = registry
        self.original_check_task = registry.check_task
        self.removed_entries = removed_entries

    def __call__(self, task: str):
        """(normalized task, registry entry, options) as `PipelineRegistry.check_task` returns them."""
        known = task in self.registry.supported_tasks or task in self.registry.task_aliases
        if not known and _translation_languages(task):
            # No options: they would select a per-language default model, which we do not list.
            return "translation", self.registry.supported_tasks["translation"], None
        return self.original_check_task(task)


def _installed_hook() -> _TaskCheckHook | None:
    """The hook if `register_pipelines` is in effect, else None."""
    hook = vars(hf_pipelines.PIPELINE_REGISTRY).get("check_task")
    return hook if isinstance(hook, _TaskCheckHook) else None


def register_pipelines() -> None:
    """Make `transformers.pipeline()` accept our task names. Idempotent; undone by `unregister_pipelines`."""
    if _installed_hook() is not None:
        return
    registry = hf_pipelines.PIPELINE_REGISTRY
    for task, pipeline_class in PIPELINE_CLASSES.items():
        registry.register_pipeline(
            task,
            pipeline_class=pipeline_class,
            pt_model=AutoModelForSeq2SeqLM,
            default=dict(_DEFAULT_MODEL),
            type="text",
        )
        # register_pipeline marks the class as Hub custom code: Pipeline.save_pretrained would then
        # write it into the checkpoint, and loading that checkpoint would demand trust_remote_code.
        if "_registered_impl" in vars(pipeline_class):
            del pipeline_class._registered_impl
    removed_tasks = getattr(hf_pipelines, "REMOVED_TASKS", {})
    removed_entries = {task: removed_tasks.pop(task) for task in PIPELINE_CLASSES if task in removed_tasks}
    registry.check_task = _TaskCheckHook(registry, removed_entries)
    logger.debug("registered pipelines %s", list(PIPELINE_CLASSES))


def unregister_pipelines() -> None:
    """Restore transformers' registry as it was before `register_pipelines`. No-op if not registered.

    Also cancels the registration `import hf_paged_t5` leaves pending (`pipeline_hook`).
    """
    pipeline_hook.remove()
    hook = _installed_hook()
    if hook is None:
        return
    registry = hf_pipelines.PIPELINE_REGISTRY
    del registry.check_task
    for task, pipeline_class in PIPELINE_CLASSES.items():
        if registry.supported_tasks.get(task, {}).get("impl") is pipeline_class:
            del registry.supported_tasks[task]
    if hook.removed_entries:
        hf_pipelines.REMOVED_TASKS.update(hook.removed_entries)
