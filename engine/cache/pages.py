"""Pages of KV storage: one layer's page store and the pool that budgets them all.

A page holds ``page_size`` tokens of one layer, for every KV head: packed codes and
float16 row scales for keys and values, page-major (``[pages, kv_heads, page_size,
packed]``). Each layer's pages live in that layer's own slabs (arrays of many
pages). Slabs are added, never grown: allocating a page never copies a page that
exists. Layers never share a slab because MLX copies a whole array on a slice update
while any other reader of it is pending, and in one forward pass every layer writes
then reads its storage.

The :class:`PagePool` owns the byte budget of one session's layers. It reserves
pages for all of them at once, so running out of budget raises before any layer
has changed.

Sessions that start with the same tokens share pages: their pools
:meth:`PagePool.join` one group and point into the same stores, where each slot
counts the block tables that hold it. A slot goes back to the free list when the
last one gives it back; a shared slot is never written (the holder that writes
into it copies it first, see ``PagedKVCache._write``).
"""

from __future__ import annotations

import heapq
import math
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.cache import kvquant
from engine.cache.modes import MODES
from engine.errors import EngineError, KvBudgetExceeded, UnsupportedModeError

# Slabs double a layer's capacity up to this many bytes, then add half the
# capacity each: few slabs per layer (each costs two kernels per decode step)
# while the idle tail a layer allocates ahead stays at most one slab, a third of
# what it holds, and within the budget's spare room.
MAX_SLAB_BYTES = 32 * 2**20
MIN_SLAB_PAGES = 4
PREFILL_SCRATCH_BYTES = 256 * 2**20


