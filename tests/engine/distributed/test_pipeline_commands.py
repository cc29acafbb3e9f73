"""Rank 0 commands, the other ranks follow: a cancel mid-prefill stops every rank.

A second chat of the same prompt takes the first chat's pages on every rank.

The followers have no schedule of their own: rank 0's cancel is the end of its
commands, so they stop after the chunk in flight and hold what rank 0 holds; the
next request on the same group continues from there. Their replies to the
request's fit check and end tell rank 0 each machine's share of the cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.cache.modes import MODES
from tests.engine.distributed.test_pipeline_cache import LAUNCH, _run
from tests.engine.tinymodels import make_tiny_model_dir

CHILD = Path(__file__).with_name("pipeline_worker_child.py")
pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict, dict]:
    """One process, then rank 0 and rank 1 of two, on the same requests."""
    tmp_path = tmp_path_factory.mktemp("pipeline_commands")
    model = make_tiny_model_dir(tmp_path, "qwen3_next")
    (one,) = _run(model, None, tmp_path / "one", ranks=1, child=CHILD)
    lead, follower = _run(model, None, tmp_path / "two", ranks=2, child=CHILD)
    return one, lead, follower


def test_a_cancel_mid_prefill_stops_every_rank_and_the_next_request_works(
        runs: tuple[dict, dict, dict]) -> None:
    one, lead, follower = runs
    reason, kept, total = lead["first"]
    assert reason == "cancelled" and 0 < kept < total, lead
    # Stopped within one chunk of the cancel, on every rank at the same token.
    assert kept <= 2 * 16
    assert follower["ends"][0] == kept and follower["cancelled"] == 1
    # The next request continues from the kept chunks and answers as one process does.
    assert lead["second"] == one["second"] and lead["tokens"] == one["tokens"]
    assert lead["prefill_tokens"] == total - kept
    if lead["second"] == "length":  # every answer token but the last was fed
        assert follower["ends"][1] == total - 1 + len(lead["tokens"])


def test_the_stats_and_the_fit_check_carry_every_machines_share(
        runs: tuple[dict, dict, dict]) -> None:
    one, lead, follower = runs
    # One machine: no machines list.
    assert one["sample_ranks"] == [] and one["fit_ranks"] == []
    assert all(one["pool"][mode] is None for mode in MODES)
    # Each rank's KV is its share of the full-attention layers (goal: within 5%).
    for shares in (lead["sample_ranks"], lead["fit_ranks"]):
        assert [share["rank"] for share in shares] == [0, 1]
        assert shares[1]["host"] == follower["host"] and shares[0]["host"]
        for share in shares:
            first, end = share["layers"]
            held = [layer for layer in one["layers"] if first <= layer < end]
            assert held, share  # the tiny model gives each rank one attention layer
            expected = one["kv_bytes"] * len(held) / len(one["layers"])
            assert abs(share["kv_bytes"] - expected) <= 0.05 * expected, (share, one)
            assert share["pages_in_use"] > 0 and share["free_bytes"] > 0
        assert sum(share["pages_in_use"] for share in shares) == one["pages"]
        assert shares[0]["kv_bytes"] == lead["kv_bytes"]
    # Rank 1's share is what it held at the request's end.
    assert lead["sample_ranks"][1]["pages_in_use"] == follower["pages_in_use"]
    # The split covers the model's layers once, rank 0 holding the last ones.
    (a, b), (c, d) = (share["layers"] for share in lead["fit_ranks"])
    assert c == 0 and d == a and b > a
    # The pool holds what its tightest machine holds, in every mode, and names it
    # only when that is under the model's context.
    for mode in MODES:
        fits = [share["tokens_fit"][MODES.index(mode)] for share in lead["fit_ranks"]]
        assert fits[0] == lead["own_fit"][mode]
        assert lead["pool"][mode] == min(fits)
        tight = lead["tight"][mode]
        assert (tight is None) == (min(fits) >= lead["max_context"])
        if tight is not None:
            assert fits[tight] == min(fits)


def test_a_second_chat_takes_the_first_chats_pages_on_every_rank(
        runs: tuple[dict, dict, dict]) -> None:
    one, lead, follower = runs
    reused = [n for n in one["notices"] if "another open chat" in n]
    assert reused and [n for n in lead["notices"] if "another open chat" in n] == reused
    # It read only what the first chat's pages did not hold, and answered as one process.
    assert lead["third"] == one["third"] and lead["third"][1] < lead["prefill_tokens"]
    assert lead["third_tokens"] == one["third_tokens"] == one["tokens"]
    # Rank 1 took the same prefix (its END check held) and answered the third request.
    assert len(follower["ends"]) == 3
