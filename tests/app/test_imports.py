"""No import cycles among the app's modules (the graph: ``tests/import_graph.py``)."""

from __future__ import annotations

from pathlib import Path

from tests.import_graph import find_cycle, import_graph, imports_of, package_modules

APP = Path(__file__).resolve().parents[2] / "app"


def test_the_cycle_finder_finds_cycles() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"b2"}, "b2": {"b"}}) == ["b", "b2", "b"]


def test_the_graph_sees_every_kind_of_import() -> None:
    modules = package_modules(APP)
    menus = imports_of("app.window.menus", modules["app.window.menus"], modules)
    assert "app.window.model_picker" in menus and "app.settings" in menus
    main = imports_of("app.__main__", modules["app.__main__"], modules)
    assert "app.window.main_window" in main  # imported inside a function
    assert "app.style" in imports_of("app.self_test", modules["app.self_test"], modules)


def test_app_modules_import_no_cycle() -> None:
    cycle = find_cycle(import_graph(APP))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
