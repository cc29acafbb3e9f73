"""The worker's stats of a session: sent when due, when its pages change, and
repeated by a heartbeat while one MLX step runs long (``engine.runtime.heartbeat``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from engine.events import Event, StatsSample
from engine.memory.stats import StatsThrottle, memory_usage, stats_sample
from engine.runtime.heartbeat import StatsChannel, StatsHeartbeat

if TYPE_CHECKING:
    from engine.session.session import Session


class StatsReporter:
    """Takes a session's ``StatsSample`` and sends it; keeps the newest.

    Args:
        emit: sends an event (see ``StatsChannel``).
        interval: seconds between samples while a request runs.
        after_publish: called (on the engine thread) after each sample is taken,
            to freeze with it what fit checks read from other threads.
    """

    def __init__(
        self, emit: Callable[[Event], None], interval: float,
        after_publish: Callable[[], None] = lambda: None,
    ) -> None:
        self._channel = StatsChannel(emit)
        self._throttle = StatsThrottle(interval)
        self._after_publish = after_publish

    def latest(self) -> StatsSample | None:
        """The last sample taken; never calls MLX."""
        return self._channel.latest()

    def publish(self, session: Session) -> None:
        """Send a sample of ``session`` (None or an empty cache: memory only) now."""
        live = session is not None and bool(session.cache)
        cache_stats = session.stats() if live else None
        peak = session.prefill_peak_bytes() if live else 0
        held = session.checkpoints.nbytes if live else 0
        others = session.other_layers() if live else None
        session_id = session.session_id if session else None
        # A pipeline's machines: rank 0's pages now, the others' as they last said
        # (at the session's open, a request's fit check and its end).
        followers = session.followers if live else None

        def take() -> StatsSample:
            memory = memory_usage()
            ranks = () if followers is None or cache_stats is None else followers.machines(
                int(cache_stats.bytes_used), int(cache_stats.pages_in_use),
                memory.system_available_bytes)
            return stats_sample(session_id, cache_stats, memory, prefill_peak_bytes=peak,
                                checkpoint_bytes=held, other_layers=others, ranks=ranks)
        self._channel.publish(take)
        self._after_publish()

    def tick_for(self, session: Session) -> Callable[[], None]:
        """A callback for between MLX steps: publishes ``session`` once a sample is due."""
        def tick() -> None:
            if self._throttle.due():
                self.publish(session)
        return tick

    def publish_when_due(self, sessions: Sequence[Session]) -> None:
        """Publish each of ``sessions`` once a sample is due (a batch's, after a step)."""
        if sessions and self._throttle.due():
            for session in sessions:
                self.publish(session)

    def heartbeat(self) -> StatsHeartbeat:
        """A context manager that repeats the newest sample while a step runs long."""
        return StatsHeartbeat(self._channel, self._throttle.interval)
