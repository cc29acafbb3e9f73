"""``generate --pipeline 2 --speculative lookup``: drafts verified across two ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.distributed.test_pipeline_cache import LAUNCH, REPO
from tests.engine.tinymodels import CORPUS, make_tiny_model_dir

pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")


def _generate(model: Path, *extra: str) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "engine", "generate", "--model", str(model),
               "--prompt", CORPUS + "\nRepeat the text above.", "--max-tokens", "16",
               "--temp", "0", "--speculative", "lookup", "--json", *extra]
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_two_ranks_speculate_as_one_process(tmp_path: Path) -> None:
    hybrid = make_tiny_model_dir(tmp_path, "qwen3_next")
    one = _generate(hybrid, "--kv", "q6")
    two = _generate(hybrid, "--kv", "q6", "--pipeline", "2")
    # Every rank drafts from the same ids and verifies the same rows, so the split
    # changes neither the drafts nor the answer; the linear-attention layers of each
    # rank come back from their own checkpoint after a rejected draft.
    assert one["draft_tokens"] > 0
    assert (two["tokens"], two["draft_tokens"], two["accepted_tokens"], two["decode_steps"]) \
        == (one["tokens"], one["draft_tokens"], one["accepted_tokens"], one["decode_steps"])
