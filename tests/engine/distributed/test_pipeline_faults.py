"""A rank that dies or stalls mid-answer ends ``generate --pipeline 2`` with an error naming it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.engine.distributed.test_pipeline_cache import LAUNCH, REPO
from tests.engine.tinymodels import make_tiny_model_dir

pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")
BOUND = 10.0  # the bound for the error after a rank dies or stalls


def _wait_for(pattern: str, folder: Path, process: subprocess.Popen[str]) -> Path:
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        found = sorted(folder.glob(pattern))
        if found:
            return found[0]
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.2)
    raise AssertionError(f"no {pattern} under {folder}")


@pytest.mark.parametrize(("sent", "says"), [
    (signal.SIGKILL, "its process was killed"),
    # Stopped, not gone: its pid lives on, only its silence tells.
    (signal.SIGSTOP, "it stopped responding"),
], ids=["killed", "stopped"])
def test_a_lost_rank_ends_the_run_with_an_error_naming_it(tmp_path: Path, sent: signal.Signals,
                                                          says: str) -> None:
    model = make_tiny_model_dir(tmp_path, "qwen3_next", endless=True)
    # The launcher's report folder is in Longleaf's private temp folder: make it ours.
    runs = tmp_path / "home"
    env = {**os.environ, "LONGLEAF_HOME": str(runs)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "engine", "generate", "--model", str(model),
               "--prompt", "Tell me a long story.", "--max-tokens", "100000",
               "--temp", "0", "--pipeline", "2"]
    process = subprocess.Popen(command, env=env, cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        rank1 = _wait_for("**/pipeline-*/rank1.pid", runs, process)
        _wait_for("**/pipeline-*/rank0.pid", runs, process)
        time.sleep(3.0)  # past loading and the short prefill: the ranks are decoding
        assert process.poll() is None, "the answer ended before rank 1 could be killed"
        assert not rank1.with_suffix(".json").exists()
        os.kill(int(rank1.read_text()), sent)
        killed = time.monotonic()
        _, stderr = process.communicate(timeout=60)
        took = time.monotonic() - killed
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()
    assert process.returncode == 1, stderr[-3000:]
    assert "failed on rank 1 " in stderr and "rank 0" not in stderr, stderr[-3000:]
    assert says in stderr, stderr[-3000:]
    assert took <= BOUND, f"the error came {took:.1f} s after the kill"
