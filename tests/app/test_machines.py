"""Use other Macs in the app: a model that splits runs on a pipeline of two local ranks
(the real RemoteWorker, a hostfile of 127.0.0.1 twice); when rank 1 dies mid-answer the
answer names it, the chat is kept and the next send answers on this machine."""

from __future__ import annotations

import json
import os
import signal
import tempfile
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import Qt

from app.settings import Settings
from engine.distributed.remote import RemoteWorker
from engine.runtime.worker import EngineWorker
from tests.app.conftest import ANSWER_TIMEOUT_MS, close_window, open_window, send_and_wait
from tests.engine.tinymodels import make_tiny_model_dir

PIPELINE_TIMEOUT_MS = 300_000  # two ranks start, import MLX and load on a busy CPU


def _rank_pid(rank: int) -> int:
    # The group's report folder is in this run's private temp folder (engine's TMPDIR).
    found = sorted(Path(tempfile.gettempdir()).glob(f"pipeline-*/rank{rank}.pid"),
                   key=lambda path: path.stat().st_mtime)
    assert found, "no pid file of the running group"
    return int(found[-1].read_text(encoding="utf-8"))


def test_a_lost_mac_ends_the_answer_keeps_the_chat_and_falls_back(qtbot, tmp_path) -> None:
    model = make_tiny_model_dir(tmp_path, "qwen3_next", endless=True)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps({"backend": "ring", "hosts": [
        {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2}), encoding="utf-8")
    settings = Settings()
    settings.pipeline_enabled = True
    settings.pipeline_hostfile = str(hostfile)
    settings.sync()
    window = open_window(qtbot, model, max_tokens=6, load_timeout_ms=PIPELINE_TIMEOUT_MS)
    controller = window.controller
    try:
        assert isinstance(controller.bridge.worker, RemoteWorker)
        assert controller.machines.where == str(hostfile)
        controller.new_session("q8")
        assert send_and_wait(qtbot, window, "Hello over two ranks") == "complete"
        assert controller.model.message(1).content

        # A long answer; rank 1 dies once it streams.
        short = controller.settings.sampling
        controller.settings.sampling = replace(short, max_tokens=100_000)
        window.composer.set_text("Tell me a long story")
        with qtbot.waitSignal(controller.answerFinished, timeout=ANSWER_TIMEOUT_MS) as ended:
            qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
            qtbot.waitUntil(lambda: controller.model.rowCount() == 4
                            and bool(controller.model.message(3).content),
                            timeout=ANSWER_TIMEOUT_MS)
            os.kill(_rank_pid(1), signal.SIGKILL)
        assert ended.args[0] == "failed"
        answer = controller.model.message(3)
        assert "rank 1" in (answer.reason or ""), answer
        texts = [m.content for m in controller.store.messages(controller.current.id)]
        assert texts[0] == "Hello over two ranks" and texts[2] == "Tell me a long story"

        # Back on this machine: the model loads in-process, the banner says so. The
        # answer's failure comes before the group's loss: until the loss is read, the
        # pipeline's model is still the one ready.
        qtbot.waitUntil(lambda: isinstance(controller.bridge.worker, EngineWorker)
                        and controller.model_ready, timeout=PIPELINE_TIMEOUT_MS)
        banner = window.banner.label.text()
        assert "rank 1" in banner and "this Mac alone" in banner, banner
        controller.settings.sampling = short
        assert send_and_wait(qtbot, window, "And now?") == "complete"
        assert controller.model.message(5).content
    finally:
        close_window(window)
