"""The engine must stay importable and usable without Qt or the app."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ENGINE = Path(__file__).resolve().parents[1] / "engine"
FORBIDDEN = ("PySide6", "PyQt5", "PyQt6", "shiboken6", "qtpy", "app")


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    roots: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_engine_sources_import_no_qt_or_app() -> None:
    offenders = {
        str(path.relative_to(ENGINE.parent)): sorted(imported_roots(path) & set(FORBIDDEN))
        for path in ENGINE.rglob("*.py")
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"engine imports Qt or app: {offenders}"


def test_importing_engine_loads_no_qt_module() -> None:
    code = (
        "import sys, pkgutil, importlib, engine\n"
        "for m in pkgutil.walk_packages(engine.__path__, 'engine.'):\n"
        "    if m.name.split('.')[-1] != '__main__':\n"
        "        importlib.import_module(m.name)\n"
        "bad = [m for m in sys.modules if m.split('.')[0] in "
        f"{FORBIDDEN!r}]\n"
        "print(bad); assert not bad, bad\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def engine_imports(source: str, package: str) -> set[str]:
    """Every ``engine.*`` module ``source`` imports, relative imports resolved.

    ``package`` is the dotted package the source lives in (``engine.cache``).
    """
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "engine")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = parts[: len(parts) - node.level + 1]
                base = ".".join([*parent, base] if base else parent)
            if base.split(".")[0] != "engine":
                continue
            for alias in node.names:  # "from engine.cache import kvquant" names a module
                is_package = (ENGINE.parent / base.replace(".", "/")).is_dir()
                found.add(f"{base}.{alias.name}" if is_package else base)
    return found


def layer_offenders(folder: Path, allowed: tuple[str, ...]) -> dict[str, list[str]]:
    offenders: dict[str, list[str]] = {}
    for path in folder.rglob("*.py"):
        package = ".".join(path.relative_to(ENGINE.parent).parts[:-1])
        imported = engine_imports(path.read_text(encoding="utf-8"), package)
        bad = sorted(m for m in imported if not m.startswith(allowed))
        if bad:
            offenders[str(path.relative_to(ENGINE.parent))] = bad
    return offenders


# Each package of the engine and what it may import of the rest: the cache at the
# bottom, then models and memory accounting, sessions, snapshots, the runtime;
# front ends (cli, server) on top, imported by nothing below them.
BASE = ("engine.errors", "engine.disk", "engine.events", "engine.format", "engine.paths")
LAYERS: dict[str, tuple[str, ...]] = {
    "cache": ("engine.cache", "engine.errors"),
    "documents": ("engine.documents", "engine.errors", "engine.format"),
    "models": ("engine.models", "engine.cache", *BASE),
    "memory": ("engine.memory", "engine.cache", *BASE),
    "session": ("engine.session", "engine.cache", "engine.memory", "engine.models", *BASE),
    "snapshots": ("engine.snapshots", "engine.session", "engine.cache", "engine.memory",
                  "engine.models", *BASE),
    "runtime": ("engine.runtime", "engine.session", "engine.snapshots", "engine.cache",
                "engine.memory", "engine.models", "engine.documents", *BASE),
}


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_each_layer_imports_only_what_sits_below_it(layer: str) -> None:
    offenders = layer_offenders(ENGINE / layer, LAYERS[layer])
    assert not offenders, f"engine/{layer} imports from above it: {offenders}"


def test_every_engine_package_has_a_layer_rule() -> None:
    """A new package must say where it sits (front ends and the API aside)."""
    front_ends = {"server", "distributed"}
    packages = {p.name for p in ENGINE.iterdir() if (p / "__init__.py").exists()}
    assert packages - front_ends - set(LAYERS) == set()


@pytest.mark.parametrize("folder", ["documents", "memory/guard.py", "memory/model_costs.py"])
def test_parsing_and_budget_arithmetic_import_no_mlx(folder: str) -> None:
    """Documents and the guard's arithmetic run without MLX (tests, other threads)."""
    target = ENGINE / folder
    paths = [target] if target.is_file() else list(target.rglob("*.py"))
    offenders = sorted(str(p.relative_to(ENGINE.parent)) for p in paths
                       if "mlx" in imported_roots(p) or "mlx_lm" in imported_roots(p))
    assert not offenders, f"these import MLX: {offenders}"


def test_import_scan_sees_absolute_and_relative_imports() -> None:
    """The scan the layer rules rely on finds both spellings (so those rules can fail)."""
    source = (
        "from engine.session.session import Session\nfrom . import kvquant\n"
        "import engine.runtime.worker\n"
    )
    found = engine_imports(source, "engine.cache")
    assert found == {"engine.session.session", "engine.cache.kvquant", "engine.runtime.worker"}
