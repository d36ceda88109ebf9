"""The package's layering, read from its own source with `ast` (nothing is imported):

- layers/ imports nothing from models/ or engine/ (nor server/, perf/, bench/);
- models/ imports nothing from engine/, server/ or bench/;
- engine/ knows no HTTP: nothing from server/;
- the engine's core does not import perf/: the ruler is an observer attached from outside;
- perf/ reaches the engine's public API only through its one documented entry point
  (tuili/perf/harness.py);
- `kernels.available()` / `kernels.amx_available()` are asked only in tuili/platform.py
  (and inside tuili/kernels itself);
- no import cycles among the package's modules (imports inside functions and under
  TYPE_CHECKING included: a cycle there is still two modules that need each other).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "tuili"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def parse_all() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


MODULES = parse_all()


def imports_of(name: str, typing_too: bool = True) -> set[str]:
    """The tuili modules `name` imports (an `import a.b` or `from a.b import c` names a.b, and
    a.b.c too when that is a module); without `typing_too`, leaving out those made only for
    type hints (under `if TYPE_CHECKING:`)."""
    tree = MODULES[name]
    if not typing_too:
        tree = _without_typing_blocks(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {m for m in found if m in MODULES}


def _without_typing_blocks(tree: ast.Module) -> ast.Module:
    class Strip(ast.NodeTransformer):
        def visit_If(self, node: ast.If) -> ast.AST | None:
            if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
                return None
            return self.generic_visit(node)

    return Strip().visit(ast.parse(ast.unparse(tree)))


def package_of(module: str) -> str:
    """tuili.layers.attention.base -> layers; tuili.platform -> platform."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


FORBIDDEN = {
    "layers": {"models", "engine", "server", "perf", "bench"},
    "models": {"engine", "server", "bench"},
    "engine": {"server", "bench"},
    "kernels": {"layers", "models", "engine", "server", "perf", "bench"},
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_lower_packages_do_not_import_higher_ones(package):
    bad = [
        (module, imported)
        for module in MODULES
        if package_of(module) == package
        for imported in imports_of(module)
        if package_of(imported) in FORBIDDEN[package]
    ]
    assert not bad, bad


def test_the_engine_core_does_not_import_the_ruler():
    core = [m for m in MODULES if package_of(m) == "engine" and m != "tuili.engine.cli"]
    bad = [(m, i) for m in core for i in imports_of(m) if package_of(i) == "perf"]
    assert not bad, bad


def test_perf_builds_engines_only_through_its_harness():
    """Type hints may name the engine; building or running one goes through perf/harness.py."""
    harness = "tuili.perf.harness"
    assert harness in MODULES
    bad = [
        (module, imported)
        for module in MODULES
        if package_of(module) == "perf" and module != harness
        for imported in imports_of(module, typing_too=False)
        if imported in ("tuili", "tuili.engine", "tuili.engine.llm", "tuili.engine.core")
    ]
    assert not bad, bad


def test_kernel_availability_is_asked_only_by_the_platform():
    askers = []
    for module, tree in MODULES.items():
        if module == "tuili.platform" or package_of(module) == "kernels":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in ("available", "amx_available", "linear_packed_available", "unavailable_reason"):
                if isinstance(node.value, ast.Name) and node.value.id == "kernels":
                    askers.append((module, node.attr, node.lineno))
            if isinstance(node, ast.ImportFrom) and node.module == "tuili.kernels":
                names = {a.name for a in node.names}
                if names & {"available", "amx_available", "linear_packed_available"}:
                    askers.append((module, "import", node.lineno))
    assert not askers, askers


def test_no_import_cycles():
    graph = {m: imports_of(m) - {m} for m in MODULES}
    # A package's __init__ re-exporting its own modules is not a cycle of ideas: drop the edges
    # from a module to a package that contains it.
    for module, targets in graph.items():
        graph[module] = {t for t in targets if not module.startswith(t + ".")}
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, cycles[:5]


def test_the_rules_can_fail(monkeypatch):
    """A layer importing a model, and two modules importing each other, are caught."""
    modules = {name: ast.parse(ast.unparse(tree)) for name, tree in MODULES.items()}
    modules["tuili.layers.norm"].body.append(ast.parse("from tuili.models.llama import X").body[0])
    modules["tuili.models.weights"].body.append(ast.parse("import tuili.layers.norm").body[0])
    monkeypatch.setattr(sys.modules[__name__], "MODULES", modules)
    with pytest.raises(AssertionError, match="tuili.layers.norm"):
        test_lower_packages_do_not_import_higher_ones("layers")
    with pytest.raises(AssertionError, match="tuili.models"):
        test_no_import_cycles()
