"""The paged cache under mlx-lm's pipeline split, on two local ring ranks (CPU).

mlx-lm's pipelined forward hangs a stage's send on its last layer's
``cache.keys``; the paged cache carries that dependency into what prefill
evaluates, and numbers its layers (rotation seeds included) as one process would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.tinymodels import make_tiny_model_dir

CHILD = Path(__file__).with_name("pipeline_child.py")
REPO = Path(__file__).resolve().parents[3]
LAUNCH = Path(sys.executable).with_name("mlx.launch")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def _run(model: Path, mode: str | None, out: Path, ranks: int,
         child: Path = CHILD) -> list[dict]:
    out.mkdir()
    command = [sys.executable, str(child), str(model), *([mode] if mode else []), str(out)]
    if ranks > 1:
        command = [str(LAUNCH), "-n", str(ranks), "--backend", "ring", *command]
    done = subprocess.run(command, env=_env(), capture_output=True, text=True, timeout=240,
                          cwd=REPO)
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    # mlx.launch can exit 0 when a rank failed: every rank must have reported.
    assert done.returncode == 0 and len(reports) == ranks, done.stdout[-2000:] + done.stderr[-3000:]
    return reports


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")


@pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")
@pytest.mark.parametrize("mode", ["fp16", "q8", "q6", "q4"])
def test_two_ranks_give_one_process_tokens_in_every_mode(hybrid: Path, tmp_path: Path,
                                                         mode: str) -> None:
    (one,) = _run(hybrid, mode, tmp_path / "one", ranks=1)
    ranks = _run(hybrid, mode, tmp_path / "two", ranks=2)
    assert [r["rank"] for r in ranks] == [0, 1]
    # Every rank computes the logits after the all_gather: same greedy tokens.
    assert all(r["tokens"] == one["tokens"] for r in ranks), (one, ranks)
    # mlx-lm gives rank 0 the last layers: each rank holds one of the two
    # full-attention layers, numbered (and rotated) as in one process.
    assert sorted(layer for r in ranks for layer in r["layers"]) == one["layers"]
    assert ranks[0]["layers"] == [one["layers"][1]] and ranks[1]["layers"] == [one["layers"][0]]
    assert all(r["rotations"] == (r["layers"] if mode != "fp16" else [None]) for r in ranks)
    assert sum(r["kv_bytes"] for r in ranks) == one["kv_bytes"]
