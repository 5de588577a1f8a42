"""Run transformers' T5 / mT5 / UMT5 model tests unpatched and patched, and compare.

    python3 benchmarks/hf_suite/assemble.py      # once: builds /work/hf_suite/<version>/
    python3 benchmarks/hf_suite/run.py           # all suites, both modes -> /work/hf_suite/results/<stamp>/
    python3 benchmarks/hf_suite/run.py --suites t5 --out DIR      # one suite; reruns reuse finished runs in DIR

Each (suite, mode) is one pytest process in the assembled tree, offline (HF_HUB_OFFLINE=1), one at a time,
with `-p no:cacheprovider` and the `hf_compat` plugin; the patched mode adds `-p patch_plugin`. Outcomes come
from pytest's junit XML; the patched mode's paged/fallback counts from patch_plugin's JSON. The summary
(summary.md, summary.json in the output folder) gives per suite passed / failed / skipped for both modes,
the tests that fail or skip only when patched (with the last lines of their error), the tests that reached
the paged path, and the fallback reasons.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import transformers

HERE = Path(__file__).resolve().parent
SUITES = ("t5", "mt5", "umt5")
MODES = ("unpatched", "patched")
FAILED = ("failed", "error")


def code_state() -> str:
    """The hf_paged_t5 under test: its repository's HEAD, plus a digest of the package's files when they
    differ from HEAD (the package may be edited while the suites run; each run records its state)."""
    import hashlib

    import hf_paged_t5

    package = Path(hf_paged_t5.__file__).parent
    git = ["git", "-C", str(package.parent)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "--", package.name], capture_output=True, text=True).stdout
    if not dirty.strip():
        return head or "unknown"
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(package.rglob("*.py")))).hexdigest()[:10]
    return f"{head}+dirty:{digest}"


def run_suite(tree: Path, out: Path, suite: str, mode: str, extra: list[str]) -> dict:
    """One pytest run; returns its wall time in seconds and the hf_paged_t5 state before and after."""
    stem = out / f"{suite}-{mode}"
    cmd = [sys.executable, "-m", "pytest", f"tests/models/{suite}", "-p", "no:cacheprovider", "-p", "hf_compat",
           f"--junitxml={stem}.xml", "-o", "log_cli=false", "-o", "junit_logging=no", "-q", "-rN",
           "-W", "ignore::pytest.PytestUnknownMarkWarning", *extra]
    if mode == "patched":
        cmd += ["-p", "patch_plugin", f"--hf-paged-json={stem}.json"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(HERE), str(tree.parent / "deps"), os.environ.get("PYTHONPATH", "")]))
    state, start = code_state(), time.monotonic()
    with open(f"{stem}.log", "w") as log:
        subprocess.run(cmd, cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    return {"seconds": time.monotonic() - start, "hf_paged_t5": state, "hf_paged_t5_after": code_state()}


def read_junit(path: Path, tree: Path) -> dict[str, tuple[str, str]]:
    """{test id: (outcome, message)} from a junit XML file; ids are pytest node ids."""
    results = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        nodeid = _nodeid(case.get("classname", ""), case.get("name", ""), tree)
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.text or child.get("message") or "").strip()
                break
        results[nodeid] = (outcome, message)
    return results


def _nodeid(classname: str, name: str, tree: Path) -> str:
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        module = "/".join(parts[:i]) + ".py"
        if (tree / module).is_file():
            return "::".join([module, *parts[i:], name])
    return f"{classname}::{name}"


def tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def summarize(out: Path, tree: Path, suites, run_log: dict) -> dict:
    summary = {"transformers": transformers.__version__, "tree": str(tree), "suites": {}}
    for suite in suites:
        runs = {mode: read_junit(out / f"{suite}-{mode}.xml", tree) for mode in MODES
                if (out / f"{suite}-{mode}.xml").is_file()}
        counts = {mode: dict(collections.Counter(o for o, _ in res.values())) for mode, res in runs.items()}
        entry = {"counts": counts, "runs": run_log.get(suite, {})}
        if len(runs) == 2:
            base, patched = runs["unpatched"], runs["patched"]
            entry["new_failures"] = {t: tail(m) for t, (o, m) in patched.items()
                                     if o in FAILED and base.get(t, ("missing",))[0] not in FAILED}
            entry["new_skips"] = {t: tail(m, 3) for t, (o, m) in patched.items()
                                  if o == "skipped" and base.get(t, ("missing",))[0] != "skipped"}
            entry["fixed_when_patched"] = sorted(t for t, (o, _) in patched.items()
                                                 if o == "passed" and base.get(t, ("",))[0] in FAILED)
        plugin = out / f"{suite}-patched.json"
        if plugin.is_file():
            data = json.loads(plugin.read_text())
            entry["paged"] = {key: data.get(key, {}) for key in ("totals", "fallback_reasons", "patch_errors",
                                                                  "raised_in_generate", "encoder_stock_reasons")}
            entry["paged"]["tests_with_paged_calls"] = sorted(
                t for t, rec in data["tests"].items() if rec["paged_calls"])
            entry["paged"]["tests_with_paged_encoder_calls"] = sorted(
                t for t, rec in data["tests"].items() if rec.get("encoder_paged_calls"))
            for test in entry.get("new_failures", {}):  # the plugin's text adds the end of captured output
                failure = data["tests"].get(test, {}).get("failure")
                if failure:
                    entry["new_failures"][test] = tail(failure, 20)
        summary["suites"][suite] = entry
    return summary


def to_markdown(summary: dict) -> str:
    lines = [f"# transformers {summary['transformers']} model tests, stock vs hf_paged_t5-patched", "",
             "| suite | mode | passed | failed | error | skipped | seconds | hf_paged_t5 (before / after) |",
             "|---|---|---|---|---|---|---|---|"]
    for suite, entry in summary["suites"].items():
        for mode, counts in entry["counts"].items():
            run = entry["runs"].get(mode, {})
            state = run.get("hf_paged_t5", "?")
            if run.get("hf_paged_t5_after", state) != state:
                state += f" / {run['hf_paged_t5_after']} (edited during the run)"
            lines.append(f"| {suite} | {mode} | {counts.get('passed', 0)} | {counts.get('failed', 0)} | "
                         f"{counts.get('error', 0)} | {counts.get('skipped', 0)} | "
                         f"{run.get('seconds', 0):.0f} | {state} |")
    for suite, entry in summary["suites"].items():
        paged = entry.get("paged", {})
        totals = paged.get("totals", {})
        lines += ["", f"## {suite}", "",
                  f"- tests that reached the paged path: {totals.get('tests_with_paged_calls', 0)} "
                  f"(generate() calls: {totals.get('generate_calls', 0)} on patched models, "
                  f"{totals.get('paged_calls', 0)} paged, {totals.get('fallback_calls', 0)} fallback)",
                  f"- tests whose patched encoder ran paged: {totals.get('tests_with_paged_encoder_calls', 0)} "
                  f"(encoder calls: {totals.get('encoder_calls', 0)}, {totals.get('encoder_paged_calls', 0)} paged)",
                  f"- models patched: {totals.get('models_patched', 0)}; patch errors: {paged.get('patch_errors', {})}",
                  f"- fixed when patched (fail unpatched, pass patched): {len(entry.get('fixed_when_patched', []))}"]
        if paged.get("fallback_reasons"):
            lines += ["", "Fallback reasons (generate() calls):", ""]
            lines += [f"- {n} x {reason}" for reason, n in paged["fallback_reasons"].items()]
        if paged.get("encoder_stock_reasons"):
            lines += ["", "Why patched encoders ran on stock HF (encoder calls):", ""]
            lines += [f"- {n} x {reason}" for reason, n in paged["encoder_stock_reasons"].items()]
        if paged.get("tests_with_paged_calls"):
            lines += ["", "Tests whose generate() ran paged:", ""]
            lines += [f"- `{t}`" for t in paged["tests_with_paged_calls"]]
        if paged.get("raised_in_generate"):
            lines += ["", "Exceptions raised by patched generate():", ""]
            lines += [f"- {n} x {what}" for what, n in paged["raised_in_generate"].items()]
        for title, key in (("New failures (fail only when patched)", "new_failures"),
                           ("New skips (skip only when patched)", "new_skips")):
            items = entry.get(key, {})
            lines += ["", f"### {title}: {len(items)}", ""]
            for test, message in sorted(items.items()):
                lines += [f"- `{test}`", "", "```", message, "```"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", type=Path, default=Path("/work/hf_suite") / transformers.__version__)
    parser.add_argument("--out", type=Path, default=None, help="output folder (default /work/hf_suite/results/<stamp>)")
    parser.add_argument("--suites", nargs="+", choices=SUITES, default=list(SUITES))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--rerun", action="store_true", help="run again even where DIR has a finished run")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = parser.parse_args(argv)
    if not (args.tree / "tests" / "test_modeling_common.py").is_file():
        raise SystemExit(f"no assembled test tree at {args.tree}; run assemble.py first")
    out = args.out or args.tree.parent / "results" / time.strftime("%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "runs.json"
    run_log = json.loads(log_path.read_text()) if log_path.is_file() else {}
    for suite in args.suites:
        for mode in args.modes:
            if (out / f"{suite}-{mode}.xml").is_file() and not args.rerun:
                continue
            print(f"running {suite} {mode} ...", flush=True)
            run_log.setdefault(suite, {})[mode] = run_suite(args.tree, out, suite, mode, args.pytest_args)
            log_path.write_text(json.dumps(run_log, indent=1))
    suites = [s for s in SUITES if any((out / f"{s}-{m}.xml").is_file() for m in MODES)]
    summary = summarize(out, args.tree, suites, run_log)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    markdown = to_markdown(summary)
    (out / "summary.md").write_text(markdown)
    print(markdown.split("\n## ")[0])
    print(f"summary: {out / 'summary.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
