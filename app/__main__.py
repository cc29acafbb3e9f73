"""Start Longleaf: ``longleaf`` or ``python -m app``."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication

from app.style import apply_style, follow_system_theme

log = logging.getLogger("longleaf")


def create_app(argv: list[str]) -> QApplication:
    """The QApplication with Longleaf's names, icon and stylesheet."""
    app = QApplication.instance() or QApplication(argv)
    app.setApplicationName("Longleaf")
    app.setOrganizationName("Longleaf")
    app.setApplicationDisplayName("Longleaf")
    if sys.platform != "darwin":
        app.setStyle("Fusion")  # follows the system palette, looks the same everywhere
    apply_style(app)
    follow_system_theme(app)
    return app


def build_window(model: str | None = None):
    """Settings, history, engine and window, wired together and started."""
    from app.controller import ChatController
    from app.engine_bridge import EngineBridge
    from app.settings import Settings
    from app.store import HistoryStore
    from app.window.main_window import MainWindow

    settings = Settings()
    store = HistoryStore()
    bridge = EngineBridge(settings.memory_budget_bytes, settings.ingest_chunk)
    controller = ChatController(settings, store, bridge)
    window = MainWindow(controller)
    controller.start(model)
    if controller.recovered:
        window.banner.show_message(
            f"Longleaf quit unexpectedly last time; {controller.recovered} unfinished answer"
            f"{'s were' if controller.recovered != 1 else ' was'} kept and marked interrupted.",
            "info")
    return window


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
    app.setAttribute(Qt.ApplicationAttribute.AA_DontShowIconsInMenus, True)
    window = build_window(args.model)
    window.show()
    if args.files:
        window.add_files(args.files)
    code = app.exec()
    return finish(window, code)


def finish(window, code: int) -> int:
    """After the window closed: join the threads, close the history, exit in time.

    When the engine is still inside an uninterruptible MLX call (a prefill chunk,
    a model load) two seconds after the close, the process exits at once with
    ``os._exit``: the history is already saved and closed, and the only thing
    dropped is the in-memory KV cache, which is rebuilt on the next start. A
    normal interpreter exit would instead run C++ destructors under the running
    engine thread, which can abort the process.
    """
    from app.window.main_window import EXIT_WITHIN_S

    stopped = window.finish_closing(EXIT_WITHIN_S)
    window.controller.store.close()
    if not stopped:
        log.warning("the engine was still inside an MLX call %.1f s after closing; "
                    "history saved, exiting without waiting for it", EXIT_WITHIN_S)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
