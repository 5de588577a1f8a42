"""Kernel namespaces for routing tests: the reference backend, but saying yes to one kernel."""

from __future__ import annotations

from types import SimpleNamespace

from hf_paged_t5 import reference


def saying_yes_to(kernel: str, supports: str, calls: list) -> SimpleNamespace:
    """`hf_paged_t5.reference` with `supports` (the kernel's predicate) always true and `kernel`
    running the reference's twin, appending the shape of its first argument to `calls` at each call."""
    twin = getattr(reference, kernel)

    def counted(x, *args, **kwargs):
        calls.append(tuple(x.shape))
        return twin(x, *args, **kwargs)

    names = {name: getattr(reference, name) for name in dir(reference) if not name.startswith("_")}
    return SimpleNamespace(**{**names, kernel: counted, supports: lambda *_: True})
