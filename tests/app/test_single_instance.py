"""One Longleaf per data folder: a second launch hands its files over and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from app.__main__ import take_data_folder
from app.single_instance import InstanceLock, hand_over, hand_over_or_take, socket_name
from app.store import HistoryStore
from engine import data_dir
from tests.app.conftest import close_window, open_window

T = TypeVar("T")


@pytest.fixture
def first(qapp):
    """The running app's lock and server on the test's data folder."""
    lock = InstanceLock(data_dir())
    assert lock.acquire() and lock.listen()
    yield lock
    lock.release()


def launched(qtbot, launch: Callable[[], T]) -> T:
    """What ``launch`` (a second launch's steps) returns, run on a thread of its own
    while this one's event loop runs: the first app answers a launch from its loop."""
    result: list[T] = []
    thread = threading.Thread(target=lambda: result.append(launch()))
    thread.start()
    qtbot.waitUntil(lambda: not thread.is_alive(), timeout=30_000)
    thread.join()
    assert result, "the launch raised (its traceback is above)"
    return result[0]


def test_a_second_lock_on_the_folder_is_refused_while_the_first_lives(first) -> None:
    second = InstanceLock(data_dir())
    assert not second.acquire() and second.held_elsewhere()
    first.release()
    assert second.acquire()  # taken over once the first is gone
    second.release()


def test_files_given_to_a_second_launch_reach_the_first(qtbot, first, tmp_path) -> None:
    doc = tmp_path / "notes.txt"
    doc.write_text("hello")
    second = InstanceLock(data_dir())
    assert not second.acquire()
    with qtbot.waitSignal(first.filesReceived, timeout=10_000) as got:
        assert launched(qtbot, lambda: hand_over_or_take(second, [str(doc)], wait_s=5.0))
    assert got.args[0] == [str(doc)]


def test_take_data_folder_hands_over_and_says_exit_0(qtbot, first, tmp_path) -> None:
    with qtbot.waitSignal(first.filesReceived, timeout=10_000) as got:
        lock, code = launched(qtbot, lambda: take_data_folder([str(tmp_path / "a.md")]))
    assert (lock, code) == (None, 0) and got.args[0] == [str(tmp_path / "a.md")]


def test_a_holder_that_does_not_answer_is_said_in_a_dialog_too(
        first, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    # A launch from the Finder has no terminal: stderr alone said nothing to anyone.
    from PySide6.QtWidgets import QMessageBox

    import app.single_instance

    def silent(_lock: InstanceLock, _files: list[str]) -> bool:
        raise TimeoutError(f"the Longleaf that holds {data_dir()} does not answer")

    monkeypatch.setattr(app.single_instance, "hand_over_or_take", silent)
    shown: list[str] = []
    monkeypatch.setattr(QMessageBox, "critical",
                        lambda _parent, _title, text, *rest: shown.append(text))
    assert take_data_folder([]) == (None, 1)
    assert len(shown) == 1 and "does not answer" in shown[0]
    assert "Activity Monitor" in shown[0] and shown[0] in capsys.readouterr().err


def test_a_second_app_process_hands_its_file_over_and_exits_0(qtbot, first, tmp_path) -> None:
    """``python -m app FILE`` on a folder another live Longleaf holds; no window, no
    history write (its live answers would otherwise be marked interrupted)."""
    store = HistoryStore()
    session = store.create_session("live", "q8", "demo")
    store.add_message(session.id, "assistant", "streaming…", "streaming")
    doc = tmp_path / "from-second.md"
    doc.write_text("# hi")
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]),
                                           os.environ.get("PYTHONPATH", "")]))
    received: list[list[str]] = []
    first.filesReceived.connect(received.append)
    child = subprocess.Popen([sys.executable, "-m", "app", "relative.txt", str(doc)],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT)
    qtbot.waitUntil(lambda: child.poll() is not None, timeout=60_000)
    output = child.stdout.read().decode()
    assert child.returncode == 0, output
    assert "Traceback" not in output
    qtbot.waitUntil(lambda: bool(received), timeout=5_000)
    assert received == [[str(tmp_path / "relative.txt"), str(doc)]]
    (message,) = store.messages(session.id)
    assert message.status == "streaming"  # the first one's live answer is untouched
    store.close()


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path) -> None:
    child = subprocess.run(
        [sys.executable, "-c",
         "import os, sys; from pathlib import Path; from PySide6.QtCore import QLockFile;"
         f"lock = QLockFile({str(data_dir() / 'longleaf.lock')!r}); lock.setStaleLockTime(0);"
         "assert lock.tryLock(0); os._exit(0)"],  # dies holding it
        env=dict(os.environ), capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    assert (data_dir() / "longleaf.lock").exists()
    lock = InstanceLock(data_dir())
    assert lock.acquire()
    lock.release()


def test_a_dead_holders_lock_in_a_read_only_folder_opens_without_a_lock(monkeypatch) -> None:
    from PySide6.QtCore import QLockFile, QSysInfo

    # A crashed run's lock (its pid is gone) in a folder that turned read-only:
    # QLockFile finds it stale but cannot remove it, so it fails as if it were held.
    # Probed on a real read-only tmpfs before the change: no window, rc 1, "Longleaf
    # is already running … does not answer".
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()
    (data_dir() / "longleaf.lock").write_text(
        f"{dead}\nLongleaf\n{QSysInfo.machineHostName()}\n")
    monkeypatch.setattr(QLockFile, "tryLock", lambda self, timeout=0: False)
    monkeypatch.setattr(QLockFile, "error", lambda self: QLockFile.LockError.LockFailedError)
    assert take_data_folder([]) == (None, None)  # opens, writing nothing to the folder
    # A live holder still counts as one.
    (data_dir() / "longleaf.lock").write_text(
        f"{os.getpid()}\nLongleaf\n{QSysInfo.machineHostName()}\n")
    assert InstanceLock(data_dir()).held_elsewhere()


def test_a_message_nested_past_the_parser_attaches_nothing() -> None:
    from app.single_instance import _paths

    assert _paths(b"[" * 100_000 + b"]" * 100_000) == []  # was a RecursionError
    assert _paths(b'{"files": ["/a.txt"]}') == ["/a.txt"]


def test_the_socket_is_never_in_the_shared_tmp_root(tmp_path, monkeypatch) -> None:
    assert Path(socket_name(tmp_path)).parent == tmp_path
    deep = tmp_path / ("x" * 120)  # past a Unix socket path's length
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "run"))
    assert Path(socket_name(deep)).parent == tmp_path / "run"


