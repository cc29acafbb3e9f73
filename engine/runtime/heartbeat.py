"""Stats that keep flowing while one MLX step runs long.

A prefill chunk or a decode step at a long context can take seconds on a slow
machine, and the worker thread cannot take a sample in the middle of one. While
a request runs, a heartbeat thread repeats the worker's last sample once it is
late, with fresh process and system memory from psutil. The KV pages and MLX
counters stay as the worker last read them: MLX is only ever called on the worker
thread, and the pages cannot change until the step ends anyway.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType

from engine.events import Event, StatsSample
from engine.memory.stats import system_readings

log = logging.getLogger(__name__)
THREAD_NAME = "longleaf-stats"
# The heartbeat fills in only when the worker is late, so the two rarely both send.
LATE_FACTOR = 1.5
JOIN_TIMEOUT_S = 5.0


def with_fresh_system_memory(sample: StatsSample) -> StatsSample:
    """``sample`` with psutil's readings and the timestamp taken now (rank 0's free
    RAM among a pipeline's machines too)."""
    readings = system_readings()
    ranks = sample.ranks
    if ranks:
        ranks = (dataclasses.replace(ranks[0], free_bytes=readings["system_available_bytes"]),
                 *ranks[1:])
    return dataclasses.replace(sample, **readings, ranks=ranks, timestamp=time.time())


class StatsChannel:
    """Where samples are stamped, kept and sent, from either thread, in time order.

    Taking, storing and sending a sample happen under one lock, so listeners see
    timestamps only ever increase and the newest sample is the one kept.

    Args:
        emit: sends an event; called with the lock held, so it must not wait on
            the engine (a queued Qt signal or a list append is fine).
    """

    def __init__(self, emit: Callable[[Event], None]) -> None:
        self.emit = emit
        self._publish_lock = threading.Lock()
        self._sample: StatsSample | None = None

    def latest(self) -> StatsSample | None:
        """The newest sample, or None before the first."""
        return self._sample

    def publish(self, take: Callable[[], StatsSample]) -> StatsSample:
        """Take a sample with ``take()``, keep it and send it."""
        with self._publish_lock:
            sample = take()
            self._sample = sample
            self.emit(sample)
            return sample

    def repeat_if_late(self, late_after: float) -> float:
        """Resend the newest sample refreshed if it is ``late_after`` seconds old.

        Returns:
            Seconds until the newest sample will be late (0 after a resend).
        """
        with self._publish_lock:
            sample = self._sample
            if sample is None:
                return late_after
            wait = sample.timestamp + late_after - time.time()
            if wait > 0:
                return wait
            self._sample = with_fresh_system_memory(sample)
            self.emit(self._sample)
            return 0.0


class StatsHeartbeat:
    """A context manager whose thread resends the channel's sample when it is late.

    Args:
        channel: the worker's stats channel.
        interval: the worker's seconds between samples; a sample older than
            ``LATE_FACTOR`` intervals is resent.
    """

    def __init__(self, channel: StatsChannel, interval: float) -> None:
        self.channel = channel
        self.late_after = LATE_FACTOR * interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)

    def __enter__(self) -> StatsHeartbeat:
        if self.late_after > 0:
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
            self._thread.join(JOIN_TIMEOUT_S)
            if self._thread.is_alive():
                log.warning("stats heartbeat did not stop within %.0f s", JOIN_TIMEOUT_S)

    def _run(self) -> None:
        wait = self.late_after
        while not self._stop.wait(max(wait, 0.01)):
            try:
                wait = self.channel.repeat_if_late(self.late_after) or self.late_after
            except Exception:
                log.exception("stats heartbeat failed; the request carries on without it")
                return
