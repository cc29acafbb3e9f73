"""No import cycles among the engine's modules (the graph: ``tests/import_graph.py``).

Imports inside functions count: they hide a cycle from Python, not from a reader.
The facade (``engine/__init__.py``) is a module like the others here.
"""

from __future__ import annotations

from pathlib import Path

from tests.import_graph import find_cycle, import_graph, imports_of, package_modules

ENGINE = Path(__file__).resolve().parents[2] / "engine"


def test_the_graph_sees_the_engines_imports() -> None:
    modules = package_modules(ENGINE)
    loader = imports_of("engine.models.loader", modules["engine.models.loader"], modules)
    assert {"engine.models", "engine.models.probe", "engine.models.split"} <= loader
    facade = imports_of("engine", modules["engine"], modules)
    assert "engine.runtime.worker" in facade  # under TYPE_CHECKING


def test_engine_modules_import_no_cycle() -> None:
    cycle = find_cycle(import_graph(ENGINE))
    assert cycle is None, "import cycle: " + " -> ".join(cycle or [])
