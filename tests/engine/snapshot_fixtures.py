"""Paged caches of random rows and the session stand-in that snapshots read.

Shaped like the demo model's cache (30 layers, 3 KV heads, head_dim 64, 256-token
pages); no model weights are needed: the model folder holds only a ``config.json``.
The snapshot tests and ``python -m benchmarks.snapshot_memory`` build their caches here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx

from engine.cache import kvquant
from engine.cache.modes import KvMode, parse_mode
from engine.cache.paged_cache import PagedKVCache
from engine.cache.pages import PagePool

LAYERS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 30, 3, 64, 256


def config_only_model(parent: Path) -> Path:
    """``parent/model`` holding only a ``config.json``: enough to fingerprint."""
    folder = parent / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return folder


def _unexpected_reset() -> None:
    raise AssertionError("This cache-only session was not expected to reset; give it a reset.")


@dataclass
class CacheSession:
    """A session without a model: what ``save_snapshot``/``load_snapshot`` need of one
    (``engine.snapshots.snapshot.SnapshotSession``) around a bare cache."""

    cache: list[PagedKVCache]
    tokens: list[int]
    mode: KvMode
    page_size: int
    model_dir: Path
    reset: Callable[[], None] = _unexpected_reset


def cache_session(
    cache: list[PagedKVCache], tokens: int, mode: str, model_dir: Path
) -> CacheSession:
    """A :class:`CacheSession` holding ``tokens`` ids around ``cache``."""
    return CacheSession(cache=cache, tokens=list(range(tokens)), mode=parse_mode(mode),
                        page_size=PAGE_SIZE, model_dir=model_dir)


def filled_cache(mode_name: str, tokens: int, layers: int = LAYERS) -> list[PagedKVCache]:
    """Paged layers shaped like the demo model's holding ``tokens`` random rows."""
    mode = parse_mode(mode_name)
    pool = PagePool(mode, PAGE_SIZE)
    pages = -(-tokens // PAGE_SIZE)
    cache = []
    for layer in range(layers):
        mx.random.seed(layer)
        rows = mx.random.normal((pages, KV_HEADS, PAGE_SIZE, HEAD_DIM))
        k = kvquant.quantize_rows(rows, kvquant.bits_for(mode))
        v = kvquant.quantize_rows(-rows, kvquant.bits_for(mode))
        mx.eval(k, v)
        paged = PagedKVCache(pool)
        paged.state = (k[0], k[1], v[0], v[1], tokens, mode, PAGE_SIZE, KV_HEADS, HEAD_DIM)
        mx.eval([a for a in paged.state[:4] if a is not None])
        cache.append(paged)
    return cache
