"""Import cost of `hf_paged_t5` against torch and transformers alone, each in a fresh process.

    python benchmarks/bench_import.py [--repeats 5] [--python PYTHON] [--out DIR]

Each statement runs `--repeats` times, every time in a new interpreter (the repeats of the
statements are interleaved, the order reversed every other round, so drift of the machine
spreads over all of them). A run times the
statement itself with `time.perf_counter()` inside the process, so interpreter start-up is left
out. Each pair compares a statement with the stock statement a user would run anyway:

- `import hf_paged_t5` against `import torch, transformers`;
- `from hf_paged_t5 import patch_model` after loading transformers' T5 model class (which a user
  who patches a model has loaded) against loading that class alone;
- `from transformers import pipeline` after `import hf_paged_t5` (the pipelines it registers)
  against the same import without it.

Prints a table (median, min, max seconds, and the median's difference to its stock statement)
and writes DIR/import.json, or DIR/import-<label>.json with `--label` (default DIR:
benchmarks/results/<date>-<gpu>/, with its env.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import common  # benchmarks/ is on sys.path

REPO = str(common.REPO)

# (name, statement, name of the stock statement it is compared with, or None for a stock one)
CASES = (
    ("torch, transformers", "import torch, transformers", None),
    ("hf_paged_t5", "import hf_paged_t5", "torch, transformers"),
    ("T5 model class", "from transformers import T5ForConditionalGeneration", None),
    ("T5 model class + patch_model",
     "from transformers import T5ForConditionalGeneration\nfrom hf_paged_t5 import patch_model", "T5 model class"),
    ("pipeline()", "from transformers import pipeline", None),
    ("hf_paged_t5 + pipeline()", "import hf_paged_t5\nfrom transformers import pipeline", "pipeline()"),
)

# Run by each fresh process: prints the seconds the statement took.
_TIMER = """\
import time
_start = time.perf_counter()
{statement}
print(time.perf_counter() - _start)
"""


def time_once(python: str, statement: str) -> float:
    """Seconds `statement` takes in a new `python` process started in the repository root."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([python, "-c", _TIMER.format(statement=statement)], capture_output=True,
                          text=True, cwd=REPO, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{statement!r} failed:\n{proc.stderr[-2000:]}")
    return float(proc.stdout.strip().splitlines()[-1])


def measure(python: str, repeats: int) -> dict[str, list[float]]:
    """name -> seconds of each run, the runs of all statements interleaved."""
    statements = {name: statement for name, statement, _ in CASES}
    return common.interleaved(list(statements), repeats, lambda name: time_once(python, statements[name]))


def summarize(times: dict[str, list[float]]) -> list[dict]:
    """One row per statement: median / min / max seconds and the median's excess over its stock statement."""
    medians = {name: common.median(runs) for name, runs in times.items()}
    rows = []
    for name, statement, stock in CASES:
        runs = times[name]
        rows.append({
            "name": name,
            "statement": statement,
            "median_s": medians[name],
            "min_s": min(runs),
            "max_s": max(runs),
            "runs_s": runs,
            "compared_with": stock,
            "excess_s": None if stock is None else medians[name] - medians[stock],
        })
    return rows


def print_table(rows: list[dict], repeats: int) -> None:
    cells = []
    for row in rows:
        excess = "-" if row["excess_s"] is None else f"{row['excess_s']:+.2f} s vs {row['compared_with']}"
        statement = row["statement"].replace("\n", "; ")
        cells.append([f"`{statement}`", f"{row['median_s']:.2f}", f"{row['min_s']:.2f}", f"{row['max_s']:.2f}", excess])
    common.print_table([f"statement (fresh process, {repeats} runs)", "median s", "min s", "max s", "vs stock"], cells)


def versions(python: str) -> dict:
    """Versions of the measured interpreter's torch, transformers and (if installed) triton."""
    code = ("import importlib.metadata as m, json, sys\n"
            "def v(name):\n"
            "    try:\n        return m.version(name)\n"
            "    except m.PackageNotFoundError:\n        return None\n"
            "print(json.dumps({'python': sys.version.split()[0], 'torch': v('torch'),"
            " 'transformers': v('transformers'), 'triton': v('triton')}))")
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="fresh processes per statement (default: 5)")
    ap.add_argument("--python", default=sys.executable, help="interpreter to measure (default: this one)")
    ap.add_argument("--out", default=None, help="folder for the JSON (default: benchmarks/results/<date>-<gpu>)")
    ap.add_argument("--label", default="", help="what the measured code is (kept in the JSON, suffix of its name)")
    args = ap.parse_args(argv)
    out = common.start_suite(args.out, "import")
    rows = summarize(measure(args.python, args.repeats))
    result = {
        "label": args.label,
        "repeats": args.repeats,
        "versions": versions(args.python),
        "rows": rows,
    }
    common.write_json(out / (f"import-{args.label}.json" if args.label else "import.json"), result)
    print_table(rows, args.repeats)


if __name__ == "__main__":
    main()
