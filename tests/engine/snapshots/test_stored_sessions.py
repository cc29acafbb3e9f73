"""Stored KV that cannot be read, touched or written is a cache miss with one
notice, never a failed send (a read-only or full data folder)."""

from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path
from types import SimpleNamespace

from engine.events import Failed, Finished, Notice, SessionOpened
from engine.session.sampling import SamplingParams
from engine.snapshots import SnapshotStore, tensors
from engine.snapshots.snapshot_store import Saved
from engine.snapshots.stored_sessions import StoredSessions
from tests.engine.read_only import make_read_only
from tests.engine.runtime.test_worker import loaded_worker
from tests.engine.snapshots.test_snapshot import DOC, QUESTION
from tests.engine.tinymodels import make_tiny_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
MESSAGES = [{"role": "user", "content": DOC}, {"role": "user", "content": QUESTION}]


def _send(engine, log, chat: str) -> tuple[Finished, list[str]]:
    log.result(engine.open_session(chat, "q8", 16), SessionOpened)
    ending = log.ending(engine.chat(chat, MESSAGES, GREEDY, threading.Event()))
    assert isinstance(ending, Finished), ending
    notices = [e.message for e in log.for_request(ending.request_id) if isinstance(e, Notice)]
    return ending, notices


def test_a_read_only_snapshot_folder_reopens_chats_and_says_once_it_stores_none(
        tmp_path, monkeypatch):
    folder = make_tiny_model_dir(tmp_path / "models", "llama")
    kv = tmp_path / "kv"
    with loaded_worker(folder, snapshots=SnapshotStore(kv)) as (engine, log):
        stored, _ = _send(engine, log, "x")
        assert isinstance(log.ending(engine.close_session("x")), Finished)
        make_read_only(kv, monkeypatch)
        # The stored chat comes back whole, though its "last used" cannot be written.
        again, notices = _send(engine, log, "x")
        assert again.stats.reused_tokens >= stored.stats.prompt_tokens - 1 and notices == []
        # A chat sharing its document reuses it too.
        shared, notices = _send(engine, log, "y")
        assert shared.stats.reused_tokens > 0 and notices[0].startswith("Reused")
        for chat in ("x", "y"):
            assert isinstance(log.ending(engine.close_session(chat)), Finished)
        monkeypatch.undo()
    told = [e.message for e in log.events if isinstance(e, Notice) and e.request_id == 0]
    assert len(told) == 1 and "read-only disk" in told[0] and str(kv) in told[0]
    assert "read again" in told[0]
    assert not any(isinstance(e, Failed) for e in log.events)
    assert sorted(p.name for p in kv.iterdir() if p.suffix == ".json") == ["x.json"]


def test_a_snapshot_that_cannot_be_read_or_removed_is_a_miss_with_one_notice(
        tmp_path, monkeypatch):
    folder = make_tiny_model_dir(tmp_path / "models", "llama")
    kv = tmp_path / "kv"
    with loaded_worker(folder, snapshots=SnapshotStore(kv)) as (engine, log):
        _send(engine, log, "x")
        assert isinstance(log.ending(engine.close_session("x")), Finished)

        def failing_disk(*args, **kwargs):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        monkeypatch.setattr(tensors, "StreamedTensors", failing_disk)
        make_read_only(kv, monkeypatch)
        ending, notices = _send(engine, log, "x")
        assert ending.stats.reused_tokens == 0 and len(notices) == 1
        # A disk's read error is no damage: kept without trying to remove it.
        assert "could not be read now" in notices[0] and "kept" in notices[0]
        assert "read again" in notices[0]
        monkeypatch.undo()
        assert (kv / "x.json").exists()  # kept: the fault may be the disk's, not its own
    assert not any(isinstance(e, Failed) for e in log.events)


