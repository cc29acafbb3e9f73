"""The queries of one attention call, folded for GQA, and the mask they attend with."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.errors import EngineError


def compute_dtype(dtype: mx.Dtype) -> mx.Dtype:
    """fp32 on the CPU backend (fp16 math is emulated there), else the model's dtype."""
    return mx.float32 if mx.default_device().type == mx.cpu else dtype


@dataclass(frozen=True)
class QueryView:
    """The queries folded for GQA (``[kv_heads, repeats * L, D]``) and their mask."""

    q: mx.array
    heads: int
    length: int
    first: int  # cache position of the first query
    mask: Any  # "causal", None, or the mask folded to [1 or kv_heads, rows, columns]
    dtype: mx.Dtype

    @classmethod
    def of(cls, queries: mx.array, cache: Any, mask: Any) -> QueryView:
        _, heads, length, head_dim = queries.shape
        kv_heads = cache.kv_heads
        repeats = heads // kv_heads
        # Q·Kᵀ in fp32 even on Metal: fp16 queries and scales measurably raise
        # q8's error (docs/benchmarks.md).
        q = queries[0].astype(mx.float32).reshape(kv_heads, repeats * length, head_dim)
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

    def sees_whole(self, end: int) -> bool:
        """Whether every query row may see every stored position before ``end``."""
        return not isinstance(self.mask, mx.array) and end <= self.first

    def allowed(self, positions: mx.array) -> mx.array:
        """Which stored positions each query row may see, as a bool mask.

        Columns past the cache's end (the unwritten rest of a page) are never
        allowed; "causal" lets each query see positions up to its own.
        """
        if self.mask == "causal" and self.length > 1:
            rows = self.q.shape[1]
            query_position = self.first + mx.arange(rows, dtype=mx.int32) % self.length
            return (positions[None] <= query_position[:, None])[None]
        return (positions < self.first + self.length)[None, None]

    def additive_or_bool(self, positions: mx.array, end: int) -> tuple[Any, Any]:
        """The folded mask array's columns at ``positions``: (bool allowed, additive)."""
        column = mx.minimum(positions, end - 1)
        picked = mx.take(self.mask, column, axis=-1)
        inside = (positions < end)[None, None]
        if picked.dtype == mx.bool_:
            return picked & inside, None
        return inside, picked


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


def masked(view: QueryView, scores: mx.array, positions: mx.array) -> mx.array:
    """``scores`` with every position the queries may not see set to -inf.

    ``scores`` are ``[kv_heads, rows, n]``, or ``[pages, kv_heads, rows, n]`` with
    ``positions`` (``pages * n``) cut the same way.
    """
    end = view.first + view.length
    pages = scores.shape[0] if scores.ndim == 4 else None
    if isinstance(view.mask, mx.array):
        allowed, additive = view.additive_or_bool(positions, end)
        if additive is not None:
            scores = scores + by_page(additive, pages).astype(scores.dtype)
    else:
        allowed = view.allowed(positions)
    return mx.where(by_page(allowed, pages), scores, -mx.inf)


def by_page(columns: mx.array, pages: int | None) -> mx.array:
    """``[..., rows, pages * n]`` as ``[pages, ..., rows, n]`` (a view; None: as is)."""
    if pages is None:
        return columns
    split = columns.reshape(*columns.shape[:-1], pages, -1)
    return mx.moveaxis(split, -2, 0)


def page_positions(logicals: list[int], page_size: int) -> mx.array:
    logical = mx.array(logicals, dtype=mx.int32)[:, None] * page_size
    return (logical + mx.arange(page_size, dtype=mx.int32)[None]).reshape(-1)
