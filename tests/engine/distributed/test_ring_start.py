"""The real ring: another program connects to a local rank's port before its peer does.

MLX's ring takes the first connection to a rank's port as its peer, so the group
never forms and its ranks give up. Was: the run failed after about 50 s with
"rank 1 … exited with code 1". Now the ranks are started again on other ports,
and that is said.
"""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from pathlib import Path

import pytest

from engine import cli
from engine.distributed import launch
from tests.engine.distributed.test_pipeline_cache import LAUNCH, REPO
from tests.engine.tinymodels import make_tiny_model_dir

pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")


class FirstToConnect:
    """Connects to ``port`` on 127.0.0.1 as soon as something listens there, and holds
    the connection (what any local program may do)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.held: list[socket.socket] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.held.append(socket.create_connection(("127.0.0.1", self.port), 1.0))
                return
            except OSError:
                time.sleep(0.0005)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        for sock in self.held:
            sock.close()


def test_a_program_that_connects_first_costs_a_new_start_not_the_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    model = make_tiny_model_dir(tmp_path, "qwen3_next")
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    monkeypatch.chdir(REPO)
    taken = launch.free_ports(2)
    starts = iter([taken])
    free = launch.free_ports
    monkeypatch.setattr(launch, "free_ports", lambda count: next(starts, None) or free(count))
    intruder = FirstToConnect(taken)  # rank 0 listens on the first port
    out = io.StringIO()
    try:
        status = cli.main(["generate", "--model", str(model), "--prompt", "Hello there",
                           "--max-tokens", "4", "--temp", "0", "--json", "--pipeline", "2"],
                          out=out)
    finally:
        intruder.close()
    assert intruder.held, "nothing connected first: this run tested nothing"
    said = capsys.readouterr().err
    assert (f"The pipeline's ranks could not connect to each other on ports {taken}-{taken + 1} "
            "of this machine ([ring] ") in said
    assert "another program may have connected to one of them first. Starting them again " \
           "on other ports." in said
    assert status == 0
    result = json.loads(out.getvalue().strip().splitlines()[-1])
    assert [share["rank"] for share in result["ranks"]] == [0, 1]
    assert result["tokens"]