def test_a_read_that_fails_outside_the_snapshot_checks_is_a_miss(tmp_path, monkeypatch):
    """A manifest the disk will not give (EIO, a lock) is a miss that keeps the
    snapshot, also through the start-up sweep: unread is no verdict. Once the disk
    reads again, the chat reuses it."""
    folder = make_tiny_model_dir(tmp_path / "models", "llama")
    kv = tmp_path / "kv"
    read_bytes = Path.read_bytes

    def failing(path: Path) -> bytes:
        if path.suffix == ".json" and path.parent == kv:
            raise OSError(errno.EIO, os.strerror(errno.EIO), str(path))
        return read_bytes(path)

    with loaded_worker(folder, snapshots=SnapshotStore(kv)) as (engine, log):
        _send(engine, log, "x")
        assert isinstance(log.ending(engine.close_session("x")), Finished)
        stored = sorted(p.name for p in kv.iterdir())
        monkeypatch.setattr(Path, "read_bytes", failing)
        SnapshotStore(kv)  # a start's sweep
        ending, notices = _send(engine, log, "x")
        assert ending.stats.reused_tokens == 0
        assert len(notices) == 1 and "could not be read" in notices[0]
        assert sorted(p.name for p in kv.iterdir()) == stored
        monkeypatch.setattr(Path, "read_bytes", read_bytes)
        log.ending(engine.close_session("x", store=False))
        ending, _ = _send(engine, log, "x")
        assert ending.stats.reused_tokens > 0
    assert not any(isinstance(e, Failed) for e in log.events)


