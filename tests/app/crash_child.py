"""Run by the app's crash and exit tests in a subprocess: the real app, scripted.

``python -m tests.app.crash_child MODEL PROMPT [--first TEXT] [--attach PATH]
[--chunk N] [--slow-chunk SECONDS] [--close-on-ingest] [--close-on-answer]
[--max-tokens N] [--term-on-answer] [--term-when-answered] [--draft TEXT]``

It optionally has a first exchange (``--first``), then sends ``PROMPT`` (with a
document when ``--attach``) and answers "forever". It prints ``ingest DONE TOTAL``
for each ingest progress event and ``answered STATUS`` after each answer, flushed,
so the parent acts at a known moment: SIGKILL mid-answer or mid-ingest, or
closing the window mid-ingest or mid-answer (``--close-on-ingest``,
``--close-on-answer``) and timing the exit.
``--term-on-answer`` and ``--term-when-answered`` send the app SIGTERM instead
(as a logout or ``kill`` does) mid-answer, or once the last answer ended with
``--draft`` just typed into the composer.
``--slow-chunk`` makes prefill chunks take that much longer on the engine
thread, standing in for a big model's chunk that MLX cannot interrupt.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

from PySide6.QtCore import QTimer

from app.__main__ import build_window, create_app, finish, run_until_closed
from app.settings import Settings
from app.window.quit_box import QUIT
from engine.session.prefill import Chunk
from engine.session.sampling import SamplingParams
from engine.session.session import Session


def slow_chunks(seconds: float) -> None:
    """Make each prefill chunk but a session's first take ``seconds`` longer.

    The first stays fast so that progress is reported before the slow ones.
    """
    forward = Session.forward

    def slow_forward(self: Session, chunk: Chunk, **options: Any) -> bool:
        sent_ahead = forward(self, chunk, **options)
        if self.tokens_ingested > len(chunk.ids):
            time.sleep(seconds)
        return sent_ahead

    Session.forward = slow_forward


def say(line: str) -> None:
    print(line, flush=True)


def terminate(sent: list[bool]) -> None:
    """SIGTERM to this process, once (``sent`` remembers): what a logout or ``kill``
    sends."""
    if not sent:
        sent.append(True)
        say("closing")
        os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("prompt")
    parser.add_argument("--first", default="")
    parser.add_argument("--attach", default="")
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--slow-chunk", type=float, default=0.0)
    parser.add_argument("--close-on-ingest", action="store_true")
    parser.add_argument("--close-on-answer", action="store_true")
    parser.add_argument("--max-tokens", type=int, default=3000)
    parser.add_argument("--term-on-answer", action="store_true")
    parser.add_argument("--term-when-answered", action="store_true")
    parser.add_argument("--draft", default="")
    args = parser.parse_args()
    if args.slow_chunk:
        slow_chunks(args.slow_chunk)
    app = create_app([sys.argv[0]])
    settings = Settings()
    # The same settings as the in-process tests, whose answers are known to stream.
    settings.sampling = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, seed=0)
    settings.system_prompt = "You are terse."
    settings.ingest_chunk = args.chunk
    settings.sync()
    window = build_window(args.model)
    window.show()
    controller = window.controller
    steps = [args.first] if args.first else []
    steps.append(args.prompt)

    def on_progress(event) -> None:
        say(f"ingest {event.tokens_done} {event.tokens_total}")
        if args.close_on_ingest and window.isVisible():
            say("closing")
            window.close()
            if window.quit_box is not None:  # asked mid-read: Quit
                window.quit_box.button(QUIT).click()

    controller.ingestProgress.connect(on_progress)

    terminated: list[bool] = []

    def on_answer_text(_text: str) -> None:
        if args.term_on_answer:
            terminate(terminated)
        if args.close_on_answer and window.isVisible():
            say("closing")
            window.close()
            if window.quit_box is not None:  # asked mid-answer: Quit, keeping the answer
                window.quit_box.button(QUIT).click()

    controller.model.streamFlushed.connect(on_answer_text)

    def on_answered(status: str) -> None:
        say(f"answered {status}")
        if args.term_when_answered and not steps:
            window.composer.set_text(args.draft)  # typed just now: not saved by its timer yet
            QTimer.singleShot(0, lambda: terminate(terminated))
        QTimer.singleShot(0, send_next)

    controller.answerFinished.connect(on_answered)

    def send_next() -> None:
        if not steps or window.closed_at is not None:
            return
        if not controller.model_ready or window.loader.pending:
            QTimer.singleShot(50, send_next)
            return
        if len(steps) == 1 and args.attach and not window.attachments:
            if not window.composer.chips:
                window.add_files([args.attach])
            QTimer.singleShot(50, send_next)
            return
        window.composer.set_text(steps.pop(0))
        window.send()

    send_next()
    code = run_until_closed(app, window)
    started = time.monotonic()
    code = finish(window, code)
    say(f"joined in {time.monotonic() - started:.2f} s")
    sys.exit(code)


if __name__ == "__main__":
    main()
