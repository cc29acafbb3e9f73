"""How fast this machine reads a prompt in, as a function of the context length.

Reading one token at context ``c`` costs the weights' work, the same at every
position, plus attention over the ``c`` tokens before it: ``a + b·c`` seconds
per token. A chunk of ``n`` tokens read after ``c0`` held ones therefore takes
the integral of that line from ``c0`` to ``c0 + n``::

    seconds = a·n + b·n·(c0 + n/2)

which is linear in ``a`` and ``b``, so a least-squares fit over the engine's own
chunk timings (``engine.events.IngestProgress``) is a 2×2 solve. Pure Python and
MLX-free: the app fits and persists it; the engine only reports the timings.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass

MAX_TIMINGS = 96  # the most recent chunks kept: a few long reads' worth
MIN_CHUNK_TOKENS = 16  # a shorter chunk is mostly fixed overhead, not a rate


@dataclass(frozen=True)
class ChunkTiming:
    """One prefill chunk: ``tokens`` read after ``start`` held ones, in ``seconds``."""

    tokens: int
    start: int
    seconds: float


@dataclass(frozen=True)
class PrefillRate:
    """Seconds per token read at context ``c``: ``a + b·c`` (both at least 0)."""

    a: float
    b: float

    def seconds_per_token(self, context: int) -> float:
        """Seconds one token takes when ``context`` tokens precede it."""
        return self.a + self.b * context

    def tokens_per_second(self, context: int) -> float:
        """The reading rate at ``context`` (0 when the line says nothing)."""
        per_token = self.seconds_per_token(context)
        return 1.0 / per_token if per_token > 0 else 0.0

    def seconds(self, start: int, stop: int) -> float:
        """Seconds to read from context ``start`` to ``stop``: the line's integral."""
        if stop <= start:
            return 0.0
        return self.a * (stop - start) + self.b * (stop * stop - start * start) / 2


def _features(timing: ChunkTiming) -> tuple[float, float]:
    n = float(timing.tokens)
    return n, n * (timing.start + n / 2)


def least_squares_rate(timings: Iterable[ChunkTiming]) -> PrefillRate | None:
    """The least-squares ``a + b·c`` line through ``timings`` (None without any).

    Both coefficients are kept non-negative: where the free solution has one
    below zero (noise) the better of the two one-coefficient fits is taken
    instead. Timings that cannot tell the two terms apart (every chunk at one
    context) give the line without attention: both one-term fits pass through
    them, and only that one does not grow with the square of a long read.
    """
    rows = [(_features(t), t.seconds) for t in timings
            if t.tokens >= MIN_CHUNK_TOKENS and t.seconds > 0]
    if not rows:
        return None
    s11 = sum(x1 * x1 for (x1, _), _ in rows)
    s12 = sum(x1 * x2 for (x1, x2), _ in rows)
    s22 = sum(x2 * x2 for (_, x2), _ in rows)
    s1y = sum(x1 * y for (x1, _), y in rows)
    s2y = sum(x2 * y for (_, x2), y in rows)
    det = s11 * s22 - s12 * s12
    only_a = PrefillRate(s1y / s11, 0.0)
    if det <= 1e-9 * s11 * s22:
        return only_a
    a = (s1y * s22 - s2y * s12) / det
    b = (s2y * s11 - s1y * s12) / det
    if a >= 0 and b >= 0:
        return PrefillRate(a, b)
    only_b = PrefillRate(0.0, s2y / s22) if s22 > 0 else only_a

    def residual(rate: PrefillRate) -> float:
        return sum((y - rate.a * x1 - rate.b * x2) ** 2 for (x1, x2), y in rows)

    return min((only_a, only_b), key=residual)


def remember(timings: tuple[ChunkTiming, ...],
             new: ChunkTiming) -> tuple[ChunkTiming, ...]:
    """``timings`` with ``new`` added, the oldest dropped past ``MAX_TIMINGS``."""
    return (*timings, new)[-MAX_TIMINGS:]


def dumps(timings: Iterable[ChunkTiming]) -> str:
    """Timings as compact JSON (``[[tokens, start, seconds], …]``), for the settings."""
    return json.dumps([[t.tokens, t.start, round(t.seconds, 6)] for t in timings],
                      separators=(",", ":"))


def loads(text: str | None) -> tuple[ChunkTiming, ...]:
    """Timings from ``dumps``; anything unreadable gives none (a fresh start, no error)."""
    try:
        rows = json.loads(text) if text else []
        return tuple(ChunkTiming(int(n), int(c), float(s)) for n, c, s in rows)[-MAX_TIMINGS:]
    except (TypeError, ValueError):
        return ()
