"""Stats keep flowing while one MLX step runs long, without calling MLX off its thread."""

from __future__ import annotations

import dataclasses
import threading
import time

from engine.events import StatsSample
from engine.memory.stats import stats_sample
from engine.runtime.heartbeat import LATE_FACTOR, THREAD_NAME, StatsChannel, StatsHeartbeat


def _aged(seconds: float) -> StatsSample:
    sample = stats_sample("s", None)
    return dataclasses.replace(sample, timestamp=sample.timestamp - seconds, process_rss_bytes=1,
                               mlx_active_bytes=12345, tokens_in_context=77)


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_a_late_sample_is_resent_with_fresh_system_memory() -> None:
    sent: list[StatsSample] = []
    channel = StatsChannel(sent.append)
    stale = channel.publish(lambda: _aged(60))
    with StatsHeartbeat(channel, interval=0.01):
        _wait_for(lambda: len(sent) >= 3)
    assert not any(t.name == THREAD_NAME for t in threading.enumerate())
    repeats = sent[1:]
    assert len(repeats) >= 2 and channel.latest() is sent[-1]
    for sample in repeats:
        assert sample.process_rss_bytes > 1 and sample.timestamp > stale.timestamp
        # What only the worker thread may read stays as it read it.
        assert (sample.mlx_active_bytes, sample.tokens_in_context) == (12345, 77)


def test_a_sample_is_resent_only_once_it_is_late() -> None:
    sent: list[StatsSample] = []
    channel = StatsChannel(sent.append)
    channel.publish(lambda: _aged(0.5))
    assert channel.repeat_if_late(1.0) > 0.4 and len(sent) == 1  # not late yet
    assert channel.repeat_if_late(0.4) == 0.0 and len(sent) == 2
    assert channel.repeat_if_late(0.4) > 0.3 and len(sent) == 2  # the resend is fresh


def test_a_fresh_sample_is_not_repeated() -> None:
    sent: list[StatsSample] = []
    channel = StatsChannel(sent.append)
    # Stamped an hour ahead: it stays "fresh" however slowly this machine runs.
    channel.publish(lambda: _aged(-3600))
    with StatsHeartbeat(channel, interval=0.01):
        time.sleep(0.2)
    assert len(sent) == 1


def test_samples_from_both_threads_reach_listeners_in_time_order() -> None:
    sent: list[StatsSample] = []
    channel = StatsChannel(sent.append)
    channel.publish(lambda: _aged(60))
    with StatsHeartbeat(channel, interval=0.001 / LATE_FACTOR):
        for _ in range(200):  # the worker publishing while the heartbeat resends
            channel.publish(lambda: stats_sample("s", None))
    stamps = [s.timestamp for s in sent]
    assert stamps == sorted(stamps) and channel.latest() is sent[-1]
