"""The kit's modules import one another as layers: no circle, counting the imports made
inside functions too (a lazy import hides a circle from Python, not from a reader), so that
every module can be read knowing only the ones below it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvref", "kvimpl", "kvcheck")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {
        module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")
    }


def imported(path: Path, name: str, known: set[str]) -> set[str]:
    """The repository's modules ``path`` imports anywhere in it (``from a import b`` counts
    ``a.b`` where that is a module, else ``a``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per dot past the first
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], base]).strip(".")
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {module for module in found if module in known and module != name}


def circle(graph: dict[str, set[str]]) -> list[str] | None:
    """A circle of the graph, as the modules on it, or None."""
    state: dict[str, int] = {}  # 1: on the path now, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for after in sorted(graph[node]):
            if state.get(after) == 1:
                return [*path[path.index(after) :], after]
            if after not in state and (found := visit(after)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_packages_import_one_another_without_a_circle():
    known = modules()
    graph = {name: imported(path, name, set(known)) for name, path in known.items()}
    # A package's __init__ imports its modules to export them: an edge down, never a circle
    # of its own, but the modules import the package for a sibling; count the siblings.
    for name in [name for name in graph if name in PACKAGES or known[name].name == "__init__.py"]:
        graph[name] = {module for module in graph[name] if not module.startswith(f"{name}.")}
    found = circle(graph)
    assert found is None, f"an import circle: {' -> '.join(found)}"


@pytest.mark.parametrize(
    ("graph", "expected"),
    [({"a": {"b"}, "b": {"c"}, "c": set()}, None), ({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"])],
)
def test_a_circle_is_found_and_a_layering_is_not_one(graph, expected):
    assert circle(graph) == expected
