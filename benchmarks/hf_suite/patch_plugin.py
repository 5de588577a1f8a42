"""pytest plugin: run a test suite with every supported model patched by `hf_paged_t5.patch_model`.

    PYTHONPATH=benchmarks/hf_suite python3 -m pytest -p patch_plugin [--hf-paged-json PATH] tests/...

- Every model whose class is (or derives from) one of `hf_paged_t5.SUPPORTED_CLASSES` is patched at the
  end of its construction (`PreTrainedModel.post_init`, which `__init__` calls last, so models made by
  `from_pretrained` and `from_config` too). If `patch_model` raises, the error is recorded for the test
  and the model stays stock HF; the test goes on.
- Each `generate()` of a patched model is counted per test as *paged* (it built a
  `PagedEncoderDecoderCache`, which only the paged path does) or *fallback* (stock HF), with the reason
  hf_paged_t5 logged (logger "hf_paged_t5"; the runtime's once-per-reason memory is cleared before each
  call so that every fallback logs its reason), or as raising.
- Each call of a patched model's encoder (inside generate() or not) is counted as paged or stock: stock
  when the encoder stack's own class `forward` ran (wrapped for that purpose before the model is
  patched), with the logged reason, or else the state that decides it (training, autograd, output flags).
- At session end a JSON summary is written: per test its outcome, generate() counts, fallback reasons,
  patch errors and failure text; and totals.
"""

from __future__ import annotations

import collections
import functools
import inspect
import json
import logging
import types
from pathlib import Path

import pytest
import torch

FALLBACK_PREFIX = "hf_paged_t5: running this generate() on stock HF: "
ENCODER_PREFIX = "hf_paged_t5: running the encoder on stock HF: "
OUTSIDE = "<outside any test>"


class _TestRecord:
    def __init__(self):
        self.outcome = None
        self.failure = None
        self.patched = collections.Counter()  # class name -> models patched
        self.patch_errors = collections.Counter()  # "Class: Error: message"
        self.generate_calls = 0
        self.paged_calls = 0
        self.fallback_calls = 0
        self.fallback_reasons = collections.Counter()
        self.raised = collections.Counter()  # "paged|fallback: Error: message"
        self.encoder_calls = 0
        self.encoder_paged_calls = 0
        self.encoder_stock_reasons = collections.Counter()
        self.warnings = collections.Counter()  # other hf_paged_t5 warnings

    def as_dict(self):
        return {key: (dict(value) if isinstance(value, collections.Counter) else value)
                for key, value in vars(self).items()}


