"""The two attention schedules: same outputs, and what each costs in host syncs and memory."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import kvquant
from engine.cache.adapter import attend
from engine.cache.attention import schedule, scratch, streams
from engine.cache.paged_cache import PagedKVCache
from engine.cache.pages import PagePool
from engine.cache.rotation import HadamardRotation
from engine.errors import EngineError
from tests.engine.cache.attention.test_dispatch import SAME_ROWS_TOLERANCE, _normal

MIB = 2**20
PAGE_SIZE = 16
KV_HEADS = 2
HEAD_DIM = 64


def _cache(mode: str, prefix: int, rotated: bool = False, head_dim: int = HEAD_DIM,
           kv_heads: int = KV_HEADS, page_size: int = PAGE_SIZE) -> PagedKVCache:
    """A cache holding ``prefix`` random rows, written in pieces (its storage grows)."""
    cache = PagedKVCache(PagePool(mode, page_size), kv_heads, head_dim)
    if rotated:
        cache.rotation = HadamardRotation(head_dim)
    piece = 64 if prefix <= 1024 else 4096  # small writes grow the storage step by step
    for start in range(0, prefix, piece):
        n = min(piece, prefix - start)
        shape = (1, kv_heads, n, head_dim)
        cache.update_and_fetch(_normal(shape, start + 1), _normal(shape, start + 2))
        mx.eval(cache.store.arrays())
    return cache


def _attend(cache: PagedKVCache, queries: mx.array, mask: object) -> mx.array:
    out = attend(queries, None, None, cache, scale=cache.head_dim**-0.5, mask=mask)
    mx.eval(out)
    return out


def _small_blocks(monkeypatch: pytest.MonkeyPatch, cache: PagedKVCache) -> None:
    """Blocks of a page or a few: the CPU's walk and the GPU's prefill merge many."""
    monkeypatch.setattr(scratch, "DECODE_SCRATCH_BYTES", 1)
    cache.pool.scratch_bytes = 256 * 1024


def _both(cache: PagedKVCache, queries: mx.array, mask: object) -> dict[str, np.ndarray]:
    outputs = {}
    for name in schedule.SCHEDULES:
        with schedule.forced(name):
            outputs[name] = np.array(_attend(cache, queries, mask))
    return outputs


@pytest.mark.parametrize("rotated", [False, True])
@pytest.mark.parametrize("mode", kvquant.MODES)
def test_schedules_attend_alike_in_every_mode(
    mode: str, rotated: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # 600 tokens of 16-token pages: decode steps and a prefill chunk, the CPU's
    # over many blocks, the GPU's prefill too.
    monkeypatch.setattr(streams, "SPLIT_MIN_VALUES", 0)
    cache = _cache(mode, prefix=600, rotated=rotated)
    _small_blocks(monkeypatch, cache)
    for step in range(2):
        keys = _normal((1, KV_HEADS, 1, HEAD_DIM), 50 + step)
        cache.update_and_fetch(keys, keys)
        outputs = _both(cache, _normal((1, 8, 1, HEAD_DIM), 60 + step), None)
        np.testing.assert_allclose(outputs["gpu"], outputs["cpu"], atol=SAME_ROWS_TOLERANCE)
    keys = _normal((1, KV_HEADS, 40, HEAD_DIM), 70)
    cache.update_and_fetch(keys, keys)
    outputs = _both(cache, _normal((1, 8, 40, HEAD_DIM), 71), "causal")
    np.testing.assert_allclose(outputs["gpu"], outputs["cpu"], atol=SAME_ROWS_TOLERANCE)


@pytest.mark.parametrize(("dtype", "tolerance"), [(mx.float16, 5e-3), (mx.bfloat16, 3e-2)])
@pytest.mark.parametrize("mode", ["fp16", "q8", "q4"])
def test_gpu_schedule_in_the_model_dtype(
    mode: str, dtype: mx.Dtype, tolerance: float, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The GPU's own arithmetic (float16 queries, scores and probabilities), run here.

    Against fp32 attention over the same stored rows, within fp16's rounding, for
    a decode step and a prefill chunk over many blocks.
    """
    cache = _cache(mode, prefix=300)
    _small_blocks(monkeypatch, cache)
    with schedule.forced(schedule.GPU):
        for length, mask in ((1, None), (20, "causal")):
            keys = _normal((1, KV_HEADS, length, HEAD_DIM), length).astype(dtype)
            queries = _normal((1, 4, length, HEAD_DIM), length + 2).astype(dtype)
            cache.update_and_fetch(keys, keys)
            out = _attend(cache, queries, mask)
            assert out.dtype == dtype
            stored_k, stored_v = cache.dequantized_prefix(cache.offset, mx.float32)
            expected = mx.fast.scaled_dot_product_attention(
                queries.astype(mx.float32), stored_k, stored_v, scale=HEAD_DIM**-0.5, mask=mask)
            error = float(mx.abs(out.astype(mx.float32) - expected).max())
            assert error < tolerance, (length, error)


