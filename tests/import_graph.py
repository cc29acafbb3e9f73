"""The import graph of a package, read from its source, and a cycle finder over it.

The graph has every ``import`` and ``from ... import``, also those under
``if TYPE_CHECKING:`` or inside functions, so a cycle shows even where Python
would let it pass at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path


def import_graph(root: Path) -> dict[str, set[str]]:
    """Each module of the package at ``root`` and the package's modules it imports."""
    modules = package_modules(root)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def module_name(path: Path, root: Path) -> str:
    """``path``'s dotted name, ``root`` being the top package's folder."""
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def package_modules(root: Path) -> dict[str, Path]:
    """Every module of the package at ``root``, by dotted name."""
    return {module_name(path, root): path for path in root.rglob("*.py")}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The ``modules`` that ``path`` imports; "from app.chat import model" names a module."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t in modules)
    found.discard(name)
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle in ``graph`` as [a, b, ..., a], or None (depth-first search)."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" after
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None
