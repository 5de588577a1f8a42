"""The package's layout rules (docs/architecture.md), read from the source itself.

- Folders import downward only: kv <- model <- decode <- {hf, batch}; kernels and kv import
  neither transformers nor anything above them; kv and kernels never import each other's
  neighbours above.
- No import cycles between modules (imports inside functions included: a lazy import is still
  a dependency).
- No module-level mutable state: no module global bound to a list, dict, set or other mutable
  container, no `global` statement.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parent.parent / "hf_paged_t5"

# folder -> the folders (and top-level modules) of the package it may import
ALLOWED = {
    "kv": {"kv", "config"},
    "kernels": {"kernels"},
    "model": {"model", "kv", "kernels", "reference", "cpu_ops", "config"},
    "decode": {"decode", "model", "kv", "cpu_ops", "config"},
    "hf": {"hf", "decode", "model", "kv", "config", "triton_start"},
    "batch": {"batch", "hf", "decode", "model", "kv", "config", "demo"},
    "serve": {"serve", "batch", "hf", "kv"},
}
NO_TRANSFORMERS = {"kv", "kernels", "reference", "cpu_ops", "config"}


def modules() -> dict[str, pathlib.Path]:
    found = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).with_suffix("")
        parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
        found[".".join(("hf_paged_t5",) + parts)] = path
    return found


def imports(name: str, path: pathlib.Path) -> set[str]:
    """Absolute names of everything the module imports, anywhere in it."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module
            out.add(target)
            out.update(f"{target}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return out


def internal_deps() -> dict[str, set[str]]:
    mods = modules()
    deps = {}
    for name, path in mods.items():
        deps[name] = {m for m in imports(name, path) if m in mods and m != name and m != "hf_paged_t5"}
    return deps


def folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_every_module_is_found():
    names = modules()
    for expected in ("hf_paged_t5.kv.pool", "hf_paged_t5.decode.runner", "hf_paged_t5.hf.patch",
                     "hf_paged_t5.batch.generator", "hf_paged_t5.kernels.decode"):
        assert expected in names


@pytest.mark.parametrize("name", sorted(ALLOWED))
def test_folders_import_downward_only(name):
    bad = []
    for module, deps in internal_deps().items():
        if folder(module) != name:
            continue
        for dep in deps:
            if folder(dep) not in ALLOWED[name]:
                bad.append(f"{module} imports {dep}")
    assert not bad, "\n".join(sorted(bad))


def test_low_layers_never_import_transformers_or_triton():
    bad = []
    for module, path in modules().items():
        if folder(module) in NO_TRANSFORMERS:
            names = imports(module, path)
            if any(n == "transformers" or n.startswith("transformers.") for n in names):
                bad.append(f"{module} imports transformers")
            if folder(module) == "kv" and any(n == "triton" or n.startswith("triton.") for n in names):
                bad.append(f"{module} imports triton")
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    deps = internal_deps()
    # a package's __init__ importing its own modules is not a cycle of theirs
    graph = {m: {d for d in ds if not m.startswith(d + ".")} for m, ds in deps.items()}
    state, stack, cycles = {}, [], []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                cycles.append(" -> ".join(stack[stack.index(dep):] + [dep]))
            elif dep not in state:
                visit(dep)
        stack.pop()
        state[node] = "done"

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(cycles)


_MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "OrderedDict", "deque", "Counter", "WeakKeyDictionary",
                  "WeakValueDictionary"}


def _mutable(value: ast.AST) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in _MUTABLE_CALLS
    return False


def test_no_module_level_mutable_state():
    bad = []
    for module, path in modules().items():
        tree = ast.parse(path.read_text())
        for node in tree.body:
            value = node.value if isinstance(node, (ast.Assign, ast.AnnAssign)) else None
            targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
            if any(getattr(t, "id", None) == "__all__" for t in targets):
                continue  # the export list: read by tools, never changed
            if value is not None and _mutable(value):
                bad.append(f"{module}:{node.lineno}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                bad.append(f"{module}:{node.lineno} global {', '.join(node.names)}")
    assert not bad, "module-level mutable state at " + ", ".join(bad)


def test_the_checks_see_a_violation(tmp_path, monkeypatch):
    """The checks above can fail: a cycle, an upward import and a module-level dict are found."""
    pkg = tmp_path / "hf_paged_t5"
    for sub in ("kv", "hf"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "kv" / "pool.py").write_text("from ..hf import patch\n_CACHE = {}\n")
    (pkg / "hf" / "patch.py").write_text("from ..kv import pool\n")
    monkeypatch.setattr(__import__(__name__), "PKG", pkg)
    with pytest.raises(AssertionError, match="kv.pool imports hf_paged_t5.hf"):
        test_folders_import_downward_only("kv")
    with pytest.raises(AssertionError, match="->"):
        test_no_import_cycles()
    with pytest.raises(AssertionError, match="kv.pool:2"):
        test_no_module_level_mutable_state()
