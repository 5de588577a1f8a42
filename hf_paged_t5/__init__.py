"""hf_paged_t5: a paged KV cache and Triton kernels under Hugging Face `generate()` for T5-family models.

    model = hf_paged_t5.patch_model(model)   # the only new line
"""

from .batching import BatchGenerator, BatchRequest, BatchResult
from .block_manager import BlockManager, PoolExhaustedError
from .cache import KVPool, PagedEncoderDecoderCache
from .config import PagedCacheConfig
from .patch import SUPPORTED_CLASSES, is_patched, patch_model, unpatch_model
from .pipelines import register_pipelines, unregister_pipelines

# The one import-time action, by design: transformers 5 removed the summarization /
# translation / text2text pipelines, and importing hf_paged_t5 brings them back.
register_pipelines()

__all__ = [
    "BatchGenerator",
    "BatchRequest",
    "BatchResult",
    "BlockManager",
    "KVPool",
    "PagedCacheConfig",
    "PagedEncoderDecoderCache",
    "PoolExhaustedError",
    "SUPPORTED_CLASSES",
    "is_patched",
    "patch_model",
    "register_pipelines",
    "unpatch_model",
    "unregister_pipelines",
]
__version__ = "0.1.0"
