"""``longleaf --self-test``: prove an install or a bundle carries everything.

Starts Qt (on whatever platform plugin is configured, e.g. offscreen), checks the
icon and stylesheet are in place, loads the demo model through the same
``EngineWorker`` the app uses, and generates a few tokens in every KV mode. Exit
code 0 means the GUI toolkit, MLX (with its data files), mlx-lm, the tokenizer
stack, the demo weights and the app's resources all work from here.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from app import style
from engine import MODES, EngineWorker, Event, Failed, Finished, SamplingParams, TokenChunk

PROMPT = "What is the capital of France?"
STEP_TIMEOUT_S = 600.0


class _Waiter:
    """Collects one request's tokens and wakes the caller when it ends."""

    def __init__(self) -> None:
        self.ended = threading.Event()
        self.ending: Finished | Failed | None = None
        self.text: list[str] = []
        self.tokens = 0

    def __call__(self, event: Event) -> None:
        if isinstance(event, TokenChunk):
            self.text.append(event.text)
            self.tokens += len(event.token_ids)
        elif isinstance(event, Finished | Failed):
            self.ending = event
            self.ended.set()

    def wait(self, what: str) -> Finished:
        if not self.ended.wait(STEP_TIMEOUT_S):
            raise RuntimeError(f"{what}: no answer from the engine in {STEP_TIMEOUT_S:.0f} s")
        ending, self.ending = self.ending, None
        self.ended.clear()
        if isinstance(ending, Failed):
            raise RuntimeError(f"{what}: {ending.error_type}: {ending.message}")
        assert ending is not None
        return ending

    def take_text(self) -> tuple[str, int]:
        text, tokens = "".join(self.text), self.tokens
        self.text, self.tokens = [], 0
        return text, tokens


def check_qt() -> str:
    """Start a QApplication and show a widget; returns the platform plugin name."""
    from PySide6.QtWidgets import QApplication, QLabel

    app = QApplication.instance() or QApplication([sys.argv[0]])
    label = QLabel("Longleaf self-test")
    label.show()
    app.processEvents()
    label.close()
    return QApplication.platformName()


def run_self_test(
    model: str = "demo", max_tokens: int = 8, out: TextIO | None = None
) -> int:
    """Load ``model`` and generate ``max_tokens`` greedy tokens in each KV mode.

    Returns:
        0 when every mode produced at least one token, 1 otherwise.
    """
    out = out or sys.stdout
    started = time.monotonic()
    try:
        out.write(f"self-test: Qt platform {check_qt()}\n")
    except Exception as error:  # any failure here means a broken install
        out.write(f"self-test: FAILED starting Qt: {error}\n")
        return 1
    missing = style.missing_resources()
    if missing:
        out.write(f"self-test: FAILED: {', '.join(missing)} not in {style.resources_dir()}\n")
        return 1
    out.write("self-test: icon and stylesheet found\n")
    waiter = _Waiter()
    worker = EngineWorker(waiter)
    worker.start()
    try:
        worker.load_model(model)
        waiter.wait(f"loading {model}")
        out.write(f"self-test: loaded {model}\n")
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens)
        for mode in MODES:
            session = f"self-test-{mode}"
            worker.open_session(session, mode)
            waiter.wait(f"opening a {mode} session")
            messages = [{"role": "user", "content": PROMPT}]
            worker.chat(session, messages, sampling, threading.Event())
            ending = waiter.wait(f"generating in {mode}")
            text, tokens = waiter.take_text()
            worker.close_session(session)
            waiter.wait(f"closing the {mode} session")
            if tokens == 0:
                out.write(f"self-test: FAILED {mode}: no tokens ({ending.reason})\n")
                return 1
            out.write(f"self-test: {mode}: {tokens} tokens ({ending.reason}): {text!r}\n")
    except RuntimeError as error:
        out.write(f"self-test: FAILED {error}\n")
        return 1
    finally:
        worker.shutdown(timeout=10.0)
    out.write(f"self-test: OK in {time.monotonic() - started:.1f} s\n")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``--self-test [--model M] [--max-tokens N]`` and run the self-test."""
    parser = argparse.ArgumentParser(prog="longleaf --self-test")
    parser.add_argument("--self-test", action="store_true")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--max-tokens", type=int, default=8)
    args, _ = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    return run_self_test(args.model, args.max_tokens)