@dataclass(frozen=True)
class PageLayout:
    """Shape of one layer's pages."""

    mode: str
    page_size: int
    kv_heads: int
    head_dim: int

    @property
    def bits(self) -> int:
        return kvquant.bits_for(self.mode)

    @property
    def row_width(self) -> int:
        """Stored elements per row: packed bytes, or float16 values for fp16."""
        if self.bits == 16:
            return self.head_dim
        return kvquant.packed_dim(self.head_dim, self.bits)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page, keys and values, codes and scales."""
        per_token = kvquant.kv_bytes_per_token(self.head_dim, self.mode)
        return self.page_size * self.kv_heads * per_token

    def with_mode(self, mode: str) -> PageLayout:
        return PageLayout(mode, self.page_size, self.kv_heads, self.head_dim)


class PageStore:
    """One layer's page slots, held in slabs, with a free list of slot ids.

    Slot ids are dense: slot ``s`` lives in the slab whose range covers ``s``.
    Arrays are ``(k_codes, k_scales, v_codes, v_scales)`` per slab; the scales are
    None in fp16 mode. Each slot counts the block tables holding it (0: free).
    """

    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout
        self.slabs: list[list[mx.array | None]] = []
        self.capacity = 0
        self._free: list[int] = []
        self._where: list[tuple[int, int]] = []  # slot -> (slab, index in slab)
        self._refs: list[int] = []  # slot -> block tables holding it

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    def add_slab(self, pages: int) -> None:
        layout = self.layout
        shape = (pages, layout.kv_heads, layout.page_size)
        code_dtype = mx.float16 if layout.bits == 16 else mx.uint8

        def codes() -> mx.array:
            return mx.zeros((*shape, layout.row_width), dtype=code_dtype)

        def scales() -> mx.array | None:
            return None if layout.bits == 16 else mx.zeros((*shape, 1), dtype=mx.float16)

        slab = [codes(), scales(), codes(), scales()]
        # Allocate now: a reservation that stays lazy would land in whatever step
        # first writes the slab, and count there as that step's transient.
        mx.eval([part for part in slab if part is not None])
        self.slabs.append(slab)
        self._where.extend((len(self.slabs) - 1, local) for local in range(pages))
        self._refs.extend([0] * pages)
        for slot in range(self.capacity, self.capacity + pages):
            heapq.heappush(self._free, slot)
        self.capacity += pages

    def take(self) -> int:
        """A free slot, lowest first so a layer's pages stay in slab order."""
        slot = heapq.heappop(self._free)
        self._refs[slot] = 1
        return slot

    def share(self, slots: list[int]) -> None:
        """Count one more holder of each slot (another block table now reads them)."""
        for slot in slots:
            self._refs[slot] += 1

    def shared(self, slot: int) -> bool:
        """Whether more than one block table holds ``slot`` (it must not be written)."""
        return self._refs[slot] > 1

    def holders(self, slot: int) -> int:
        return self._refs[slot]

    def give_back(self, slots: list[int]) -> None:
        """Drop one holder of each slot; a slot nobody holds is free again."""
        for slot in slots:
            self._refs[slot] -= 1
            if self._refs[slot] == 0:
                heapq.heappush(self._free, slot)

    def copy_page(self, source: int, target: int) -> None:
        """Make slot ``target`` hold the same rows as slot ``source``."""
        from_slab, from_local = self.locate(source)
        to_slab, to_local = self.locate(target)
        pages = [None if a is None else a[from_local] for a in self.slabs[from_slab]]
        # Evaluated first: a slice update of a slab another pending op still reads
        # would copy the whole slab.
        mx.eval([p for p in pages if p is not None])
        slab = self.slabs[to_slab]
        for part, page in enumerate(pages):
            if page is not None:
                slab[part][to_local] = page

    def drop_free_tail(self) -> int:
        """Drop the last slabs while every slot in them is free; returns pages dropped.

        Slots are dense and taken lowest first, so after a trim the free slots
        gather in the last slabs: dropping them hands their memory back (to MLX's
        buffer cache; ``mx.clear_cache`` returns it to the system).
        """
        dropped = 0
        while self.slabs:
            pages = self.slabs[-1][0].shape[0]
            start = self.capacity - pages
            if sum(1 for slot in self._free if slot >= start) < pages:
                break
            self._free = [slot for slot in self._free if slot < start]
            heapq.heapify(self._free)
            del self._where[start:]
            del self._refs[start:]
            self.slabs.pop()
            self.capacity = start
            dropped += pages
        return dropped

    def arrays(self) -> list[mx.array]:
        """Every array the store holds its rows in."""
        return [part for slab in self.slabs for part in slab if part is not None]

    def replace_arrays(self, arrays: list[mx.array]) -> None:
        """Hold ``arrays`` (:meth:`arrays`' order and shapes) instead (graph counts)."""
        it = iter(arrays)
        self.slabs = [[None if part is None else next(it) for part in slab]
                      for slab in self.slabs]

    def locate(self, slot: int) -> tuple[int, int]:
        """(slab index, index inside the slab) of a slot."""
        return self._where[slot]

    def write(self, slot: int, row: int, rows: tuple[mx.array | None, ...]) -> None:
        """Write ``[kv_heads, n, width]`` rows at ``row`` of a page, in place.

        ``rows`` is ``(k_codes, k_scales, v_codes, v_scales)``.
        """
        slab_index, local = self.locate(slot)
        slab = self.slabs[slab_index]
        for part, value in enumerate(rows):
            if value is None:
                continue
            target = slab[part]
            target[local, :, row : row + value.shape[1], :] = value
            slab[part] = target

    def gather(self, slots: list[int], heads_first: bool = False) -> list[mx.array | None]:
        """Copies of the given pages in the given order.

        Page-major ``[n, kv_heads, page_size, w]``, or with ``heads_first``
        ``[kv_heads, n, page_size, w]`` (one gather, ready to read as a sequence).
        """
        axis = 1 if heads_first else 0
        groups = self.group(slots)
        parts: list[mx.array | None] = []
        for part in range(4):
            if self.slabs[0][part] is None:
                parts.append(None)
                continue
            pieces = []
            for slab_index, local, _ in groups:
                pages = self.slabs[slab_index][part]
                pages = pages.swapaxes(0, 1) if heads_first else pages
                pieces.append(mx.take(pages, local, axis=axis))
            parts.append(pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=axis))
        order = [p for _, _, positions in groups for p in positions]
        if order != sorted(order):
            inverse = mx.array(sorted(range(len(order)), key=order.__getitem__))
            parts = [None if p is None else mx.take(p, inverse, axis=axis) for p in parts]
        return parts

    def group(self, slots: list[int]) -> list[tuple[int, mx.array, list[int]]]:
        """Split logical pages by slab: (slab index, local indices, logical page numbers)."""
        by_slab: dict[int, tuple[list[int], list[int]]] = {}
        for logical, slot in enumerate(slots):
            slab_index, local = self.locate(slot)
            locals_, logicals = by_slab.setdefault(slab_index, ([], []))
            locals_.append(local)
            logicals.append(logical)
        return [
            (index, mx.array(locals_, dtype=mx.uint32), logicals)
            for index, (locals_, logicals) in sorted(by_slab.items())
        ]


