"""One forward pass over several conversations' own caches (engine.cache.batched).

Each row's cache is made, filled and stepped twice over: once alone, once as a
row of a batch whose other rows hold other lengths in other modes. The batch must
give each row the logits and the stored pages its own step gives.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import (
    ArraysCache,
    ConcatenateKVCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
)

from benchmarks import graph_count
from engine.cache import adapter, sharing
from engine.cache.attention import schedule
from engine.cache.batched import BatchedCache, PagedRows, check_batchable
from engine.cache.paged_cache import PagedKVCache
from engine.errors import EngineError
from tests.engine.tinymodels import load_tiny

MODES = ("fp16", "q8", "q6", "q4")
LENGTHS = (5, 40, 17, 70)  # prompt lengths, page size 16: partial pages differ per row
PAGE_SIZE = 16
STEPS = 6


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("batched-models")
    return {arch: load_tiny(root, arch)[0] for arch in ("llama", "qwen3_next", "gemma3_text")}


def _filled(model: Any, mode: str | None, length: int,
            seed: int) -> tuple[list[Any], list[int]]:
    """A cache holding ``length`` random tokens (mode None: mlx-lm's own cache)."""
    cache = (make_prompt_cache(model) if mode is None
             else adapter.make_cache(model, mode, page_size=PAGE_SIZE))
    ids = np.random.default_rng(seed).integers(0, 300, length + STEPS).tolist()
    model(mx.array(ids[:length])[None], cache=cache)
    mx.eval(adapter.eval_targets(cache))
    return cache, ids


def _alone(model: Any, cache: list[Any], ids: list[int], length: int) -> list[np.ndarray]:
    out = []
    for step in range(STEPS):
        logits = model(mx.array([[ids[length + step]]]), cache=cache)[0, -1]
        out.append(np.array(logits.astype(mx.float32)))
    return out


@pytest.mark.parametrize(("arch", "modes"), [
    ("llama", MODES), ("qwen3_next", MODES),
    ("gemma3_text", MODES),  # sliding windows (rotating caches, wrapped) beside pages
    ("llama", (None,) * len(MODES)),  # mlx-lm's own KVCache, where the probe chose it
    # One mode: the rows are encoded, and their queries rotated, together.
    ("llama", ("q6",) * len(MODES)),
    # Two rows of each of two quantized modes, interleaved: each mode's rows encoded
    # together, picked out of the batch's order.
    ("llama", ("q6", "q4", "q6", "q4")),
])
def test_each_row_of_a_batch_gets_its_own_steps_logits(models, arch: str, modes) -> None:
    model = models[arch]
    alone, alone_caches = [], []
    for index, (mode, length) in enumerate(zip(modes, LENGTHS, strict=True)):
        cache, ids = _filled(model, mode, length, index)
        alone.append(_alone(model, cache, ids, length))
        alone_caches.append(cache)
    rows = [_filled(model, mode, length, index)
            for index, (mode, length) in enumerate(zip(modes, LENGTHS, strict=True))]
    for step in range(STEPS):
        batch = BatchedCache([cache for cache, _ in rows])
        tokens = mx.array([[ids[length + step]] for (_, ids), length in zip(rows, LENGTHS,
                                                                           strict=True)])
        logits = model(tokens, cache=batch.layers)[:, -1]
        batch.write_back()
        for row in range(len(rows)):
            got = np.array(logits[row].astype(mx.float32))
            # Every row is computed by the same ops as alone: a difference is the
            # matmul rounding of B rows against one (below), carried through the
            # layers by an fp16 row's stored values: 7e-4 at most seen, on logits
            # of size 5 to 8.
            np.testing.assert_allclose(got, alone[row][step], atol=1e-3, rtol=0)
    for (cache, _), length in zip(rows, LENGTHS, strict=True):
        assert adapter.cache_tokens(cache) == length + STEPS
        assert all(layer.offset == length + STEPS for layer in cache
                   if isinstance(layer, PagedKVCache | KVCache | RotatingKVCache))
    # Each row's pages hold what its steps alone stored: codes and scales bit for
    # bit, fp16 values (of size 1 to 3) within a few steps of float16 -- the rows'
    # projections are one matmul of B rows, and a BLAS may sum B rows in another
    # order than one (OpenBLAS's AVX2 kernels do; its reference kernels did not).
    for (cache, _), own, mode in zip(rows, alone_caches, modes, strict=True):
        for layer, alone_layer in zip(cache, own, strict=True):
            if isinstance(layer, PagedKVCache):
                for got, want in zip(layer.state[:4], alone_layer.state[:4], strict=True):
                    assert (got is None) == (want is None)
                    if got is not None:
                        _same_store(got, want, mode)


def _same_store(got: mx.array, want: mx.array, mode: str) -> None:
    if mode != "fp16":
        assert mx.array_equal(got, want).item()
        return
    assert got.dtype == want.dtype == mx.float16
    np.testing.assert_allclose(np.array(got.astype(mx.float32)),
                               np.array(want.astype(mx.float32)), rtol=2**-8, atol=2**-8)


def test_rows_keep_their_own_offsets_and_pages(models) -> None:
    model = models["llama"]
    rows = [_filled(model, mode, length, 0)[0] for mode, length in (("q8", 3), ("fp16", 32))]
    before = [len(cache[0].block_table) for cache in rows]
    batch = BatchedCache(rows)
    layer = batch.layers[0]
    assert isinstance(layer, PagedRows)
    assert layer.offset.tolist() == [3, 32]
    model(mx.array([[1], [2]]), cache=batch.layers)
    assert [cache[0].offset for cache in rows] == [4, 33]
    # The 32-token row's new token opens its third page; the other stays in its first.
    assert [len(cache[0].block_table) for cache in rows] == [before[0], before[1] + 1]


def test_rows_sharing_a_documents_pages_each_get_a_new_page_in_one_pass(models) -> None:
    model = models["llama"]
    first, ids = _filled(model, "fp16", 32, 0)  # two full pages
    second = adapter.make_cache(model, "fp16", page_size=PAGE_SIZE)
    sharing.share_pages(second, first, 32)
    stores = {id(layer.store): layer.store for layer in first}
    for store in stores.values():  # other chats' pages take all but one slot
        while store.free_count > 1:
            store.take()
    # Each row alone finds the one free slot; the pass gives each its own.
    for cache in (first, second):
        adapter.ensure_capacity(cache, 1)
    batch = BatchedCache([first, second])
    logits = model(mx.array([[ids[32]], [ids[32]]]), cache=batch.layers)
    mx.eval(logits)
    assert [cache[0].offset for cache in (first, second)] == [33, 33]
    assert first[0].block_table[2] != second[0].block_table[2]
    np.testing.assert_array_equal(np.array(logits[0]), np.array(logits[1]))


def test_a_batch_refuses_layers_it_cannot_carry(models) -> None:
    gemma = adapter.make_cache(models["gemma3_text"], "q8", page_size=PAGE_SIZE)
    assert any(isinstance(layer, RotatingKVCache) for layer in gemma)
    check_batchable([gemma])  # sliding windows decode row by row
    with pytest.raises(EngineError, match="ConcatenateKVCache layers cannot decode in a batch"):
        check_batchable([[ConcatenateKVCache()]])
    llama = adapter.make_cache(models["llama"], "q8")
    hybrid = adapter.make_cache(models["qwen3_next"], "q8")
    assert any(isinstance(layer, ArraysCache) for layer in hybrid)
    with pytest.raises(EngineError, match="different models"):
        check_batchable([llama, hybrid])


def test_a_batch_step_is_one_token_a_row(models) -> None:
    rows = [_filled(models["llama"], "q8", 8, 0)[0]]
    layer = BatchedCache(rows).layers[0]
    with pytest.raises(EngineError, match="one token per row"):
        layer.make_mask(2)


@pytest.mark.parametrize("rows", [1, 2, 8])
def test_a_batch_of_one_mode_encodes_and_rotates_its_rows_in_one_op_each(models,
                                                                        rows: int) -> None:
    # Under the GPU schedule every op is a kernel launch: a batch's paged layer
    # must not rotate, quantize and rotate back row by row.
    caches = [_filled(models["llama"], "q6", length, index)[0]
              for index, length in enumerate((5, 40, 17, 70, 9, 33, 16, 2)[:rows])]
    layers = [cache[0] for cache in caches]
    kv_heads, head_dim = layers[0].kv_heads, layers[0].head_dim
    heads = kv_heads * 2
    queries = mx.zeros((rows, heads, 1, head_dim), mx.float16)
    new = mx.zeros((rows, kv_heads, 1, head_dim), mx.float16)

    def step(q: mx.array, k: mx.array, v: mx.array) -> tuple[mx.array, ...]:
        layer = PagedRows(layers, mx.array([row.offset for row in layers]))
        layer.make_mask(1)
        keys, values = layer.update_and_fetch(k, v)
        out = adapter.attend_rows(q, keys, values, layer, head_dim ** -0.5)
        return (out, *[part for row in layers for part in row.held_store.parts
                        if part is not None])

    with schedule.forced(schedule.GPU):
        counted = graph_count.tally(*graph_count.trace(step, queries, new, new))
    ops = counted.by_primitive
    # Rotations: keys, values, queries in and the output back; quantizing: keys, values.
    assert ops["Matmul"] == 4 and ops["Compiled"] == 4, ops
    # What stays a row's own: its four page writes and its two reads of its pages.
    assert ops["SliceUpdate"] == 4 * rows and ops["QuantizedMatmul"] == 2 * rows, ops
