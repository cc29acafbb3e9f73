"""The start-up sweep removes only what a dead process left, never a live one's files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from engine.snapshots import files
from engine.snapshots.snapshot_store import SnapshotStore


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid  # exited and reaped: no process has this id now (until reused)


def _live_child() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def _leftovers(folder: Path, pid: int) -> tuple[Path, Path]:
    """A half-written temp file and a data file whose manifest is not written yet."""
    temp = folder / f"{files.TEMP_MARK}{pid}-0123456789ab-chat.aaaaaaaaaaaa-p{pid}.safetensors"
    data = folder / f"chat.bbbbbbbbbbbb-p{pid}.safetensors"
    for path in (temp, data):
        path.write_bytes(b"half written")
    return temp, data


def test_names_record_this_process_as_their_writer(tmp_path: Path) -> None:
    import os

    data = files.new_data_name("chat")
    temp = files.temp_path(tmp_path / data)
    assert files.owner_pid(data) == files.owner_pid(temp.name) == os.getpid()
    assert files.owner_pid("chat.0123456789ab.safetensors") is None  # an older name


def test_a_live_process_files_survive_another_sweep(tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    folder.mkdir()
    child = _live_child()
    try:
        temp, data = _leftovers(folder, child.pid)
        SnapshotStore(folder)  # its start-up sweep
        assert temp.exists() and data.exists()
        SnapshotStore(folder).clear()  # "clear stored KV" spares them too
        assert temp.exists() and data.exists()
    finally:
        child.kill()
        child.wait()
    SnapshotStore(folder)  # the writer is gone now: its leftovers go
    assert not temp.exists() and not data.exists()


def test_a_dead_process_files_are_swept(tmp_path: Path) -> None:
    folder = tmp_path / "kv"
    folder.mkdir()
    temp, data = _leftovers(folder, _dead_pid())
    old = folder / f"{files.TEMP_MARK}0123456789ab-chat.json"  # no writer recorded
    old.write_bytes(b"{")
    SnapshotStore(folder)
    assert not temp.exists() and not data.exists() and not old.exists()
