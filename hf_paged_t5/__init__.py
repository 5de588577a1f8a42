"""hf_paged_t5: a paged KV cache and Triton kernels under Hugging Face `generate()` for T5-family models.

    model = hf_paged_t5.patch_model(model)   # the only new line

The names below are imported from their modules on first use: those modules load transformers'
model and generation code, which `import hf_paged_t5` alone does not need to pay for.
"""

import importlib
from types import MappingProxyType

from . import pipeline_hook

# public name -> the module that defines it
_EXPORTS = MappingProxyType({
    "BatchGenerator": "batching",
    "BatchRequest": "batching",
    "BatchResult": "batching",
    "BlockManager": "block_manager",
    "PoolExhaustedError": "block_manager",
    "KVPool": "cache",
    "PagedEncoderDecoderCache": "cache",
    "PagedCacheConfig": "config",
    "SUPPORTED_CLASSES": "patch",
    "is_patched": "patch",
    "patch_model": "patch",
    "unpatch_model": "patch",
    "register_pipelines": "pipelines",
    "unregister_pipelines": "pipelines",
})

__all__ = sorted(_EXPORTS)
__version__ = "0.1.0"


def __getattr__(name: str):
    """The public `name`, imported from its module (PEP 562; called only for names not yet bound)."""
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module_name}", __name__), name)
    globals()[name] = value  # bound once, so later lookups are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


# The one import-time action, by design: transformers 5 removed the summarization / translation /
# text2text pipelines, and importing hf_paged_t5 brings them back, as soon as transformers'
# pipelines module is imported (now, if it already is).
pipeline_hook.install()
