"""Run by test_persistence in a subprocess: start the app and answer forever.

The parent kills this process with SIGKILL while the answer streams.
"""

from __future__ import annotations

import sys

from PySide6.QtCore import QTimer

from app.__main__ import build_window, create_app
from app.settings import Settings
from engine.sampling import SamplingParams


def main() -> None:
    model, prompt = sys.argv[1], sys.argv[2]
    app = create_app([sys.argv[0]])
    settings = Settings()
    # The same settings as the in-process tests, whose answers are known to stream.
    settings.sampling = SamplingParams(temperature=0.0, max_tokens=3000, seed=0)
    settings.system_prompt = "You are terse."
    settings.sync()
    window = build_window(model)
    window.show()
    controller = window.controller

    def send_when_ready() -> None:
        if not controller.model_ready:
            QTimer.singleShot(50, send_when_ready)
            return
        window.composer.set_text(prompt)
        window.send()

    send_when_ready()
    app.exec()


if __name__ == "__main__":
    main()
