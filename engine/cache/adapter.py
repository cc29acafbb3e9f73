"""Plug the paged KV cache into mlx-lm's own model classes, without forking them.

mlx-lm models call ``cache.update_and_fetch`` and then ``scaled_dot_product_attention``
looked up in their own module. :func:`make_cache` gives attention layers a
:class:`PagedKVCache` and swaps that module-level name for a dispatcher that sends
paged caches to :func:`engine.cache.attention.dispatch.paged_attention` and every other cache to
mlx-lm's original function, unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from engine.cache import mlx_lm_compat, sharing
from engine.cache.attention import schedule, streams
from engine.cache.attention.dispatch import paged_attention
from engine.cache.batched import CacheRows, PagedRows
from engine.cache.modes import FP16, MODES, KvMode
from engine.cache.paged_cache import PagedKVCache, cache_tokens
from engine.cache.pages import DEFAULT_PAGE_SIZE, PagePool
from engine.cache.rotation import HadamardRotation
from engine.errors import EngineError, ModelLoadError


class LayerStats(NamedTuple):
    """Pages of one paged layer."""

    layer: int
    pages_in_use: int
    tokens: int
    bytes_used: int


@dataclass(frozen=True)
class CacheStats:
    """A cache's page occupancy in plain values (safe to send across threads)."""

    mode: KvMode
    page_size: int
    tokens: int
    pages_in_use: int
    pages_allocated: int
    pages_free: int
    last_page_fill: float
    bytes_used: int
    bytes_allocated: int
    budget_bytes: int | None
    layers: tuple[LayerStats, ...]
    rotation: str | None = None  # format id of the rows' rotation; None: stored as given
    # Bytes of the layers that are not paged (sliding windows, linear-attention state):
    # outside the page budget, but memory the session holds all the same.
    other_bytes: int = 0
    # Of bytes_used, the pages other open chats hold too (engine.cache.sharing);
    # bytes_once divides each shared page among its holders, so a sum over chats
    # counts it once; shared_with: other chats in the page group.
    shared_bytes: int = 0
    bytes_once: int | None = None
    shared_with: int = 0
    # bytes_once plus the idle slots of the stores (room allocated ahead for the next
    # pages) divided among the page group: a sum over chats is what their pages
    # take in memory, each byte once (what the memory limit counts).
    bytes_held_once: int = 0


def attend(queries: mx.array, keys: mx.array, values: mx.array, cache: PagedKVCache,
           scale: float, mask: Any = None, sinks: mx.array | None = None) -> mx.array:
    """Attention over a :class:`PagedKVCache`, in its rotation's basis when it has one.

    What a model's attention call becomes for a paged layer (same arguments).
    """
    return _in_basis(cache.rotation, queries, scale, lambda rotated, rest: paged_attention(
        rotated, keys, values, cache, rest, mask, sinks))


def _in_basis(rotation: Any, queries: mx.array, scale: float,
              attention: Callable[[mx.array, float], mx.array]) -> mx.array:
    """``attention(queries, scale)`` where the keys and values are stored in ``rotation``'s
    basis (None: as given), its output rotated back.

    Keys and values were stored (and returned) rotated by an orthonormal R:
    (qR)·(kR) = q·k, and the output, a mix of rotated values, is rotated back.
    The GPU schedule folds the scale into the query's rotation (one kernel less).
    """
    if rotation is None:
        return attention(queries, scale)
    folded = scale if schedule.current() == schedule.GPU else 1.0
    rotated = rotation.rotate_query(queries, folded)
    return rotation.unrotate(attention(rotated, scale / folded))


def attend_rows(queries: mx.array, keys: mx.array, values: mx.array, cache: PagedRows,
                scale: float, mask: Any = None, sinks: mx.array | None = None) -> mx.array:
    """Attention of a batch's rows, each row's queries over that row's own pages.

    What a model's attention call becomes for a :class:`PagedRows` layer: row ``i``
    of ``queries`` (``[B, heads, 1, D]``) attends row ``i``'s cache in its own mode
    and rotation, exactly as that conversation's decode step alone would. Rows
    stored in one rotation (usually all) rotate their queries in, and their
    outputs back, in one op each.
    """
    if mask is not None:
        raise EngineError("A batch of conversations attends without a mask.")
    rows = cache.rows
    if len(rows) == 1:  # as alone: its heads may take the cores
        return attend(queries, keys, values, rows[0], scale, None, sinks)
    if len({row.basis for row in rows}) > 1:  # rows in other bases: each rotates its own
        return _each_row(queries, rows, lambda q, row: attend(
            q, keys, values, row, scale, None, sinks))
    return _in_basis(rows[0].rotation, queries, scale, lambda rotated, rest: _each_row(
        rotated, rows, lambda q, row: paged_attention(q, keys, values, row, rest, None, sinks)))


