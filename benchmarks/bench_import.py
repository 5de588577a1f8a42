"""Import cost of `hf_paged_t5` against torch and transformers alone, each in a fresh process.

    python benchmarks/bench_import.py [--repeats 5] [--python PYTHON] [--out DIR]

Each statement runs `--repeats` times, every time in a new interpreter (the repeats of the
statements are interleaved, so drift of the machine spreads over all of them). A run times the
statement itself with `time.perf_counter()` inside the process, so interpreter start-up is left
out. Each pair compares a statement with the stock statement a user would run anyway:

- `import hf_paged_t5` against `import torch, transformers`;
- `from hf_paged_t5 import patch_model` after loading transformers' T5 model class (which a user
  who patches a model has loaded) against loading that class alone;
- `from transformers import pipeline` after `import hf_paged_t5` (the pipelines it registers)
  against the same import without it.

Prints a table (median, min, max seconds, and the median's difference to its stock statement)
and writes `import-<N>cpu-<date>[-<label>].json` under `--out`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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
    times: dict[str, list[float]] = {name: [] for name, _, _ in CASES}
    for _ in range(repeats):
        for name, statement, _ in CASES:
            times[name].append(time_once(python, statement))
    return times


def summarize(times: dict[str, list[float]]) -> list[dict]:
    """One row per statement: median / min / max seconds and the median's excess over its stock statement."""
    medians = {name: statistics.median(runs) for name, runs in times.items()}
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
    print(f"| statement (fresh process, {repeats} runs) | median s | min s | max s | vs stock |")
    print("|---|---|---|---|---|")
    for row in rows:
        excess = "—" if row["excess_s"] is None else f"{row['excess_s']:+.2f} s vs {row['compared_with']}"
        statement = row["statement"].replace("\n", "; ")
        print(f"| `{statement}` | {row['median_s']:.2f} | {row['min_s']:.2f} | {row['max_s']:.2f} | {excess} |")


def versions(python: str) -> dict:
    """Versions of the measured interpreter's torch, transformers and (if installed) triton."""
    code = ("import importlib.metadata as m, json, sys\n"
            "def v(name):\n"
            "    try:\n        return m.version(name)\n"
            "    except m.PackageNotFoundError:\n        return None\n"
            "print(json.dumps({'python': sys.version.split()[0], 'torch': v('torch'),"
            " 'transformers': v('transformers'), 'triton': v('triton')}))")
    return json.loads(subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5, help="fresh processes per statement (default: 5)")
    ap.add_argument("--python", default=sys.executable, help="interpreter to measure (default: this one)")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join(REPO, "benchmarks", "results")),
                    help="directory for the JSON (default: $OUT or benchmarks/results)")
    ap.add_argument("--label", default="", help="what the measured code is (kept in the JSON, suffix of its name)")
    args = ap.parse_args()
    rows = summarize(measure(args.python, args.repeats))
    print_table(rows, args.repeats)
    result = {
        "date": datetime.date.today().isoformat(),
        "machine": platform.machine(),
        "label": args.label,
        "cpu_count": os.cpu_count(),
        "repeats": args.repeats,
        "versions": versions(args.python),
        "rows": rows,
    }
    os.makedirs(args.out, exist_ok=True)
    suffix = f"-{args.label}" if args.label else ""
    name = f"import-{os.cpu_count()}cpu-{datetime.date.today():%Y%m%d}{suffix}.json"
    path = os.path.join(args.out, name)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    print(f"-> {path}")


if __name__ == "__main__":
    main()
