"""Attention work split over CPU streams, so every core has some.

On MLX's CPU backend an elementwise op runs on its stream's one thread, and a
prefill chunk's attention is mostly the exponentials of its scores
(docs/benchmarks.md, "Figures behind constants"): one stream leaves the other cores idle.
Heads are independent, so each group of KV heads walks the blocks on its own
stream (a prefill chunk, and a long context's decode step). The rows of a batch
are independent too: each row attends on a stream of its own, the rows spread
over the cores, and its heads then stay together. On a GPU one stream already
fills the device: no split there.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator

import mlx.core as mx

from engine.cache.attention import schedule

# A few threads are enough to spread the elementwise work; more only add streams
# that wait on the same BLAS.
_MAX_STREAMS = 8
# Below this many stored values per layer (4,096 tokens of 4 KV heads of 256) the
# work is too small to pay for syncing the streams: a short decode step runs faster
# on one (and a small model's lazy graph keeps running across layers).
SPLIT_MIN_VALUES = 2**22
# A decode step reads every stored value once for a few query rows, on its stream's
# one thread: its heads split from a smaller context than a prefill chunk's, below
# which the streams' syncs cost more than the split read saves (docs/benchmarks.md,
# "Figures behind constants").
DECODE_SPLIT_MIN_VALUES = 2**19
_local = threading.local()


def cpu_cores() -> int:
    """Cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS has no affinity call
        return os.cpu_count() or 1


def streams_for(kv_heads: int) -> int:
    """Streams a long context's ``kv_heads`` split over on this device (1: no split).

    Asks MLX for the device: call it on the engine thread only. The GPU schedule
    walks every head on one stream, as it would on a GPU.
    """
    return max(1, min(kv_heads, _stream_count()))


def _stream_count() -> int:
    """Streams the attention's work spreads over on this device (1: no split)."""
    if mx.default_device().type != mx.cpu or schedule.current() == schedule.GPU:
        return 1
    return min(cpu_cores(), _MAX_STREAMS)


def split_count(available: int, values: int, min_values: int = SPLIT_MIN_VALUES) -> int:
    """Groups the heads split into, with ``available`` streams for them (see
    :func:`streams_for`) and ``values`` stored values to read (tokens x KV heads x
    head_dim), split from ``min_values`` on. Plain arithmetic, for the estimates
    on any thread."""
    return available if values >= min_values else 1


def group_count(kv_heads: int, values: int) -> int:
    """How many groups :func:`head_groups` splits ``kv_heads`` into on this device."""
    return split_count(streams_for(kv_heads), values)


def head_groups(kv_heads: int, values: int) -> list[tuple[slice, mx.Stream | None]]:
    """KV heads in contiguous groups, each with the stream it runs on.

    One group (``None``: the default stream) off the CPU backend, on one core, or
    for little work (see :func:`group_count`). Streams belong to the calling thread
    (MLX streams are thread-local), made once.
    """
    return _groups(kv_heads, group_count(kv_heads, values))


def decode_groups(kv_heads: int, values: int) -> list[tuple[slice, mx.Stream | None]]:
    """:func:`head_groups` for a decode step: split from ``DECODE_SPLIT_MIN_VALUES``
    on, and never for a batch's row, whose stream is already one core's
    (:func:`on_row_stream`)."""
    if getattr(_local, "in_row", False):
        return [(slice(0, kv_heads), None)]
    available = streams_for(kv_heads)
    return _groups(kv_heads, split_count(available, values, DECODE_SPLIT_MIN_VALUES))


def row_streams(rows: int) -> list[mx.Stream | None]:
    """The stream each of a batch's ``rows`` attends on: spread over the cores on
    the CPU backend, round robin; None (the default stream) elsewhere.

    Asks MLX for the device: call it on the engine thread only.
    """
    count = max(1, min(rows, _stream_count()))
    if count == 1:
        return [None] * rows
    streams = _cpu_streams(count)
    return [streams[row % count] for row in range(rows)]


@contextlib.contextmanager
def on_row_stream(stream: mx.Stream | None) -> Iterator[None]:
    """Run one batch row's attention on ``stream`` (None: the current one), its
    heads kept together there (:func:`decode_groups`)."""
    before = getattr(_local, "in_row", False)
    _local.in_row = True
    try:
        with contextlib.nullcontext() if stream is None else mx.stream(stream):
            yield
    finally:
        _local.in_row = before


def _groups(kv_heads: int, count: int) -> list[tuple[slice, mx.Stream | None]]:
    if count == 1:
        return [(slice(0, kv_heads), None)]
    streams = _cpu_streams(count)
    edges = [kv_heads * group // count for group in range(count + 1)]
    return [(slice(edges[g], edges[g + 1]), streams[g]) for g in range(count)]


def _cpu_streams(count: int) -> list[mx.Stream]:
    """This thread's first ``count`` CPU streams, made once."""
    streams: list[mx.Stream] = getattr(_local, "streams", [])
    while len(streams) < count:
        streams.append(mx.new_stream(mx.cpu))
    _local.streams = streams
    return streams[:count]