def test_a_holder_that_reads_nothing_is_not_told_to_have_taken_the_files(
        first, tmp_path, monkeypatch) -> None:
    # A Longleaf whose window closed: its event loop has ended while finish() joins
    # the engine. Before, a write into the socket's buffer counted as taken: the
    # launch exited 0 and its files reached no one.
    import app.single_instance

    monkeypatch.setattr(app.single_instance, "HANDOFF_WAIT_S", 0.5)
    got: list[list[str]] = []
    first.filesReceived.connect(got.append)
    assert not hand_over(data_dir(), [str(tmp_path / "notes.txt")])
    assert got == []


def test_a_launch_while_the_holder_quits_takes_the_folder_once_it_is_free(
        qtbot, first, tmp_path) -> None:
    # The window's close was accepted: no more files are taken. The launch is not
    # answered, keeps trying, and opens its own window once the lock is given up.
    first.stop_listening()
    got: list[list[str]] = []
    first.filesReceived.connect(got.append)
    second = InstanceLock(data_dir())
    releaser = threading.Timer(0.5, first.release)
    releaser.start()
    try:
        assert not hand_over_or_take(second, [str(tmp_path / "notes.txt")], wait_s=10.0)
    finally:
        releaser.join()
    second.release()
    assert got == []


def test_a_window_whose_close_is_accepted_says_so(qtbot, tiny_llama) -> None:
    # What the app's main() stops listening on, before its event loop has ended.
    window = open_window(qtbot, tiny_llama)
    with qtbot.waitSignal(window.closeAccepted, timeout=5_000):
        close_window(window)
