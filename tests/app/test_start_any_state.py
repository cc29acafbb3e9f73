"""The window opens whatever state the data folder is in, and says what happened."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.__main__ import build_window
from app.store import HistoryStore, default_path
from tests.app.conftest import MODEL_LOAD_TIMEOUT_MS, close_window


def _open(qtbot, model: Path):
    window = build_window(str(model))
    qtbot.addWidget(window)
    window.show()
    qtbot.waitUntil(lambda: window.controller.model_ready, timeout=MODEL_LOAD_TIMEOUT_MS)
    return window


def test_a_damaged_history_opens_the_window_with_a_banner(qtbot, tiny_llama, capfd) -> None:
    path = default_path()
    store = HistoryStore(path)
    for c in range(6):
        record = store.create_session(f"chat {c}", "q8", "demo")
        for m in range(20):
            store.add_message(record.id, "user", f"message {m} " + "text " * 400)
    store.close()
    data = bytearray(path.read_bytes())
    leaf = data.index(b"message 10 ") // 4096  # a leaf of the messages table
    data[leaf * 4096:(leaf + 1) * 4096] = os.urandom(4096)
    path.write_bytes(bytes(data))
    window = _open(qtbot, tiny_llama)
    try:
        text = window.banner.label.text()
        assert window.banner.isVisible() and "damaged" in text and "6 chats" in text
        (damaged,) = path.parent.glob("history.damaged-*.sqlite3")
        assert str(damaged) in text and damaged.read_bytes() == bytes(data)
        assert len(window.controller.store.sessions()) == 6
    finally:
        close_window(window)
    assert "Traceback" not in "".join(capfd.readouterr())


def test_an_unusable_data_folder_opens_the_window_with_a_message(qtbot, tiny_llama, tmp_path,
                                                                 monkeypatch, capfd) -> None:
    # Tests run as root, where a 0500 folder can still be written: a data folder
    # under a file is one no one can create or write.
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("LONGLEAF_HOME", str(blocker / "longleaf"))
    monkeypatch.setenv("LONGLEAF_CONFIG_HOME", str(tmp_path / "config"))
    window = _open(qtbot, tiny_llama)
    try:
        text = window.banner.label.text()
        assert window.banner.isVisible() and "cannot write" in text and "saved" in text
        window.controller.new_session()  # the history works, in memory
        assert window.controller.store.sessions()
    finally:
        close_window(window)
    assert "Traceback" not in "".join(capfd.readouterr())


def test_the_demo_in_an_unusable_data_folder_fails_with_a_message(qtbot, tmp_path, monkeypatch,
                                                                  capfd) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("LONGLEAF_HOME", str(blocker / "longleaf"))
    monkeypatch.setenv("LONGLEAF_CONFIG_HOME", str(tmp_path / "config"))
    window = build_window("demo")
    qtbot.addWidget(window)
    window.show()
    qtbot.waitUntil(lambda: "demo model is converted" in window.banner.label.text(),
                    timeout=MODEL_LOAD_TIMEOUT_MS)
    close_window(window)
    assert "Traceback" not in "".join(capfd.readouterr())


@pytest.fixture
def read_only_mount(tmp_path):
    """A real read-only file system (a tmpfs remounted ro), where the test can mount one."""
    import subprocess

    mount = tmp_path / "ro"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("this machine does not let the test mount a file system")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def test_a_read_only_file_system_opens_the_window_with_the_history(
        qtbot, tiny_llama, read_only_mount, tmp_path, monkeypatch, capfd) -> None:
    import subprocess

    from app.__main__ import take_data_folder

    home = read_only_mount / "longleaf"
    monkeypatch.setenv("LONGLEAF_HOME", str(home))
    monkeypatch.setenv("LONGLEAF_CONFIG_HOME", str(tmp_path / "config"))
    store = HistoryStore()
    record = store.create_session("kept", "q8", "demo")
    store.add_message(record.id, "user", "what I wrote")
    store.close()
    subprocess.run(["mount", "-o", "remount,ro", str(read_only_mount)], check=True)
    lock, code = take_data_folder([])
    assert (lock, code) == (None, None)  # no lock file can be made: open without one
    window = build_window(str(tiny_llama), owns_data=False)
    qtbot.addWidget(window)
    window.show()
    qtbot.waitUntil(lambda: window.controller.model_ready, timeout=MODEL_LOAD_TIMEOUT_MS)
    try:
        text = window.banner.label.text()
        assert "cannot write" in text and "read-only" in text.lower()
        (shown,) = window.controller.store.sessions()
        assert shown.title == "kept"
        assert [m.content for m in window.controller.store.messages(shown.id)] == ["what I wrote"]
    finally:
        close_window(window)
    assert "Traceback" not in "".join(capfd.readouterr())
