"""The caches the cache benchmark races: the engine's paged cache in each mode and
mlx-lm's own ``KVCache`` and ``QuantizedKVCache``, each with the attention function
a model would call for it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.base import scaled_dot_product_attention as mlx_lm_attention
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from engine.cache.adapter import attend
from engine.cache.kvquant import bits_for
from engine.cache.modes import FP16, KvMode
from engine.cache.paged_cache import PagedKVCache
from engine.cache.pages import PagePool
from engine.cache.rotation import HadamardRotation

GROUP_SIZE = 64


@dataclass(frozen=True)
class Contender:
    """One cache implementation plus the attention function a model would call."""

    name: str
    kind: str  # "paged", "paged-rotated", "mlx-fp16" or "mlx-quant"
    mode: KvMode  # the KV mode it stores
    make_cache: Callable[[int, int, int], Any]  # (kv_heads, head_dim, capacity) -> cache
    attend: Callable[..., mx.array]


def mlx_quantized_cache(bits: int, dtype: mx.Dtype) -> Callable[[int, int, int], Any]:
    def make(kv_heads: int, head_dim: int, capacity: int) -> Any:
        cache = QuantizedKVCache(group_size=GROUP_SIZE, bits=bits)
        if mlx_needs_presized_buffers(head_dim, bits):
            # mlx-lm 0.32 sizes its buffers as head_dim // (32 // bits) words,
            # which is wrong for 6 bits unless head_dim == 64 (it then fails to
            # broadcast). Pre-sizing the buffers correctly lets mlx-lm's own
            # update_and_fetch run unchanged; it also skips its regrowth copies,
            # which can only make this baseline faster, never slower.
            # mlx-lm leaves these unannotated and starts them at None, so its
            # inferred type is None alone.
            cache.keys = _empty_quantized(  # type: ignore[assignment]
                kv_heads, capacity, head_dim, bits, dtype)
            cache.values = _empty_quantized(  # type: ignore[assignment]
                kv_heads, capacity, head_dim, bits, dtype)
        return cache

    return make


def _empty_quantized(
    kv_heads: int, capacity: int, head_dim: int, bits: int, dtype: mx.Dtype
) -> tuple[mx.array, ...]:
    # mlx-lm gives scales and biases the dtype of the rows written into them.
    return (
        mx.zeros((1, kv_heads, capacity, head_dim * bits // 32), dtype=mx.uint32),
        mx.zeros((1, kv_heads, capacity, head_dim // GROUP_SIZE), dtype=dtype),
        mx.zeros((1, kv_heads, capacity, head_dim // GROUP_SIZE), dtype=dtype),
    )


def mlx_needs_presized_buffers(head_dim: int, bits: int) -> bool:
    """Whether mlx-lm's own QuantizedKVCache mis-sizes its buffers at this width."""
    return head_dim // (32 // bits) != head_dim * bits // 32


def contenders(
    modes: tuple[KvMode, ...], page_size: int, dtype: mx.Dtype, rotated: tuple[KvMode, ...] = ()
) -> list[Contender]:
    """The paged cache in each mode, mlx-lm's KVCache and its QuantizedKVCache.

    ``rotated``: modes whose paged cache also runs with Hadamard-rotated rows
    (kind "paged-rotated"), to measure what the rotation costs.
    """
    entries = [
        Contender("mlx-lm KVCache", "mlx-fp16", FP16, lambda h, d, c: KVCache(), mlx_lm_attention)
    ]
    for mode in modes:
        if mode == FP16:
            continue
        bits = bits_for(mode)
        entries.append(
            Contender(
                f"mlx-lm QuantizedKVCache {bits}-bit",
                "mlx-quant",
                mode,
                mlx_quantized_cache(bits, dtype),
                mlx_lm_attention,
            )
        )
    for mode in modes:
        make, attend = paged_cache_factory(mode, page_size)
        entries.append(Contender(f"paged {mode}", "paged", mode, make, attend))
    for mode in rotated:
        make, attend = paged_cache_factory(mode, page_size, rotate=True)
        entries.append(Contender(f"paged {mode} rotated", "paged-rotated", mode, make, attend))
    return entries


def paged_cache_factory(
    mode: KvMode, page_size: int, rotate: bool = False
) -> tuple[Callable[[int, int, int], Any], Callable[..., mx.array]]:
    """(make_cache, attend) for the engine's paged cache in ``mode``.

    ``adapter.attend`` is what the adapter's dispatcher calls for a PagedKVCache,
    with the arguments the model passed; calling it directly skips one isinstance.
    """

    def make(kv_heads: int, head_dim: int, capacity: int) -> Any:
        cache = PagedKVCache(PagePool(mode, page_size), kv_heads, head_dim)
        if rotate:
            cache.rotation = HadamardRotation(head_dim)
        return cache

    return make, attend


def held_bytes(entry: Contender, cache: Any) -> int:
    """Bytes of the rows a cache holds.

    The paged cache reports its own ``nbytes``. mlx-lm's ``nbytes`` counts its whole
    buffer, which includes a pre-sized buffer's spare room, so for its caches this
    counts the rows ``keys_and_values()`` returns; at multiples of its 256-token step
    the two agree.
    """
    if entry.kind.startswith("paged"):
        return int(cache.nbytes)
    # tree_flatten returns a dict only when handed one to fill; here its list.
    rows = cast("list[tuple[str, mx.array]]", tree_flatten(cache.keys_and_values()))
    return sum(x.nbytes for _, x in rows)
