"""KV heads split over CPU streams, so a prefill chunk's attention uses every core.

On MLX's CPU backend an elementwise op runs on its stream's one thread, and a
prefill chunk's attention is mostly the exponentials of its scores
(docs/benchmarks.md, "Figures behind constants"): one stream leaves the other cores idle.
Heads are independent, so each group of KV heads walks the blocks on its own
stream. On a GPU one stream already fills the device: no split there.
"""

from __future__ import annotations

import os
import threading

import mlx.core as mx

from engine.cache.attention import schedule

# A few threads are enough to spread the elementwise work; more only add streams
# that wait on the same BLAS.
_MAX_STREAMS = 8
# Below this many stored values per layer (4,096 tokens of 4 KV heads of 256) the
# work is too small to pay for syncing the streams: a short decode step runs faster
# on one (and a small model's lazy graph keeps running across layers).
SPLIT_MIN_VALUES = 2**22
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
    if mx.default_device().type != mx.cpu or schedule.current() == schedule.GPU:
        return 1
    return max(1, min(kv_heads, cpu_cores(), _MAX_STREAMS))


def split_count(available: int, values: int) -> int:
    """Groups the heads split into, with ``available`` streams for them (see
    :func:`streams_for`) and ``values`` stored values to read (tokens x KV heads x
    head_dim). Plain arithmetic, for the estimates on any thread."""
    return available if values >= SPLIT_MIN_VALUES else 1


def group_count(kv_heads: int, values: int) -> int:
    """How many groups :func:`head_groups` splits ``kv_heads`` into on this device."""
    return split_count(streams_for(kv_heads), values)


def head_groups(kv_heads: int, values: int) -> list[tuple[slice, mx.Stream | None]]:
    """KV heads in contiguous groups, each with the stream it runs on.

    One group (``None``: the default stream) off the CPU backend, on one core, or
    for little work (see :func:`group_count`). Streams belong to the calling thread
    (MLX streams are thread-local), made once.
    """
    count = group_count(kv_heads, values)
    if count == 1:
        return [(slice(0, kv_heads), None)]
    streams: list[mx.Stream] = getattr(_local, "streams", [])
    while len(streams) < count:
        streams.append(mx.new_stream(mx.cpu))
    _local.streams = streams
    edges = [kv_heads * group // count for group in range(count + 1)]
    return [(slice(edges[g], edges[g + 1]), streams[g]) for g in range(count)]
