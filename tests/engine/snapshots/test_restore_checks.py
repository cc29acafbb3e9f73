"""A reopen verifies what it restored; a snapshot whose manifest lies about its data
is rejected and removed with one notice, and the send that found it answers as a
fresh read would; a disk that fills before the manifest leaves no data behind."""

from __future__ import annotations

import errno
import json
import threading
from pathlib import Path

import pytest

from engine.events import Failed, Finished, ModelLoaded, Notice, SessionOpened, TokenChunk
from engine.runtime.worker import EngineWorker
from engine.session.sampling import SamplingParams
from engine.snapshots import SnapshotError, SnapshotRejected, SnapshotStore, load_snapshot
from engine.snapshots import snapshot as snapshot_module
from engine.snapshots.manifest import sealed
from tests.engine.runtime.test_worker import EventLog
from tests.engine.snapshots.test_snapshot import (
    DOC,
    QUESTION,
    _ingest,
    _loaded,
    _session,
    _user,
    save_snapshot,
)
from tests.engine.tinymodels import make_tiny_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict:
    return {"llama": _loaded(make_tiny_model_dir(tmp_path_factory.mktemp("models"), "llama"))}


def _reseal(manifest: Path, change) -> None:
    record = json.loads(manifest.read_text())
    record.pop("manifest_sha256")
    change(record)
    manifest.write_bytes(sealed(record))


def claim_q8(record: dict) -> None:
    """Say the fp16 pages are q8 (what a buggy writer or an attacker could seal)."""
    record["mode"] = "q8"


def offsets_below_the_tokens(record: dict) -> None:
    """Layers that hold fewer tokens than the token list claims."""
    for layer in record["layers"]:
        if layer["kind"] == "paged":
            layer["offset"] = len(record["tokens"]) // 2


def layer_shapes_swapped(record: dict) -> None:
    """Records claiming another head layout than the stored pages have."""
    for layer in record["layers"]:
        if layer["kind"] == "paged":
            layer["kv_heads"], layer["head_dim"] = layer["head_dim"], layer["kv_heads"]


LIES = [claim_q8, offsets_below_the_tokens, layer_shapes_swapped]


@pytest.mark.parametrize("lie", LIES)
def test_a_manifest_that_lies_about_its_data_is_rejected_and_removed(models, tmp_path, lie):
    stored = _session(models["llama"], mode="fp16")
    _ingest(stored, _user(DOC))
    manifest = save_snapshot(stored, tmp_path, "chat")
    _reseal(manifest, lie)
    reopened = _session(models["llama"], mode="q8")
    with pytest.raises(SnapshotRejected) as caught:
        load_snapshot(reopened, tmp_path, "chat", [*stored.tokens, 1])
    assert caught.value.reason == "corrupt" and caught.value.removed
    assert reopened.tokens == [] and list(tmp_path.iterdir()) == []


def test_any_exception_while_restoring_is_a_rejection(models, tmp_path, monkeypatch):
    stored = _session(models["llama"])
    _ingest(stored, _user(DOC))
    save_snapshot(stored, tmp_path, "chat")

    def broken(*args, **kwargs):
        raise AttributeError("'NoneType' object has no attribute 'shape'")

    monkeypatch.setattr(snapshot_module, "restore", broken)
    reopened = _session(models["llama"])
    with pytest.raises(SnapshotRejected) as caught:
        load_snapshot(reopened, tmp_path, "chat", [*stored.tokens, 1])
    assert caught.value.reason == "corrupt" and caught.value.removed
    assert reopened.tokens == [] and list(tmp_path.iterdir()) == []


def _answer(log: EventLog, engine: EngineWorker, chat: str, messages) -> tuple[Finished, list]:
    ending = log.ending(engine.chat(chat, messages, GREEDY, threading.Event()))
    assert isinstance(ending, Finished), ending
    events = log.for_request(ending.request_id)
    tokens = [t for e in events if isinstance(e, TokenChunk) for t in e.token_ids]
    notices = [e.message for e in events if isinstance(e, Notice)]
    return ending, [tokens, notices]


@pytest.mark.parametrize("lie", [claim_q8, offsets_below_the_tokens])
def test_the_send_that_finds_a_lying_snapshot_answers_like_a_fresh_read(tmp_path, lie):
    folder = make_tiny_model_dir(tmp_path / "models", "llama")
    messages = [{"role": "user", "content": DOC}, {"role": "user", "content": QUESTION}]
    log = EventLog()
    engine = EngineWorker(log, snapshots=SnapshotStore(tmp_path / "kv"))
    engine.start()
    try:
        log.result(engine.load_model(str(folder)), ModelLoaded)
        log.result(engine.open_session("fresh", "q8", 16), SessionOpened)
        _, (expected, _) = _answer(log, engine, "fresh", messages)
        assert log.ending(engine.close_session("fresh", store=False)).reason == "done"
        log.result(engine.open_session("x", "fp16", 16), SessionOpened)
        log.ending(engine.ingest("x", messages[:1], threading.Event()))
        assert log.ending(engine.close_session("x")).reason == "done"
        _reseal(tmp_path / "kv" / "x.json", lie)

        log.result(engine.open_session("x", "q8", 16), SessionOpened)
        ending, (tokens, notices) = _answer(log, engine, "x", messages)
        assert ending.stats.reused_tokens == 0
        assert tokens == expected
        assert len(notices) == 1 and "incomplete or damaged" in notices[0]
        assert not (tmp_path / "kv" / "x.json").exists()
        # The next send of that chat goes on from what it holds, with no notice.
        follow = [*messages, {"role": "assistant", "content": "Sand."},
                  {"role": "user", "content": "And?"}]
        ending, (_, notices) = _answer(log, engine, "x", follow)
        assert ending.stats.prefill_tokens < ending.stats.prompt_tokens and notices == []
        assert not any(isinstance(e, Failed) for e in log.events)
    finally:
        engine.shutdown(timeout=10.0)


