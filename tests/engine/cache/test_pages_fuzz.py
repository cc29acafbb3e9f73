"""A hypothesis state machine over page pools and paged caches.

Two sessions (each a pool with one to three layers of ``PagedKVCache``) draw
from one ``MemoryGuard`` budget and are driven by random appends, trims,
reopenings and state round trips. After every step: no page is leaked or handed
out twice, occupancy and bytes match a simple model, the pools together stay
within the one budget, and a refused append changed nothing. A rule reads the
pages back and compares them with the rows written.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from engine.cache import adapter, kvquant
from engine.cache.paged_cache import PagedKVCache
from engine.cache.pages import PageLayout, PagePool
from engine.errors import KvBudgetExceeded
from engine.format import GB
from engine.memory.guard import MemoryGuard, MemoryReading

KV_HEADS, HEAD_DIM = 1, 8
SESSIONS = ("a", "b")


def _stored(x: np.ndarray, mode: str) -> np.ndarray:
    bits = kvquant.bits_for(mode)
    codes, scales = kvquant.quantize_rows(mx.array(x), bits)
    return np.array(kvquant.dequantize_rows(codes, scales, bits, HEAD_DIM))


class Sessions(RuleBasedStateMachine):
    """Sessions of paged layers sharing one budget, against a list-of-rows model."""

    @initialize(
        mode=st.sampled_from(list(kvquant.MODES)),
        page_size=st.sampled_from([1, 3, 4, 16]),
        layers=st.integers(1, 3),
        budget_pages=st.none() | st.integers(0, 24),
    )
    def setup(self, mode: str, page_size: int, layers: int, budget_pages: int | None) -> None:
        self.mode, self.page_size, self.layers = mode, page_size, layers
        self.page_bytes = PageLayout(mode, page_size, KV_HEADS, HEAD_DIM).page_bytes
        budget = None if budget_pages is None else budget_pages * layers * self.page_bytes
        memory = MemoryReading(64 * GB, 32 * GB)
        self.guard = MemoryGuard(budget_bytes=budget, headroom_bytes=0, floor_bytes=0,
                                 probe=lambda: memory, check_interval=0.0)
        self.caches: dict[str, list[PagedKVCache]] = {}
        self.rows: dict[str, list[np.ndarray]] = {}  # per session: stored K rows, then V
        self.rng = np.random.default_rng(0)
        for name in SESSIONS:
            self._open(name)

    def _open(self, name: str) -> None:
        pool = PagePool(self.mode, self.page_size)
        self.caches[name] = [
            PagedKVCache(pool, KV_HEADS, HEAD_DIM, layer=i) for i in range(self.layers)
        ]
        self.rows[name] = [np.zeros((KV_HEADS, 0, HEAD_DIM), np.float32)] * 2
        self.guard.attach(name, pool)

    def _pool(self, name: str) -> PagePool:
        return self.caches[name][0].pool

    def _tokens(self, name: str) -> int:
        return self.rows[name][0].shape[1]

    # -- rules -----------------------------------------------------------------

    @rule(name=st.sampled_from(SESSIONS), n=st.integers(1, 40))
    def append(self, name: str, n: int) -> None:
        caches = self.caches[name]
        self.guard.refresh(name)  # as a session does before each request
        share = self.guard.kv_share(name)
        before = [(c.offset, list(c.block_table), c.store.capacity) for c in caches]
        keys = self.rng.standard_normal((1, KV_HEADS, n, HEAD_DIM)).astype(np.float32)
        values = self.rng.standard_normal((1, KV_HEADS, n, HEAD_DIM)).astype(np.float32)
        needed = -(-(self._tokens(name) + n) // self.page_size)
        capacity = before[0][2]
        try:
            adapter.ensure_capacity(caches, n)
        except KvBudgetExceeded as error:
            # Refused exactly when the pages needed exceed this session's share,
            # and nothing changed.
            assert share is not None and needed > capacity
            assert needed * self.layers * self.page_bytes > share
            assert error.tokens_requested == self._tokens(name) + n
            assert [(c.offset, c.block_table, c.store.capacity) for c in caches] == before
            return
        assert share is None or needed <= capacity or (
            needed * self.layers * self.page_bytes <= share)
        for cache in caches:
            cache.update_and_fetch(mx.array(keys), mx.array(values))
        k_rows, v_rows = self.rows[name]
        self.rows[name] = [np.concatenate([k_rows, _stored(keys[0], self.mode)], axis=1),
                           np.concatenate([v_rows, _stored(values[0], self.mode)], axis=1)]

    @rule(name=st.sampled_from(SESSIONS), n=st.integers(0, 60))
    def trim(self, name: str, n: int) -> None:
        expected = min(n, self._tokens(name))
        assert adapter.trim_cache(self.caches[name], n) == expected
        keep = self._tokens(name) - expected
        self.rows[name] = [rows[:, :keep] for rows in self.rows[name]]

    @rule(name=st.sampled_from(SESSIONS))
    def reopen(self, name: str) -> None:
        self.guard.detach(name, self._pool(name))
        self._open(name)

    @precondition(lambda self: any(self._tokens(n) for n in SESSIONS))
    @rule(name=st.sampled_from(SESSIONS))
    def state_round_trip(self, name: str) -> None:
        cache = self.caches[name][0]
        copy = PagedKVCache(PagePool(self.mode, self.page_size), KV_HEADS, HEAD_DIM)
        copy.state = cache.state
        assert copy.offset == cache.offset and len(copy.block_table) == len(cache.block_table)
        self._check_rows(copy, name)

    @precondition(lambda self: any(self._tokens(n) for n in SESSIONS))
    @rule(name=st.sampled_from(SESSIONS))
    def read_back(self, name: str) -> None:
        for cache in self.caches[name]:
            self._check_rows(cache, name)

    def _check_rows(self, cache: PagedKVCache, name: str) -> None:
        tokens = self._tokens(name)
        if not tokens:
            return
        k, v = cache.dequantized_prefix(tokens, mx.float32)
        np.testing.assert_array_equal(np.array(k)[0], self.rows[name][0])
        np.testing.assert_array_equal(np.array(v)[0], self.rows[name][1])

    # -- invariants --------------------------------------------------------------

    @invariant()
    def no_page_is_leaked_or_handed_out_twice(self) -> None:
        for name in SESSIONS:
            for cache in self.caches[name]:
                used = list(cache.block_table)
                free = list(cache.store._free)
                assert len(set(used)) == len(used)
                assert not set(used) & set(free)
                assert sorted(used + free) == list(range(cache.store.capacity))
                assert len(used) == -(-cache.offset // self.page_size)
                assert cache.offset == self._tokens(name)

    @invariant()
    def occupancy_matches_the_model(self) -> None:
        for name in SESSIONS:
            stats = adapter.cache_stats(self.caches[name])
            tokens = self._tokens(name)
            pages = -(-tokens // self.page_size)
            assert stats.tokens == tokens
            assert stats.pages_in_use == pages * self.layers
            assert stats.pages_free == stats.pages_allocated - stats.pages_in_use >= 0
            assert stats.bytes_used == pages * self.layers * self.page_bytes
            assert stats.bytes_allocated == stats.pages_allocated * self.page_bytes
            assert stats.bytes_allocated == self._pool(name).bytes_allocated
            last = tokens - (pages - 1) * self.page_size if tokens else 0
            assert stats.last_page_fill == (last / self.page_size if tokens else 0.0)
            assert all(layer.tokens == tokens for layer in stats.layers)

    @invariant()
    def all_sessions_stay_within_the_one_budget(self) -> None:
        held = sum(self._pool(name).bytes_allocated for name in SESSIONS)
        assert held == self.guard.held_bytes()
        if self.guard.budget_bytes is not None:
            assert held <= self.guard.budget_bytes


Sessions.TestCase.settings = settings(max_examples=120, stateful_step_count=25, deadline=None)
TestSessions = Sessions.TestCase
