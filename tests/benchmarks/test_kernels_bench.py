"""The GPU schedule's decode step on a GPU's terms, counted by the kernels benchmark.

The decode step's graph is traced (``benchmarks.graph_count``) for the seed's
layer shape (4 KV heads of 256, 16 query heads, 256-token pages): its Metal
kernels must not grow with the context, its bytes must stay near the KV bytes it
reads, and nothing in it may be as large as the context converted.
"""

from __future__ import annotations

import pytest

from benchmarks import graph_count, kernels_bench
from engine.cache.attention import schedule
from engine.cache.kvquant import MODES

CONFIG = kernels_bench.KernelsConfig(contexts=(4096, 16384), host_repeats=0)


@pytest.fixture(autouse=True)
def gpu_schedule():
    with schedule.forced(schedule.GPU):
        yield


def _longleaf(mode: str) -> kernels_bench.Layer:
    return next(layer for layer in kernels_bench.layers((mode,)) if layer.kind == "longleaf")


def _decode(mode: str, context: int) -> tuple[dict, kernels_bench.Layer]:
    layer = _longleaf(mode)
    cache = layer.make(CONFIG, context)
    return kernels_bench.measure(layer, cache, CONFIG, 1, 0), layer


@pytest.mark.parametrize("mode", MODES)
def test_a_decode_step_is_a_fixed_few_kernels_at_any_context(mode: str) -> None:
    short, _ = _decode(mode, 4096)
    long, layer = _decode(mode, 16384)
    assert long["kernels"] == short["kernels"] <= 40, (short, long)
    assert not long["unknown"]
    # Its bytes are the stored rows it reads, near enough: the scores, a few rows
    # of them, and the rotation's matrices are what comes on top.
    held = kernels_bench.held_bytes(CONFIG, layer, 16384)
    limit = 1.1 if mode == "fp16" else 1.2
    assert (long["read"] + long["written"]) / held <= limit


def test_a_decode_step_holds_nothing_the_size_of_the_context() -> None:
    # Traced at 16k in q6: no array the step computes is larger than its score
    # rows (16 query heads x 16k columns, 16-bit), let alone the context converted
    # (4 heads x 16k x 256 values: 32 MiB in fp16).
    layer = _longleaf("q6")
    cache = layer.make(CONFIG, 16384)
    q, k, v = kernels_bench._inputs(CONFIG, 1)
    cache.pool.ensure(cache.offset + 1)
    undo = kernels_bench._Undo(cache)
    held = kernels_bench.storage(cache)
    try:
        nodes, _ = graph_count.trace(
            lambda q, k, v, *a: kernels_bench._traced_step(layer, cache, q, k, v, a),
            q, k, v, *held)
    finally:
        undo()
    computed = [out.nbytes for node in nodes if node.name not in graph_count._VIEWS
                and node.name != "SliceUpdate" for out in node.outputs]
    score_rows = 16 * (16384 + 1) * 2
    assert max(computed) <= score_rows
