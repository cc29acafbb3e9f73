"""Pages of KV storage: one layer's page store and the pool that budgets them all.

A page holds ``page_size`` tokens of one layer, for every KV head. A layer's pages
live in four arrays (keys' codes, their scales and biases, values' codes, theirs),
heads first and tokens next: slot ``s`` holds tokens ``s * page_size`` to
``(s + 1) * page_size`` of every head's rows (``[kv_heads, capacity * page_size,
width]``; scales and biases ``[2, kv_heads, capacity * page_size, groups]``, see
``engine.cache.kvquant``). Each head's rows are then one contiguous run, so the
attention reads a layer's keys or values with one GPU op at any context instead of
one per block of pages. A layer grows by copying its arrays into larger ones (one
array at a time, so the transient is one array of one layer), shrinks the same way
once most of it is free, and never shares an array with another layer: MLX copies
a whole array on a slice update while any other reader of it is pending, and in one
forward pass every layer writes then reads its storage.

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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.cache import kvquant
from engine.cache.modes import FULL_PRECISION_BITS, MODES, KvMode
from engine.errors import EngineError, KvBudgetExceeded, UnsupportedModeError

# A layer grows by doubling up to this many bytes, then by half its capacity: few
# growth copies over a long context, while the idle room a layer allocates ahead
# stays at most a third of what it holds, and within the budget's spare room.
MAX_GROWTH_BYTES = 32 * 2**20
MIN_GROWTH_PAGES = 4
PREFILL_SCRATCH_BYTES = 256 * 2**20
DEFAULT_PAGE_SIZE = 256  # tokens a page holds unless a chat or the CLI says otherwise
# Parts of a layer's storage, in the order every tuple of them follows.
PARTS = ("k_codes", "k_scales", "v_codes", "v_scales")


@dataclass(frozen=True)
class PageLayout:
    """Shape of one layer's pages."""

    mode: KvMode
    page_size: int
    kv_heads: int
    head_dim: int

    @property
    def bits(self) -> int:
        return kvquant.bits_for(self.mode)

    @property
    def row_width(self) -> int:
        """Stored elements per row: packed bytes, or float16 values for fp16."""
        if self.bits == FULL_PRECISION_BITS:
            return self.head_dim
        return kvquant.packed_dim(self.head_dim, self.bits)

    @property
    def groups(self) -> int:
        """Scales (and biases) per row in memory (``kvquant.scale_groups``)."""
        return kvquant.scale_groups(self.head_dim)

    @property
    def page_bytes(self) -> int:
        """Bytes of one page in memory, keys and values, codes, scales and biases."""
        per_token = kvquant.kv_bytes_per_token(self.head_dim, self.mode)
        return self.page_size * self.kv_heads * per_token

    def part_bytes(self, tokens: int) -> int:
        """Bytes of the largest storage array holding ``tokens`` tokens: what growing
        a layer holds twice for a moment (its old copy and the new array)."""
        width = self.head_dim * 2 if self.bits == FULL_PRECISION_BITS else self.row_width
        pages = -(-tokens // self.page_size)
        return pages * self.page_size * self.kv_heads * max(width, 2 * 2 * self.groups)

    def with_mode(self, mode: KvMode) -> PageLayout:
        return PageLayout(mode, self.page_size, self.kv_heads, self.head_dim)

    def empty(self, pages: int) -> list[mx.array | None]:
        """Zeroed storage for ``pages`` slots, in :data:`PARTS` order."""
        tokens = pages * self.page_size
        if self.bits == FULL_PRECISION_BITS:
            values = (self.kv_heads, tokens, self.head_dim)
            return [mx.zeros(values, mx.float16), None, mx.zeros(values, mx.float16), None]
        codes = (self.kv_heads, tokens, self.row_width)
        scales = (2, self.kv_heads, tokens, self.groups)
        return [mx.zeros(codes, mx.uint8), mx.zeros(scales, mx.float16),
                mx.zeros(codes, mx.uint8), mx.zeros(scales, mx.float16)]


def _resized(part: mx.array, tokens: int) -> mx.array:
    """``part`` with room for ``tokens`` tokens (axis -2), the rows it keeps copied."""
    shape = (*part.shape[:-2], tokens, part.shape[-1])
    grown = mx.zeros(shape, part.dtype)
    kept = min(tokens, part.shape[-2])
    grown[..., :kept, :] = part[..., :kept, :]
    mx.eval(grown)  # one array at a time: the transient is one part of one layer
    return grown


class PageStore:
    """One layer's page slots, with a free list of slot ids.

    ``parts`` are the storage arrays in :data:`PARTS` order (the scales None in
    fp16 mode). Each slot counts the block tables holding it (0: free).
    """

    def __init__(self, layout: PageLayout) -> None:
        self.layout = layout
        self.parts: list[mx.array | None] = [None] * len(PARTS)
        self.capacity = 0
        self._free: list[int] = []
        self._refs: list[int] = []  # slot -> block tables holding it
        # Changes to the holder counts so far: what a count over them is kept on.
        self.changes = 0

    @property
    def free_count(self) -> int:
        return len(self._free)

    @property
    def in_use(self) -> int:
        return self.capacity - len(self._free)

    def grow(self, pages: int) -> None:
        """Room for ``pages`` more slots; the rows held are copied into the new arrays."""
        self._resize(self.capacity + pages)
        self._refs.extend([0] * pages)
        for slot in range(self.capacity, self.capacity + pages):
            heapq.heappush(self._free, slot)
        self.capacity += pages

    def _resize(self, pages: int) -> None:
        if self.capacity == 0 or pages == 0:
            self.parts = self.layout.empty(pages) if pages else [None] * len(PARTS)
            mx.eval([p for p in self.parts if p is not None])
            return
        tokens = pages * self.layout.page_size
        self.parts = list(self.parts)
        for index, part in enumerate(self.parts):
            if part is not None:
                # Replaced before the next is copied: the old array is freed, so the
                # transient is one part (PageLayout.part_bytes), not the layer.
                self.parts[index] = _resized(part, tokens)
                del part

    def take(self) -> int:
        """A free slot, lowest first so a layer's pages stay in order."""
        slot = heapq.heappop(self._free)
        self._refs[slot] = 1
        self.changes += 1
        return slot

    def share(self, slots: list[int]) -> None:
        """Count one more holder of each slot (another block table now reads them)."""
        for slot in slots:
            self._refs[slot] += 1
        self.changes += 1

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
        self.changes += 1

    def copy_page(self, source: int, target: int) -> None:
        """Make slot ``target`` hold the same rows as slot ``source``."""
        rows = self.rows(source, 0, self.layout.page_size)
        # Copied out first: a slice update whose update still views the array it
        # writes into would copy the whole array.
        rows = tuple(None if r is None else mx.contiguous(r) for r in rows)
        mx.eval([r for r in rows if r is not None])
        self.write(target, 0, rows)

    def drop_free_tail(self) -> int:
        """Shrink past the free slots at the end, once they are most of the store.

        Slots are taken lowest first, so after a trim the free slots gather at the
        end: shrinking hands their memory back (to MLX's buffer cache;
        ``mx.clear_cache`` returns it to the system). A store shrinks when the free
        tail is at least half of it (or all of it), keeping a quarter of what it
        still holds as room, so trimming and writing again does not copy it back
        and forth. Returns the pages dropped.
        """
        free = set(self._free)
        end = self.capacity
        while end and end - 1 in free:
            end -= 1
        keep = 0 if end == 0 else min(self.capacity, end + end // 4)
        if self.capacity - keep < max(1, self.capacity // 2) and keep:
            return 0
        dropped = self.capacity - keep
        self._free = [slot for slot in self._free if slot < keep]
        heapq.heapify(self._free)
        del self._refs[keep:]
        self._resize(keep)
        self.capacity = keep
        return dropped

    def write(self, slot: int, row: int, rows: tuple[mx.array | None, ...]) -> None:
        """Write ``[kv_heads, n, width]`` rows at ``row`` of slot ``slot`` and on,
        in place, through as many consecutive slots as they fill.

        ``rows`` are the storage parts (:data:`PARTS`), scales and biases ``[2,
        kv_heads, n, groups]``.
        """
        start = slot * self.layout.page_size + row
        parts = list(self.parts)
        for index, value in enumerate(rows):
            if value is None:
                continue
            target = parts[index]
            if target is None:
                raise EngineError(f"Page storage {PARTS[index]} was written before it was "
                                  "allocated.")
            target[..., start : start + value.shape[-2], :] = value
            parts[index] = target
        self.parts = parts

    def rows(self, slot: int, row: int, count: int) -> tuple[mx.array | None, ...]:
        """Views of ``count`` rows of slot ``slot`` from ``row`` on, per part."""
        start = slot * self.layout.page_size + row
        return tuple(None if p is None else p[..., start : start + count, :] for p in self.parts)

    def part(self, index: int) -> mx.array:
        """Storage part ``index`` (:data:`PARTS`), which the store's mode keeps."""
        array = self.parts[index]
        if array is None:
            raise EngineError(f"This store keeps no {PARTS[index]} (its mode stores none, or "
                              "it holds no page yet).")
        return array

    def columns(self, part: int, end: int) -> mx.array | None:
        """Part ``part`` (:data:`PARTS`) up to token column ``end``: a view."""
        array = self.parts[part]
        return None if array is None else array[..., :end, :]

    def gather(self, slots: list[int]) -> list[mx.array | None]:
        """Copies of the given pages, page-major, in the row format snapshots keep.

        ``[n, kv_heads, page_size, width]`` codes and ``[n, kv_heads, page_size, 1]``
        row scales per part (None where the mode stores none).
        """
        size, heads = self.layout.page_size, self.layout.kv_heads
        index = mx.array(slots, dtype=mx.uint32)
        gathered: list[mx.array | None] = []
        for name, part in zip(PARTS, self.parts, strict=True):
            if part is None:
                gathered.append(None)
                continue
            if name.endswith("scales"):
                part = part[0, ..., :1]  # every group of a row holds the row's scale
            paged = part.reshape(heads, -1, size, part.shape[-1])
            gathered.append(mx.take(paged, index, axis=1).swapaxes(0, 1))
        return gathered

    def arrays(self) -> list[mx.array]:
        """Every array the store holds its rows in."""
        return [part for part in self.parts if part is not None]

    def replace_arrays(self, arrays: list[mx.array]) -> None:
        """Hold ``arrays`` (:meth:`arrays`' order and shapes) instead (graph counts)."""
        it = iter(arrays)
        self.parts = [None if part is None else next(it) for part in self.parts]


class PageGroup:
    """The pools whose sessions point into the same stores.

    Weakly held: a pool refers to its group and its layers' caches refer to the
    pool, so strong references back would make cycles, and a closed session's
    storage (gigabytes at 262k tokens) would wait for Python's cycle collector.
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
        mode: KV storage mode.
        page_size: tokens per page.
        budget_bytes: bytes all allocated pages may take together; None for no limit.
    """

    def __init__(self, mode: KvMode, page_size: int = DEFAULT_PAGE_SIZE,
                 budget_bytes: int | None = None) -> None:
        if page_size < 1:
            raise ValueError("page_size must be at least 1 token")
        self.mode = MODES[mode].mode  # an unknown mode raises here, before any page
        self.page_size = page_size
        self.budget_bytes = budget_bytes
        self.stores: list[PageStore] = []
        # The block table reading each store (a ``PagedKVCache``), for what this
        # session still needs when its stores are shared; None: the store's only user.
        self.holders: list[weakref.ref[Any] | None] = []
        # Pools whose sessions share pages: one group, the same stores (see join).
        self.group = PageGroup(self)
        # The most one prefill chunk's attention may hold on top of the pages
        # (engine.cache.attention.dispatch walks the columns in blocks that fit it).
        self.scratch_bytes = PREFILL_SCRATCH_BYTES
        # The most tokens the session may hold (the model's context; None: no
        # bound): a store grows ahead no further than their pages.
        self.max_tokens: int | None = None
        # Pages every store already has room for, so most calls (two per layer per
        # step) return without looking at the stores; reset when a store shrinks.
        self._room = 0
        # The last out-of-order block table's column map (``PagedKVCache.columns``):
        # a session's layers take their pages alike, so they hold the same table,
        # and one map serves them all rather than one per layer.
        self.column_map: tuple[tuple[int, ...], int, Any] | None = None

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
        """Shrink ``store`` past its free last slots, when they are most of it (after a trim)."""
        if store.drop_free_tail():
            for pool in self.group:
                pool._room = 0

    def growth_transient_bytes(self, tokens: int) -> int:
        """What growing a layer to ``tokens`` tokens holds beyond the pages, at most."""
        return max((s.layout.part_bytes(tokens) for s in self.stores), default=0)

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
            # Past MAX_GROWTH_BYTES a layer grows by half its capacity, so a 262k
            # cache is copied about a dozen times over its whole fill, not hundreds,
            # and the idle room stays at most a third.
            cap = max(1, MAX_GROWTH_BYTES // store.layout.page_bytes, store.capacity // 2)
            grow = min(max(store.capacity, MIN_GROWTH_PAGES), cap)
            extra = max(0, grow - missing)
            if spare != math.inf:
                # Every short layer grows by the same slack, so layers stay symmetric
                # and the budget's last pages are never held idle by one layer.
                extra = min(extra, int(spare // step_bytes))
            if self.max_tokens is not None and not self.shared:
                # Pages past the context are never used (a third of a q8 layer's
                # storage at 262k, doubled past it); a shared store holds others' too.
                extra = min(extra, max(0, self.pages_for(self.max_tokens)
                                       - store.capacity - missing))
            store.grow(missing + extra)
        self._room = self._reach()

    def _needed(self, index: int, tokens: int) -> int:
        """Free slots store ``index`` must give this session to hold ``tokens``."""
        store, ref = self.stores[index], self.holders[index]
        holder = ref() if ref is not None else None
        if holder is None:  # the store's only user: everything in use is its own
            return self.pages_for(tokens) - store.in_use
        return self.pages_for(tokens) - len(holder.block_table) + holder.copies_due(tokens)

    def slots_wanted(self, tokens: int) -> list[int]:
        """Free slots each store must give this session for it to hold ``tokens``
        tokens (its own pages past those it holds, and copies of shared ones it
        will write into)."""
        return [max(0, self._needed(index, tokens)) for index in range(len(self.stores))]

    def bytes_to_hold(self, tokens: int) -> int:
        """Bytes these stores must take for this session to hold ``tokens`` tokens
        beside the pages other chats sharing them hold now (:func:`bytes_to_hold`)."""
        return bytes_to_hold([(self, tokens)])

    def _reach(self) -> int:
        """Pages every layer can hold without growing; 0 (look again each time)
        while other sessions take slots from the same stores."""
        if self.shared:
            return 0
        return min((s.capacity for s in self.stores), default=0)

    def tokens_fit(self, mode: KvMode | None = None) -> int:
        """Tokens every layer can hold within the budget (in ``mode``, default ours),
        beside the pages other chats hold in stores shared with them."""
        if self.budget_bytes is None:
            return 2**62
        mode = self.mode if mode is None else mode
        per_page = sum(s.layout.with_mode(mode).page_bytes for s in self.stores)
        if per_page == 0:
            return 2**62
        return max(0, self.budget_bytes - self.foreign_bytes()) // per_page * self.page_size

    def foreign_bytes(self) -> int:
        """Bytes of the pages other chats hold in the stores this session shares with
        them, not one of them its own (0 for stores of its own)."""
        if not self.shared:
            return 0
        total = 0
        for store, ref in zip(self.stores, self.holders, strict=True):
            holder = ref() if ref is not None else None
            own = store.in_use if holder is None else len(holder.block_table)
            total += max(0, store.in_use - own) * store.layout.page_bytes
        return total

    def _exceeded(self, tokens: int) -> KvBudgetExceeded:
        fit = self.tokens_fit()
        suggestion = None
        for mode in list(MODES)[MODES.index(self.mode) + 1 :]:
            try:
                if self.tokens_fit(mode) >= tokens:
                    suggestion = mode
                    break
            except UnsupportedModeError:
                continue  # a width whose groups do not divide this head_dim
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


def bytes_to_hold(wants: Iterable[tuple[PagePool, int]]) -> int:
    """Bytes the stores of the pools in ``wants`` must take for each pool's session
    to hold its tokens beside every page in use there now.

    A store that sessions share (one page group) counts once, with the slots every
    one of them wants: for a pool of its own that is its pages for the tokens; for
    one sharing a document with other chats, their pages too.
    """
    return sum((store.in_use + slots) * store.layout.page_bytes
               for store, slots in _wanted_by_store(wants))


def bytes_to_grow(wants: Iterable[tuple[PagePool, int]]) -> int:
    """What :func:`bytes_to_hold` adds to what those stores have already."""
    return sum(max(0, store.in_use + slots - store.capacity) * store.layout.page_bytes
               for store, slots in _wanted_by_store(wants))


def ensure_together(wants: Iterable[tuple[PagePool, int]]) -> None:
    """Make sure every pool in ``wants`` can hold its tokens at once (a pass that
    writes into all of them), or raise with no page taken.

    Each pool alone counts every free slot of its stores as its own: pools that
    share stores (chats on one document) may each count the same slot. Such
    stores grow first by what they lack together, within the smallest limit of
    the pools asking.

    Raises:
        KvBudgetExceeded: a pool, or the pools sharing a store, cannot hold them.
    """
    wants = list(wants)
    for pool, tokens in wants:
        pool.ensure(tokens)
    shared = [(pool, tokens) for pool, tokens in wants if pool.shared]
    lacking = [(store, slots - store.free_count)
               for store, slots in _wanted_by_store(shared) if slots > store.free_count]
    if not lacking:
        return
    needed = sum(missing * store.layout.page_bytes for store, missing in lacking)
    owners = [(pool, tokens) for pool, tokens in shared
              if any(store in pool.stores for store, _ in lacking)]
    limited = [(pool, tokens) for pool, tokens in owners if pool.budget_bytes is not None]
    for pool, tokens in limited:
        if needed > (pool.budget_bytes or 0) - pool.bytes_allocated:
            raise pool._exceeded(tokens)
    for store, missing in lacking:
        store.grow(missing)
    for pool, _ in owners:
        for member in pool.group:
            member._room = 0


def _wanted_by_store(wants: Iterable[tuple[PagePool, int]]) -> list[tuple[PageStore, int]]:
    """Each store of the pools in ``wants`` once, with the free slots they want of it."""
    stores: dict[int, tuple[PageStore, int]] = {}
    for pool, tokens in wants:
        for store, slots in zip(pool.stores, pool.slots_wanted(tokens), strict=True):
            stores[id(store)] = (store, stores.get(id(store), (store, 0))[1] + slots)
    return list(stores.values())
