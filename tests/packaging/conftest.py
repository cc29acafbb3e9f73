"""Import the packaging/ helper modules by path: packaging/ is not a package
(it must not shadow the PyPI ``packaging`` module)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

PACKAGING = Path(__file__).resolve().parents[2] / "packaging"


def load_packaging_module(name: str) -> ModuleType:
    """Import ``packaging/<name>.py`` under its own name."""
    if name in sys.modules:
        return sys.modules[name]
    if str(PACKAGING) not in sys.path:
        sys.path.insert(0, str(PACKAGING))
    spec = importlib.util.spec_from_file_location(name, PACKAGING / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
