"""``python -m engine generate --pipeline 2``: two local ranks answer as one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.engine.distributed.test_pipeline_cache import LAUNCH, REPO
from tests.engine.tinymodels import make_tiny_model_dir

pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")
PROMPT = "The quick brown fox jumps over the lazy dog, twice over."


def _generate(model: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "engine", "generate", "--model", str(model),
               "--prompt", PROMPT, "--max-tokens", "8", "--chunk-size", "8", "--json", *extra]
    return subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def _json(done: subprocess.CompletedProcess[str]) -> dict:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next")


@pytest.mark.parametrize("sampling", [("--temp", "0"), ("--temp", "0.9", "--seed", "7")])
def test_two_ranks_answer_as_one_process(hybrid: Path, sampling: tuple[str, ...]) -> None:
    one = _json(_generate(hybrid, "--kv", "q6", *sampling))
    two = _json(_generate(hybrid, "--kv", "q6", "--pipeline", "2", *sampling))
    # Same tokens, greedy or sampled (every rank draws with the same seed).
    assert two["tokens"] == one["tokens"] and two["text"] == one["text"]
    ranks = two["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    # Rank 0 holds the last full-attention layer, rank 1 the first: half the pages each.
    assert [r["layers"] for r in ranks] == [[3], [1]]
    assert sum(r["kv_bytes"] for r in ranks) == one["kv_bytes"]
    # Each rank's KV is its share of the full-attention layers (goal: within 5%).
    layers = sum(len(r["layers"]) for r in ranks)
    for rank in ranks:
        share = one["kv_bytes"] * len(rank["layers"]) / layers
        assert abs(rank["kv_bytes"] - share) <= 0.05 * share, (rank, one["kv_bytes"])
        assert rank["free_bytes"] > 0 and rank["tokens_fit"]["q6"] > 0
    # The pool holds what its tightest rank holds, and says which rank that is.
    pool = two["pool"]
    for mode, tokens in pool["tokens_fit"].items():
        assert tokens == min(r["tokens_fit"][mode] for r in ranks)
        assert ranks[pool["tight_rank"][mode]]["tokens_fit"][mode] == tokens


def test_a_model_mlx_lm_cannot_split_is_refused_by_name(tmp_path: Path) -> None:
    llama = make_tiny_model_dir(tmp_path, "llama")
    done = _generate(llama, "--pipeline", "2")
    assert done.returncode == 1
    assert "cannot be split across machines" in done.stderr
    # Said before any rank starts (it was one rank's error, named by the launcher).
    assert "The pipeline run failed" not in done.stderr
