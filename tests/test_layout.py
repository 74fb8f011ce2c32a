"""The layout rules of docs/ARCHITECTURE.md, read from the source: what may import what.

- only gpu_worker/ imports torch (a CPU stage, the command and a direct client must install
  and start without it);
- stages/ (and cli/) and gpu_worker/ never import each other: they share only the packages
  below them (SHARED), which import none of the three;
- among the shared packages, each imports only those LAYERS puts below it;
- every package's __init__ docstring names each module and sub-package it holds;
- no import circle between the project's modules, counting imports made only for type
  checkers (a circle of annotations is still two modules that each need the other), nor
  through imports inside functions (an import deferred to a call still needs the other);
- no module outside tests/ is over MAX_LINES lines (one concept a file).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("bus", "jobs", "batch_store", "observability", "runtime", "stages", "gpu_worker", "cli")
# The benchmarks are scripts, not imported by the packages; they count for the size rule.
SIZED = (*PACKAGES, "benchmarks")
MAX_LINES = 400
# The packages both sides may use, and what each may import of the others (docs/ARCHITECTURE.md
# draws them bottom up; bus/ and observability/ use each other: the Actor measures its loop,
# the deployment readers read liveness).
LAYERS = {
    "runtime": set(),
    "jobs": {"runtime"},
    "batch_store": {"runtime", "jobs"},
    "observability": {"runtime", "jobs", "bus"},
    "bus": {"runtime", "jobs", "batch_store", "observability"},
}
SHARED = tuple(LAYERS)


def _modules() -> dict[str, Path]:
    modules = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


MODULES = _modules()


def _imported(node: ast.Import | ast.ImportFrom, module: str, path: Path) -> Iterator[str]:
    """The names an import statement brings in, absolute, submodules included."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, *([node.module] if node.module else [])])
    yield base
    yield from (f"{base}.{alias.name}" for alias in node.names)


def _all_imports(module: str) -> set[str]:
    """Every name the module imports anywhere, functions included."""
    path = MODULES[module]
    return _imports_anywhere(ast.parse(path.read_text()), module, path)


def _imports_anywhere(tree: ast.Module, module: str, path: Path) -> set[str]:
    return {
        name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for name in _imported(node, module, path)
    }


def _project_imports(module: str) -> set[str]:
    """The project modules the module imports anywhere, function bodies included."""
    return {name for name in _all_imports(module) if name in MODULES and name != module}


def _module_level_imports(module: str) -> set[str]:
    """The project modules imported when the module loads, or for its annotations: the top
    level and its if/try blocks (TYPE_CHECKING ones too), not function bodies."""
    path = MODULES[module]
    found: set[str] = set()

    def visit(statements: list[ast.stmt]) -> None:
        for node in statements:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.update(_imported(node, module, path))
            elif isinstance(node, ast.If):
                visit(node.body)
                visit(node.orelse)
            elif isinstance(node, ast.Try):
                visit(node.body)

    visit(ast.parse(path.read_text()).body)
    return {name for name in found if name in MODULES and name != module}


def _is_within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


@pytest.mark.parametrize("package", [p for p in PACKAGES if p != "gpu_worker"])
def test_only_the_gpu_worker_imports_torch(package):
    offenders = {
        module: sorted(name for name in _all_imports(module) if _is_within(name, "torch"))
        for module in MODULES
        if _is_within(module, package)
    }
    assert {module: names for module, names in offenders.items() if names} == {}


def _offenders(package: str, others: set[str]) -> dict[str, list[str]]:
    found = {
        module: sorted(
            name for name in _all_imports(module) if any(_is_within(name, o) for o in others)
        )
        for module in MODULES
        if _is_within(module, package)
    }
    return {module: names for module, names in found.items() if names}


@pytest.mark.parametrize(
    "package, other",
    [("stages", "gpu_worker"), ("cli", "gpu_worker"), ("gpu_worker", "stages"),
     ("gpu_worker", "cli")],
)  # fmt: skip
def test_stages_and_gpu_worker_share_only_bus(package, other):
    assert _offenders(package, {other}) == {}


@pytest.mark.parametrize("package", SHARED)
def test_a_shared_package_imports_only_what_is_below_it(package):
    forbidden = set(PACKAGES) - LAYERS[package] - {package}
    assert _offenders(package, forbidden) == {}


def _held(package_dir: Path) -> list[str]:
    names = [p.name for p in package_dir.glob("*.py") if p.name != "__init__.py"]
    names += [p.name + "/" for p in package_dir.iterdir() if (p / "__init__.py").exists()]
    return sorted(names)


@pytest.mark.parametrize(
    "init", sorted(path for package in PACKAGES for path in (ROOT / package).rglob("__init__.py")),
    ids=lambda path: str(path.parent.relative_to(ROOT)),
)  # fmt: skip
def test_every_package_docstring_names_what_it_holds(init):
    docstring = ast.get_docstring(ast.parse(init.read_text())) or ""
    assert [name for name in _held(init.parent) if name not in docstring] == []


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                connect(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            connect(node)
    return circles


def test_the_circle_finder_finds_a_circle_through_three_modules():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _circles(graph) == [["a", "b", "c"]]


def test_no_module_imports_itself_back_through_others():
    graph = {module: _module_level_imports(module) for module in MODULES}
    assert _circles(graph) == []


def test_no_circle_through_imports_inside_functions():
    graph = {module: _project_imports(module) for module in MODULES}
    assert _circles(graph) == []


def test_an_import_inside_a_function_counts():
    source = "def stop():\n    from . import main\n    return main\n"
    found = _imports_anywhere(ast.parse(source), "cli.launcher", ROOT / "cli" / "launcher.py")
    assert "cli.main" in found


def test_no_module_is_over_the_line_limit():
    sizes = {
        str(path.relative_to(ROOT)): len(path.read_text().splitlines())
        for package in SIZED
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert {path: lines for path, lines in sizes.items() if lines > MAX_LINES} == {}
