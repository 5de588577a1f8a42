"""Registers the pipelines when `transformers.pipelines` is imported, instead of when hf_paged_t5 is.

`register_pipelines` needs `transformers.pipelines`: its registry is made there, and the pipeline
classes subclass its `Pipeline`. That module takes seconds to import (it loads the processing
code of every pipeline), which a user who only patches `generate()` should not pay. So
`import hf_paged_t5` calls `install()`, which puts a `PipelineImportHook` first on
`sys.meta_path`. The hook wraps the loaders of `transformers.pipelines` and
`hf_paged_t5.hf.pipelines`; once both modules are loaded, however the user reached them
(`from transformers import pipeline`, `import transformers.pipelines`,
`from hf_paged_t5.hf.pipelines import SummarizationPipeline` ...), it calls `register_pipelines()`
and takes itself off `sys.meta_path`.
"""

from __future__ import annotations

import importlib
import importlib.abc
import logging
import sys

logger = logging.getLogger(__name__)

_TRANSFORMERS_PIPELINES = "transformers.pipelines"
_OUR_PIPELINES = f"{__package__}.pipelines"


class _RegisteringLoader(importlib.abc.Loader):
    """Runs the wrapped loader, then registers the pipelines if both modules are now loaded.

    Everything else (`get_source`, `is_package`, resource readers ...) is the wrapped loader's.
    """

    def __init__(self, loader: importlib.abc.Loader):
        self._loader = loader

    def __getattr__(self, name: str):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _register_if_loaded()


class PipelineImportHook(importlib.abc.MetaPathFinder):
    """A `sys.meta_path` finder that gives the two pipeline modules a `_RegisteringLoader`.

    It finds nothing itself: the spec comes from the finders after it on `sys.meta_path`.
    """

    def find_spec(self, fullname: str, path=None, target=None):
        if fullname not in (_TRANSFORMERS_PIPELINES, _OUR_PIPELINES):
            return None
        spec = _spec_from_other_finders(self, fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _RegisteringLoader(spec.loader)
        return spec


def _spec_from_other_finders(hook: PipelineImportHook, fullname: str, path, target):
    """The spec the first finder on `sys.meta_path` other than `hook` returns, or None."""
    for finder in list(sys.meta_path):
        if finder is hook or not hasattr(finder, "find_spec"):
            continue
        spec = finder.find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def _register_if_loaded() -> None:
    """Register the pipelines and remove the hook, if `transformers.pipelines` is loaded.

    Imports `hf_paged_t5.hf.pipelines` when only transformers' module is there. Does nothing while
    `hf_paged_t5.hf.pipelines` is itself being imported (it imports `transformers.pipelines` first):
    the end of its own import calls this again.
    """
    if _TRANSFORMERS_PIPELINES not in sys.modules:
        return
    ours = sys.modules.get(_OUR_PIPELINES) or importlib.import_module(_OUR_PIPELINES)
    if not hasattr(ours, "register_pipelines"):
        return
    remove()
    ours.register_pipelines()


def installed() -> bool:
    """Whether a hook is waiting on `sys.meta_path` for `transformers.pipelines`."""
    return any(isinstance(finder, PipelineImportHook) for finder in sys.meta_path)


def install() -> None:
    """Register the pipelines now if `transformers.pipelines` is loaded, else when it is. Idempotent."""
    if _TRANSFORMERS_PIPELINES in sys.modules:
        _register_if_loaded()
    elif not installed():
        sys.meta_path.insert(0, PipelineImportHook())
        logger.debug("pipelines will be registered when %s is imported", _TRANSFORMERS_PIPELINES)


def remove() -> None:
    """Take every `PipelineImportHook` off `sys.meta_path` (nothing is registered later)."""
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, PipelineImportHook)]
