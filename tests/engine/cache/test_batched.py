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

from engine.cache import adapter
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
])
def test_each_row_of_a_batch_gets_its_own_steps_logits(models, arch: str, modes) -> None:
    model = models[arch]
    alone = []
    for index, (mode, length) in enumerate(zip(modes, LENGTHS, strict=True)):
        cache, ids = _filled(model, mode, length, index)
        alone.append(_alone(model, cache, ids, length))
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
            # matmul rounding of B rows against one, far below a logit's size.
            np.testing.assert_allclose(got, alone[row][step], atol=1e-4, rtol=0)
    for (cache, _), length in zip(rows, LENGTHS, strict=True):
        assert adapter.cache_tokens(cache) == length + STEPS
        assert all(layer.offset == length + STEPS for layer in cache
                   if isinstance(layer, PagedKVCache | KVCache | RotatingKVCache))


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
