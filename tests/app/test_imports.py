"""No import cycles among the app's modules.

The graph is read from the source (every ``import`` and ``from ... import``,
also those under ``if TYPE_CHECKING:`` or inside functions), so a cycle shows
even where Python would let it pass at run time.
"""

from __future__ import annotations

import ast
from pathlib import Path

APP = Path(__file__).resolve().parents[2] / "app"


def module_name(path: Path) -> str:
    parts = path.relative_to(APP.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def app_modules() -> dict[str, Path]:
    return {module_name(path): path for path in APP.rglob("*.py")}


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The app modules ``path`` imports; "from app.chat import model" names a module."""
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


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"b2"}, "b2": {"b"}}) == ["b", "b2", "b"]


def test_the_graph_sees_every_kind_of_import() -> None:
    modules = app_modules()
    menus = imports_of("app.window.menus", modules["app.window.menus"], modules)
    assert "app.window.model_picker" in menus and "app.settings" in menus
    main = imports_of("app.__main__", modules["app.__main__"], modules)
    assert "app.window.main_window" in main  # imported inside a function
    assert "app.style" in imports_of("app.self_test", modules["app.self_test"], modules)


def test_app_modules_import_no_cycle() -> None:
    modules = app_modules()
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
