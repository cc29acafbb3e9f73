"""The door to mlx-lm's internals: the tested range, the refusal, and nothing beside it."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
import types
from pathlib import Path
from typing import Any

import pytest

from engine.cache import mlx_lm_compat
from engine.cache.mlx_lm_compat import TESTED_BELOW, TESTED_FROM, MlxLmVersionError
from engine.errors import EngineError, ModelLoadError
from engine.models.folder import check_model_dir
from tests.engine.tinymodels import make_tiny_model_dir

ROOT = Path(__file__).resolve().parents[3]


def test_pyproject_pins_the_tested_range() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    pin = next(d for d in config["project"]["dependencies"] if re.match(r"mlx-lm\b", d))
    assert pin == f"mlx-lm>={TESTED_FROM},<{TESTED_BELOW}"


def test_the_installed_mlx_lm_is_a_tested_version() -> None:
    import mlx_lm

    assert mlx_lm_compat.installed_version() == mlx_lm.__version__
    mlx_lm_compat.check_version()  # the suite runs on a version it was tested with


@pytest.mark.parametrize(("version", "tested"), [
    (TESTED_FROM, True), ("0.32.9", True), ("0.32.2.post1", True),
    ("0.32.1", False), (TESTED_BELOW, False), ("0.33.0rc1", False), ("1.0", False),
    ("not a version", False),
])
def test_is_tested_takes_the_range_with_its_upper_bound_excluded(
        version: str, tested: bool) -> None:
    assert mlx_lm_compat.is_tested(version) is tested


@pytest.mark.parametrize("version", ["0.33.0", "0.31.0"])
def test_an_untested_version_is_refused_naming_both_versions(version: str) -> None:
    with pytest.raises(MlxLmVersionError) as raised:
        mlx_lm_compat.check_version(version)
    message = str(raised.value)
    assert f"mlx-lm {version} is installed" in message
    assert f"tested with mlx-lm {TESTED_FROM} up to (not including) {TESTED_BELOW}" in message
    assert f"pip install 'mlx-lm>={TESTED_FROM},<{TESTED_BELOW}'" in message
    assert isinstance(raised.value, ModelLoadError) and isinstance(raised.value, EngineError)


def test_loading_a_model_under_an_untested_mlx_lm_fails_with_that_message(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = make_tiny_model_dir(tmp_path / "model", "llama")
    check_model_dir(folder)
    monkeypatch.setattr(mlx_lm_compat, "installed_version", lambda: "0.40.1")
    with pytest.raises(MlxLmVersionError, match=r"mlx-lm 0\.40\.1 is installed"):
        check_model_dir(folder)


def test_an_untested_version_refuses_to_replace_attention(
        monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("fake_model")
    module.scaled_dot_product_attention = print  # type: ignore[attr-defined]
    monkeypatch.setattr(mlx_lm_compat, "installed_version", lambda: "0.33.0")
    with pytest.raises(MlxLmVersionError):
        mlx_lm_compat.install_attention([module], lambda original: original)
    assert module.scaled_dot_product_attention is print  # type: ignore[attr-defined]


def test_attention_is_replaced_once_and_keeps_the_original(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def original(*args: Any) -> str:
        return "mlx-lm"

    module = types.ModuleType("fake_model")
    module.scaled_dot_product_attention = original  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, module.__name__, module)
    assert not mlx_lm_compat.routes_attention([module.__name__])
    routes: list[Any] = []

    def route(found: Any) -> Any:
        routes.append(found)
        return lambda *args: "paged"

    mlx_lm_compat.install_attention([module], route)
    mlx_lm_compat.install_attention([module], route)
    installed = module.scaled_dot_product_attention  # type: ignore[attr-defined]
    assert routes == [original] and installed() == "paged"
    assert getattr(installed, mlx_lm_compat.ORIGINAL) is original
    assert mlx_lm_compat.routes_attention(["not_imported", module.__name__])


def test_base_cache_is_the_base_of_mlx_lms_caches() -> None:
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    assert issubclass(KVCache, mlx_lm_compat.BaseCache)
    assert issubclass(RotatingKVCache, mlx_lm_compat.BaseCache)
    with pytest.raises(AttributeError):
        _ = mlx_lm_compat.NoSuchName  # type: ignore[attr-defined]


def test_model_classes_builds_mlx_lms_own_class() -> None:
    model_class, args_class = mlx_lm_compat.model_classes({"model_type": "llama"})
    assert model_class.__module__ == "mlx_lm.models.llama"
    assert args_class.__module__ == "mlx_lm.models.llama"


@pytest.mark.parametrize(("model_type", "known"), [
    ("llama", True), ("qwen3_next", True), ("mistral", True), ("llama9000", False),
])
def test_has_architecture_follows_mlx_lms_modules_and_remapping(
        model_type: str, known: bool) -> None:
    assert mlx_lm_compat.has_architecture(model_type) is known


def test_importing_the_module_imports_neither_mlx_nor_mlx_lm() -> None:
    code = ("import sys, engine.cache.mlx_lm_compat as c\n"
            "c.has_architecture('llama'); c.installed_version()\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('mlx', 'mlx_lm')]\n"
            "assert not bad, bad\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def _private_mlx_lm_names(path: Path) -> list[str]:
    """``from mlx_lm... import _name`` imports and ``.scaled_dot_product_attention =``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mlx_lm")
                and any(alias.name.startswith("_") for alias in node.names)):
            found.append(f"{path.name}:{node.lineno}")
        if isinstance(node, ast.Constant) and node.value == mlx_lm_compat.ATTENTION:
            found.append(f"{path.name}:{node.lineno}")
    return found


def test_scan_finds_a_private_import_and_the_attention_name(tmp_path: Path) -> None:
    source = tmp_path / "bad.py"
    source.write_text("from mlx_lm.utils import _get_classes\n"
                      "setattr(m, 'scaled_dot_product_attention', f)\n")
    assert _private_mlx_lm_names(source) == ["bad.py:1", "bad.py:2"]


def test_no_other_engine_module_reaches_into_mlx_lm() -> None:
    engine = ROOT / "engine"
    own = Path(mlx_lm_compat.__file__).resolve()
    sources = [p for p in engine.rglob("*.py") if p.resolve() != own]
    offenders = [hit for path in sources for hit in _private_mlx_lm_names(path)]
    assert not offenders, f"reach mlx-lm's internals through mlx_lm_compat: {offenders}"
