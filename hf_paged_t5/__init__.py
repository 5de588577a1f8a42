"""hf_paged_t5: a paged KV cache and Triton kernels under Hugging Face `generate()` for T5-family models.

    model = hf_paged_t5.patch_model(model)   # the only new line
"""

from .block_manager import BlockManager, PoolExhaustedError
from .cache import KVPool, PagedEncoderDecoderCache
from .config import PagedCacheConfig
from .patch import SUPPORTED_CLASSES, is_patched, patch_model, unpatch_model

__all__ = [
    "BlockManager",
    "KVPool",
    "PagedCacheConfig",
    "PagedEncoderDecoderCache",
    "PoolExhaustedError",
    "SUPPORTED_CLASSES",
    "is_patched",
    "patch_model",
    "unpatch_model",
]
__version__ = "0.1.0"
