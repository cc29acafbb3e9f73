"""Paged attention against a float64 NumPy reference over the same stored rows, under
both attention schedules (the CPU's block walk, the GPU's whole-context reads)."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import kvquant
from engine.cache.attention import dispatch as attention
from engine.cache.attention import schedule
from engine.cache.paged_cache import PagedKVCache
from engine.cache.pages import PagePool
from engine.errors import EngineError

PAGE_SIZE = 16
KV_HEADS = 2
# Same stored rows, float32 kernels vs float64 NumPy: measured <= 3e-7.
SAME_ROWS_TOLERANCE = 2e-5


@pytest.fixture(autouse=True, params=schedule.SCHEDULES)
def attention_schedule(request: pytest.FixtureRequest):
    with schedule.forced(request.param):
        yield request.param


def _normal(shape: tuple[int, ...], seed: int) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed))


def _cache(mode: str, head_dim: int, prefix: int, seed: int = 0) -> PagedKVCache:
    cache = PagedKVCache(PagePool(mode, PAGE_SIZE), KV_HEADS, head_dim)
    if prefix:
        shape = (1, KV_HEADS, prefix, head_dim)
        cache.update_and_fetch(_normal(shape, seed), _normal(shape, seed + 1))
    return cache


def _stored(x: mx.array, mode: str) -> np.ndarray:
    bits = kvquant.bits_for(mode)
    codes, scales = kvquant.quantize_rows(x, bits)
    return np.array(kvquant.dequantize_rows(codes, scales, bits, x.shape[-1]), dtype=np.float64)


def _reference(
    queries: mx.array, keys: np.ndarray, values: np.ndarray, scale: float, allowed: np.ndarray
) -> np.ndarray:
    """Softmax attention in float64; ``allowed`` is ``[L, T]``."""
    q = np.array(queries, dtype=np.float64)[0]  # [heads, L, D]
    repeats = q.shape[0] // keys.shape[0]
    k = np.repeat(keys, repeats, axis=0)
    v = np.repeat(values, repeats, axis=0)
    scores = np.where(allowed[None], q @ k.transpose(0, 2, 1) * scale, -np.inf)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return (weights @ v)[None]


def _step(
    cache: PagedKVCache, mode: str, length: int, heads: int, mask: object, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """Run one attention call of ``length`` new tokens; return (got, reference)."""
    head_dim = cache.head_dim
    prefix = cache.offset
    shape = (1, KV_HEADS, length, head_dim)
    keys, values = _normal(shape, seed), _normal(shape, seed + 1)
    queries = _normal((1, heads, length, head_dim), seed + 2)
    cache.update_and_fetch(keys, values)
    scale = head_dim**-0.5
    got = attention.paged_attention(queries, keys, values, cache, scale=scale, mask=mask)
    total = prefix + length
    rows = np.arange(prefix, total)[:, None]
    allowed = rows >= np.arange(total)[None]
    if mask is None:
        allowed = np.ones_like(allowed)
    elif isinstance(mask, mx.array) and mask.dtype == mx.bool_:
        allowed = np.array(mask)
    # Every position attends the stored rows, the new chunk's own included.
    full_k, full_v = (np.array(x[0], dtype=np.float64)
                      for x in cache.dequantized_prefix(total, mx.float32))
    return np.array(got), _reference(queries, full_k, full_v, scale, allowed)


@pytest.mark.parametrize("mode", kvquant.MODES)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_decode_over_pages_matches_reference(mode: str, head_dim: int) -> None:
    cache = _cache(mode, head_dim, prefix=70)  # 5 pages, the last one partial
    for step in range(3):
        got, expected = _step(cache, mode, 1, heads=4, mask=None, seed=10 + 3 * step)
        np.testing.assert_allclose(got, expected, atol=SAME_ROWS_TOLERANCE)


@pytest.mark.parametrize("mode", ["q8", "q6", "q4"])
@pytest.mark.parametrize("mask_kind", [None, "causal", "window", "additive"])
def test_short_chunks_over_pages_with_masks(mode: str, mask_kind: str | None) -> None:
    # 3 new tokens take the packed-page path; 8 query heads on 2 KV heads (GQA x4).
    assert attention.PACKED_MAX_TOKENS >= 3
    cache = _cache(mode, 64, prefix=37)
    length, total = 3, 40
    rows = mx.arange(37, total)[:, None]
    causal = rows >= mx.arange(total)[None]
    window = causal & (rows < mx.arange(total)[None] + 20)
    masks = {
        None: None,  # no mask at all: the chunk sees itself whole, as in mx.fast SDPA
        "causal": "causal",
        "window": window,
        "additive": mx.where(causal, 0.0, -1e9).astype(mx.float32),
    }
    mask = masks[mask_kind]
    got, expected = _step(cache, mode, length, heads=8, mask=mask, seed=5)
    np.testing.assert_allclose(got, expected, atol=SAME_ROWS_TOLERANCE)


def test_window_mask_hides_old_tokens_in_decode() -> None:
    cache = _cache("q8", 32, prefix=50)
    total = 51
    window = (mx.arange(total) >= total - 8)[None]  # mlx-lm's [1, T] decode window mask
    got, expected = _step(cache, "q8", 1, heads=4, mask=window, seed=3)
    np.testing.assert_allclose(got, expected, atol=SAME_ROWS_TOLERANCE)


@pytest.mark.parametrize("mode", kvquant.MODES)
def test_prefill_chunk_dequantizes_prefix_once(mode: str) -> None:
    cache = _cache(mode, 64, prefix=45)
    got, expected = _step(cache, mode, 40, heads=4, mask="causal", seed=21)
    np.testing.assert_allclose(got, expected, atol=SAME_ROWS_TOLERANCE)
    got, expected = _step(_cache(mode, 64, prefix=0), mode, 40, heads=4, mask="causal", seed=2)
    np.testing.assert_allclose(got, expected, atol=SAME_ROWS_TOLERANCE)


def _move_page(cache: PagedKVCache, logical: int, slot: int) -> None:
    """Hold logical page ``logical`` in ``slot`` instead (a copy of its rows)."""
    store = cache.store
    store.copy_page(cache.block_table[logical], slot)
    cache.block_table[logical] = slot
    cache._table_version += 1


@pytest.mark.parametrize("mode", ["q8", "q4", "fp16"])
def test_out_of_order_pages(mode: str) -> None:
    cache = _cache(mode, 64, prefix=16)
    cache.update_and_fetch(*(_normal((1, KV_HEADS, 84, 64), s) for s in (3, 4)))
    store = cache.store
    pages = store.gather(cache.block_table)
    order = (4, 1, 6, 0, 3, 5, 2)
    cache.pool.ensure(cache.offset + len(order) * PAGE_SIZE)
    spare = [store.take() for _ in order]  # move every page out, then back shuffled
    for logical, slot in enumerate(spare):
        _move_page(cache, logical, slot)
    for logical, page in enumerate(order):
        _move_page(cache, logical, page)
    store.give_back(spare)
    assert cache.block_table == list(order)
    for part, expected in zip(store.gather(cache.block_table), pages, strict=True):
        if expected is not None:
            np.testing.assert_array_equal(np.array(part), np.array(expected))
    got, expected = _step(cache, mode, 1, heads=4, mask=None, seed=40)
    np.testing.assert_allclose(got, expected, atol=SAME_ROWS_TOLERANCE)


def test_error_grows_as_bits_shrink_at_every_step() -> None:
    """Attention error vs exact float attention: q8 < q6 < q4 at each decode step."""
    head_dim, prefix, steps = 128, 300, 6
    history_k = _normal((1, KV_HEADS, prefix + steps, head_dim), 50)
    history_v = _normal((1, KV_HEADS, prefix + steps, head_dim), 51)
    caches = {m: PagedKVCache(PagePool(m, PAGE_SIZE), KV_HEADS, head_dim) for m in kvquant.MODES}
    for cache in caches.values():
        cache.update_and_fetch(history_k[:, :, :prefix], history_v[:, :, :prefix])
    worst = dict.fromkeys(kvquant.MODES, 0.0)
    for step in range(steps):
        at = prefix + step
        keys, values = history_k[:, :, at : at + 1], history_v[:, :, at : at + 1]
        queries = _normal((1, 4, 1, head_dim), 60 + step)
        exact = mx.fast.scaled_dot_product_attention(
            queries, history_k[:, :, : at + 1], history_v[:, :, : at + 1], scale=head_dim**-0.5
        )
        errors = {}
        for mode, cache in caches.items():
            cache.update_and_fetch(keys, values)
            out = attention.paged_attention(queries, keys, values, cache, head_dim**-0.5)
            errors[mode] = float(mx.abs(out - exact).max() / mx.abs(exact).max())
            worst[mode] = max(worst[mode], errors[mode])
        assert errors["fp16"] < errors["q8"] < errors["q6"] < errors["q4"], errors
    # Measured worst (max |error| / max |output|): fp16 4.8e-4, q8 1.3e-2, q6 3.9e-2,
    # q4 2.1e-1.
    assert worst["q8"] < 0.02 and worst["q4"] < 0.4


def test_compute_dtype_and_output_dtype_on_cpu() -> None:
    assert mx.default_device().type == mx.cpu
    assert attention.compute_dtype(mx.float16) == mx.float32
    cache = _cache("q8", 32, prefix=20)
    keys = _normal((1, KV_HEADS, 1, 32), 1).astype(mx.float16)
    cache.update_and_fetch(keys, keys)
    queries = _normal((1, 4, 1, 32), 2).astype(mx.float16)
    out = attention.paged_attention(queries, keys, keys, cache, 32**-0.5)
    assert out.dtype == mx.float16 and out.shape == (1, 4, 1, 32)


def test_attention_sinks_are_refused() -> None:
    cache = _cache("q8", 32, prefix=4)
    keys = _normal((1, KV_HEADS, 1, 32), 1)
    cache.update_and_fetch(keys, keys)
    with pytest.raises(EngineError, match="sinks"):
        attention.paged_attention(
            _normal((1, 4, 1, 32), 2), keys, keys, cache, 1.0, sinks=mx.zeros((4,))
        )


@pytest.mark.parametrize("page_size", [1, 7, 256])
def test_any_page_size(page_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys.modules[__name__], "PAGE_SIZE", page_size)
    for mode in ("q8", "q6", "q4"):
        cache = _cache(mode, 64, prefix=70)
        for step in range(2):
            got, expected = _step(cache, mode, 1, heads=4, mask=None, seed=3 + 3 * step)
            np.testing.assert_allclose(got, expected, atol=SAME_ROWS_TOLERANCE)


@pytest.mark.parametrize(("dtype", "tolerance"), [(mx.float16, 5e-3), (mx.bfloat16, 3e-2)])
@pytest.mark.parametrize("mode", ["fp16", "q8", "q4"])
def test_model_dtype_compute_path(dtype: mx.Dtype, tolerance: float, mode: str) -> None:
    """A 16-bit model: the GPU schedule computes in float16, the CPU's in float32.

    Measured max errors vs float32 over the same rows: ~1.5e-3 (float16 pages),
    ~3.4e-3 (quantized pages: float16 scores and probabilities, as mlx-lm computes
    them), ~1.2e-2 (bfloat16 output), i.e. the dtype's own rounding.
    """
    cache = _cache(mode, 64, prefix=70)
    for length, mask in ((1, None), (3, "causal"), (20, "causal")):
        keys = _normal((1, KV_HEADS, length, 64), length).astype(dtype)
        values = _normal((1, KV_HEADS, length, 64), length + 1).astype(dtype)
        queries = _normal((1, 4, length, 64), length + 2).astype(dtype)
        cache.update_and_fetch(keys, values)
        out = attention.paged_attention(queries, keys, values, cache, 0.125, mask)
        assert out.dtype == dtype
        stored_k, stored_v = cache.dequantized_prefix(cache.offset, mx.float32)
        expected = mx.fast.scaled_dot_product_attention(
            queries.astype(mx.float32), stored_k, stored_v, scale=0.125, mask=mask
        )
        error = float(mx.abs(out.astype(mx.float32) - expected).max())
        assert error < tolerance, (length, error)


@pytest.mark.parametrize("mode", ["fp16", "q6"])
def test_pages_out_of_slot_order_attend_the_same(mode: str) -> None:
    """A block table out of slot order reads the columns by their positions."""
    cache = _cache(mode, 64, prefix=70)
    queries = _normal((1, 4, 8, 64), 9)
    expected = attention.paged_attention(queries, None, None, cache, 0.125, "causal")
    # Move logical page 1 to a fresh slot: the block table stops being consecutive.
    cache.pool.ensure(cache.offset + 5 * PAGE_SIZE)
    store = cache.store
    new_slot = store.capacity - 1
    store.give_back([cache.block_table[1]])
    store.share([new_slot])
    _move_page(cache, 1, new_slot)
    assert cache.block_table != sorted(cache.block_table)
    assert cache.columns()[1] is not None
    got = attention.paged_attention(queries, None, None, cache, 0.125, "causal")
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-6)
