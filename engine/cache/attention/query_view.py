"""The queries of one attention call, folded for GQA, and the mask they attend with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from engine.errors import EngineError

if TYPE_CHECKING:
    from engine.cache.paged_cache import PagedKVCache


def compute_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """fp32 on the CPU backend (fp16 math is emulated there), else the model's dtype."""
    return mx.float32 if mx.default_device().type == mx.cpu else dtype


@dataclass(frozen=True)
class QueryView:
    """The queries folded for GQA (``[kv_heads, repeats * L, D]``) and their mask.

    Row ``r * L + l`` is query head ``r`` of its KV head at the chunk's position ``l``.
    """

    q: mx.array
    heads: int
    length: int
    first: int  # cache position of the first query
    mask: Any  # "causal", None, or the mask folded to [1 or kv_heads, rows, columns]
    dtype: mx.Dtype

    @classmethod
    def of(cls, queries: mx.array, cache: PagedKVCache, mask: Any,
           dtype: mx.Dtype = mx.float32) -> QueryView:
        """The view of ``queries`` (``[1, heads, L, D]``) with ``q`` in ``dtype``."""
        _, heads, length, head_dim = queries.shape
        kv_heads = cache.kv_heads
        repeats = heads // kv_heads
        # squeeze, not [0]: an integer index is a gather (a kernel) in MLX.
        q = queries.squeeze(0).astype(dtype).reshape(kv_heads, repeats * length, head_dim)
        if isinstance(mask, mx.array):
            mask = fold_mask(mask, kv_heads, repeats, length)
        elif mask is not None and mask != "causal":
            raise EngineError(f"The paged KV cache cannot apply a {mask!r} attention mask.")
        first = cache.offset - length
        return cls(q, heads, length, first, mask, compute_dtype(queries.dtype))

    def for_heads(self, heads: slice) -> QueryView:
        """The view of the KV heads ``heads`` only (their queries and mask rows)."""
        if heads == slice(0, self.q.shape[0]):
            return self
        mask = self.mask
        if isinstance(mask, mx.array) and mask.shape[0] > 1:
            mask = mask[heads]
        return QueryView(self.q[heads], self.heads, self.length, self.first, mask, self.dtype)

    @property
    def end(self) -> int:
        """One past the last position the queries attend (the cache's offset)."""
        return self.first + self.length

    def sees_whole(self, start: int, stop: int, positions: mx.array | None) -> bool:
        """Whether every query row may see every stored column in ``[start, stop)``.

        ``positions``: each column's position (None: column ``c`` holds position ``c``).
        """
        return positions is None and not isinstance(self.mask, mx.array) and stop <= self.first

    def allowed(self, positions: mx.array) -> mx.array:
        """Which stored positions each query row may see, as a bool mask (no mask
        array: :meth:`hide` applies one).

        Positions past the cache's end (the unwritten rest of a page) and columns
        the cache does not hold (position -1) are never allowed; "causal" lets each
        query see positions up to its own.
        """
        held = positions >= 0
        if self.mask == "causal" and self.length > 1:
            rows = self.q.shape[1]
            query_position = self.first + mx.arange(rows, dtype=mx.int32) % self.length
            return (held[None] & (positions[None] <= query_position[:, None]))[None]
        return (held & (positions < self.end))[None, None]

    def _mask_columns(self, positions: mx.array) -> tuple[mx.array, mx.array | None]:
        """The folded mask array's columns at ``positions``: (bool allowed, additive)."""
        column = mx.clip(positions, 0, self.end - 1)
        picked = mx.take(self.mask, column, axis=-1)
        inside = ((positions >= 0) & (positions < self.end))[None, None]
        if picked.dtype == mx.bool_:
            return picked & inside, None
        return inside, picked

    def hide(self, scores: mx.array, positions: mx.array, hidden: float = -mx.inf) -> mx.array:
        """``scores`` (``[kv_heads or 1, rows, n]``) with every column the queries may
        not see at ``positions`` set to ``hidden``, an additive mask's values added."""
        if isinstance(self.mask, mx.array):
            allowed, additive = self._mask_columns(positions)
            if additive is not None:
                # A -inf the mask adds hides its column as ``hidden`` does: a finite
                # ``hidden`` keeps a block its rows see none of from a NaN softmax.
                scores = mx.maximum(scores + additive.astype(scores.dtype),
                                    mx.array(hidden, scores.dtype))
        else:
            allowed = self.allowed(positions)
        return mx.where(allowed, scores, mx.array(hidden, scores.dtype))


def fold_mask(mask: mx.array, kv_heads: int, repeats: int, length: int) -> mx.array:
    """An mlx-lm mask ``[..., L, T]`` as ``[1 or kv_heads, repeats * L, T]`` rows."""
    while mask.ndim > 3:
        if mask.shape[0] != 1:
            raise EngineError("The paged KV cache holds one sequence; batch size must be 1.")
        mask = mask[0]
    if mask.ndim == 2:
        mask = mask[None]
    columns = mask.shape[-1]
    if mask.shape[0] == 1:
        mask = mx.broadcast_to(mask[:, None], (1, repeats, length, columns))
        return mask.reshape(1, repeats * length, columns)
    return mask.reshape(kv_heads, repeats * length, columns)


def column_positions(start: int, stop: int, positions: mx.array | None) -> mx.array:
    """Positions of the stored columns ``[start, stop)`` (``positions`` from
    ``PagedKVCache.columns``; None: each column holds its own position)."""
    if positions is None:
        return mx.arange(start, stop, dtype=mx.int32)
    return positions[start:stop]
