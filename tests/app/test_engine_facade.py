"""The app reaches the engine through its facade, ``engine/__init__.py``, only.

Every ``engine`` import in app/ (at the top, inside functions, under
``TYPE_CHECKING``) is ``from engine import ...`` of a name the facade offers;
the facade's names all resolve, and each is imported under ``TYPE_CHECKING``
there, so the type checker sees its real type rather than the lazy
``__getattr__``'s ``Any``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import engine

ROOT = Path(__file__).resolve().parents[2]


def engine_imports(source: str) -> tuple[set[str], list[str]]:
    """(names taken from ``engine`` itself, modules reached past it) in ``source``."""
    names: set[str] = set()
    past: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "engine":
                names.update(alias.name for alias in node.names)
            elif node.module.startswith("engine."):
                past.append(node.module)
        elif isinstance(node, ast.Import):
            past += [a.name for a in node.names if a.name.startswith("engine.")]
    return names, past


def test_the_scan_tells_the_facade_from_what_lies_past_it() -> None:
    source = (
        "from engine import KvMode\nimport engine.events\n"
        "def f():\n    from engine.cache.modes import MODES\n"
    )
    assert engine_imports(source) == ({"KvMode"}, ["engine.events", "engine.cache.modes"])


def test_the_app_imports_the_engine_through_its_facade_only() -> None:
    used: set[str] = set()
    offenders: dict[str, list[str]] = {}
    for path in (ROOT / "app").rglob("*.py"):
        names, past = engine_imports(path.read_text(encoding="utf-8"))
        used |= names
        if past:
            offenders[str(path.relative_to(ROOT))] = past
    assert not offenders, f"these reach past engine/__init__.py: {offenders}"
    assert used - set(engine.__all__) == set(), "the facade does not offer these"


def test_every_name_of_the_facade_resolves() -> None:
    for name in engine.__all__:
        assert getattr(engine, name) is not None, name


def test_every_name_of_the_facade_is_typed() -> None:
    tree = ast.parse((ROOT / "engine" / "__init__.py").read_text(encoding="utf-8"))
    typed: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for inner in ast.walk(node):
                if isinstance(inner, ast.ImportFrom):
                    typed.update(alias.asname or alias.name for alias in inner.names)
    assert typed == set(engine.__all__)
