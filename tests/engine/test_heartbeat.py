"""Stats keep flowing while one MLX step runs long, without calling MLX off its thread."""

from __future__ import annotations

import dataclasses
import threading
import time

from engine.events import StatsSample
from engine.heartbeat import THREAD_NAME, LatestSample, StatsHeartbeat
from engine.stats import stats_sample


def _stale_sample() -> StatsSample:
    sample = stats_sample("s", None)
    return dataclasses.replace(sample, timestamp=sample.timestamp - 60, process_rss_bytes=1,
                               mlx_active_bytes=12345, tokens_in_context=77)


def _heartbeat(latest: LatestSample, sent: list, interval: float) -> StatsHeartbeat:
    return StatsHeartbeat(latest, sent.append, interval)


def test_a_stale_sample_is_resent_with_fresh_system_memory() -> None:
    latest, sent = LatestSample(), []
    stale = _stale_sample()
    latest.set(stale)
    with _heartbeat(latest, sent, interval=0.01):
        deadline = time.monotonic() + 30
        while len(sent) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert not any(t.name == THREAD_NAME for t in threading.enumerate())
    assert len(sent) >= 2 and latest.get() is sent[-1]
    for sample in sent:
        assert sample.process_rss_bytes > 1 and sample.timestamp > stale.timestamp
        # What only the worker thread may read stays as it read it.
        assert (sample.mlx_active_bytes, sample.tokens_in_context) == (12345, 77)


def test_a_fresh_sample_is_not_repeated() -> None:
    latest, sent = LatestSample(), []
    sample = stats_sample("s", None)
    # Stamped an hour ahead: it stays "fresh" however slowly this machine runs.
    latest.set(dataclasses.replace(sample, timestamp=sample.timestamp + 3600))
    with _heartbeat(latest, sent, interval=0.01):
        time.sleep(0.2)
    assert sent == []


def test_a_newer_worker_sample_wins_over_a_refreshed_old_one() -> None:
    latest = LatestSample()
    old, newer = _stale_sample(), stats_sample("s", None)
    latest.set(old)
    latest.set(newer)
    assert not latest.replace(old, stats_sample("s", None))
    assert latest.get() is newer
