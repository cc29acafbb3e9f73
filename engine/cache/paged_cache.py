"""PagedKVCache: one attention layer's paged, quantized KV cache in mlx-lm's protocol.

``update_and_fetch`` quantizes the new rows into the layer's pages; the adapter
routes every PagedKVCache to :func:`engine.cache.attention.dispatch.paged_attention`,
which reads only the stored pages, the new chunk's own rows included, so every
position attends the same quantized rows whatever the chunking.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import create_attention_mask

from engine.cache import kvquant
from engine.cache.mlx_lm_compat import BaseCache
from engine.cache.modes import parse_mode
from engine.cache.pages import PagePool, PageStore
from engine.cache.rotation import rotation_for
from engine.errors import EngineError

# A batch's rows as a layer stores them: key codes, their scales and biases (None
# for fp16), value codes, theirs (engine.cache.pages.PARTS).
EncodedRows = tuple[mx.array, mx.array | None, mx.array, mx.array | None]


class PagedKVCache(BaseCache):
    """KV cache of one attention layer, stored in pages of a shared :class:`PagePool`.

    Args:
        pool: the session's page pool (mode, page size and byte budget).
        kv_heads: KV heads of the layer; with ``head_dim``, registers the layer's
            storage now so budget checks cover it before its first token.
        head_dim: values per head.
        layer: index of the layer in the model, for stats.
    """

    def __init__(
        self,
        pool: PagePool,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        layer: int = 0,
    ) -> None:
        self.pool = pool
        self.layer = layer
        self.store: PageStore | None = None
        if kv_heads is not None and head_dim is not None:
            self.store = pool.add_store(kv_heads, head_dim, holder=self)
        self.block_table: list[int] = []
        self.offset = 0
        # mlx-lm's pipelined forward makes the stage's send depend on the last
        # layer's ``keys`` (``cache.keys = mx.depends(cache.keys, h)``); what it
        # sets here is evaluated with the pages (``adapter.eval_targets``).
        self._dependency: mx.array | None = None
        # An orthonormal transform applied to every key and value row before it is
        # quantized (``engine.cache.rotation``); attention then works in the rotated
        # basis: queries rotated in, the output rotated back. None: rows as given.
        self.rotation: Any = None
        # The version counts the block table's changes, so a decode step checks
        # what it memoized from the table in constant time.
        self._table_version = 0
        # (table version, end column, positions or None): see ``columns``.
        self._columns: tuple[int, int, mx.array | None] | None = None
        # ((store, table version, holder changes), shared_pages): see there.
        self._shared: tuple[tuple[int, int, int], tuple[int, float]] | None = None

    @property
    def keys(self) -> mx.array:
        """mlx-lm's pipeline hook: an array the stage's send is made to depend on."""
        return mx.zeros((0,)) if self._dependency is None else self._dependency

    @keys.setter
    def keys(self, value: mx.array | None) -> None:
        self._dependency = value

    @property
    def pipeline_dependency(self) -> mx.array | None:
        """What a pipeline stage's forward made depend on this layer (None: nothing)."""
        return self._dependency

    # -- writing -------------------------------------------------------------

    def _store_for(self, kv_heads: int, head_dim: int) -> PageStore:
        if self.store is None:
            self.store = self.pool.add_store(kv_heads, head_dim, holder=self)
        layout = self.store.layout
        if (layout.kv_heads, layout.head_dim) != (kv_heads, head_dim):
            raise EngineError(
                f"Layer {self.layer} was set up for {layout.kv_heads} KV heads of "
                f"{layout.head_dim} values but got {kv_heads} of {head_dim}."
            )
        return self.store

    @property
    def held_store(self) -> PageStore:
        """The layer's store, which a layer has from its first row on."""
        if self.store is None:
            raise EngineError(f"Layer {self.layer} holds no KV pages yet.")
        return self.store

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Store the new rows (rotated when the layer rotates them) and return them.

        mlx-lm's attention call receives what this returns, but the paged path
        ignores it and reads the stored pages instead.
        """
        batch, kv_heads, length, head_dim = keys.shape
        if batch != 1:
            raise EngineError("The paged KV cache holds one sequence; batch size must be 1.")
        if values.shape[-1] != head_dim:
            raise EngineError("The paged KV cache needs keys and values of the same width.")
        self.reserve(kv_heads, head_dim, length)
        keys, values, rows = self.encode(keys, values)
        self.append(row_of(rows, 0))
        return keys, values

    def reserve(self, kv_heads: int, head_dim: int, length: int) -> None:
        """Make room for ``length`` more rows of ``kv_heads`` heads of ``head_dim``.

        Raises:
            EngineError: the layer holds rows of another shape.
            KvBudgetExceeded: the pool's budget cannot hold them.
        """
        self._store_for(kv_heads, head_dim)
        self.pool.ensure(self.offset + length)

    def encoding(self) -> tuple[Any, ...]:
        """What :meth:`encode` depends on: layers with equal encodings encode rows
        alike, so a batch's rows of one layer are rotated and quantized together."""
        layout = self.held_store.layout
        return self.basis, layout.bits, layout.groups, layout.kv_heads, layout.head_dim

    @property
    def basis(self) -> tuple[str, int] | None:
        """The rotation rows are stored in, as (format id, layer); None: as given."""
        return None if self.rotation is None else (self.rotation.format_id, self.rotation.layer)

    def encode(self, keys: mx.array, values: mx.array
               ) -> tuple[mx.array, mx.array, EncodedRows]:
        """Rows ``[B, kv_heads, L, D]`` as this layer stores them, written nowhere.

        Returns the rows rotated (when the layer rotates them) and the storage
        parts (:data:`engine.cache.pages.PARTS`): codes ``[B, kv_heads, L, ...]``,
        scales and biases ``[2, B, kv_heads, L, groups]``. Each row is encoded on
        its own: a row encodes to the same parts in a batch as alone.
        """
        layout = self.held_store.layout
        if self.rotation is not None:
            keys, values = self.rotation.rotate(keys), self.rotation.rotate(values)
        k_codes, k_scales = kvquant.quantize_for_store(keys, layout.bits, layout.groups)
        v_codes, v_scales = kvquant.quantize_for_store(values, layout.bits, layout.groups)
        return keys, values, (k_codes, k_scales, v_codes, v_scales)

    def append(self, rows: EncodedRows) -> None:
        """Write one sequence's encoded rows (:func:`row_of`) after the held ones;
        their pages must be reserved (``pool.ensure``)."""
        self._write(rows, self.offset)
        self.offset += rows[0].shape[-2]

    def _write(self, rows: EncodedRows, start: int) -> None:
        """Write rows from position ``start`` on: one write per run of consecutive
        slots (a decode step's row, or a whole chunk when the table is in order)."""
        page_size = self.pool.page_size
        end = start + rows[0].shape[-2]
        position = start
        while position < end:
            logical, row = divmod(position, page_size)
            slot = last = self._writable_slot(logical)
            count = min(page_size - row, end - position)
            while position + count < end and self._writable_slot(logical + 1) == last + 1:
                logical, last = logical + 1, last + 1
                count = min(count + page_size, end - position)
            first = position - start
            piece = tuple(None if r is None else r[..., first : first + count, :] for r in rows)
            self.held_store.write(slot, row, piece)
            position += count

    def _writable_slot(self, logical: int) -> int:
        """The slot of logical page ``logical``, taken if new, copied if shared."""
        if logical == len(self.block_table):
            self.block_table.append(self.held_store.take())
            self._table_version += 1
        elif self.held_store.shared(self.block_table[logical]):
            self._copy_on_write(logical)
        return self.block_table[logical]

    def _copy_on_write(self, logical: int) -> None:
        # Another chat reads this page too: write into a copy of it instead.
        shared = self.block_table[logical]
        store = self.held_store
        own = store.take()
        store.copy_page(shared, own)
        store.give_back([shared])
        self.block_table[logical] = own
        self._table_version += 1

    def copies_due(self, tokens: int) -> int:
        """Pages a write up to ``tokens`` must copy first (its shared, partly filled
        last page), for the budget to count."""
        if tokens <= self.offset or self.offset % self.pool.page_size == 0:
            return 0
        return int(self.held_store.shared(self.block_table[-1]))

    # -- sharing with another session's cache -------------------------------------

    def share_prefix(self, other: PagedKVCache, tokens: int) -> None:
        """Hold ``other``'s first ``tokens`` tokens by pointing at its pages.

        This cache must hold nothing and its pool must have joined ``other``'s
        (``PagePool.join``). No page is copied; the first write into a shared
        page copies that page alone.
        """
        if self.block_table or self.pool.stores is not other.pool.stores:
            raise EngineError("Only an empty cache in the same page group can share pages.")
        self.store = other.held_store
        slots = other.block_table[: self.pool.pages_for(tokens)]
        self.store.share(slots)
        self.block_table.extend(slots)
        self._table_version += 1
        self.offset = tokens

    def release(self) -> None:
        """Give every page back (shared ones stay with their other holders)."""
        self._drop_last(self.offset, release=True)

    @property
    def shared_pages(self) -> tuple[int, float]:
        """(pages held that others hold too, held pages with each shared one
        divided among its holders): a sum over chats counts every page once."""
        if self.store is None or not self.pool.shared:
            return 0, float(len(self.block_table))
        # Kept until this table or anyone's holders change (a new page, every
        # page_size tokens): a stats sample walks the table only then.
        key = (id(self.store), self._table_version, self.store.changes)
        if self._shared is None or self._shared[0] != key:
            holders = [self.store.holders(slot) for slot in self.block_table]
            self._shared = (key, (sum(1 for h in holders if h > 1),
                                  sum(1 / h for h in holders)))
        return self._shared[1]

    # -- reading (for the attention) -------------------------------------------

    @property
    def kv_heads(self) -> int:
        return self.held_store.layout.kv_heads

    @property
    def head_dim(self) -> int:
        return self.held_store.layout.head_dim

    def columns(self) -> tuple[int, mx.array | None]:
        """Which token columns of the store the attention reads, and where they sit.

        Returns ``(end, positions)``: the attention reads columns ``[0, end)`` of
        every part. ``positions`` is None when the block table is in slot order
        (logical page ``i`` in slot ``i``, the usual case): column ``c`` then holds
        position ``c`` and ``end`` is the offset. Otherwise (pages shared with
        another chat, or copied on write) ``positions`` gives each column's
        position, or -1 where this cache holds no row, and ``end`` covers its
        highest slot. Memoized per block table: a decode step inside a page does
        no Python work over the table.
        """
        if self._columns is None or self._columns[0] != self._table_version:
            self._columns = (self._table_version, *self._columns_of_table())
        _, end, positions = self._columns
        return (self.offset, None) if positions is None else (end, positions)

    def _columns_of_table(self) -> tuple[int, mx.array | None]:
        table = self.block_table
        if table == list(range(len(table))):
            return len(table) * self.pool.page_size, None
        key = tuple(table)
        shared = self.pool.column_map
        if shared is not None and shared[0] == key:
            return shared[1], shared[2]
        end, positions = self._column_map(table)
        self.pool.column_map = (key, end, positions)
        return end, positions

    def _column_map(self, table: list[int]) -> tuple[int, mx.array]:
        """Each column's position for an out-of-order ``table`` (-1: no row here)."""
        page_size = self.pool.page_size
        slots = np.asarray(table, dtype=np.int64)
        end = int(slots.max() + 1) * page_size
        positions = np.full(end, -1, dtype=np.int32)
        # Every page's columns at once (a page at a time was a Python loop over
        # the whole table, at each new page of a chat sharing a document).
        columns = (slots[:, None] * page_size + np.arange(page_size)).reshape(-1)
        positions[columns] = np.arange(len(table) * page_size, dtype=np.int32)
        return end, mx.array(positions)

    def dequantized_prefix(self, tokens: int, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
        """The first ``tokens`` cached keys and values as ``[1, kv_heads, tokens, D]``."""
        pages = self.pool.pages_for(tokens)
        store = self.held_store
        k_codes, k_scales, v_codes, v_scales = store.gather(self.block_table[:pages])
        bits, head_dim = store.layout.bits, self.head_dim

        def rows(codes: mx.array | None, scales: mx.array | None) -> mx.array:
            if codes is None:  # gathered from a store that holds pages: never
                raise EngineError(f"Layer {self.layer} lost its KV codes.")
            values = kvquant.dequantize_rows(codes, scales, bits, head_dim, dtype)
            return values.swapaxes(0, 1).reshape(self.kv_heads, -1, head_dim)[None, :, :tokens]

        return rows(k_codes, k_scales), rows(v_codes, v_scales)

    # -- mlx-lm cache protocol ---------------------------------------------------

    def make_mask(
        self, N: int, window_size: int | None = None, return_array: bool = False
    ) -> Any:
        # Models build masks before any layer runs: reserving here means a budget
        # error leaves every layer (paged or not) untouched.
        self.pool.ensure(self.offset + N)
        return create_attention_mask(
            N, offset=self.offset, return_array=return_array, window_size=window_size
        )

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return not self.block_table

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        return self._drop_last(n, release=True)

    def _drop_last(self, n: int, *, release: bool) -> int:
        n = max(0, min(self.offset, n))
        self.offset -= n
        keep = self.pool.pages_for(self.offset)
        if self.store is not None:
            self.store.give_back(self.block_table[keep:])
        if keep < len(self.block_table):
            del self.block_table[keep:]
            self._table_version += 1
        if self.store is not None and release:
            self.pool.release_free_tail(self.store)
        return n

    @property
    def nbytes(self) -> int:
        """Bytes of the pages held (codes and scales), by the kvquant arithmetic."""
        if self.store is None:
            return 0
        return len(self.block_table) * self.store.layout.page_bytes

    @property
    def state(self) -> tuple[Any, ...]:
        """Held pages in logical order, then offset, mode, page size, kv heads, head_dim."""
        if self.store is None or not self.block_table:
            arrays: list[mx.array | None] = [None] * 4
        else:
            arrays = self.store.gather(self.block_table)
        layout = self.store.layout if self.store is not None else None
        return (
            *arrays,
            self.offset,
            self.pool.mode,
            self.pool.page_size,
            layout.kv_heads if layout else 0,
            layout.head_dim if layout else 0,
        )

    @state.setter
    def state(self, v: tuple[Any, ...]) -> None:
        k_codes, k_scales, v_codes, v_scales, offset, mode, page_size, kv_heads, head_dim = v
        if not hasattr(self, "pool"):  # built by from_state: a private, unbudgeted pool
            PagedKVCache.__init__(self, PagePool(parse_mode(mode), int(page_size)))
        if (parse_mode(mode), int(page_size)) != (self.pool.mode, self.pool.page_size):
            raise EngineError(
                f"Saved KV pages are {mode} with {page_size}-token pages; this cache is "
                f"{self.pool.mode} with {self.pool.page_size}-token pages."
            )
        offset = int(offset)
        if offset:
            if k_codes is None or k_codes.shape[0] < self.pool.pages_for(offset):
                raise EngineError(
                    f"Saved KV state is incomplete: it lacks pages for {offset} tokens."
                )
            self._store_for(int(kv_heads), int(head_dim))
            self.pool.ensure(offset)
        if offset and k_scales is not None:
            bits = kvquant.bits_for(self.pool.mode)
            k_codes, k_scales = kvquant.within_cap(k_codes, k_scales, bits, int(head_dim))
            v_codes, v_scales = kvquant.within_cap(v_codes, v_scales, bits, int(head_dim))
        # Keep the storage reserved above: the pages are rewritten into it.
        self._drop_last(self.offset, release=False)
        for page in range(self.pool.pages_for(offset)):
            store = self.held_store
            slot = store.take()
            self.block_table.append(slot)
            self._table_version += 1
            rows = [k_codes[page], k_scales, v_codes[page], v_scales]
            for part in (1, 3):  # row scales (the snapshot's format) as MLX's pairs
                if rows[part] is not None:
                    rows[part] = kvquant.affine_scales(rows[part][page], store.layout.bits,
                                                       store.layout.groups)
            store.write(slot, 0, tuple(rows))
        self.offset = offset

    @property
    def meta_state(self) -> tuple[str, ...]:
        """Mode, page size, offset, the rotation's format id ("" for none) and the layer."""
        rotation = "" if self.rotation is None else self.rotation.format_id
        return (self.pool.mode, str(self.pool.page_size), str(self.offset), rotation,
                str(self.layer))

    @meta_state.setter
    def meta_state(self, v: tuple[str, ...]) -> None:
        mode, page_size, offset, *rotation = v
        if (parse_mode(mode), int(page_size)) != (self.pool.mode, self.pool.page_size):
            raise EngineError("Saved KV metadata does not match this cache's mode and page size.")
        self.offset = min(int(offset), self.offset)
        if rotation and self.store is not None:
            # The pages hold rotated rows: read without their rotation they are noise.
            format_id, layer = rotation
            self.layer = int(layer)
            self.rotation = rotation_for(format_id or None, self.head_dim, self.layer)


def row_of(rows: EncodedRows, index: int) -> EncodedRows:
    """Sequence ``index`` of a batch's encoded rows (:meth:`PagedKVCache.encode`):
    views, no kernel (an integer index would be a gather in MLX)."""
    k_codes, k_scales, v_codes, v_scales = rows

    def codes(part: mx.array) -> mx.array:
        return part[index:index + 1].squeeze(0)

    def scales(part: mx.array | None) -> mx.array | None:  # [2, B, ...]: batch second
        return None if part is None else part[:, index:index + 1].squeeze(1)

    return codes(k_codes), scales(k_scales), codes(v_codes), scales(v_scales)


def cache_tokens(cache: list[Any]) -> int:
    """Tokens a model's cache holds (paged layers first, else any layer with an offset)."""
    paged = [layer for layer in cache if isinstance(layer, PagedKVCache)]
    for layer_cache in paged or cache:
        offset = getattr(layer_cache, "offset", None)
        if isinstance(offset, int):
            return offset
    return 0