def _syncs(cache: PagedKVCache, length: int) -> dict[str, int]:
    """Host syncs one attention call of ``length`` new tokens makes, per schedule."""
    keys = _normal((1, cache.kv_heads, length, cache.head_dim), length)
    cache.pool.ensure(cache.offset + length)
    cache.update_and_fetch(keys, keys)
    queries = _normal((1, 8, length, cache.head_dim), length + 1)
    counts = {}
    for name in schedule.SCHEDULES:
        with schedule.forced(name):
            before = schedule.host_syncs()
            _attend(cache, queries, None if length == 1 else "causal")
            counts[name] = schedule.host_syncs() - before
    cache.trim(length)
    return counts


@pytest.mark.parametrize("mode", ["fp16", "q6"])
def test_host_syncs_per_decode_step_and_chunk(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Blocks of one page: the CPU schedule waits on the host once per block, the
    # GPU schedule never, at every context.
    decode, chunk = {}, {}
    for tokens in (256, 1024, 4096):
        cache = _cache(mode, prefix=tokens)
        _small_blocks(monkeypatch, cache)
        cache.pool.scratch_bytes = 64 * 1024
        decode[tokens], chunk[tokens] = _syncs(cache, 1), _syncs(cache, 32)
    assert all(count["gpu"] == 0 for count in [*decode.values(), *chunk.values()])
    # What the counter counts: the CPU schedule's syncs grow with the blocks.
    assert decode[4096]["cpu"] > 4 * decode[256]["cpu"] > 0, decode
    assert chunk[4096]["cpu"] > 4 * chunk[256]["cpu"] > 0, chunk


def _decode_transient(cache: PagedKVCache, q_heads: int, dtype: mx.Dtype = mx.float32) -> int:
    """Worst MLX peak above the active memory of three decode steps after a warm-up."""
    peaks = []
    cache.pool.ensure(cache.offset + 4)
    for step in range(4):
        keys = _normal((1, cache.kv_heads, 1, cache.head_dim), 90 + step).astype(dtype)
        queries = _normal((1, q_heads, 1, cache.head_dim), 95 + step).astype(dtype)
        mx.eval(keys, queries)
        cache.update_and_fetch(keys, keys)
        mx.eval(cache.store.arrays())
        mx.synchronize()
        mx.clear_cache()
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        out = _attend(cache, queries, None)
        del out
        peaks.append(mx.get_peak_memory() - before)
    return max(peaks[1:])


def test_gpu_decode_transient_is_a_few_score_rows() -> None:
    # The bench's layer (4 KV heads of 256, 16 query heads, 256-token pages) in
    # fp16 at 16k and 64k tokens, 16-bit queries as on a GPU: one op over the whole
    # context holds its score rows (16 x 64k float16 = 2 MiB here), never the
    # context converted (512 MiB in fp32 at 64k). (Quantized pages: the CPU
    # backend's quantized matmul copies a strided view where Metal's reads it in
    # place, so test_gpu bounds their graph instead.)
    caches = [_cache("fp16", tokens, head_dim=256, kv_heads=4, page_size=256)
              for tokens in (16384, 65536)]
    with schedule.forced(schedule.GPU):
        peaks = [_decode_transient(cache, q_heads=16, dtype=mx.float16) for cache in caches]
    rows = [16 * cache.offset * 2 for cache in caches]  # one float16 score row each
    assert all(peak <= 3 * row + MIB for peak, row in zip(peaks, rows, strict=True)), peaks


def test_schedule_is_read_once_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(schedule, "_chosen", None)
    monkeypatch.setenv(schedule.ENV_VAR, "GPU")
    assert schedule.current() == schedule.GPU
    monkeypatch.setenv(schedule.ENV_VAR, "cpu")
    assert schedule.current() == schedule.GPU  # read at the first call, kept
    monkeypatch.setattr(schedule, "_chosen", None)
    monkeypatch.delenv(schedule.ENV_VAR)
    assert schedule.current() == schedule.backend_schedule() == schedule.CPU  # this machine
    monkeypatch.setattr(schedule, "_chosen", None)
    monkeypatch.setenv(schedule.ENV_VAR, "metal")
    with pytest.raises(EngineError, match="'gpu' or 'cpu'"):
        schedule.current()


def test_gpu_schedule_walks_every_head_on_one_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(streams, "cpu_cores", lambda: 4)
    with schedule.forced(schedule.CPU):
        assert streams.streams_for(4) == 4
    with schedule.forced(schedule.GPU):
        assert streams.streams_for(4) == 1
