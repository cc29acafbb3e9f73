"""What ships: the wheel and the app hold ``app`` and ``engine``, never the benchmarks or tests.

The wheel's packages are what setuptools finds with pyproject.toml's rules; the
app's are what PyInstaller reaches from the launcher and ``app``/``engine``'s
submodules, so neither may import the checkout's other packages. The bundle test
(tests/packaging/test_bundle.py) reads the built archive itself.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest
from setuptools import find_namespace_packages

from tests.packaging.conftest import load_packaging_module

ROOT = Path(__file__).resolve().parents[2]
config = load_packaging_module("bundle_config")
build = load_packaging_module("build")


def wheel_packages() -> list[str]:
    """The packages a wheel of this checkout holds, found as setuptools finds them."""
    with (ROOT / "pyproject.toml").open("rb") as source:
        rules = tomllib.load(source)["tool"]["setuptools"]["packages"]["find"]
    return find_namespace_packages(
        where=str(ROOT), include=rules.get("include", ["*"]), exclude=rules.get("exclude", [])
    )


def test_the_wheel_holds_the_product_and_not_the_benchmarks() -> None:
    packages = wheel_packages()
    assert {"app", "app.chat", "engine", "engine.cache.attention", "engine.server"} <= set(
        packages
    )
    assert not [name for name in packages if name.split(".")[0] in config.NOT_SHIPPED]


def imported_roots(path: Path) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", ["app", "engine"])
def test_the_product_imports_nothing_that_does_not_ship(package: str) -> None:
    offenders = {
        str(path.relative_to(ROOT)): sorted(imported_roots(path) & set(config.NOT_SHIPPED))
        for path in (ROOT / package).rglob("*.py")
    }
    assert not {path: roots for path, roots in offenders.items() if roots}


def test_the_benchmarks_are_a_package_of_the_checkout() -> None:
    # The names the spec excludes are real packages here, so the exclusion means something.
    for name in config.NOT_SHIPPED:
        assert (ROOT / name / "__init__.py").is_file(), name
    assert (ROOT / "benchmarks" / "__main__.py").is_file()


def test_a_bundle_holding_a_benchmark_is_caught() -> None:
    modules = ["app", "engine.cache.pages", "benchmarks", "benchmarks.cache_bench",
               "tests.engine.tinymodels", "benchmarksish", "pytest"]
    assert build.stray_modules(modules) == [
        "benchmarks", "benchmarks.cache_bench", "tests.engine.tinymodels",
    ]
