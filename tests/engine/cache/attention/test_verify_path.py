"""A speculative verification (up to 9 new tokens) reads the pages the way decode does."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import kvquant
from engine.cache.attention import block_walk, scratch
from engine.cache.attention import dispatch as attention
from engine.cache.paged_cache import PagedKVCache
from engine.cache.pages import PagePool

PAGE_SIZE = 16
KV_HEADS = 2
HEADS = 8
HEAD_DIM = 64
VERIFY_TOKENS = 9  # the last accepted token and a draft of 8
# The same stored rows on the same path; only the softmax's row count differs.
SAME_PATH_TOLERANCE = 1e-5


def _normal(shape: tuple[int, ...], seed: int) -> mx.array:
    return mx.random.normal(shape, key=mx.random.key(seed))


def _filled(mode: str, prefix: int) -> PagedKVCache:
    cache = PagedKVCache(PagePool(mode, PAGE_SIZE), KV_HEADS, HEAD_DIM)
    shape = (1, KV_HEADS, prefix, HEAD_DIM)
    cache.update_and_fetch(_normal(shape, 1), _normal(shape, 2))
    return cache


@pytest.mark.parametrize("mode", kvquant.MODES)
def test_verification_rows_match_single_token_decode(mode: str, monkeypatch) -> None:
    assert scratch.PACKED_MAX_TOKENS >= VERIFY_TOKENS
    prefix, scale = 70, HEAD_DIM**-0.5
    shape = (1, KV_HEADS, VERIFY_TOKENS, HEAD_DIM)
    keys, values = _normal(shape, 3), _normal(shape, 4)
    queries = _normal((1, HEADS, VERIFY_TOKENS, HEAD_DIM), 5)
    paths: list[str] = []
    for name in ("attend_packed", "attend_blocks"):
        original = getattr(block_walk, name)
        monkeypatch.setattr(block_walk, name,
                            lambda *a, _f=original, _n=name, **k: paths.append(_n) or _f(*a, **k))
    decode = _filled(mode, prefix)
    singles = []
    for i in range(VERIFY_TOKENS):
        decode.update_and_fetch(keys[:, :, i:i + 1], values[:, :, i:i + 1])
        singles.append(attention.paged_attention(queries[:, :, i:i + 1], None, None, decode,
                                                 scale=scale, mask=None))
    single_paths, paths[:] = list(paths), []
    verify = _filled(mode, prefix)
    verify.update_and_fetch(keys, values)
    got = attention.paged_attention(queries, None, None, verify, scale=scale, mask="causal")
    assert paths == single_paths[:1]  # the one verification call took decode's path
    expected = mx.concatenate(singles, axis=2)
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=SAME_PATH_TOLERANCE)
