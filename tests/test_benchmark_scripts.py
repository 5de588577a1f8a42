"""The benchmark scripts are not run in CI (the GPU ones cannot be, the CPU ones take minutes), but
they must at least compile and show --help: a script that fails on the device wastes a call of a
30-minute budget."""

import pathlib
import py_compile
import subprocess
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if not p.name.startswith("_"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_benchmark_script_compiles(script):
    py_compile.compile(str(script), doraise=True)


@pytest.mark.parametrize("name", ["bench_generate.py", "diag_memory.py", "bench_batch.py", "bench_kernels.py",
                                  "bench_import.py", "bench_cpu.py"])
def test_benchmark_script_parses_its_arguments(name):
    proc = subprocess.run([sys.executable, str(BENCH / name), "--help"], capture_output=True, text=True,
                          cwd=BENCH.parent, env={"PYTHONPATH": f"{BENCH.parent}:{BENCH}", "PATH": ""}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "usage" in proc.stdout
