"""The prefill rate model: seconds per token a + b·context, fitted from chunk timings."""

from __future__ import annotations

import random

import pytest

from engine.memory.prefill_rate import (
    MAX_TIMINGS,
    ChunkTiming,
    PrefillRate,
    dumps,
    least_squares_rate,
    loads,
    remember,
)

A, B = 4e-3, 2e-6  # 4 ms a token plus 2 µs per token of context before it


def _read(rate: PrefillRate, total: int, chunk: int, start: int = 0,
          noise: float = 0.0, rng: random.Random | None = None) -> list[ChunkTiming]:
    timings = []
    for begin in range(start, total, chunk):
        n = min(chunk, total - begin)
        seconds = rate.seconds(begin, begin + n)
        if rng is not None:
            seconds *= 1 + rng.uniform(-noise, noise)
        timings.append(ChunkTiming(n, begin, seconds))
    return timings


def test_the_fit_recovers_the_line_from_exact_timings() -> None:
    rate = least_squares_rate(_read(PrefillRate(A, B), 8192, 512))
    assert rate is not None
    assert rate.a == pytest.approx(A, rel=1e-6) and rate.b == pytest.approx(B, rel=1e-6)


def test_the_fit_stays_close_on_noisy_timings_of_several_reads() -> None:
    rng = random.Random(0)
    truth = PrefillRate(A, B)
    timings = (_read(truth, 6000, 512, noise=0.1, rng=rng)
               + _read(truth, 9000, 256, start=2000, noise=0.1, rng=rng))
    rate = least_squares_rate(timings)
    assert rate is not None
    assert rate.seconds(0, 8000) == pytest.approx(truth.seconds(0, 8000), rel=0.05)
    assert rate.b == pytest.approx(B, rel=0.3)


def test_the_time_to_read_is_the_integral_of_the_line() -> None:
    rate = PrefillRate(0.01, 1e-5)
    # ∫ from 1000 to 3000 of (0.01 + 1e-5·c) dc = 0.01·2000 + 1e-5·(3000² − 1000²)/2
    assert rate.seconds(1000, 3000) == pytest.approx(20 + 40)
    # Pieces add up to the whole: the ETA at any point plus what was read is the total.
    assert rate.seconds(0, 1200) + rate.seconds(1200, 3000) == pytest.approx(rate.seconds(0, 3000))
    assert rate.seconds(3000, 3000) == 0 and rate.seconds(3000, 1000) == 0
    assert rate.tokens_per_second(1000) == pytest.approx(1 / 0.02)


def test_reading_slows_with_context_so_later_tokens_take_longer() -> None:
    rate = least_squares_rate(_read(PrefillRate(A, B), 8192, 512))
    assert rate is not None
    # The second half of a read takes longer than the first: a constant rate would be wrong.
    assert rate.seconds(2048, 4096) > 1.2 * rate.seconds(0, 2048)


def test_no_timings_give_no_rate_and_one_chunk_gives_a_constant_rate() -> None:
    assert least_squares_rate([]) is None
    assert least_squares_rate([ChunkTiming(4, 0, 1.0)]) is None  # too short to be a rate
    rate = least_squares_rate([ChunkTiming(512, 0, 2.0)])
    assert rate is not None and rate.b == 0 and rate.a == pytest.approx(2.0 / 512)
    # One context cannot tell attention's term from the weights': the line without
    # it, not one that grows with the square of a long read (hours for 2,372 tokens
    # from one warm-up chunk of 37).
    for timings in ([ChunkTiming(37, 0, 3.566372)],
                    [ChunkTiming(64, 100, 1.0), ChunkTiming(64, 100, 1.1)]):
        rate = least_squares_rate(timings)
        assert rate is not None and rate.b == 0


def test_the_coefficients_never_go_negative() -> None:
    # Later chunks faster than early ones (a warm-up on the first): no negative slope.
    timings = [ChunkTiming(512, 0, 4.0), ChunkTiming(512, 512, 2.0),
               ChunkTiming(512, 1024, 1.9)]
    rate = least_squares_rate(timings)
    assert rate is not None and rate.a >= 0 and rate.b >= 0


def test_timings_round_trip_and_keep_only_the_most_recent() -> None:
    timings: tuple[ChunkTiming, ...] = ()
    for i in range(MAX_TIMINGS + 10):
        timings = remember(timings, ChunkTiming(256, 256 * i, 0.5 + i / 1000))
    assert len(timings) == MAX_TIMINGS and timings[0].start == 256 * 10
    assert loads(dumps(timings)) == tuple(
        ChunkTiming(t.tokens, t.start, round(t.seconds, 6)) for t in timings)
    assert loads("not json") == () and loads(None) == () and loads('[[1, 2]]') == ()
