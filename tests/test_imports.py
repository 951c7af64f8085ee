"""The house's import map, read from the code: every import counts (module level, inside
functions, under ``TYPE_CHECKING``). A package imports only the packages below it; no two files
import each other, however indirectly; ``exporters/`` and ``serving/`` stand alone, and
``serving/`` imports no torch at module level."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Each package of clika_runtime and the packages it may import (beside the standard library,
# torch, numpy, onnx and the like). The face (``__init__``, ``cli``, ``entry``, ``testing``,
# ``__main__``) may import any of them; none of them imports the face.
BELOW = {
    "base": set(),
    "guards": {"base"},
    "format": {"base", "guards"},
    "trees": {"base", "format"},
    "state": {"base"},
    "triton": {"base", "format", "guards"},
    "shipped": {"base", "format", "guards", "triton"},
    "capture": {"base", "format", "guards", "trees", "state", "shipped"},
    "cache": {"base", "format", "guards", "trees", "state", "shipped", "capture"},
    "function": {"base", "format", "guards", "trees", "state", "shipped", "capture", "cache"},
    "kserve": {"base", "format", "shipped"},
}
FACE = {"__init__", "__main__", "cli", "entry", "testing"}
OURS = ("clika_runtime", "exporters", "serving")


def _modules() -> dict[str, Path]:
    found = {}
    for top in OURS:
        for path in (ROOT / top).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The module of ours an imported name lives in (``a.b.c`` -> ``a.b`` when ``c`` is a name)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str) -> list[tuple[int, str]]:
    """(line, module of ours) for every import in ``module``, wherever it stands."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                found.append((node.lineno, target))
    return found


def _package(module: str) -> str | None:
    """The package of clika_runtime a module belongs to; ``None`` for the face and the others."""
    parts = module.split(".")
    return parts[1] if parts[0] == "clika_runtime" and len(parts) > 1 and parts[1] in BELOW else None


def test_every_package_of_clika_runtime_is_on_the_map():
    packages = {p.name for p in (ROOT / "clika_runtime").iterdir() if (p / "__init__.py").exists()}
    loose = {p.stem for p in (ROOT / "clika_runtime").glob("*.py")}
    assert packages == set(BELOW), f"packages not on the map (tests/test_imports.py BELOW): {packages ^ set(BELOW)}"
    assert loose == FACE, f"modules beside the packages that are not the face: {loose - FACE}"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("clika_runtime.")))
def test_a_package_imports_only_the_packages_below_it(module):
    mine = _package(module)
    wrong = []
    for line, target in _imports(module):
        theirs = _package(target)
        if target.startswith(("exporters", "serving")):
            continue
        if mine is None:  # the face imports anything of ours
            continue
        if theirs is None:
            wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports the face ({target})")
        elif theirs != mine and theirs not in BELOW[mine]:
            wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line} imports {target}: "
                         f"{mine}/ may import only {sorted(BELOW[mine]) or 'nothing of ours'}")
    assert not wrong, "; ".join(wrong)


@pytest.mark.parametrize("top", ["exporters", "serving"])
def test_exporters_and_serving_stand_alone(top):
    other = {"exporters": "serving", "serving": "exporters"}[top]
    wrong = [f"{MODULES[m].relative_to(ROOT)}:{line} imports {t}" for m in MODULES if m.split(".")[0] == top
             for line, t in _imports(m) if t.split(".")[0] in ("clika_runtime", other)]
    assert not wrong, "; ".join(wrong)


def test_serving_imports_no_torch_at_module_level():
    wrong = []
    for module, path in MODULES.items():
        if module.split(".")[0] != "serving":
            continue
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            wrong += [f"{path.relative_to(ROOT)}:{node.lineno}" for n in names if n.split(".")[0] == "torch"]
    assert not wrong, f"serving/ imports torch at module level (a deployment box may have none): {wrong}"


def test_no_two_files_import_each_other_however_indirectly():
    graph = {m: {t for _, t in _imports(m) if not MODULES[t].name == "__init__.py"} for m in MODULES}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    circles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(graph):
        if module not in index:
            visit(module)
    described = []
    for circle in circles:
        edges = [f"{MODULES[a].relative_to(ROOT)}:{line} -> {b}" for a in circle for line, b in _imports(a) if b in circle]
        described.append(f"{circle}: {'; '.join(edges)}")
    assert not circles, "import circles: " + " | ".join(described)
