"""Pages shared between caches: reference counts, copy-on-write, release, one budget."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import pages, sharing
from engine.cache.paged_cache import PagedKVCache
from engine.cache.pages import PageLayout, PagePool, PageStore
from engine.errors import KvBudgetExceeded
from engine.memory import fit
from engine.memory.guard import MemoryGuard, MemoryReading

PAGE_SIZE = 16
KV_HEADS, HEAD_DIM = 2, 64


def _rows(length: int, seed: int) -> mx.array:
    return mx.random.normal((1, KV_HEADS, length, HEAD_DIM), key=mx.random.key(seed))


def _cache(mode: str = "q8", budget: int | None = None) -> PagedKVCache:
    return PagedKVCache(PagePool(mode, PAGE_SIZE, budget), KV_HEADS, HEAD_DIM)


def _write(cache: PagedKVCache, length: int, seed: int) -> None:
    cache.update_and_fetch(_rows(length, seed), _rows(length, seed + 1))


def _held(cache: PagedKVCache) -> tuple[np.ndarray, np.ndarray]:
    k, v = cache.dequantized_prefix(cache.offset, mx.float32)
    return np.array(k), np.array(v)


def test_a_slot_is_free_again_only_when_its_last_holder_gives_it_back() -> None:
    store = PageStore(PageLayout("q8", PAGE_SIZE, KV_HEADS, HEAD_DIM))
    store.grow(2)
    slot = store.take()
    store.share([slot])
    assert store.shared(slot) and store.in_use == 1
    store.give_back([slot])
    assert not store.shared(slot) and store.in_use == 1
    store.give_back([slot])
    assert store.in_use == 0 and store.take() == slot


@pytest.mark.parametrize("mode", ["fp16", "q6"])
def test_a_shared_prefix_takes_no_page_and_a_write_copies_only_the_last(mode: str) -> None:
    first = _cache(mode)
    _write(first, 40, 0)  # 2 full pages and a partial third
    before = _held(first)
    second = _cache(mode)
    sharing.share_pages([second], [first], 40)
    store = first.store
    assert second.store is store and second.block_table == first.block_table
    assert store.in_use == 3 and all(store.shared(s) for s in first.block_table)
    np.testing.assert_array_equal(_held(second)[0], before[0])
    _write(second, 9, 10)  # into the shared third page, then a fourth
    assert second.block_table[:2] == first.block_table[:2]
    assert second.block_table[2] != first.block_table[2] and store.in_use == 5
    assert not store.shared(first.block_table[2])
    for mine, theirs in zip(_held(second), before, strict=True):
        np.testing.assert_array_equal(mine[:, :, :40], theirs)
    # The donor writing on never touches what the other reads.
    after = _held(second)
    _write(first, 20, 20)
    for now, then in zip(_held(second), after, strict=True):
        np.testing.assert_array_equal(now, then)
    for now, then in zip(_held(first), before, strict=True):
        np.testing.assert_array_equal(now[:, :, :40], then)


def test_a_layers_shared_count_follows_what_the_other_holders_do() -> None:
    first = _cache()
    _write(first, 40, 0)  # 3 pages
    second, third = _cache(), _cache()
    sharing.share_pages([second], [first], 40)
    assert first.shared_pages == (3, 1.5)
    assert second.shared_pages == (3, 1.5)  # counted once, then kept
    # Another chat takes the same pages: neither table changed, the holders did.
    sharing.share_pages([third], [first], 40)
    assert first.shared_pages == (3, 1.0)
    third.release()
    assert first.shared_pages == (3, 1.5)
    _write(second, 9, 10)  # its third page copied on write: its own table changed
    assert first.shared_pages == (2, 2.0) and second.shared_pages == (2, 3.0)


def test_a_sessions_layers_with_one_out_of_order_table_share_one_column_map() -> None:
    donor_pool, pool = PagePool("q8", PAGE_SIZE), PagePool("q8", PAGE_SIZE)
    donor = [PagedKVCache(donor_pool, KV_HEADS, HEAD_DIM) for _ in range(2)]
    layers = [PagedKVCache(pool, KV_HEADS, HEAD_DIM) for _ in range(2)]
    for layer in donor:
        _write(layer, 40, 0)
    sharing.share_pages(layers, donor, 40)
    for layer in layers:
        _write(layer, 9, 10)  # the shared third page copied: out of slot order
    assert layers[0].block_table == layers[1].block_table != list(range(4))
    (end, positions), (other_end, other) = (layer.columns() for layer in layers)
    # One map for the session (it was built, and held, once per layer).
    assert other is positions and other_end == end
    assert np.array(positions).tolist() == [*range(32), *[-1] * 16, *range(32, 64)]


def test_trimming_into_a_shared_page_then_writing_copies_it() -> None:
    first = _cache()
    _write(first, 48, 0)  # 3 full pages
    second = _cache()
    sharing.share_pages([second], [first], 48)
    before = _held(first)
    second.trim(20)  # back into page 2, which the first still reads
    _write(second, 4, 30)
    assert second.block_table[:1] == first.block_table[:1]
    assert second.block_table[1] != first.block_table[1]
    for now, then in zip(_held(first), before, strict=True):
        np.testing.assert_array_equal(now, then)


def test_the_budget_counts_the_copy_a_write_into_a_shared_page_needs() -> None:
    three_pages = 3 * PageLayout("q8", PAGE_SIZE, KV_HEADS, HEAD_DIM).page_bytes
    first = _cache(budget=three_pages)
    _write(first, 40, 0)
    assert first.store.free_count == 0
    second = _cache(budget=three_pages)
    sharing.share_pages([second], [first], 40)
    with pytest.raises(KvBudgetExceeded):
        _write(second, 1, 10)  # one token, but into the shared partial page: a copy
    assert second.offset == 40 and second.block_table == first.block_table
    second.trim(8)  # back to whole pages: the next write takes a new page, no copy
    second.pool.budget_bytes = 4 * three_pages // 3
    _write(second, 1, 10)
    assert second.block_table[:2] == first.block_table[:2] and first.store.capacity == 4


def test_release_frees_only_the_pages_nobody_else_holds() -> None:
    first = _cache()
    _write(first, 40, 0)
    second = _cache()
    sharing.share_pages([second], [first], 40)
    _write(second, 30, 10)
    store = first.store
    own = [s for s in second.block_table if s not in first.block_table]
    assert store.in_use == 3 + len(own)
    before = _held(first)
    sharing.release_pages([second])
    assert store.in_use == 3 and not any(store.shared(s) for s in first.block_table)
    assert not first.pool.shared and second.block_table == []
    for now, then in zip(_held(first), before, strict=True):
        np.testing.assert_array_equal(now, then)
    # Alone again, the first's pool caches its room as before.
    _write(first, 1, 40)
    assert first.offset == 41


def test_the_guard_counts_a_page_group_once() -> None:
    reading = MemoryReading(total_bytes=2**40, available_bytes=2**39)
    guard = MemoryGuard(budget_bytes=10 * 2**20, headroom_bytes=0, probe=lambda: reading)
    first, second, third = _cache(), _cache(), _cache()
    _write(first, 40, 0)
    _write(third, 40, 5)
    sharing.share_pages([second], [first], 40)
    for key, cache in (("a", first), ("b", second), ("c", third)):
        guard.attach(key, cache.pool)
    group, alone = first.pool.bytes_allocated, third.pool.bytes_allocated
    assert guard.held_bytes() == group + alone
    assert guard.held_bytes(exclude="b") == alone
    assert guard.kv_share("a") == 10 * 2**20 - alone


def test_dropped_caches_free_their_pools_without_the_cycle_collector() -> None:
    """No reference cycle through the group or the holders: storage goes when the caches go."""
    import gc
    import weakref

    gc.collect()
    gc.disable()  # a cycle would keep the pools (and their storage) alive from here on
    try:
        alone, donor, sharer = _cache(), _cache(), _cache()
        _write(alone, 40, 1)
        _write(donor, 40, 3)
        sharer.pool.join(donor.pool)
        sharer.share_prefix(donor, 32)
        pools = [weakref.ref(c.pool) for c in (alone, donor, sharer)]
        del alone, donor, sharer
        assert [ref() for ref in pools] == [None, None, None]
    finally:
        gc.enable()


def test_what_a_chat_sharing_pages_needs_counts_the_others_pages_once() -> None:
    first = _cache("fp16")
    _write(first, 40, 0)  # 2 full pages and a partial third
    second, third = _cache("fp16"), _cache("fp16")
    for cache in (second, third):
        sharing.share_pages([cache], [first], 40)
    store, page = first.store, first.store.layout.page_bytes
    assert store is not None and store.in_use == 3
    # A pool of its own: its pages for the tokens, whatever it holds now.
    assert _cache("fp16").pool.bytes_to_hold(40) == 3 * page
    # The first chat shares its pages now too: its partial third page is copied
    # before it writes there, and 64 tokens take a fourth.
    assert first.pool.bytes_to_hold(64) == (3 + 1 + 1) * page
    # Sharing: the three pages in use, a copy of the partial page it will write
    # into, and two pages past it for 80 tokens.
    assert second.pool.bytes_to_hold(80) == (3 + 1 + 2) * page
    # Two chats of the group wanting more: the store once, with both their slots.
    wants = [(second.pool, 80), (third.pool, 48)]
    assert pages.bytes_to_hold(wants) == (3 + 3 + 1) * page
    assert pages.bytes_to_grow(wants) == (3 + 3 + 1) * page - store.capacity * page
    assert pages.bytes_to_grow([(second.pool, 40)]) == 0  # held already, no write


def _one_free_slot_shared() -> tuple[PagedKVCache, PagedKVCache, PageStore]:
    """Two caches sharing two full pages in a store with one free slot left."""
    first = _cache("fp16")
    _write(first, 32, 0)
    second = _cache("fp16")
    sharing.share_pages([second], [first], 32)
    store = first.store
    assert store is not None
    while store.free_count > 1:  # other chats' pages fill the rest
        store.take()
    return first, second, store


def test_chats_sharing_a_store_get_a_slot_each_when_both_need_one_at_once() -> None:
    first, second, store = _one_free_slot_shared()
    wants = [(first.pool, 33), (second.pool, 33)]
    for pool, tokens in wants:
        pool.ensure(tokens)  # alone, each finds the one free slot
    assert store.free_count == 1
    pages.ensure_together(wants)
    assert store.free_count == 2
    _write(first, 1, 5)
    _write(second, 1, 6)  # before: no slot left for it (IndexError mid-pass)
    assert first.offset == second.offset == 33


def test_chats_sharing_a_store_that_cannot_grow_for_both_are_refused_unchanged() -> None:
    first, second, store = _one_free_slot_shared()
    for pool in (first.pool, second.pool):
        pool.budget_bytes = pool.bytes_allocated  # no room to grow
    capacity = store.capacity
    with pytest.raises(KvBudgetExceeded):
        pages.ensure_together([(first.pool, 33), (second.pool, 33)])
    assert store.capacity == capacity and store.free_count == 1


def test_a_chat_sharing_a_document_counts_the_others_pages_as_theirs() -> None:
    reading = MemoryReading(total_bytes=2**40, available_bytes=2**40)
    page = PageLayout("q8", PAGE_SIZE, KV_HEADS, HEAD_DIM).page_bytes
    guard = MemoryGuard(budget_bytes=64 * page, headroom_bytes=0, probe=lambda: reading)
    first, second = _cache(), _cache()
    guard.attach("a", first.pool)
    guard.attach("b", second.pool)
    _write(first, 16 * PAGE_SIZE, 0)  # the document: 16 pages
    sharing.share_pages([second], [first], 16 * PAGE_SIZE)
    guard.refresh("a")
    _write(first, 32 * PAGE_SIZE, 2)  # the first chat's own answer: 32 pages more
    guard.refresh("b")
    # The second chat holds the document's 16 pages and may add 16 of its own:
    # the budget less the first chat's 32, not the whole storage's room.
    assert second.pool.foreign_bytes() == 32 * page
    assert second.pool.tokens_fit() == 32 * PAGE_SIZE
    inputs = fit.FitInputs(fit.ModelFacts(1, KV_HEADS, HEAD_DIM, 10**6), PAGE_SIZE,
                           guard.view(), session_id="b", session_mode="q8",
                           session_bytes_allocated=second.pool.bytes_allocated
                           - second.pool.foreign_bytes())
    report = fit.guarded_fit_report(inputs, reading, 16 * PAGE_SIZE)
    assert report.for_mode("q8").tokens_fit_budget == 32 * PAGE_SIZE
    # What it says fits, its pages take; a page more is refused.
    second.pool.ensure(32 * PAGE_SIZE)
    with pytest.raises(KvBudgetExceeded, match="holds 512 tokens"):
        second.pool.ensure(33 * PAGE_SIZE)


def test_what_chats_sharing_a_store_hold_sums_to_the_storage_once() -> None:
    """Each chat's share of the storage (its pages, a shared one divided among its
    holders, and the room held ahead divided among the group) sums to the storage."""
    from engine.cache.adapter import cache_stats

    first, second = _cache(), _cache()
    _write(first, 40, 0)
    sharing.share_pages([second], [first], 40)
    _write(second, 9, 10)
    stats = [cache_stats([first]), cache_stats([second])]
    storage = first.store.capacity * first.store.layout.page_bytes
    assert first.store.free_count > 0  # room held ahead, to be counted once
    assert all(s.bytes_allocated == storage for s in stats)  # each sees the whole store
    assert sum(s.bytes_held_once for s in stats) == storage
    alone = _cache()
    _write(alone, 40, 0)
    assert cache_stats([alone]).bytes_held_once == cache_stats([alone]).bytes_allocated


@pytest.mark.parametrize("mode", ["fp16", "q8", "q6", "q4"])
def test_a_freed_pages_nan_never_reaches_the_chat_reading_beside_it(mode: str) -> None:
    from engine.cache.attention import dispatch, schedule

    page = 4
    first = PagedKVCache(PagePool(mode, page), 1, 32)
    first.update_and_fetch(_rows(page, 1)[:, :1, :, :32], _rows(page, 2)[:, :1, :, :32])
    second = PagedKVCache(PagePool(mode, page), 1, 32)
    sharing.share_pages([second], [first], page)
    nan = mx.full((1, 1, page, 32), float("nan"))
    first.update_and_fetch(_rows(page, 3)[:, :1, :, :32], nan)  # its own page
    second.update_and_fetch(_rows(1, 4)[:, :1, :, :32], _rows(1, 5)[:, :1, :, :32])
    sharing.release_pages([first])  # the NaN page is free; its rows stay in the store
    for step in range(2):
        second.update_and_fetch(_rows(1, 10 + step)[:, :1, :, :32],
                                _rows(1, 20 + step)[:, :1, :, :32])
        for kind in ("cpu", "gpu"):
            with schedule.forced(kind):
                out = dispatch.paged_attention(_rows(1, 30 + step)[:, :1, :, :32], None,
                                               None, second, 32 ** -0.5)
            assert bool(mx.all(mx.isfinite(out))), (kind, step)
