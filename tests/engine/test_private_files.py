"""What the engine writes about a conversation is user-only: KV snapshots hold its text."""

from __future__ import annotations

import stat
import threading
from pathlib import Path

import pytest

from engine.models.loader import load_model
from engine.session.session import Session
from engine.snapshots.snapshot_store import SnapshotStore, default_snapshot_dir
from tests.engine.tinymodels import make_tiny_model_dir


def _modes(folder: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in [folder, *folder.iterdir()]}


def test_a_saved_kv_snapshot_is_user_only(
    tmp_path_factory: pytest.TempPathFactory, loose_umask: None
) -> None:
    loaded = load_model(make_tiny_model_dir(tmp_path_factory.mktemp("models"), "llama"))
    session = Session("private", loaded, "q8")
    session.model_dir = loaded.info.path
    session.ingest(
        [{"role": "user", "content": "the contents of a private document"}],
        request_id=1, cancel=threading.Event(), emit=lambda event: None, tick=lambda: None,
    )
    store = SnapshotStore(default_snapshot_dir())

    store.save(session, "chat")
    session.close()

    modes = _modes(default_snapshot_dir())
    assert modes.pop("kv-snapshots") == 0o700
    assert sorted(name.split(".")[-1] for name in modes) == ["json", "safetensors"]
    assert set(modes.values()) == {0o600}
