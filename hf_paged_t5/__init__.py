"""hf_paged_t5: a paged KV cache and Triton kernels under Hugging Face `generate()` for T5-family models.

    model = hf_paged_t5.patch_model(model)   # the only new line

The names below are imported from their modules on first use: those modules load transformers'
model and generation code, which `import hf_paged_t5` alone does not need to pay for.
"""

import importlib
from types import MappingProxyType

from . import triton_start
from .hf import pipeline_hook

# public name -> the module that defines it
_EXPORTS = MappingProxyType({
    "BatchGenerator": "batch.generator",
    "BatchRequest": "batch.requests",
    "BatchResult": "batch.requests",
    "OnlineEngine": "batch.online",
    "BatchReplica": "batch.ray_data",
    "replica_compute": "batch.ray_data",
    "BlockManager": "kv.block_manager",
    "PoolExhaustedError": "kv.block_manager",
    "KVPool": "kv.pool",
    "PagedEncoderDecoderCache": "hf.cache",
    "PagedCacheConfig": "config",
    "SUPPORTED_CLASSES": "hf.patch",
    "is_patched": "hf.patch",
    "patch_model": "hf.patch",
    "unpatch_model": "hf.patch",
    "runtime_stats": "hf.patch",
    "register_pipelines": "hf.pipelines",
    "unregister_pipelines": "hf.pipelines",
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


# The import-time actions, by design: transformers 5 removed the summarization / translation /
# text2text pipelines, and importing hf_paged_t5 brings them back, as soon as transformers'
# pipelines module is imported (now, if it already is); and where torch is already imported and
# sees a GPU, Triton's one-time start-up begins on a thread (triton_start.py).
pipeline_hook.install()
triton_start.start()
