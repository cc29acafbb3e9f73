"""The stored-KV disk budget applied live, and listings and clears through the worker."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine import EngineError, EngineWorker, Failed, Finished, StoredKv
from engine.format import human_bytes
from engine.snapshots import SnapshotStore, default_budget
from engine.snapshots.files import rank_folder
from engine.snapshots.snapshot import SnapshotError, save_snapshot
from tests.engine.runtime.test_worker import EventLog
from tests.engine.snapshot_fixtures import cache_session, config_only_model, filled_cache

MODE = "q8"
TOKENS = 256


@pytest.fixture
def store(tmp_path: Path) -> SnapshotStore:
    """Snapshots "a", "b", "c", used in that order (c most recently)."""
    model_dir = config_only_model(tmp_path)
    store = SnapshotStore(tmp_path / "kv", budget_bytes=2**30)
    for used, name in enumerate("abc"):
        session = cache_session(filled_cache(MODE, TOKENS, 2), TOKENS, MODE, model_dir)
        manifest = store.save(session, name).manifest
        os.utime(manifest, (1000 + used, 1000 + used))
    return store


def _names(store: SnapshotStore) -> list[str]:
    return [info.name for info in store.per_snapshot()]


def test_a_lowered_budget_evicts_the_least_recently_used(store):
    os.utime(store.directory / "a.json", (2000, 2000))  # "a" reopened last
    one = store.info("b").disk_bytes
    assert store.set_budget(2 * one + one // 2) == ["b"]
    assert _names(store) == ["a", "c"] and store.total_bytes() <= store.budget_bytes
    assert store.set_budget(10 * one) == []  # a higher one evicts nothing


def test_snapshots_spared_go_only_once_no_other_is_left(store):
    one = store.info("b").disk_bytes
    store.budget_bytes = 2 * one + one // 2
    # "a" is the oldest, but spared: "b" goes in its place.
    assert store.evict(spare={"a"}) == ["b"]
    store.budget_bytes = one + one // 2
    assert store.evict(spare={"a", "c"}) == ["a"]  # all spared: the oldest of them
    assert _names(store) == ["c"]


def test_no_budget_means_the_default_and_a_negative_one_is_refused(store):
    assert store.set_budget(None) == []
    assert store.budget_bytes == default_budget(store.directory)
    with pytest.raises(EngineError, match="negative"):
        store.set_budget(-1)


def test_a_restart_with_the_default_budget_evicts_nothing(store, monkeypatch):
    # The stored KV takes free space itself: counted as free alone, the default
    # shrank at every start and a plain restart evicted the oldest chat's KV.
    from collections import namedtuple

    import engine.snapshots.snapshot_store as snapshot_store

    stored = store.total_bytes()
    disk = 10 * (stored + store.info("b").disk_bytes // 4)  # its 10% just holds all three
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(snapshot_store.shutil, "disk_usage",
                        lambda _folder: usage(disk, stored, disk - store.total_bytes()))
    restarted = SnapshotStore(store.directory)
    assert restarted.set_budget(None) == []
    assert _names(restarted) == ["c", "b", "a"]
    assert abs(restarted.budget_bytes - disk // 10) <= 1  # as on a fresh disk


def test_a_snapshot_over_the_whole_budget_is_refused_in_the_apps_units(store, tmp_path):
    one = store.info("c").disk_bytes
    store.budget_bytes = one // 2
    session = cache_session(filled_cache(MODE, TOKENS, 2), TOKENS, MODE,
                            config_only_model(tmp_path))
    with pytest.raises(SnapshotError) as refused:
        store.save(session, "d")
    assert f"disk budget ({human_bytes(one // 2)}); it was not stored" in str(refused.value)
    assert sorted(_names(store)) == ["a", "b", "c"]  # nothing evicted for it


def _listing(log: EventLog, request_id: int) -> StoredKv:
    ending = log.ending(request_id)
    assert isinstance(ending, Finished), ending
    listings = [e for e in log.events if isinstance(e, StoredKv)]
    return listings[-1]


def test_the_worker_applies_the_budget_lists_and_clears(store):
    log = EventLog()
    worker = EngineWorker(log, snapshots=store)
    worker.start()
    try:
        one = store.info("a").disk_bytes
        listing = _listing(log, worker.set_snapshot_budget(2 * one + one // 2))
        assert [i.name for i in listing.snapshots] == ["c", "b"]  # "a" was the oldest
        assert listing.budget_bytes == store.budget_bytes
        assert listing.total_bytes == store.total_bytes()
        listing = _listing(log, worker.clear_snapshots("c"))
        assert [i.name for i in listing.snapshots] == ["b"] == _names(store)
        listing = _listing(log, worker.clear_snapshots())
        assert listing.snapshots == () and listing.total_bytes == 0
        assert list(store.directory.iterdir()) == []
        failed = log.ending(worker.set_snapshot_budget(-5))
        assert isinstance(failed, Failed) and "negative" in failed.message
    finally:
        worker.shutdown(timeout=10.0)


def test_a_worker_without_a_store_lists_nothing():
    log = EventLog()
    worker = EngineWorker(log)
    worker.start()
    try:
        listing = _listing(log, worker.set_snapshot_budget(10**9))
        assert listing == StoredKv(0, 0)
        assert _listing(log, worker.clear_snapshots()) == StoredKv(0, 0)
    finally:
        worker.shutdown(timeout=10.0)


def test_another_folder_counted_with_a_store_shares_its_budget(store, tmp_path):
    """The server's store counts the app's stored KV against one budget, and only
    ever evicts its own snapshots."""
    one = store.info("a").disk_bytes
    app_kv = tmp_path / "app-kv"
    app_kv.mkdir()
    (app_kv / "chat.safetensors").write_bytes(b"\0" * one)
    server = SnapshotStore(store.directory, budget_bytes=10 * one, counted_with=(app_kv,))
    assert server.counted_bytes() == server.total_bytes() + one
    # Three of its own and one of the app's fit in 3.5 snapshots' worth only
    # once its least recently used one goes.
    assert server.set_budget(3 * one + one // 2) == ["a"]
    assert _names(server) == ["c", "b"]
    assert (app_kv / "chat.safetensors").exists()
    assert server.counted_bytes() <= server.budget_bytes
    missing = SnapshotStore(store.directory, budget_bytes=10 * one,
                            counted_with=(tmp_path / "not-made-yet",))
    assert missing.counted_bytes() == missing.total_bytes()


def test_a_pipeline_ranks_parts_count_are_evicted_and_cleared_with_rank_0s(store, tmp_path):
    # Rank 1 of a local pipeline stores its layers' part of every chat beside rank 0's.
    rank1 = rank_folder(store.directory, 1)
    rank1.mkdir()
    model_dir = config_only_model(tmp_path)
    for name in "abc":
        save_snapshot(cache_session(filled_cache(MODE, TOKENS, 2), TOKENS, MODE, model_dir),
                      rank1, name)
    part = sum(p.stat().st_size for p in rank1.iterdir())
    own = sum(info.disk_bytes for info in store.per_snapshot())
    assert store.total_bytes() >= own + part  # the budget sees every rank's bytes here
    one = store.info("a").disk_bytes + part // 3
    # Evicting "a" (least recently used) takes rank 1's part of "a" with it.
    assert store.set_budget(2 * one + one // 2) == ["a"]
    assert sorted(p.name.split(".")[0] for p in rank1.glob("*.json")) == ["b", "c"]
    assert store.total_bytes() <= store.budget_bytes
    store.delete("b")
    assert [p.name.split(".")[0] for p in rank1.glob("*.json")] == ["c"]
    store.clear()
    assert not rank1.exists() and store.total_bytes() == 0


def test_a_listing_says_which_snapshots_the_model_loaded_now_reopens(store, tmp_path):
    """A chat stored with other weights is read again, not reopened (its snapshot is
    set aside): the app must not describe it as reopenable."""
    import threading

    from engine import ModelLoaded
    from engine.session.sampling import SamplingParams
    from tests.engine.tinymodels import make_tiny_model_dir

    log = EventLog()
    worker = EngineWorker(log, snapshots=store)
    worker.start()
    try:
        log.result(worker.load_model(str(make_tiny_model_dir(tmp_path, "llama"))), ModelLoaded)
        listing = [e for e in log.events if isinstance(e, StoredKv)][-1]  # sent as it loaded
        assert listing.model_digest and not any(map(listing.reopenable, listing.snapshots))
        log.ending(worker.open_session("s", MODE, 16))
        log.ending(worker.chat("s", [{"role": "user", "content": "Hello there"}],
                               SamplingParams(temperature=0.0, max_tokens=2),
                               threading.Event()))
        listing = _listing(log, worker.close_session("s"))  # stored as it closes
        reopens = {info.name: listing.reopenable(info) for info in listing.snapshots}
        assert reopens == {"s": True, "a": False, "b": False, "c": False}
    finally:
        worker.shutdown(timeout=10.0)
