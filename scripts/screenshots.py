"""Screens of the app's main states with the demo model, for a person to look at.

Not a test: it drives the real window through a short walkthrough and saves one PNG
per state. Run it under a display (Xvfb on Linux) with a private HOME, e.g.::

    Xvfb :99 & DISPLAY=:99 HOME=$(mktemp -d) PYTHONPATH=. python scripts/screenshots.py shots/
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QEventLoop
from PySide6.QtWidgets import QWidget

from app.__main__ import create_app
from app.controller import ChatController
from app.engine_bridge import EngineBridge
from app.settings import Settings
from app.store import HistoryStore
from app.window.main_window import MainWindow
from engine.session.sampling import SamplingParams

DOCUMENT = "\n\n".join(
    f"Section {i}. The longleaf pine (Pinus palustris) grows in the coastal plain of the "
    f"southeastern United States. Stand {i} was burned in spring, and its grass stage "
    f"seedlings recovered within {i % 7 + 2} weeks, as the survey of plot {i * 13} notes."
    for i in range(1, 60))


def main(out: Path) -> None:
    app = create_app(sys.argv)  # the stylesheet and style the app itself runs with
    out.mkdir(parents=True, exist_ok=True)
    settings = Settings()
    settings.sampling = SamplingParams(temperature=0.0, max_tokens=40, seed=0)
    store = HistoryStore()
    bridge = EngineBridge(settings.memory_budget_bytes, settings.ingest_chunk)
    controller = ChatController(settings, store, bridge)
    window = MainWindow(controller)
    window.resize(1380, 860)
    window.show()

    def wait_until(done: Callable[[], bool], timeout: float = 600.0) -> bool:
        end = time.monotonic() + timeout
        while not done() and time.monotonic() < end:
            app.processEvents(QEventLoop.ProcessEventsFlag.AllEvents, 50)
            time.sleep(0.02)
        return done()

    def shot(name: str, widget: QWidget = window) -> None:
        wait_until(lambda: False, 0.6)  # let the panel's timers repaint
        widget.grab().save(str(out / name))
        print("saved", out / name, flush=True)

    def state_of(session_id: str) -> str | None:
        job = controller.activity.job_of(session_id)
        return None if job is None else job.state

    controller.start("demo")
    assert wait_until(lambda: controller.model_ready), "the demo model did not load"
    controller.new_session("q6")
    shot("1-new-chat.png")

    window.composer.set_text(f"{DOCUMENT}\n\nWhen did stand 12 recover?")
    window.fit.run()
    shot("1b-fit-line.png")  # what the message holds, before it is sent
    window.send()
    first = controller.current.id
    wait_until(lambda: state_of(first) == "reading")
    shot("2a-first-part.png")  # no part read yet: a busy bar
    wait_until(lambda: state_of(first) == "reading"
               and controller.activity.job_of(first).progress is not None)
    shot("2-reading.png")
    controller.new_session("q8")
    window.composer.set_text("Name three pines.")
    window.send()
    second = controller.current.id
    wait_until(lambda: state_of(second) in ("reading", "answering"), 30)
    shot("3-together.png")  # it starts beside the first; the panel names both
    controller.select_session(first)
    wait_until(lambda: state_of(first) == "answering")
    shot("4-answering.png")
    wait_until(lambda: state_of(first) is None and state_of(second) is None)

    controller.select_session(first)
    controller.caches.close(first)
    wait_until(lambda: bridge.stored_snapshot(first) is not None, 120)
    window.panel_feed.refresh()
    shot("5-stored-on-disk.png")
    controller.check_quality()
    wait_until(lambda: state_of(first) == "checking")
    shot("6-checking-quality.png")
    wait_until(lambda: state_of(first) is None)
    window.panel_feed.refresh()
    shot("7-quality-receipt.png")

    # A long read cancelled: "Stopping after this part…" at once, then what was kept.
    controller.new_session("q8")
    window.composer.set_text(f"{DOCUMENT}\n\n{DOCUMENT}\n\nSummarise the survey.")
    window.send()
    third = controller.current.id
    wait_until(lambda: state_of(third) == "reading"
               and controller.activity.job_of(third).progress is not None)
    window.composer.progress_cancel.click()
    shot("10-stopping.png")
    wait_until(lambda: state_of(third) is None)
    window.panel_feed.refresh()
    shot("11-stopped-read.png")

    window.open_models()
    wait_until(lambda: window.models_dialog is not None, 10)
    shot("8-models-dialog.png", window.models_dialog)
    window.models_dialog.close()

    window.resize(window.minimumSize())
    shot("9-minimum-size.png")
    window.resize(1380, 860)
    controller.select_session(first)  # the README's: answered, stored and checked
    window.panel_feed.refresh()
    shot("screenshot.png")
    window.close()
    window.finish_closing(10)
    store.close()


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "shots"))