class PageGroup:
    """The pools whose sessions point into the same stores.

    Weakly held: a pool refers to its group and its layers' caches refer to the
    pool, so strong references back would make cycles, and a closed session's
    slabs (gigabytes at 262k tokens) would wait for Python's cycle collector.
    """

    def __init__(self, pool: PagePool) -> None:
        self._pools: weakref.WeakSet[PagePool] = weakref.WeakSet([pool])

    def __len__(self) -> int:
        return len(self._pools)

    def __iter__(self) -> Iterator[PagePool]:
        return iter(list(self._pools))

    def add(self, pool: PagePool) -> None:
        self._pools.add(pool)

    def discard(self, pool: PagePool) -> None:
        self._pools.discard(pool)


class PagePool:
    """Hands out pages to one session's layers under a shared byte budget.

    Args:
        mode: KV storage mode (any name :func:`engine.cache.kvquant.normalize_mode` takes).
        page_size: tokens per page.
        budget_bytes: bytes all allocated pages may take together; None for no limit.
    """

    def __init__(self, mode: str, page_size: int = 256, budget_bytes: int | None = None) -> None:
        if page_size < 1:
            raise ValueError("page_size must be at least 1 token")
        self.mode = kvquant.normalize_mode(mode)
        self.page_size = page_size
        self.budget_bytes = budget_bytes
        self.stores: list[PageStore] = []
        # The block table reading each store (a ``PagedKVCache``), for what this
        # session still needs when its stores are shared; None: the store's only user.
        self.holders: list[weakref.ref[Any] | None] = []
        # Pools whose sessions share pages: one group, the same stores (see join).
        self.group = PageGroup(self)
        # The most one prefill chunk's attention may hold on top of the pages
        # (engine.cache.attention.dispatch walks the pages in blocks that fit it).
        self.scratch_bytes = PREFILL_SCRATCH_BYTES
        # Pages every store already has room for, so most calls (two per layer per
        # step) return without looking at the stores; reset when a store shrinks.
        self._room = 0

    def add_store(self, kv_heads: int, head_dim: int, holder: Any = None) -> PageStore:
        """Register one layer's storage (validates the mode against head_dim).

        ``holder`` is the layer's cache (its ``block_table`` and ``offset``).
        """
        if self.shared:
            raise EngineError("A layer cannot join page stores shared with other chats.")
        layout = PageLayout(self.mode, self.page_size, kv_heads, head_dim)
        layout.row_width  # noqa: B018 - raises UnsupportedModeError for a bad head_dim
        store = PageStore(layout)
        self.stores.append(store)
        # Weak: the holder (a layer's cache) refers to this pool.
        self.holders.append(None if holder is None else weakref.ref(holder))
        self._room = 0
        return store

    # -- sharing pages between sessions ----------------------------------------

    @property
    def shared(self) -> bool:
        """Whether another session's pool points into these stores."""
        return len(self.group) > 1

    def can_join(self, other: PagePool) -> bool:
        """Whether this pool (holding no page) can point into ``other``'s stores."""
        return (
            other is not self
            and (self.mode, self.page_size) == (other.mode, other.page_size)
            and [s.layout for s in self.stores] == [s.layout for s in other.stores]
            and all(s.in_use == 0 for s in self.stores)
        )

    def join(self, other: PagePool) -> None:
        """Point this pool's layers into ``other``'s stores, to share its pages.

        Call while this pool holds no page; its own empty stores are dropped. The
        caller rebinds each layer's cache to ``stores[i]``.
        """
        if not self.can_join(other):
            raise EngineError("These page stores cannot be shared: another layout.")
        self.leave()
        self.stores = other.stores
        self.group = other.group
        self.group.add(self)
        for pool in self.group:
            pool._room = 0

    def leave(self) -> None:
        """Stop sharing (after every page was given back): the others keep the stores."""
        if self.shared:
            self.group.discard(self)
            for pool in self.group:
                pool._room = 0
            self.stores = [PageStore(s.layout) for s in self.stores]
            self.group = PageGroup(self)
        self._room = 0

    @property
    def bytes_allocated(self) -> int:
        return sum(s.capacity * s.layout.page_bytes for s in self.stores)

    def release_free_tail(self, store: PageStore) -> None:
        """Give back ``store``'s fully free last slabs (after a trim)."""
        if store.drop_free_tail():
            for pool in self.group:
                pool._room = 0

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def ensure(self, tokens: int) -> None:
        """Make sure every layer can hold ``tokens`` tokens, or raise without changes.

        Raises:
            KvBudgetExceeded: the budget cannot hold ``tokens`` in every layer.
        """
        pages = self.pages_for(tokens)
        if pages <= self._room:
            return
        short = [(s, self._needed(index, tokens) - s.free_count)
                 for index, s in enumerate(self.stores)]
        short = [(s, n) for s, n in short if n > 0]
        if not short:
            self._room = self._reach()
            return
        needed = sum(n * s.layout.page_bytes for s, n in short)
        headroom = math.inf
        if self.budget_bytes is not None:
            headroom = self.budget_bytes - self.bytes_allocated
        if needed > headroom:
            raise self._exceeded(tokens)
        spare = headroom - needed
        step_bytes = sum(s.layout.page_bytes for s, _ in short)
        for store, missing in short:
            # Past MAX_SLAB_BYTES a slab is half the layer's capacity, so a 262k
            # cache is ~a dozen slabs per layer (each costs kernels every decode
            # step), not a hundred, and the idle tail stays at most a third.
            cap = max(1, MAX_SLAB_BYTES // store.layout.page_bytes, store.capacity // 2)
            grow = min(max(store.capacity, MIN_SLAB_PAGES), cap)
            extra = max(0, grow - missing)
            if spare != math.inf:
                # Every short layer grows by the same slack, so layers stay symmetric
                # and the budget's last pages are never held idle by one layer.
                extra = min(extra, int(spare // step_bytes))
            store.add_slab(missing + extra)
        self._room = self._reach()

    def _needed(self, index: int, tokens: int) -> int:
        """Free slots store ``index`` must give this session to hold ``tokens``."""
        store, ref = self.stores[index], self.holders[index]
        holder = ref() if ref is not None else None
        if holder is None:  # the store's only user: everything in use is its own
            return self.pages_for(tokens) - store.in_use
        return self.pages_for(tokens) - len(holder.block_table) + holder.copies_due(tokens)

    def _reach(self) -> int:
        """Pages every layer can hold without a new slab; 0 (look again each time)
        while other sessions take slots from the same stores."""
        if self.shared:
            return 0
        return min((s.capacity for s in self.stores), default=0)

    def tokens_fit(self, mode: str | None = None) -> int:
        """Tokens every layer can hold within the budget (in ``mode``, default ours)."""
        if self.budget_bytes is None:
            return 2**62
        mode = self.mode if mode is None else mode
        per_page = sum(s.layout.with_mode(mode).page_bytes for s in self.stores)
        if per_page == 0:
            return 2**62
        return self.budget_bytes // per_page * self.page_size

    def _exceeded(self, tokens: int) -> KvBudgetExceeded:
        fit = self.tokens_fit()
        suggestion = None
        for mode in MODES[MODES.index(self.mode) + 1 :]:
            try:
                if self.tokens_fit(mode) >= tokens:
                    suggestion = mode
                    break
            except UnsupportedModeError:
                continue  # q6 on a head_dim that is not a multiple of 4
        budget_mib = (self.budget_bytes or 0) / 2**20
        advice = (
            f"Switch the KV mode to {suggestion} to fit it, or shorten the conversation."
            if suggestion
            else "Shorten the conversation or raise the KV memory budget."
        )
        return KvBudgetExceeded(
            f"The KV memory budget ({budget_mib:.1f} MiB) holds {fit} tokens in "
            f"{self.mode} mode, but this step needs {tokens}. {advice}",
            tokens_requested=tokens,
            tokens_fit=fit,
            suggested_mode=suggestion,
        )
