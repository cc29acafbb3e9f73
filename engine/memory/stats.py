"""Cheap samples of KV pages, MLX memory and system memory.

Nothing here evaluates an MLX graph: the MLX counters are allocator reads and
the page numbers come from ``engine.cache.adapter.cache_stats``, so a sample is safe
to take several times a second while a model is generating.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
import time
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import psutil

from engine.cache.adapter import CacheStats
from engine.cache.other_layers import OtherLayers
from engine.events import LayerPages, RankShare, StatsSample

# kern.memorystatus_vm_pressure_level values (xnu's kern_memorystatus.h).
_PRESSURE_NAMES = {1: "normal", 2: "warning", 4: "critical"}
_libc: Any = None


@dataclass(frozen=True)
class MemoryUsage:
    """MLX, process and system memory at one instant, in bytes."""

    mlx_active_bytes: int
    mlx_peak_bytes: int
    mlx_cache_bytes: int
    process_rss_bytes: int
    system_total_bytes: int
    system_available_bytes: int
    system_used_percent: float
    swap_used_bytes: int
    pressure_level: str | None


def _sysctl_int(name: str) -> int | None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    value = ctypes.c_int(0)
    size = ctypes.c_size_t(ctypes.sizeof(value))
    status = _libc.sysctlbyname(
        name.encode(), ctypes.byref(value), ctypes.byref(size), None, ctypes.c_size_t(0)
    )
    return value.value if status == 0 else None


def pressure_level() -> str | None:
    """Return macOS's memory pressure ("normal", "warning", "critical"), else None.

    Read through ``sysctlbyname`` rather than by spawning ``sysctl`` so it costs
    microseconds; other platforms have no equivalent and report None.
    """
    if sys.platform != "darwin":
        return None
    try:
        level = _sysctl_int("kern.memorystatus_vm_pressure_level")
    except (OSError, AttributeError):
        return None
    return _PRESSURE_NAMES.get(level) if level is not None else None


def system_readings() -> dict[str, Any]:
    """psutil's process and system memory, and the macOS pressure level; no MLX call."""
    virtual = psutil.virtual_memory()
    return {
        "process_rss_bytes": int(psutil.Process().memory_info().rss),
        "system_total_bytes": int(virtual.total),
        "system_available_bytes": int(virtual.available),
        "system_used_percent": float(virtual.percent),
        "swap_used_bytes": int(psutil.swap_memory().used),
        "pressure_level": pressure_level(),
    }


def memory_usage() -> MemoryUsage:
    """Return MLX allocator counters plus psutil's process and system memory."""
    return MemoryUsage(
        mlx_active_bytes=int(mx.get_active_memory()),
        mlx_peak_bytes=int(mx.get_peak_memory()),
        mlx_cache_bytes=int(mx.get_cache_memory()),
        **system_readings(),
    )


def _kv_fields(cache: CacheStats | None) -> dict[str, Any]:
    """StatsSample's page fields from the cache's own stats (all zero without pages)."""
    if cache is None:
        return dict(kv_mode=None, tokens_in_context=0, kv_bytes_used=0, kv_bytes_allocated=0,
                    pages_in_use=0, pages_allocated=0, pages_free=0, page_size=0,
                    last_page_fill=0.0)
    return dict(
        kv_mode=cache.mode,
        tokens_in_context=cache.tokens,
        kv_bytes_used=cache.bytes_used,
        kv_bytes_allocated=cache.bytes_allocated,
        pages_in_use=cache.pages_in_use,
        pages_allocated=cache.pages_allocated,
        pages_free=cache.pages_free,
        page_size=cache.page_size,
        last_page_fill=cache.last_page_fill,
        layers=tuple(
            LayerPages(layer=layer.layer, pages_in_use=layer.pages_in_use,
                       tokens=layer.tokens, bytes_used=layer.bytes_used)
            for layer in cache.layers
        ),
        other_cache_bytes=cache.other_bytes,
        kv_shared_bytes=cache.shared_bytes,
        kv_bytes_once=cache.bytes_once,
        kv_shared_with=cache.shared_with,
        kv_bytes_held_once=cache.bytes_held_once,
    )


def stats_sample(
    session_id: str | None,
    cache_stats: CacheStats | None,
    memory: MemoryUsage | None = None,
    prefill_peak_bytes: int = 0,
    checkpoint_bytes: int = 0,
    other_layers: OtherLayers | None = None,
    ranks: tuple[RankShare, ...] = (),
) -> StatsSample:
    """Build a ``StatsSample`` from the cache's ``CacheStats`` (or None) and memory.

    Args:
        session_id: the session the pages belong to, or None when idle.
        cache_stats: ``engine.cache.adapter.CacheStats`` of that session, or None.
        memory: the memory usage to use; read now when None.
        prefill_peak_bytes: the session's predicted prefill peak
            (``Session.prefill_peak_bytes``), or 0.
        checkpoint_bytes: bytes of the session's checkpoints, or 0.
        other_layers: the session's ``engine.cache.other_layers.OtherLayers``: the
            bound its budget keeps for the layers outside the pages, and their kinds.
        ranks: a pipeline's machines, rank 0 first (empty on one machine).
    """
    memory = memory or memory_usage()
    others = other_layers or OtherLayers()
    return StatsSample(
        session_id=session_id,
        **_kv_fields(cache_stats),
        mlx_active_bytes=memory.mlx_active_bytes,
        mlx_peak_bytes=memory.mlx_peak_bytes,
        mlx_cache_bytes=memory.mlx_cache_bytes,
        process_rss_bytes=memory.process_rss_bytes,
        system_total_bytes=memory.system_total_bytes,
        system_available_bytes=memory.system_available_bytes,
        system_used_percent=memory.system_used_percent,
        swap_used_bytes=memory.swap_used_bytes,
        pressure_level=memory.pressure_level,
        timestamp=time.time(),
        prefill_peak_bytes=int(prefill_peak_bytes),
        checkpoint_bytes=int(checkpoint_bytes),
        other_cache_bound_bytes=others.bound_bytes,
        checkpoint_bound_bytes=others.reserve_bytes - others.bound_bytes,
        other_cache_kinds=others.kinds,
        ranks=ranks,
    )


class StatsThrottle:
    """Says when the next sample is due, so callers emit at a steady rate.

    Args:
        interval: seconds between samples; 0.25 gives 4 Hz, comfortably above
            the 2 Hz the live panel needs.
        clock: monotonic clock, injectable for tests.
    """

    def __init__(self, interval: float = 0.25, clock: Any = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._last: float | None = None

    def due(self) -> bool:
        """Return True (and restart the interval) when a sample is due."""
        now = self._clock()
        if self._last is not None and now - self._last < self.interval:
            return False
        self._last = now
        return True
