"""Stats that keep flowing while one MLX step runs long.

A prefill chunk or a decode step at a long context can take seconds on a slow
machine, and the worker thread cannot take a snapshot in the middle of one. While
a request runs, this thread repeats the worker's last snapshot whenever it is older
than the interval, with fresh process and system memory from psutil. The KV pages
and MLX counters stay as the worker last read them: MLX is only ever called on the
worker thread, and the pages cannot change until the step ends anyway.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType

from engine.events import StatsSample
from engine.stats import system_readings

log = logging.getLogger(__name__)
THREAD_NAME = "longleaf-stats"


def with_fresh_system_memory(sample: StatsSample) -> StatsSample:
    """``sample`` with psutil's readings and the timestamp taken now."""
    return dataclasses.replace(sample, **system_readings(), timestamp=time.time())


class LatestSample:
    """The newest snapshot, shared by the worker thread, the heartbeat and readers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sample: StatsSample | None = None

    def get(self) -> StatsSample | None:
        """The newest snapshot, or None before the first."""
        with self._lock:
            return self._sample

    def set(self, sample: StatsSample) -> None:
        """Make ``sample`` the newest."""
        with self._lock:
            self._sample = sample

    def replace(self, based_on: StatsSample, refreshed: StatsSample) -> bool:
        """Swap in ``refreshed`` only if ``based_on`` is still the newest."""
        with self._lock:
            if self._sample is not based_on:
                return False
            self._sample = refreshed
            return True


class StatsHeartbeat:
    """A context manager whose thread re-sends a stale snapshot every ``interval`` seconds.

    Args:
        latest: the worker's newest snapshot; a refreshed copy replaces it.
        emit: sends an event (called on the heartbeat thread).
        interval: seconds; a snapshot older than this is repeated.
    """

    def __init__(
        self, latest: LatestSample, emit: Callable[[object], None], interval: float
    ) -> None:
        self.latest = latest
        self.emit = emit
        self.interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)

    def __enter__(self) -> StatsHeartbeat:
        if self.interval > 0:
            self._thread.start()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            sample = self.latest.get()
            if sample is None or time.time() - sample.timestamp < self.interval:
                continue
            try:
                refreshed = with_fresh_system_memory(sample)
            except Exception:
                log.exception("stats heartbeat failed; the request carries on without it")
                return
            # A newer snapshot from the worker wins over this refreshed old one.
            if self.latest.replace(sample, refreshed):
                self.emit(refreshed)
