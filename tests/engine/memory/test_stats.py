"""Memory snapshots, StatsSample assembly and the emission throttle."""

from __future__ import annotations

import dataclasses
import sys

import mlx.core as mx
import pytest

from engine.cache.adapter import CacheStats, LayerStats
from engine.events import LayerPages, StatsSample
from engine.memory.stats import (
    MemoryUsage,
    StatsThrottle,
    memory_usage,
    pressure_level,
    stats_sample,
)


def cache_stats(**changes) -> CacheStats:
    layers = (LayerStats(0, 2, 300, 500), LayerStats(1, 2, 300, 500))
    stats = CacheStats(mode="q6", page_size=256, tokens=300, pages_in_use=4, pages_allocated=6,
                       pages_free=2, last_page_fill=44 / 256, bytes_used=1000,
                       bytes_allocated=1500, budget_bytes=None, layers=layers)
    return dataclasses.replace(stats, **changes)


def test_memory_usage_is_plausible() -> None:
    mx.eval(mx.ones((256, 256)))
    snap = memory_usage()
    assert snap.system_total_bytes > 0
    assert 0 <= snap.system_available_bytes <= snap.system_total_bytes
    assert 0.0 <= snap.system_used_percent <= 100.0
    assert 0 < snap.process_rss_bytes < snap.system_total_bytes
    assert snap.mlx_peak_bytes >= snap.mlx_active_bytes >= 0
    assert snap.mlx_cache_bytes >= 0 and snap.swap_used_bytes >= 0


@pytest.mark.skipif(sys.platform == "darwin", reason="macOS reports a real level")
def test_pressure_level_is_none_off_macos() -> None:
    assert pressure_level() is None


@pytest.mark.skipif(sys.platform != "darwin", reason="needs macOS sysctl")
def test_pressure_level_on_macos() -> None:
    assert pressure_level() in ("normal", "warning", "critical")


def test_stats_sample_copies_cache_and_memory_fields() -> None:
    memory = MemoryUsage(1, 2, 3, 4, 5, 6, 7.5, 8, "normal")
    sample = stats_sample("s1", cache_stats(), memory)
    assert isinstance(sample, StatsSample)
    assert (sample.session_id, sample.kv_mode, sample.tokens_in_context) == ("s1", "q6", 300)
    assert (sample.kv_bytes_used, sample.kv_bytes_allocated) == (1000, 1500)
    assert (sample.pages_in_use, sample.pages_allocated, sample.pages_free) == (4, 6, 2)
    assert sample.page_size == 256 and sample.last_page_fill == pytest.approx(44 / 256)
    assert (sample.mlx_active_bytes, sample.mlx_peak_bytes, sample.mlx_cache_bytes) == (1, 2, 3)
    assert (sample.process_rss_bytes, sample.system_total_bytes) == (4, 5)
    assert (sample.system_available_bytes, sample.system_used_percent) == (6, 7.5)
    assert (sample.swap_used_bytes, sample.pressure_level) == (8, "normal")
    assert sample.layers == (LayerPages(0, 2, 300, 500), LayerPages(1, 2, 300, 500))
    assert sample.prefill_peak_bytes == 0  # not given: unknown


def test_stats_sample_carries_the_predicted_prefill_peak() -> None:
    memory = MemoryUsage(1, 2, 3, 4, 5, 6, 7.5, 8, None)
    sample = stats_sample("s1", cache_stats(), memory, prefill_peak_bytes=3 * 2**30,
                          checkpoint_bytes=5 * 2**20)
    assert sample.prefill_peak_bytes == 3 * 2**30 and sample.kv_bytes_allocated == 1500
    assert sample.checkpoint_bytes == 5 * 2**20


def test_stats_sample_without_a_session_reports_zero_pages() -> None:
    sample = stats_sample(None, None)
    assert sample.session_id is None and sample.kv_mode is None
    assert sample.pages_allocated == 0 and sample.layers == ()
    assert sample.system_total_bytes > 0


def test_throttle_is_due_once_per_interval() -> None:
    now = [100.0]
    throttle = StatsThrottle(0.25, clock=lambda: now[0])
    assert throttle.due()          # the first call is always due
    assert not throttle.due()
    now[0] += 0.2
    assert not throttle.due()
    now[0] += 0.06
    assert throttle.due()
    assert not throttle.due()


def test_stats_sample_carries_the_layers_outside_the_pages() -> None:
    from engine.cache.other_layers import OtherLayers

    memory = MemoryUsage(1, 2, 3, 4, 5, 6, 7.5, 8, None)
    cache = cache_stats(other_bytes=20 * 2**20)
    sample = stats_sample("s1", cache, memory,
                          other_layers=OtherLayers(24 * 2**20, "sliding windows", 4))
    assert sample.other_cache_bytes == 20 * 2**20
    assert sample.other_cache_bound_bytes == 24 * 2**20
    assert sample.checkpoint_bound_bytes == 4 * 24 * 2**20
    assert sample.other_cache_kinds == "sliding windows"
    assert stats_sample("s1", cache_stats(), memory).other_cache_kinds == ""