class _Recorder(logging.Handler):
    """Patches models as they are built and keeps the per-test records."""

    def __init__(self):
        super().__init__(level=logging.WARNING)
        self.records: dict[str, _TestRecord] = collections.defaultdict(_TestRecord)
        self.current = OUTSIDE
        self.caches_built = 0
        self.pending: list[str] = []  # hf_paged_t5 warnings logged during the running generate()
        self.stack_calls = collections.Counter()  # id(stack) -> calls of its class's own (stock) forward
        self._stack_classes: set[type] = set()
        self._undo = []

    @property
    def record(self) -> _TestRecord:
        return self.records[self.current]

    # ---- logging.Handler ----
    def emit(self, record):
        self.pending.append(record.getMessage())

    # ---- installation ----
    def install(self):
        import hf_paged_t5
        from transformers import PreTrainedModel

        self.hf = hf_paged_t5
        supported = {c if isinstance(c, str) else c.__name__ for c in hf_paged_t5.SUPPORTED_CLASSES}
        self.supported = supported
        recorder = self

        original_post_init = PreTrainedModel.post_init

        @functools.wraps(original_post_init)
        def post_init(model, *args, **kwargs):
            result = original_post_init(model, *args, **kwargs)
            recorder.patch(model)
            return result

        cache_cls = hf_paged_t5.PagedEncoderDecoderCache
        original_cache_init = cache_cls.__init__

        @functools.wraps(original_cache_init)
        def cache_init(cache, *args, **kwargs):
            recorder.caches_built += 1
            return original_cache_init(cache, *args, **kwargs)

        self._set(PreTrainedModel, "post_init", post_init)
        self._set(cache_cls, "__init__", cache_init)
        logger = logging.getLogger("hf_paged_t5")
        logger.addHandler(self)
        self._undo.append(lambda: logger.removeHandler(self))

    def _set(self, owner, name, value):
        had = name in owner.__dict__
        old = owner.__dict__.get(name)
        setattr(owner, name, value)
        self._undo.append(lambda: setattr(owner, name, old) if had else delattr(owner, name))

    def uninstall(self):
        while self._undo:
            self._undo.pop()()

    # ---- patching and counting ----
    def patch(self, model):
        names = {cls.__name__ for cls in type(model).__mro__}
        if not names & self.supported or self.hf.is_patched(model):
            return
        encoder = getattr(model, "encoder", None)
        if encoder is not None:
            self._watch_stack_class(type(encoder))  # before patch_model keeps the stock forward
        try:
            self.hf.patch_model(model)
        except Exception as exc:  # recorded, never raised: the test runs on the stock model
            self.record.patch_errors[f"{type(model).__name__}: {_summary(exc)}"] += 1
            return
        self.record.patched[type(model).__name__] += 1
        inner = model.__dict__.get("generate")
        if inner is not None:
            model.generate = types.MethodType(_counting(inner, self.count_call, model), model)
        inner = encoder.__dict__.get("forward") if encoder is not None else None
        if inner is not None:
            encoder.forward = types.MethodType(_counting(inner, self.count_encoder_call, model), encoder)

    def _watch_stack_class(self, cls):
        """Count calls of `cls.forward`, the stock forward that a patched encoder falls back to."""
        if cls in self._stack_classes:
            return
        self._stack_classes.add(cls)
        original, calls = cls.forward, self.stack_calls

        @functools.wraps(original)
        def forward(stack, *args, **kwargs):
            # not while torch.compile traces it (a counter there would be guarded on: recompiles)
            if not torch.compiler.is_compiling() and not getattr(stack, "is_decoder", False):
                calls[id(stack)] += 1
            return original(stack, *args, **kwargs)

        self._set(cls, "forward", forward)

    def count_encoder_call(self, model, encoder, inner, args, kwargs):
        _forget_warnings(model)
        record = self.record
        record.encoder_calls += 1
        stock_calls, start = self.stack_calls[id(encoder)], len(self.pending)
        try:
            return inner(*args, **kwargs)
        finally:
            messages, self.pending[start:] = self.pending[start:], []
            if self.stack_calls[id(encoder)] == stock_calls:
                record.encoder_paged_calls += 1
            else:
                reasons = [m[len(ENCODER_PREFIX):] for m in messages if m.startswith(ENCODER_PREFIX)]
                if not reasons:
                    flags = [n for n in ("output_attentions", "output_hidden_states")
                             if kwargs.get(n, getattr(encoder.config, n, False))]
                    grad = torch.is_grad_enabled() and any(p.requires_grad for p in encoder.parameters())
                    reasons = [f"not logged (training={encoder.training}, autograd={grad}, output flags={flags})"]
                record.encoder_stock_reasons.update(reasons)
            record.warnings.update(m[:300] for m in messages if not m.startswith(ENCODER_PREFIX))

    def count_call(self, model, _, inner, args, kwargs):
        _forget_warnings(model)
        record = self.record
        record.generate_calls += 1
        caches, start = self.caches_built, len(self.pending)
        try:
            result = inner(*args, **kwargs)
        except Exception as exc:
            kind = "paged" if self.caches_built > caches else "before the paged path / fallback"
            record.raised[f"{kind}: {_summary(exc)}"] += 1
            raise
        finally:
            messages, self.pending[start:] = self.pending[start:], []
        paged = self.caches_built > caches
        for message in messages:
            if not paged and message.startswith(FALLBACK_PREFIX):
                record.fallback_reasons[message[len(FALLBACK_PREFIX):]] += 1
            else:
                record.warnings[message[:300]] += 1
        if paged:
            record.paged_calls += 1
        else:
            record.fallback_calls += 1
            if not any(m.startswith(FALLBACK_PREFIX) for m in messages):
                record.fallback_reasons["(no reason logged)"] += 1
        return result

    # ---- summary ----
    def summary(self):
        totals = collections.Counter()
        reasons, patch_errors, raised = collections.Counter(), collections.Counter(), collections.Counter()
        encoder_reasons = collections.Counter()
        for nodeid, rec in self.records.items():
            if nodeid != OUTSIDE:
                totals["tests"] += 1
                totals["tests_with_paged_calls"] += rec.paged_calls > 0
                totals["tests_with_fallback_calls"] += rec.fallback_calls > 0
                totals["tests_with_patched_models"] += sum(rec.patched.values()) > 0
                totals["tests_with_paged_encoder_calls"] += rec.encoder_paged_calls > 0
            for key in ("generate_calls", "paged_calls", "fallback_calls", "encoder_calls", "encoder_paged_calls"):
                totals[key] += getattr(rec, key)
            totals["models_patched"] += sum(rec.patched.values())
            reasons.update(rec.fallback_reasons)
            patch_errors.update(rec.patch_errors)
            raised.update(rec.raised)
            encoder_reasons.update(rec.encoder_stock_reasons)
        return {
            "totals": dict(totals),
            "fallback_reasons": dict(reasons.most_common()),
            "patch_errors": dict(patch_errors.most_common()),
            "raised_in_generate": dict(raised.most_common()),
            "encoder_stock_reasons": dict(encoder_reasons.most_common()),
            "tests": {nodeid: rec.as_dict() for nodeid, rec in self.records.items()},
        }


