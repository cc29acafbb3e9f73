"""Start Longleaf: ``longleaf`` or ``python -m app``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from typing import TYPE_CHECKING

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication

from app.style import apply_style, follow_system_theme

if TYPE_CHECKING:  # imported where used: the window's modules load after the arguments
    from app.single_instance import InstanceLock
    from app.store import HistoryOpened
    from app.window.main_window import MainWindow

log = logging.getLogger("longleaf")
MACOS_OPTIONS = ("-psn_", "-NS", "-Apple")  # options macOS itself reads
# How much longer than the window's close an engine that is storing the open chats'
# KV is waited for: minutes of reading for each chat saved by a few seconds' write,
# yet bounded, since a logout or a shutdown waits for no app for long.
STORE_AT_EXIT_S = 30.0


def create_app(argv: list[str]) -> QApplication:
    """The QApplication with Longleaf's names, icon and stylesheet."""
    existing = QApplication.instance()
    app = existing if isinstance(existing, QApplication) else QApplication(argv)
    app.setApplicationName("Longleaf")
    app.setOrganizationName("Longleaf")
    app.setApplicationDisplayName("Longleaf")
    if sys.platform != "darwin":
        app.setStyle("Fusion")  # follows the system palette, looks the same everywhere
    apply_style(app)
    follow_system_theme(app)
    return app


def model_argument(model: str | None) -> str | None:
    """``--model`` as the app keeps it: a folder by its absolute path, since it is
    remembered for the next launch, which may start in another folder."""
    if model is None or model == "demo":
        return model
    return os.path.abspath(os.path.expanduser(model))


def unknown_options(left: list[str]) -> list[str]:
    """The options among ``left``, what neither Longleaf nor Qt took: a typo
    (``--mdoel``) would otherwise pass without a word. macOS reads its own
    (``-psn_…`` from older Finder launches, ``-NS…`` and ``-Apple…`` defaults)."""
    return [arg for arg in left
            if arg.startswith("-") and not arg.startswith(MACOS_OPTIONS)]


def build_window(model: str | None = None, owns_data: bool = True) -> MainWindow:
    """Settings, history, engine and window, wired together and started.

    ``owns_data``: this process holds the data folder's lock. Without it the
    history is read into memory and nothing is written to the folder's history
    (another Longleaf may be writing it).
    """
    from app.controller import ChatController
    from app.engine_bridge import EngineBridge
    from app.settings import Settings
    from app.store import open_history
    from app.window.main_window import MainWindow

    settings = Settings()
    store, opened = open_history(writable=owns_data)
    bridge = EngineBridge(settings.memory_budget_bytes, settings.ingest_chunk,
                          settings.read_share)
    controller = ChatController(settings, store, bridge)
    window = MainWindow(controller)
    controller.start(model)
    about_history = history_note(opened)
    notes = [about_history] if about_history else []
    # Without the lock, "streaming" answers may be another Longleaf's live ones.
    if controller.recovered and owns_data:
        notes.append(
            f"Longleaf quit unexpectedly last time; {controller.recovered} unfinished answer"
            f"{'s were' if controller.recovered != 1 else ' was'} kept and marked interrupted.")
    if notes:
        # A damaged or unsaved history stays on screen until dismissed.
        window.banner.show_message(" ".join(notes), "error" if about_history else "info")
    return window


def history_note(opened: HistoryOpened) -> str:
    """What the banner says about how the history opened ("" when all is well)."""
    from app.format import counted

    parts = []
    if opened.damaged is not None:
        parts.append(
            f"The chat history was damaged. {counted(opened.chats, 'chat')} and "
            f"{counted(opened.messages, 'message')} were recovered; the damaged file is kept "
            f"at {opened.damaged}.")
    if opened.unsaved:
        parts.append(opened.unsaved)
    return " ".join(parts)


def take_data_folder(files: list[str]) -> tuple[InstanceLock | None, int | None]:
    """The data folder's lock for this process, or why this launch should not open.

    Returns:
        ``(lock, exit_code)``: the held ``InstanceLock`` (None when the folder
        cannot hold one: unwritable) and None to go on; or ``(None, code)`` when
        another Longleaf holds the folder: it was handed ``files`` (0), or it
        does not answer (1, said on stderr and in a dialog).
    """
    from app.single_instance import InstanceLock, hand_over_or_take
    from engine import data_dir

    try:
        folder = data_dir()
    except OSError:
        return None, None  # the history opens in memory and says why
    lock = InstanceLock(folder)
    if lock.acquire():
        return lock, None
    if not lock.held_elsewhere():
        log.warning("the data folder %s cannot hold a lock file; opening without one", folder)
        return None, None
    try:
        if hand_over_or_take(lock, files):
            return None, 0
    except TimeoutError as error:
        refuse_launch(f"Longleaf is already running with {folder}, but {error}. Close it "
                      "(or end its process in Activity Monitor) and start Longleaf again.")
        return None, 1
    return lock, None


