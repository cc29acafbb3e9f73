"""Stored KV of a pipeline: each rank its layers, one manifest naming the split.

A second run of the same chat on the same split reads only what is new (and the
other rank keeps parts of rank 0's snapshots only); a run on
another split of the same model refuses the stored KV with the reason, and reads
the conversation again.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.snapshots.files import manifest_path
from engine.snapshots.manifest import read_manifest
from engine.snapshots.snapshot import save_snapshot
from tests.engine.distributed.test_cli_pipeline import _generate, _json
from tests.engine.distributed.test_pipeline_cache import LAUNCH
from tests.engine.snapshot_fixtures import cache_session, config_only_model, filled_cache
from tests.engine.tinymodels import make_tiny_model_dir

pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")


def test_a_pipeline_chat_is_stored_per_rank_and_reopened_on_the_same_split(
        tmp_path: Path) -> None:
    model = make_tiny_model_dir(tmp_path, "qwen3_next")
    store = tmp_path / "kv"
    run = ("--session", "chat", "--session-dir", str(store), "--kv", "q8", "--temp", "0",
           "--pipeline", "2")
    first = _json(_generate(model, *run, "--split", "2,2"))
    assert first["reused_tokens"] == 0
    # One manifest on rank 0 names the split and every rank's weights; each rank's
    # folder holds its own layers of the same tokens.
    manifest = read_manifest(manifest_path(store, "cli-chat"))
    record = manifest["model"]["pipeline"]
    assert record["split"] == [[2, 4], [0, 2]]
    assert [r["rank"] for r in record["ranks"]] == [0, 1]
    assert all(len(r["digest"]) == 64 for r in record["ranks"])
    follower = read_manifest(manifest_path(store / "rank1", "cli-chat"))
    assert follower["tokens"] == manifest["tokens"]
    assert follower["kv_bytes"] > 0 and manifest["kv_bytes"] > 0

    # A part rank 0 holds no snapshot of (left by an older run): rank 1 drops it when
    # rank 0's stored KV changes, so a follower's disk goes with rank 0's budget.
    stale = cache_session(filled_cache("q8", 32, 1), 32, "q8", config_only_model(tmp_path))
    save_snapshot(stale, store / "rank1", "cli-gone")
    assert manifest_path(store / "rank1", "cli-gone").exists()

    second = _json(_generate(model, *run, "--split", "2,2"))
    assert not manifest_path(store / "rank1", "cli-gone").exists()
    assert manifest_path(store / "rank1", "cli-chat").exists()
    # Only the prompt's last token is fed again (it gives the first answer token).
    assert second["reused_tokens"] == second["prompt_tokens"] - 1
    assert second["prefill_tokens"] == 1, second
    assert second["tokens"] == first["tokens"]

    moved = _json(_generate(model, *run, "--split", "1,3"))
    assert moved["reused_tokens"] == 0 and moved["prefill_tokens"] == moved["prompt_tokens"]
    assert any("split as layers 0-1 on rank 1, layers 2-3 on rank 0; this run has layers "
               "0-2 on rank 1, layer 3 on rank 0" in notice for notice in moved["notices"]), moved
