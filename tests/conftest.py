"""Suite-wide fixtures: isolated user dirs and a guard against leaked threads."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

# Before any test module imports engine (and through it MLX): engine's import points
# TMPDIR at a user-only folder inside Longleaf's cache directory, which here is a
# folder of this run's own (mkdtemp: 0700, an unguessable name), never the real
# user's cache; it goes at the end of the run, so nothing is left in /tmp.
_RUN_HOME = Path(tempfile.mkdtemp(prefix="longleaf-tests-"))
_PREVIOUS_HOME = os.environ.get("LONGLEAF_HOME")
os.environ["LONGLEAF_HOME"] = str(_RUN_HOME)
# Also when the run stops before pytest_unconfigure (a conftest that fails to import).
atexit.register(shutil.rmtree, _RUN_HOME, True)


@pytest.fixture(autouse=True)
def isolated_user_dirs(tmp_path_factory: pytest.TempPathFactory, monkeypatch) -> Iterator[Path]:
    """Point every data/config/cache location at a temp dir.

    Tests must never touch the real user's settings, data or model caches.
    """
    root = tmp_path_factory.mktemp("home")
    for var, sub in (
        ("XDG_DATA_HOME", "data"),
        ("XDG_CONFIG_HOME", "config"),
        ("XDG_CACHE_HOME", "cache"),
        ("HF_HOME", "hf"),
    ):
        (root / sub).mkdir()
        monkeypatch.setenv(var, str(root / sub))
    monkeypatch.setenv("LONGLEAF_HOME", str(root / "longleaf"))
    yield root


@pytest.fixture
def loose_umask() -> Iterator[None]:
    """A umask that would make new files world-readable, as many systems have."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


@pytest.fixture(scope="session")
def demo_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A LONGLEAF_HOME holding the demo model, converted once per test session.

    Tests set it with ``monkeypatch.setenv("LONGLEAF_HOME", ...)`` and must not
    write into it: it is shared.
    """
    from engine.models.demo import ensure_demo_model

    home = tmp_path_factory.mktemp("demo-home")
    patch = pytest.MonkeyPatch()
    patch.setenv("LONGLEAF_HOME", str(home))
    try:
        ensure_demo_model()
    finally:
        patch.undo()
    yield home


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Fail any test that leaves a thread running behind it."""
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5.0
    while True:
        leaked = [
            t for t in threading.enumerate()
            if t not in before and t.is_alive() and not t.daemon
        ]
        leaked += [
            t for t in threading.enumerate()
            if t not in before and t.is_alive() and t.name.startswith("longleaf")
        ]
        if not leaked or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    assert not leaked, f"test left threads running: {[t.name for t in leaked]}"


def pytest_configure(config: pytest.Config) -> None:
    # mlx[cpu] emulates fp16 slowly; keep tests deterministic and single-device.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _PREVIOUS_HOME is None:
        os.environ.pop("LONGLEAF_HOME", None)
    else:
        os.environ["LONGLEAF_HOME"] = _PREVIOUS_HOME
    shutil.rmtree(_RUN_HOME, ignore_errors=True)
