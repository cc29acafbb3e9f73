"""Where Longleaf keeps its data; one place so tests can redirect it."""

from __future__ import annotations

import os
from pathlib import Path

import platformdirs

APP_NAME = "Longleaf"


def data_dir() -> Path:
    """Return the user data directory (history, converted models), creating it.

    ``LONGLEAF_HOME`` overrides the platform location; tests always set it.
    """
    override = os.environ.get("LONGLEAF_HOME")
    path = Path(override) if override else Path(platformdirs.user_data_dir(APP_NAME, False))
    path.mkdir(parents=True, exist_ok=True)
    return path


def models_dir() -> Path:
    """Return the folder for models Longleaf converted or downloaded itself."""
    path = data_dir() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path