def refuse_launch(message: str) -> None:
    """Why this launch ends before its window: on stderr, and in a dialog, since a
    launch from the Finder or the Dock has no terminal to read."""
    print(message, file=sys.stderr)
    from PySide6.QtWidgets import QApplication, QMessageBox

    if QApplication.instance() is not None:
        QMessageBox.critical(None, "Longleaf", message)


def main(argv: list[str] | None = None) -> int:
    """Run the app; returns the exit code."""
    args_in = sys.argv[1:] if argv is None else argv
    if "--self-test" in args_in:  # answered before any window is built
        from app.self_test import main as self_test

        return self_test(args_in)
    parser = argparse.ArgumentParser(prog="longleaf", description="Local long-context chat.")
    parser.add_argument("--model", help="model folder to load, or 'demo'")
    parser.add_argument("--self-test", action="store_true",
                        help="load the demo model, generate in every KV mode, exit 0 if all works")
    parser.add_argument("files", nargs="*", help="documents to attach")
    args, qt_args = parser.parse_known_args(args_in)
    app = create_app([sys.argv[0], *qt_args])
    for option in unknown_options(app.arguments()[1:]):
        print(f"longleaf: {option} is not an option and was ignored (longleaf --help "
              "lists them).", file=sys.stderr)
    app.setAttribute(Qt.ApplicationAttribute.AA_DontShowIconsInMenus, True)
    lock, code = take_data_folder(args.files)
    if code is not None:
        return code
    if lock is not None:
        # Listening at once: a launch meanwhile connects, and its files are read
        # once the event loop runs, after the window below exists.
        lock.listen()
    # No lock and a data folder: it could not hold a lock file; write nothing to it.
    window = build_window(model_argument(args.model),
                          owns_data=lock is not None or not _has_data_folder())
    if lock is not None:
        lock.filesReceived.connect(lambda paths: bring_files(window, paths))
        # A launch while this one quits is not answered, and so takes the folder
        # once it is free, instead of handing its files to a window that is gone.
        window.closeAccepted.connect(lock.stop_listening)
    window.show()
    if args.files:
        window.add_files(args.files)
    code = run_until_closed(app, window)
    try:
        return finish(window, code)
    finally:
        if lock is not None:
            lock.release()


def _has_data_folder() -> bool:
    from engine import data_dir

    try:
        data_dir()
    except OSError:
        return False
    return True


def bring_files(window: MainWindow, paths: list[str]) -> None:
    """Files a second launch handed over: attached as if dropped, the window raised."""
    window.add_files(paths)
    if window.isMinimized():
        window.showNormal()
    window.raise_()
    window.activateWindow()


def run_until_closed(app: QApplication, window: MainWindow) -> int:
    """``app.exec()``, with SIGTERM, SIGHUP and SIGINT closing the window as its Quit
    menu does (asking nothing); once it returns, a further one ends the process at once."""
    from app.quit_signals import end_at_once_on_signals, quit_signals

    with quit_signals(window.quit_now):
        code = app.exec()
    end_at_once_on_signals()
    return code


def finish(window: MainWindow, code: int) -> int:
    """After the window closed: join the threads, close the history, exit in time.

    When the engine is still inside an uninterruptible MLX call (a prefill chunk,
    a model load) two seconds after the close, the process exits at once with
    ``os._exit``: the history is already saved and closed, and the only thing
    dropped is the in-memory KV cache, which is rebuilt on the next start. A
    normal interpreter exit would instead run C++ destructors under the running
    engine thread, which can abort the process. An engine storing the open
    chats' KV to disk by then is waited for longer (``STORE_AT_EXIT_S``): the
    window is gone already, and dropping the store would make each of those
    chats read its whole conversation again with its next message.
    """
    from app.window.main_window import EXIT_WITHIN_S

    stopped = window.finish_closing(EXIT_WITHIN_S)
    bridge = window.controller.bridge
    storing = not stopped and bridge.storing_at_exit
    if storing:
        log.info("storing the open chats' KV before exiting (at most %.0f s more)",
                 STORE_AT_EXIT_S)
        stopped = bridge.finish_storing(STORE_AT_EXIT_S) and window.finish_closing(0)
    window.controller.store.close()
    if not stopped:
        log.warning(_not_stopped(storing, window.closed_at))
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _not_stopped(storing: bool, closed_at: float | None) -> str:
    """The log line for an exit that leaves the engine thread running: what it did."""
    after = time.monotonic() - closed_at if closed_at is not None else 0.0
    doing = ("still storing the open chats' KV (they will read their conversation again)"
             if storing else "still inside an MLX call (a prefill chunk or a model load)")
    return (f"the engine was {doing} {after:.1f} s after closing; history saved, "
            "exiting without waiting for it")


if __name__ == "__main__":
    sys.exit(main())