def _each_row(queries: mx.array, rows: Sequence[PagedKVCache],
              attention: Callable[[mx.array, PagedKVCache], mx.array]) -> mx.array:
    outs = []
    for index, (row, stream) in enumerate(zip(rows, streams.row_streams(len(rows)),
                                              strict=True)):
        # On the CPU each row attends on one core's stream: the rows run side by side.
        with streams.on_row_stream(stream):
            outs.append(attention(queries[index:index + 1], row))
    return mx.concatenate(outs, axis=0)


def _dispatcher(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def scaled_dot_product_attention(queries: mx.array, keys: mx.array, values: mx.array,
                                     cache: Any, *args: Any, **kwargs: Any) -> mx.array:
        if isinstance(cache, PagedKVCache):
            return attend(queries, keys, values, cache, *args, **kwargs)
        if isinstance(cache, PagedRows):
            return attend_rows(queries, keys, values, cache, *args, **kwargs)
        if isinstance(cache, CacheRows):
            return cache.attend(queries, original, *args, **kwargs)
        return original(queries, keys, values, cache, *args, **kwargs)

    return scaled_dot_product_attention


def _model_modules(model: nn.Module) -> set[Any]:
    names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    return {sys.modules[n] for n in names if n in sys.modules}


def install_attention(model: nn.Module) -> None:
    """Route PagedKVCache attention in every module the model's classes come from.

    Idempotent; other caches keep calling mlx-lm's original function.
    """
    mlx_lm_compat.install_attention(_model_modules(model), _dispatcher)


def layer_attention_shape(model: nn.Module, index: int) -> tuple[int | None, int | None]:
    """(kv_heads, head_dim) of layer ``index``, read from its attention module."""
    layer = model.layers[index]
    for _, module in layer.named_modules():
        kv_heads = getattr(module, "n_kv_heads", None) or getattr(
            module, "num_key_value_heads", None
        )
        k_proj = getattr(module, "k_proj", None)
        if kv_heads and k_proj is not None and hasattr(k_proj, "weight"):
            head_dim = getattr(module, "head_dim", None)
            if head_dim is None:
                head_dim = k_proj.weight.shape[0] // kv_heads
            return int(kv_heads), int(head_dim)
    return None, None


def _check_dispatch(model: nn.Module, index: int) -> None:
    layer = model.layers[index]
    if not mlx_lm_compat.routes_attention(type(m).__module__ for _, m in layer.named_modules()):
        raise ModelLoadError(
            f"{type(model).__module__} does not call mlx-lm's scaled_dot_product_attention "
            "from its module, so the paged KV cache cannot plug into it. Use a supported "
            "architecture (llama, qwen3, qwen3_next, gemma3_text, ...)."
        )


def rotates_by_default(mode: KvMode) -> bool:
    """Whether :func:`make_cache` rotates ``mode``'s rows when not told (the
    registry's default: the quantized modes, whose error a rotation lowers)."""
    return MODES[mode].rotated


def make_cache(
    model: nn.Module,
    mode: KvMode,
    *,
    page_size: int = DEFAULT_PAGE_SIZE,
    budget_bytes: int | None = None,
    rotate: bool | None = None,
) -> list[Any]:
    """An mlx-lm prompt cache whose full-attention layers hold paged, quantized KV.

    Layers for which mlx-lm makes a plain ``KVCache`` get a :class:`PagedKVCache`
    sharing one :class:`PagePool`; every other layer (sliding-window rotating
    caches, linear-attention state) keeps exactly what mlx-lm makes for it.

    Args:
        model: an mlx-lm model.
        mode: the KV mode.
        page_size: tokens per page.
        budget_bytes: bytes all pages may take; None for no limit.
        rotate: store key and value rows after a Hadamard rotation
            (:mod:`engine.cache.rotation`); None: the mode's default
            (:func:`rotates_by_default`).

    Raises:
        UnsupportedModeError: unknown mode, or one that cannot store this model's heads.
        ModelLoadError: the model's attention cannot be routed to the paged cache.
    """
    pool = PagePool(mode, page_size, budget_bytes)
    rotate = rotates_by_default(pool.mode) if rotate is None else rotate
    install_attention(model)
    cache = make_prompt_cache(model)
    first = first_layer(model)
    for index, layer_cache in enumerate(cache):
        if type(layer_cache) is KVCache:
            kv_heads, head_dim = layer_attention_shape(model, index)
            _check_dispatch(model, index)
            # The model's own layer number, also on a pipeline stage that holds
            # only some layers: rotations, snapshots and stats match one process.
            paged = PagedKVCache(pool, kv_heads, head_dim, layer=first + index)
            if rotate and head_dim is not None:
                paged.rotation = HadamardRotation(head_dim, layer=first + index)
            cache[index] = paged
    return cache


def first_layer(model: nn.Module) -> int:
    """The model's number of its first local layer: 0, or a pipeline stage's first.

    mlx-lm's ``pipeline(group, split)`` keeps the layers ``start_idx`` onwards on
    a rank (``model.layers`` then lists only those).
    """
    inner = getattr(model, "model", model)
    return int(getattr(inner, "start_idx", 0) or 0)


def rotation_format(cache: list[Any]) -> str | None:
    """The rotation format id every paged layer stores rows in; None if any is unrotated."""
    formats = {getattr(c.rotation, "format_id", None) for c in _paged(cache)}
    return formats.pop() if len(formats) == 1 else None


def converts_modes(cache: list[Any]) -> bool:
    """Whether KV stored in another mode can be restored into ``cache``: paged layers
    convert it page by page, but mlx-lm's own attention caches (the probe's
    fallback) hold only the mode they were made in."""
    return not any(type(c) in (KVCache, QuantizedKVCache) for c in cache)


def _paged(cache: list[Any]) -> list[PagedKVCache]:
    return [c for c in cache if isinstance(c, PagedKVCache)]


def ensure_capacity(cache: list[Any], new_tokens: int) -> None:
    """Raise KvBudgetExceeded now if ``new_tokens`` more tokens would not fit.

    Call before a forward pass of a model whose first layers are not paged, so that
    no layer has changed when the budget runs out.
    """
    paged = _paged(cache)
    if paged:
        paged[0].pool.ensure(paged[0].offset + new_tokens)


def trim_cache(cache: list[Any], n: int) -> int:
    """Trim ``n`` tokens from every layer; 0 if any layer cannot trim (nothing changes)."""
    if not cache or not all(c.is_trimmable() for c in cache):
        return 0
    trimmed = [c.trim(n) for c in cache]  # every layer, not just the first
    return trimmed[0]


def cache_stats(cache: list[Any]) -> CacheStats:
    """Page occupancy of a cache made by :func:`make_cache` (no MLX evaluation)."""
    paged = _paged(cache)
    pool = paged[0].pool if paged else None
    layers = tuple(
        LayerStats(c.layer, len(c.block_table), c.offset, c.nbytes) for c in paged
    )
    in_use = sum(layer.pages_in_use for layer in layers)
    allocated = sum(c.store.capacity for c in paged if c.store is not None)
    free = sum(c.store.free_count for c in paged if c.store is not None)
    shared, once, others = sharing.shared_bytes(cache)
    idle = sum(c.store.free_count * c.store.layout.page_bytes for c in paged if c.store)
    tokens = cache_tokens(cache)
    page_size = pool.page_size if pool else 0
    fill = 0.0
    if tokens and page_size:
        fill = (tokens - (tokens - 1) // page_size * page_size) / page_size
    return CacheStats(
        mode=pool.mode if pool else FP16,
        page_size=page_size,
        tokens=tokens,
        pages_in_use=in_use,
        pages_allocated=allocated,
        pages_free=free,
        last_page_fill=fill,
        bytes_used=sum(layer.bytes_used for layer in layers),
        bytes_allocated=sum(c.store.capacity * c.store.layout.page_bytes for c in paged if c.store),
        budget_bytes=pool.budget_bytes if pool else None,
        layers=layers,
        rotation=rotation_format(cache),
        other_bytes=sum(_held_bytes(c) for c in cache if not isinstance(c, PagedKVCache)),
        shared_bytes=shared,
        bytes_once=once,
        shared_with=others,
        bytes_held_once=once + idle // (len(pool.group) if pool else 1),
    )


def _held_bytes(layer: Any) -> int:
    # mlx-lm's caches compute nbytes from arrays they only create on first use.
    try:
        return 0 if layer.empty() else int(layer.nbytes)
    except (AttributeError, TypeError):
        return 0


def eval_targets(cache: list[Any]) -> list[Any]:
    """Arrays whose evaluation completes a forward pass's cache writes.

    A paged layer's ``state`` gathers (copies) every held page, so its storage
    arrays are evaluated instead, with what a pipeline stage made depend on them
    (its send to the next stage); other layers use ``state`` as mlx-lm's prefill does.
    """
    targets: list[Any] = []
    for layer in cache:
        if isinstance(layer, PagedKVCache):
            if layer.store is not None:
                targets.extend(layer.store.arrays())
            if layer.pipeline_dependency is not None:
                targets.append(layer.pipeline_dependency)  # the stage's send
        else:
            targets.append(layer.state)
    return targets