def _counting(inner, count, model):
    """A method calling `count(model, self, inner, args, kwargs)`, with `inner`'s signature (HF and the
    tests inspect `generate` and `encoder.forward` signatures)."""

    def method(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # traced by torch.compile: count nothing, guard on nothing
            return inner(*args, **kwargs)
        return count(model, self, inner, args, kwargs)

    func = getattr(inner, "__func__", None)
    if func is not None:
        method.__signature__ = inspect.signature(func)
    return method


def _forget_warnings(model):
    """Clear the runtime's once-per-reason memory, so that every stock call logs its reason."""
    warned = getattr(getattr(model, "_hf_paged_t5", None), "warned", None)
    if isinstance(warned, set):
        warned.clear()


def _summary(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:300] if text else ''}"


_recorder: _Recorder | None = None


def pytest_addoption(parser):
    parser.addoption("--hf-paged-json", default="hf_paged_t5_suite.json",
                     help="where patch_plugin writes its JSON summary")


def pytest_configure(config):
    global _recorder
    _recorder = _Recorder()
    _recorder.install()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _recorder.current = item.nodeid
    _recorder.records[item.nodeid]  # every test gets a record, even one that builds no model
    yield
    # warnings logged outside any counted call (patching, a bare encoder run): kept, not lost
    _recorder.records[item.nodeid].warnings.update(m[:300] for m in _recorder.pending)
    _recorder.pending.clear()
    _recorder.current = OUTSIDE


def pytest_runtest_logreport(report):
    record = _recorder.records[report.nodeid]
    if report.when == "call" or report.outcome != "passed":
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        elif report.failed and report.when != "call":
            outcome = "error"
        else:
            outcome = report.outcome
        if record.outcome in (None, "passed"):
            record.outcome = outcome
        if report.failed and record.failure is None:
            text = report.longreprtext.rstrip().splitlines()[-25:]
            for title, content in report.sections:  # the end of captured stderr / logs (e.g. dynamo's guards)
                if content.strip() and ("stderr" in title or "log" in title):
                    text += [f"--- {title} (end) ---", *content.rstrip().splitlines()[-6:]]
            record.failure = "\n".join(text)


def pytest_sessionfinish(session):
    path = Path(session.config.getoption("--hf-paged-json"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_recorder.summary(), indent=1, sort_keys=False))


def pytest_unconfigure(config):
    if _recorder is not None:
        _recorder.uninstall()