def test_a_disk_full_before_the_manifest_removes_the_data_at_once(models, tmp_path, monkeypatch):
    session = _session(models["llama"])
    _ingest(session, _user(DOC))
    manifest = save_snapshot(session, tmp_path, "chat")
    before = sorted(p.name for p in tmp_path.iterdir())
    _ingest(session, _user(DOC, QUESTION))
    written = snapshot_module.files.write_bytes_atomic

    def full(path: Path, data: bytes, label: str = "file") -> None:
        if label == "manifest":
            raise OSError(errno.ENOSPC, "No space left on device")
        written(path, data, label)

    monkeypatch.setattr(snapshot_module.files, "write_bytes_atomic", full)
    with pytest.raises(SnapshotError, match="KV was not stored") as caught:
        save_snapshot(session, tmp_path, "chat")
    assert f"the disk holding {tmp_path} is full" in str(caught.value)
    # The new data file went with the failure; the earlier snapshot is whole.
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    monkeypatch.undo()
    reopened = _session(models["llama"])
    stored = json.loads(manifest.read_text())["tokens"]
    assert load_snapshot(reopened, tmp_path, "chat", [*stored, 1]) == len(stored)


def test_snapshots_set_aside_count_against_the_budget_and_go_first(models, tmp_path):
    from engine.snapshots.manifest import SET_ASIDE

    old = _session(models["llama"])
    _ingest(old, _user(DOC))
    _reseal(save_snapshot(old, tmp_path, "old"), lambda m: m.update(version=1))
    with pytest.raises(SnapshotRejected):
        load_snapshot(_session(models["llama"]), tmp_path, "old", [*old.tokens, 1])
    aside = tmp_path / SET_ASIDE
    store = SnapshotStore(tmp_path)  # its start-up sweep leaves the set-aside folder alone
    aside_bytes = sum(p.stat().st_size for p in aside.iterdir())
    assert aside_bytes > 0 and store.total_bytes() == aside_bytes
    live = _session(models["llama"])
    _ingest(live, _user(QUESTION))
    store.save(live, "live")
    assert store.total_bytes() > aside_bytes
    # A budget that holds the live snapshot alone: the set-aside one goes, not it.
    assert store.set_budget(store.total_bytes() - aside_bytes) == []
    assert list(aside.iterdir()) == [] and store.info("live") is not None
    _reseal(tmp_path / "live.json", lambda m: m.update(version=1))
    with pytest.raises(SnapshotRejected):
        load_snapshot(_session(models["llama"]), tmp_path, "live", [*live.tokens, 1])
    store.clear()
    assert not aside.exists() and list(tmp_path.iterdir()) == []


def _copies_set_aside(models, folder, *names: str) -> None:
    """Snapshots ``names`` of a document, each set aside as a reopen finds it stale."""
    for name in names:
        old = _session(models["llama"])
        _ingest(old, _user(DOC))
        _reseal(save_snapshot(old, folder, name), lambda m: m.update(version=1))
        with pytest.raises(SnapshotRejected):
            load_snapshot(_session(models["llama"]), folder, name, [*old.tokens, 1])


def test_a_store_limited_to_its_own_snapshots_drops_only_their_copies_set_aside(
        models, tmp_path):
    """The CLI's store evicts its own sessions only: the app's copies set aside for
    another model stay, however short of room it is; its own go first."""
    from engine.snapshots.manifest import SET_ASIDE

    _copies_set_aside(models, tmp_path, "chat", "cli-doc")
    aside = tmp_path / SET_ASIDE
    store = SnapshotStore(tmp_path, evictable=lambda name: name.startswith("cli-"))
    assert store.set_budget(0) == []
    assert sorted({p.name.split(".")[0] for p in aside.iterdir()}) == ["chat"]


def test_a_model_that_cannot_be_fingerprinted_keeps_the_snapshot(models, tmp_path):
    stored = _session(models["llama"])
    _ingest(stored, _user(DOC))
    manifest = save_snapshot(stored, tmp_path, "chat")
    reopened = _session(models["llama"])
    reopened.model_dir = tmp_path / "gone"  # its weights cannot be read now
    with pytest.raises(SnapshotRejected) as caught:
        load_snapshot(reopened, tmp_path, "chat", [*stored.tokens, 1])
    assert caught.value.reason == "model" and not (caught.value.removed or caught.value.set_aside)
    assert manifest.exists() and reopened.tokens == []


def test_deleting_a_chats_snapshot_deletes_its_copy_set_aside(models, tmp_path):
    """A copy set aside for another model holds the chat's ids, its text: deleting
    the chat (its snapshot) leaves none of it on disk, and no other chat's."""
    from engine.snapshots.manifest import SET_ASIDE

    _copies_set_aside(models, tmp_path, "chat", "other")
    aside = tmp_path / SET_ASIDE
    store = SnapshotStore(tmp_path)
    assert store.per_snapshot() == [] and store.total_bytes() > 0  # listed nowhere
    store.delete("chat")
    assert sorted({p.name.split(".")[0] for p in aside.iterdir()}) == ["other"]
