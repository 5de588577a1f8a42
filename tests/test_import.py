"""What `import hf_paged_t5` costs and needs, each case in a fresh interpreter.

The package imports its modules on first use and registers the pipelines only once
`transformers.pipelines` is imported (`hf_paged_t5/pipeline_hook.py`); the CPU path runs without
Triton installed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent

# Makes `import triton` fail as it does where Triton is not installed.
NO_TRITON = """
import importlib.abc, sys

class NoTriton(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "triton" or fullname.startswith("triton."):
            raise ModuleNotFoundError(f"No module named {fullname!r}")
        return None

sys.meta_path.insert(0, NoTriton())
"""

# A pipeline on the tiny model: prints the class of the pipeline "summarization" builds.
SUMMARIZE = """
from transformers import pipeline
from hf_paged_t5 import tiny
pipe = pipeline("summarization", model=tiny.build_model(), tokenizer=tiny.build_tokenizer())
pipe("a short text", max_new_tokens=3)
print("pipeline:", type(pipe).__name__)
"""


def run_python(*parts: str) -> str:
    """stdout of the code `parts` (each dedented) run by a new interpreter; fails the test if it exits non-zero."""
    pythonpath = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": pythonpath}
    env.pop("TRITON_INTERPRET", None)  # set by conftest for this process; the CPU path must not need it
    code = "\n".join(map(textwrap.dedent, parts))
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_import_loads_neither_pipelines_nor_model_code_and_names_resolve():
    out = run_python("""
        import sys
        import hf_paged_t5
        print("loaded:", sorted(m for m in ("torch", "transformers", "transformers.pipelines") if m in sys.modules))
        print("hook:", hf_paged_t5.hf.pipeline_hook.installed())
        assert set(hf_paged_t5.__all__) <= set(dir(hf_paged_t5))
        for name in hf_paged_t5.__all__:
            getattr(hf_paged_t5, name)
        from hf_paged_t5 import *  # noqa: F403
        try:
            hf_paged_t5.no_such_name
        except AttributeError as exc:
            print("missing:", exc)
    """)
    assert "loaded: []" in out and "hook: True" in out, out
    assert "missing: module 'hf_paged_t5' has no attribute 'no_such_name'" in out, out


def test_pipelines_are_registered_when_transformers_pipelines_is_imported():
    out = run_python("""
        import sys
        import hf_paged_t5
        from hf_paged_t5 import tiny
        print("before:", "transformers.pipelines" in sys.modules)
    """, SUMMARIZE, """
        print("hook after:", hf_paged_t5.hf.pipeline_hook.installed())
    """)
    assert "before: False" in out and "pipeline: SummarizationPipeline" in out and "hook after: False" in out, out


def test_pipelines_are_registered_at_import_when_transformers_pipelines_is_loaded():
    out = run_python("import transformers.pipelines\nimport hf_paged_t5", SUMMARIZE)
    assert "pipeline: SummarizationPipeline" in out, out


def test_pipelines_module_imported_first_registers_itself():
    out = run_python("from hf_paged_t5.hf.pipelines import SummarizationPipeline", SUMMARIZE)
    assert "pipeline: SummarizationPipeline" in out, out


def test_unregister_before_transformers_pipelines_cancels_the_registration():
    out = run_python("""
        import hf_paged_t5
        hf_paged_t5.unregister_pipelines()
        from transformers import pipeline
        from hf_paged_t5 import tiny
        try:
            pipeline("summarization", model=tiny.build_model(), tokenizer=tiny.build_tokenizer())
        except KeyError:  # transformers' own answer for a task it does not know (or removed)
            print("refused")
    """)
    assert "refused" in out, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA build of torch brings and uses Triton itself; "
                    "the claim is about CPU-only installs")
def test_cpu_path_runs_without_triton():
    out = run_python(NO_TRITON, """
import logging, sys
import torch
import hf_paged_t5
logging.basicConfig(stream=sys.stdout, level=logging.WARNING)  # a fall back to stock HF is logged
from hf_paged_t5 import tiny
model, tok = tiny.build_model(), tiny.build_tokenizer()
batch = tok(["a short text", "and a somewhat longer second text"], return_tensors="pt", padding=True)
stock = model.generate(**batch, max_new_tokens=6, num_beams=2)
hf_paged_t5.patch_model(model)
paged = model.generate(**batch, max_new_tokens=6, num_beams=2)
print("same:", torch.equal(stock, paged))
print("triton loaded:", "triton" in sys.modules)
""", SUMMARIZE)
    assert "same: True" in out and "triton loaded: False" in out, out
    assert "running this generate() on stock HF" not in out, out
    assert "pipeline: SummarizationPipeline" in out, out


def test_triton_start_up_begins_only_where_torch_is_imported_and_sees_a_gpu():
    """`triton_start`: nothing at import without torch or with HF_PAGED_T5_EARLY_TRITON=0; with torch
    on a machine without a GPU the thread ends at once, importing no Triton."""
    out = run_python("""
        import sys
        import hf_paged_t5
        print("without torch:", hf_paged_t5.triton_start.started())
    """)
    assert "without torch: False" in out
    out = run_python("""
        import os, sys
        os.environ["HF_PAGED_T5_EARLY_TRITON"] = "0"
        import torch, hf_paged_t5
        print("turned off:", hf_paged_t5.triton_start.started())
    """)
    assert "turned off: False" in out
    if torch.cuda.is_available():
        pytest.skip("the no-GPU half needs a machine without a GPU")
    out = run_python("""
        import sys
        import torch, hf_paged_t5
        hf_paged_t5.triton_start.wait()
        print("thread:", hf_paged_t5.triton_start.started(), "triton:", "triton" in sys.modules)
    """)
    assert "thread: True triton: False" in out
