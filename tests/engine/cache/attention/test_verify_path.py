"""A speculative verification (up to 9 new tokens) reads the pages the way decode does.

Not "close to": the same numbers. A quantized page store rounds each key and value
to its grid, so a last-bit difference in one layer's attention output can move a
later layer's stored row by a whole quantization step; every row of a k-token
verification must therefore come out bit for bit as k one-token decode steps
would give it, in every mode, rotated or not, under both schedules (the CPU's
walk across several blocks, the GPU's whole-context reads, run here on the CPU
backend) -- but where the GPU schedule takes a kernel that rounds by the rows it
holds (below), which no schedule of one kernel a call can avoid.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import kvquant
from engine.cache.adapter import attend
from engine.cache.attention import block_walk, schedule, scratch
from engine.cache.paged_cache import PagedKVCache
from engine.cache.pages import PagePool
from engine.cache.rotation import HadamardRotation

PAGE_SIZE = 16
KV_HEADS = 3
HEADS = 9
HEAD_DIM = 64
VERIFY_TOKENS = 9  # the last accepted token and a draft of 8
PREFIX = 300
# Small enough that the prefix walks several blocks of pages.
DECODE_BUDGET = 96 * 1024


def _rows(heads: int, length: int, seed: int) -> mx.array:
    """``[1, heads, length, D]`` laid out as mlx-lm's attention gets it (a transposed view)."""
    flat = mx.random.normal((1, length, heads * HEAD_DIM), key=mx.random.key(seed))
    return flat.reshape(1, length, heads, HEAD_DIM).transpose(0, 2, 1, 3)


def _filled(mode: str, rotate: bool) -> PagedKVCache:
    cache = PagedKVCache(PagePool(mode, PAGE_SIZE), KV_HEADS, HEAD_DIM, layer=2)
    if rotate:
        cache.rotation = HadamardRotation(HEAD_DIM, layer=2)
    cache.update_and_fetch(_rows(KV_HEADS, PREFIX, 1), _rows(KV_HEADS, PREFIX, 2))
    return cache


def _blocks_walked(monkeypatch) -> list[int]:
    """Records how many blocks each CPU-schedule attention call walks."""
    calls: list[int] = []
    walk = block_walk._walk

    def counted(view, scale, blocks, *args, **kwargs):
        calls.append(len(blocks))
        return walk(view, scale, blocks, *args, **kwargs)

    monkeypatch.setattr(block_walk, "_walk", counted)
    return calls


@pytest.mark.parametrize("name", schedule.SCHEDULES)
@pytest.mark.parametrize("rotate", [False, True])
@pytest.mark.parametrize("mode", kvquant.MODES)
def test_verification_rows_are_single_token_decode_bit_for_bit(
    mode: str, rotate: bool, name: str, monkeypatch
) -> None:
    assert scratch.PACKED_MAX_TOKENS >= VERIFY_TOKENS
    monkeypatch.setattr(scratch, "DECODE_SCRATCH_BYTES", DECODE_BUDGET)
    blocks = _blocks_walked(monkeypatch)
    keys, values = _rows(KV_HEADS, VERIFY_TOKENS, 3), _rows(KV_HEADS, VERIFY_TOKENS, 4)
    queries = _rows(HEADS, VERIFY_TOKENS, 5)
    scale = HEAD_DIM**-0.5
    with schedule.forced(name):
        decode = _filled(mode, rotate)
        singles = []
        for i in range(VERIFY_TOKENS):
            k, v = decode.update_and_fetch(keys[:, :, i:i + 1], values[:, :, i:i + 1])
            singles.append(attend(queries[:, :, i:i + 1], k, v, decode, scale=scale, mask=None))
        single_blocks, blocks[:] = list(blocks), []
        verify = _filled(mode, rotate)
        k, v = verify.update_and_fetch(keys, values)
        got = attend(queries, k, v, verify, scale=scale, mask="causal")
    if name == schedule.CPU:
        assert min(single_blocks) > 1  # the context spans several blocks
        # Decode's path, cut into the blocks the last decode step walked.
        assert blocks == single_blocks[-1:]
    else:
        assert blocks == single_blocks == []  # the whole context at once, no walk
    expected = np.array(mx.concatenate(singles, axis=2))
    if name == schedule.GPU and (mode == "fp16" or rotate):
        # MLX's fused SDPA: a step and a verification take different kernels
        # (vector and fallback), which round apart within the dtype. So may the
        # rotation's one matmul: BLAS (or Metal) picks its kernel by the rows it
        # holds, and OpenBLAS's AVX2 kernels sum 9 rows in another order than one.
        np.testing.assert_allclose(np.array(got), expected, atol=1e-6)
        return
    np.testing.assert_array_equal(np.array(got), expected)
