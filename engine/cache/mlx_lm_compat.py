"""The one door to mlx-lm's internals, held to the mlx-lm versions Longleaf was tested with.

Longleaf plugs into mlx-lm below its public API: the paged cache subclasses mlx-lm's
private cache base, a model's classes come from its private loader helper, the
attention function mlx-lm's model modules look up in their own globals is replaced,
and the off-thread architecture check reads mlx-lm's package layout and its
``MODEL_REMAPPING`` table from source. A new mlx-lm may change any of these without
notice, so every such use goes through this module, and :func:`check_version` refuses
an mlx-lm outside ``TESTED_FROM``..``TESTED_BELOW``, the range pyproject.toml pins.

Importing this module imports neither MLX nor mlx-lm (pickers call the architecture
check from other threads); each name is imported on first use.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.metadata
import importlib.util
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.errors import ModelLoadError

if TYPE_CHECKING:
    from mlx_lm.models.cache import _BaseCache as BaseCache

__all__ = [
    "TESTED_BELOW",
    "TESTED_FROM",
    "BaseCache",
    "MlxLmVersionError",
    "check_version",
    "has_architecture",
    "install_attention",
    "installed_version",
    "model_classes",
    "routes_attention",
]

DISTRIBUTION = "mlx-lm"
# The mlx-lm versions the suite passed with: TESTED_FROM up to, not including,
# TESTED_BELOW (tests/engine/cache/test_mlx_lm_compat.py keeps pyproject.toml's pin equal).
TESTED_FROM = "0.32.2"
TESTED_BELOW = "0.33"

# The name mlx-lm's model modules call attention by, looked up in their own globals.
ATTENTION = "scaled_dot_product_attention"
# Set on a replacement attention function: the function it replaced.
ORIGINAL = "_longleaf_original"


class MlxLmVersionError(ModelLoadError):
    """The installed mlx-lm is outside the range of versions Longleaf was tested with."""


def __getattr__(name: str) -> Any:
    # BaseCache is imported on first use, so importing this module stays MLX-free.
    if name == "BaseCache":
        from mlx_lm.models.cache import _BaseCache

        return _BaseCache
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def installed_version() -> str:
    """The installed mlx-lm's version, from its package metadata (imports nothing).

    Raises:
        MlxLmVersionError: mlx-lm is not installed.
    """
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as error:
        raise MlxLmVersionError("mlx-lm is not installed; reinstall Longleaf.") from error


def _release(version: str) -> tuple[int, ...]:
    """The leading numeric release of a version string: ``"0.32.2rc1"`` -> ``(0, 32, 2)``."""
    found = re.match(r"\d+(?:\.\d+)*", version.strip())
    return tuple(int(part) for part in found.group().split(".")) if found else ()


def is_tested(version: str) -> bool:
    """Whether ``version`` lies in ``TESTED_FROM``..``TESTED_BELOW`` (upper bound excluded)."""
    release = _release(version)
    return bool(release) and _release(TESTED_FROM) <= release < _release(TESTED_BELOW)


def check_version(installed: str | None = None) -> None:
    """Raise unless the installed mlx-lm (or ``installed``) is a version Longleaf was tested with.

    Raises:
        MlxLmVersionError: naming the installed and the tested versions, and the fix.
    """
    version = installed_version() if installed is None else installed
    if not is_tested(version):
        raise MlxLmVersionError(
            f"Longleaf was tested with mlx-lm {TESTED_FROM} up to (not including) "
            f"{TESTED_BELOW}, but mlx-lm {version} is installed; it reaches into mlx-lm's "
            f"internals, which change between versions. Install a tested version "
            f"(pip install 'mlx-lm>={TESTED_FROM},<{TESTED_BELOW}') or update Longleaf."
        )


def model_classes(config: dict[str, Any]) -> tuple[Any, Any]:
    """mlx-lm's (model class, model args class) for a ``config.json``.

    Raises:
        MlxLmVersionError: the installed mlx-lm is not a tested version.
        ValueError: mlx-lm has no module for the config's ``model_type``.
    """
    check_version()
    from mlx_lm.utils import _get_classes

    return _get_classes(config)


def has_architecture(model_type: str) -> bool:
    """Whether mlx-lm has a module for ``model_type``, found without importing it.

    Importing a model module imports MLX, and this runs off the worker thread, so it
    looks for the module's file, after mlx-lm's own remapping (mistral -> llama).

    Raises:
        ModelLoadError: mlx-lm is not installed.
    """
    model_type = model_type.replace("-", "_")
    model_type = _model_remapping().get(model_type, model_type)
    models = _package_root() / "models"
    return (models / f"{model_type}.py").is_file() or (models / model_type).is_dir()


@functools.cache
def _package_root() -> Path:
    spec = importlib.util.find_spec("mlx_lm")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("mlx-lm is not installed; reinstall Longleaf.")
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def _model_remapping() -> dict[str, str]:
    # mlx-lm maps some model_types to another module (mistral -> llama); its table
    # is a literal in mlx_lm/utils.py, read from the source so MLX stays unimported.
    try:
        tree = ast.parse((_package_root() / "utils.py").read_text(encoding="utf-8"))
    except (OSError, SyntaxError):
        return {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "MODEL_REMAPPING" for t in node.targets
        ):
            with contextlib.suppress(ValueError):
                return dict(ast.literal_eval(node.value))
    return {}


def install_attention(modules: Iterable[Any], route: Callable[[Any], Any]) -> None:
    """Replace the attention function of each of mlx-lm's model ``modules``, once.

    Args:
        modules: the modules a model's classes come from.
        route: given mlx-lm's attention function, returns the function to call
            instead; the replacement keeps the original as its ``ORIGINAL`` attribute,
            which makes this idempotent.

    Raises:
        MlxLmVersionError: the installed mlx-lm is not a tested version.
    """
    check_version()
    for module in modules:
        current = getattr(module, ATTENTION, None)
        if current is not None and not hasattr(current, ORIGINAL):
            replacement = route(current)
            setattr(replacement, ORIGINAL, current)
            setattr(module, ATTENTION, replacement)


def routes_attention(module_names: Iterable[str]) -> bool:
    """Whether any of the named modules calls attention through a replacement."""
    modules = (sys.modules.get(name) for name in module_names)
    return any(hasattr(getattr(m, ATTENTION, None), ORIGINAL) for m in modules if m)
