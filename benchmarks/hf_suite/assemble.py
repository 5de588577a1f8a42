"""Assemble a runnable copy of transformers' T5 / mT5 / UMT5 model tests outside the repo.

    python3 benchmarks/hf_suite/assemble.py            # -> /work/hf_suite/<installed transformers version>/

The tree is put together from two sources:

1. The sdist of the installed transformers version (`pip download --no-binary :all: --no-deps`): the
   top-level `tests/*.py` (test_modeling_common.py, test_configuration_common.py, test_pipeline_mixin.py,
   ...) and the `[tool.pytest.ini_options]` of its pyproject.toml (markers). Fully reproducible.
2. Files the sdist does not ship (`tests/models/*`, `tests/generation/test_utils.py`,
   `tests/exporters/test_export.py`, the top-level `conftest.py`, `tests/utils/test_configuration_utils.py`).
   They were read out of a public-source index and are expected under `--upstream`
   (default /work/hf_suite/upstream), one folder per source, named `<owner>+<repo>@<commit>`, holding the
   file at its repository path. `UPSTREAM_FILES` below says which file comes from which folder. Where an
   upstream file is an excerpt, the file says so in a comment marked `[hf_suite]`:
   `tests/utils/test_configuration_utils.py` is kept to its license header and `config_common_kwargs`
   (what `tests/test_configuration_common.py` imports; the whole file imports `tests/utils/test_module`,
   which is not fetched, and every suite then fails to collect).

Two stand-ins complete the checkout layout the tests assume: `src/transformers` is a symlink to the
installed package (test_pipeline_mixin.py imports it from there), and `tests/utils/tiny_model_summary.json`
is `{}` (the real file lists hub-hosted tiny models for the pipeline tests, which cannot load offline; with
an empty summary every `test_pipeline_*` skips, patched or not).

Neither source is ever copied into this repository; the assembled tree lives outside it. The one test
dependency missing from this machine, `parameterized` (pure Python), is installed into `<dest>/../deps`,
which `run.py` puts on PYTHONPATH.
"""

from __future__ import annotations

import argparse
import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import transformers

# repository path -> upstream folder it is read from (see the module docstring)
_A1EFBEE = "zucchini-nlp+transformers@a1efbee2dc82be3b3eb44afaff7929263f5de241"
UPSTREAM_FILES = {
    "conftest.py": "huggingface+transformers@ea8f33271b322b80b71647298051adb2fcb73684",
    "tests/generation/test_utils.py": _A1EFBEE,
    "tests/exporters/test_export.py": _A1EFBEE,
    "tests/models/t5/test_modeling_t5.py": _A1EFBEE,
    "tests/models/mt5/test_modeling_mt5.py": _A1EFBEE,
    "tests/models/umt5/test_modeling_umt5.py": _A1EFBEE,
    "tests/utils/test_configuration_utils.py": "zucchini-nlp+transformers@9dcfb22fa63737894af436d88cf51befa3086053",
}
# packages of the test tree (empty __init__.py upstream too)
PACKAGES = ["tests", "tests/models", "tests/models/t5", "tests/models/mt5", "tests/models/umt5",
            "tests/generation", "tests/exporters", "tests/utils"]
TEST_DEPS = ["parameterized"]


def fetch_sdist(version: str, sdist_dir: Path) -> Path:
    """The transformers sdist for `version`, downloaded into `sdist_dir` unless already there."""
    found = sorted(sdist_dir.glob(f"transformers-{version}.tar.gz"))
    if not found:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        f"transformers=={version}", "-d", str(sdist_dir)], check=True)
        found = sorted(sdist_dir.glob(f"transformers-{version}.tar.gz"))
    if not found:
        raise SystemExit(f"no sdist transformers-{version}.tar.gz in {sdist_dir}")
    return found[0]


def extract_sdist(sdist: Path, dest: Path) -> list[str]:
    """Copy the sdist's top-level tests/*.py into dest/tests and write its pytest options to dest/pytest.ini."""
    copied = []
    with tarfile.open(sdist) as tar:
        for member in tar.getmembers():
            parts = Path(member.name).parts  # transformers-X/tests/name.py
            if member.isfile() and len(parts) == 3 and parts[1] == "tests" and parts[2].endswith(".py"):
                (dest / "tests" / parts[2]).write_bytes(tar.extractfile(member).read())
                copied.append(f"tests/{parts[2]}")
            elif member.isfile() and len(parts) == 2 and parts[1] == "pyproject.toml":
                (dest / "pytest.ini").write_text(_pytest_ini(tar.extractfile(member).read().decode()))
    return copied


def _pytest_ini(pyproject: str) -> str:
    """pyproject.toml's [tool.pytest.ini_options] as a pytest.ini (markers and filters; addopts dropped)."""
    import tomllib

    options = tomllib.load(io.BytesIO(pyproject.encode()))["tool"]["pytest"]["ini_options"]
    lines = ["[pytest]"]
    for key, value in options.items():
        if key in ("addopts", "env"):  # doctest globbing and pytest-env settings: not wanted here
            continue
        if isinstance(value, list):
            lines.append(f"{key} =")
            lines.extend(f"    {item}" for item in value)
        else:
            lines.append(f"{key} = {value}")
    return "\n".join(lines) + "\n"


def copy_upstream(upstream: Path, dest: Path) -> None:
    missing = [f"{upstream / src / path}" for path, src in UPSTREAM_FILES.items() if not (upstream / src / path).is_file()]
    if missing:
        raise SystemExit("missing upstream files (see this script's docstring):\n  " + "\n  ".join(missing))
    for path, src in UPSTREAM_FILES.items():
        (dest / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(upstream / src / path, dest / path)


def install_deps(deps_dir: Path) -> None:
    sys.path.insert(0, str(deps_dir))
    wanted = []
    for name in TEST_DEPS:
        try:
            __import__(name)
        except ImportError:
            wanted.append(name)
    if wanted:
        subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(deps_dir), *wanted],
                       check=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default=transformers.__version__, help="transformers version (default: installed)")
    parser.add_argument("--root", type=Path, default=Path("/work/hf_suite"), help="where the tree goes (ROOT/VERSION)")
    parser.add_argument("--upstream", type=Path, default=None, help="upstream files (default ROOT/upstream)")
    parser.add_argument("--sdist-dir", type=Path, default=Path("/tmp/tfsdist"))
    args = parser.parse_args(argv)
    upstream = args.upstream or args.root / "upstream"
    dest = args.root / args.version
    if dest.exists():
        shutil.rmtree(dest)
    for package in PACKAGES:
        (dest / package).mkdir(parents=True, exist_ok=True)
        (dest / package / "__init__.py").touch()
    args.sdist_dir.mkdir(parents=True, exist_ok=True)
    copied = extract_sdist(fetch_sdist(args.version, args.sdist_dir), dest)
    copy_upstream(upstream, dest)
    (dest / "src").mkdir()
    (dest / "src" / "transformers").symlink_to(Path(transformers.__file__).parent, target_is_directory=True)
    (dest / "tests" / "utils" / "tiny_model_summary.json").write_text("{}\n")
    install_deps(args.root / "deps")
    print(f"assembled {dest}: {len(copied)} files from the sdist, {len(UPSTREAM_FILES)} from {upstream}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