def test_a_full_disk_on_the_data_write_is_one_line_and_one_notice(tmp_path, monkeypatch,
                                                                   caplog):
    folder = make_tiny_model_dir(tmp_path / "models", "llama")
    kv = tmp_path / "kv"

    def full(path: Path, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(tensors, "write_file", full)
    with (loaded_worker(folder, snapshots=SnapshotStore(kv)) as (engine, log),
          caplog.at_level(logging.INFO, logger="engine.snapshots")):
        for chat in ("x", "y"):
            _send(engine, log, chat)
            assert isinstance(log.ending(engine.close_session(chat)), Finished)
    told = [e.message for e in log.events if isinstance(e, Notice) and e.request_id == 0]
    assert len(told) == 1 and told[0].startswith("This conversation's KV was not stored.")
    assert f"the disk holding {kv} is full" in told[0]
    warned = [r for r in caplog.records if "not saved" in r.getMessage()]
    assert len(warned) == 2 and not any(r.exc_info for r in caplog.records)
    assert not [p for p in kv.iterdir() if p.is_file()]


def test_only_the_open_chats_whose_stored_kv_went_are_told_of() -> None:
    class Store:  # evicts what the test says, and says so as SnapshotStore does
        budget_bytes = 2 * 2**30  # "2.0 GB" as the app says sizes

        def __init__(self, evicted: tuple[str, ...]) -> None:
            self.evicted = evicted

        def save(self, session: object, name: str, *, spare: object) -> Saved:
            return Saved(Path(f"{name}.json"), self.evicted)

        def total_bytes(self) -> int:
            return 0

        def counted_bytes(self) -> int:
            return 0

        def per_snapshot(self) -> list:
            return []

    chat = SimpleNamespace(session_id="c", tokens=[1, 2], followers=None)
    for evicted, told in ((("closed",), []),
                          (("closed", "a"), ["another open chat was removed", "it is read"]),
                          (("a", "b"), ["KV of 2 other open chats was removed", "they are read"])):
        said: list[object] = []
        stored = StoredSessions(Store(evicted), said.append)  # type: ignore[arg-type]
        assert stored.store(chat, spare={"a", "b"})  # type: ignore[arg-type]
        notices = [e.message for e in said if isinstance(e, Notice)]
        if not told:
            assert notices == []
            continue
        (notice,) = notices
        assert all(part in notice for part in told) and "(2.0 GB)" in notice, notice


def test_a_new_chat_takes_the_longest_stored_prefix_it_can_use(tmp_path) -> None:
    """The chat sharing the most is stored in q4, one a q8 chat cannot take; the one
    holding the document alone, in fp16, serves it instead of nothing."""
    folder = make_tiny_model_dir(tmp_path / "models", "llama")
    chats = {"fp16doc": ("fp16", MESSAGES[:1]), "q4chat": ("q4", MESSAGES)}
    with loaded_worker(folder, snapshots=SnapshotStore(tmp_path / "kv")) as (engine, log):
        for chat, (mode, messages) in chats.items():
            log.result(engine.open_session(chat, mode, 16), SessionOpened)
            log.ending(engine.chat(chat, messages, GREEDY, threading.Event()))
            assert isinstance(log.ending(engine.close_session(chat)), Finished)
        log.result(engine.open_session("new", "q8", 16), SessionOpened)
        more = [*MESSAGES, {"role": "user", "content": "And the pines?"}]
        ending = log.ending(engine.chat("new", more, GREEDY, threading.Event()))
        notices = [e.message for e in log.for_request(ending.request_id)
                   if isinstance(e, Notice)]
    assert isinstance(ending, Finished) and ending.stats.reused_tokens > 0
    assert notices == [f"Reused {ending.stats.reused_tokens:,} tokens stored for another "
                       "chat; reading only the rest."]


def test_another_chat_sharing_more_goes_before_the_chats_own_snapshot(tmp_path) -> None:
    """A chat stored after half the document (then edited to hold all of it) takes
    the stored chat that read the whole document, not its own half."""
    folder = make_tiny_model_dir(tmp_path / "models", "llama")
    half = [{"role": "user", "content": DOC[: len(DOC) // 2] + "Zebras!"}]
    with loaded_worker(folder, snapshots=SnapshotStore(tmp_path / "kv")) as (engine, log):
        stored = {}
        for chat, messages in (("edited", half), ("whole", MESSAGES)):
            log.result(engine.open_session(chat, "q8", 16), SessionOpened)
            stored[chat] = log.ending(engine.ingest(chat, messages, threading.Event()))
            assert isinstance(log.ending(engine.close_session(chat)), Finished)
        log.result(engine.open_session("edited", "q8", 16), SessionOpened)
        again = log.ending(engine.ingest("edited", MESSAGES, threading.Event()))
        notices = [e.message for e in log.for_request(again.request_id)
                   if isinstance(e, Notice)]
    assert isinstance(again, Finished)
    assert again.stats.reused_tokens == stored["whole"].stats.prompt_tokens
    assert stored["edited"].stats.prompt_tokens < again.stats.reused_tokens
    assert notices == [f"Reused {again.stats.reused_tokens:,} tokens stored for another "
                       "chat; reading only the rest."]


def test_a_stored_chat_keeps_its_rotation_when_the_setting_for_new_chats_changes(
        tmp_path) -> None:
    """Reopened unrotated, its q4 pages would be decoded and rounded to 4 bits again:
    a second quantization's error on the first, at every change of the setting."""
    folder = make_tiny_model_dir(tmp_path / "models", "llama")
    with loaded_worker(folder, snapshots=SnapshotStore(tmp_path / "kv")) as (engine, log):
        first = log.result(engine.open_session("old", "q4", 16, rotate=True), SessionOpened)
        log.ending(engine.ingest("old", MESSAGES[:1], threading.Event()))
        assert isinstance(log.ending(engine.close_session("old")), Finished)
        again = log.result(engine.open_session("old", "q4", 16, rotate=False), SessionOpened)
        new = log.result(engine.open_session("new", "q4", 16, rotate=False), SessionOpened)
        other_mode = log.result(engine.open_session("old", "q8", 16, rotate=False),
                                SessionOpened)
    assert first.rotation is not None and again.rotation == first.rotation
    assert new.rotation is None and other_mode.rotation is None  # the setting, where new
