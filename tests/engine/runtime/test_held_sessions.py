"""HeldSessions through the worker: idle chats' pages set aside for a conversation
that needs their room, least recently used first, and brought back from disk."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine.events import Failed, Finished, Notice, SessionOpened, StatsSample, TokenChunk
from engine.memory.guard import MemoryGuard
from engine.snapshots import SnapshotStore
from tests.engine.runtime.test_worker import GREEDY, MESSAGES, EventLog, loaded_worker
from tests.engine.tinymodels import make_tiny_model_dir

PAGE = 16
# Conversations that share no prefix: no chat takes pages another holds.
OTHER = {name: [{"role": "user", "content": f"{text} {MESSAGES[0]['content']}"}]
         for name, text in (("b", "Bonjour."), ("c", "Ciao."))}
TOKENS = 4 * PAGE  # what a short chat's pages grow to: MIN_GROWTH_PAGES of them


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("held"), "llama")


@pytest.fixture(scope="module")
def chat_bytes(model_dir: Path) -> int:
    """KV bytes of one short chat's pages in q8."""
    with loaded_worker(model_dir) as (worker, log):
        log.result(worker.open_session("probe", "q8", PAGE), SessionOpened)
        return worker.fit_check("probe", TOKENS).for_mode("q8").bytes_needed


def _guarded(budget: float) -> dict[str, Any]:
    return {"memory_guard": MemoryGuard(budget_bytes=int(budget))}


def _chat(worker: Any, log: EventLog, name: str, messages: list[dict[str, str]] = MESSAGES,
          ) -> Finished | Failed:
    return log.ending(worker.chat(name, messages, GREEDY, threading.Event()))


def _open(worker: Any, log: EventLog, *names: str) -> None:
    for name in names:
        log.result(worker.open_session(name, "q8", PAGE), SessionOpened)


def _held_tokens(log: EventLog, name: str) -> int:
    """The tokens the last stats sample of ``name`` says its cache holds."""
    with log.changed:
        samples = [e for e in log.events if isinstance(e, StatsSample) and e.session_id == name]
    return samples[-1].tokens_in_context


def _notices(log: EventLog, request_id: int) -> list[str]:
    """What the request was told of chats set aside for it."""
    return [e.message for e in log.for_request(request_id)
            if isinstance(e, Notice) and e.message.startswith("Made room")]


def test_an_idle_chat_is_set_aside_for_one_its_pages_keep_out_and_comes_back_from_disk(
        model_dir: Path, chat_bytes: int, tmp_path: Path) -> None:
    # The KV budget holds one short chat's pages, not two.
    with loaded_worker(model_dir, snapshots=SnapshotStore(tmp_path / "kv"),
                       **_guarded(chat_bytes * 1.5)) as (worker, log):
        _open(worker, log, "a", "b")
        first = _chat(worker, log, "a")
        assert isinstance(first, Finished) and first.stats is not None
        held_a = _held_tokens(log, "a")
        assert held_a > 0
        second = worker.chat("b", OTHER["b"], GREEDY, threading.Event())
        ending = log.ending(second)
        assert isinstance(ending, Finished), ending
        (notice,) = _notices(log, second)
        assert "set aside another chat's cache" in notice and "on disk" in notice
        assert _held_tokens(log, "a") == 0 and _held_tokens(log, "b") > 0
        # A's next message takes its pages back from disk (B, idle now, goes aside).
        answer = "".join(e.text for e in log.for_request(first.request_id)
                         if isinstance(e, TokenChunk))
        more = [*MESSAGES, {"role": "assistant", "content": answer},
                {"role": "user", "content": "And of Spain?"}]
        again = _chat(worker, log, "a", more)
        assert isinstance(again, Finished) and again.stats is not None
        # Its whole first prompt at least (the answer re-tokenized may differ).
        assert again.stats.reused_tokens >= first.stats.prompt_tokens - 1
        assert _held_tokens(log, "b") == 0


def test_without_snapshots_the_chat_set_aside_is_read_again_next_time(
        model_dir: Path, chat_bytes: int) -> None:
    with loaded_worker(model_dir, **_guarded(chat_bytes * 1.5)) as (worker, log):
        _open(worker, log, "a", "b")
        assert isinstance(_chat(worker, log, "a"), Finished)
        second = worker.chat("b", OTHER["b"], GREEDY, threading.Event())
        assert isinstance(log.ending(second), Finished)
        (notice,) = _notices(log, second)
        assert "read again" in notice
        again = _chat(worker, log, "a")
        assert isinstance(again, Finished) and again.stats is not None
        assert again.stats.reused_tokens == 0


def test_the_chat_used_longest_ago_goes_aside_first_and_only_as_many_as_needed(
        model_dir: Path) -> None:
    with loaded_worker(model_dir) as (worker, log):
        # Opened in another order than used: the order of use decides.
        _open(worker, log, "c", "a", "b")
        assert isinstance(_chat(worker, log, "a"), Finished)
        with log.changed:
            held = [e.kv_bytes_allocated for e in log.events
                    if isinstance(e, StatsSample) and e.session_id == "a"][-1]
        # Room for two short chats' pages, not three.
        log.ending(worker.configure(budget_bytes=int(held * 2.5),
                                    chunk_size=worker.chunk_size, read_share=0.5))
        assert isinstance(_chat(worker, log, "c", OTHER["c"]), Finished)
        assert _held_tokens(log, "a") > 0
        third = worker.chat("b", OTHER["b"], GREEDY, threading.Event())
        assert isinstance(log.ending(third), Finished)
        assert len(_notices(log, third)) == 1
        assert _held_tokens(log, "a") == 0
        assert _held_tokens(log, "c") > 0 and _held_tokens(log, "b") > 0


def test_nothing_is_set_aside_when_the_conversation_would_not_fit_anyway(
        model_dir: Path, chat_bytes: int) -> None:
    long = [{"role": "user", "content": " ".join([MESSAGES[0]["content"]] * 12)}]
    with loaded_worker(model_dir, **_guarded(chat_bytes * 1.5)) as (worker, log):
        _open(worker, log, "a", "b")
        assert isinstance(_chat(worker, log, "a"), Finished)
        held_a = _held_tokens(log, "a")
        second = worker.chat("b", long, GREEDY, threading.Event())
        ending = log.ending(second)
        assert isinstance(ending, Failed) and ending.error_type == "MemoryShort", ending
        assert not _notices(log, second)
        assert _held_tokens(log, "a") == held_a


def test_a_chat_that_lends_its_pages_to_the_conversation_is_not_set_aside(
        model_dir: Path, chat_bytes: int, tmp_path: Path) -> None:
    with loaded_worker(model_dir, snapshots=SnapshotStore(tmp_path / "kv"),
                       **_guarded(chat_bytes * 1.5)) as (worker, log):
        _open(worker, log, "a", "b")
        assert isinstance(_chat(worker, log, "a"), Finished)
        held_a = _held_tokens(log, "a")
        # The same conversation in another chat: it takes A's pages, shared, and
        # needs room for its own answer only.
        second = worker.chat("b", MESSAGES, GREEDY, threading.Event())
        ending = log.ending(second)
        assert isinstance(ending, Finished) and ending.stats is not None, ending
        assert not _notices(log, second)
        assert ending.stats.reused_tokens > 0
        assert _held_tokens(log, "a") == held_a


def _general_notices(log: EventLog) -> list[str]:
    """What the worker said to no request in particular."""
    with log.changed:
        return [e.message for e in log.events if isinstance(e, Notice) and e.request_id == 0]


def _within(worker: Any, log: EventLog, store: SnapshotStore, snapshots: float) -> None:
    """Give the stored KV a disk budget of ``snapshots`` times the largest one now."""
    largest = max(info.disk_bytes for info in store.per_snapshot())
    assert isinstance(log.ending(worker.set_snapshot_budget(int(largest * snapshots))),
                      Finished)


def test_a_chat_set_aside_keeps_its_stored_kv_over_an_older_closed_ones(
        model_dir: Path, chat_bytes: int, tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "kv")
    with loaded_worker(model_dir, snapshots=store, **_guarded(chat_bytes * 1.5)) as (worker, log):
        _open(worker, log, "a", "b", "c", "d")
        first = _chat(worker, log, "a")
        assert isinstance(first, Finished) and first.stats is not None
        assert isinstance(_chat(worker, log, "b", OTHER["b"]), Finished)  # A goes aside
        log.ending(worker.close_session("b"))  # B stored, closed: its snapshot the newer
        assert [info.name for info in store.per_snapshot()] == ["b", "a"]
        _within(worker, log, store, 2.5)
        assert isinstance(_chat(worker, log, "c", OTHER["c"]), Finished)
        later = [{"role": "user", "content": f"Hola. {MESSAGES[0]['content']}"}]
        assert isinstance(_chat(worker, log, "d", later), Finished)  # C goes aside
        # Storing C evicted the closed chat's snapshot, not the only copy of A's KV.
        assert sorted(info.name for info in store.per_snapshot()) == ["a", "c"]
        log.ending(worker.close_session("d", store=False))  # A comes back, storing nothing
        again = _chat(worker, log, "a")
        assert isinstance(again, Finished) and again.stats is not None
        assert again.stats.reused_tokens >= first.stats.prompt_tokens - 1
        assert not _general_notices(log)


def test_a_chat_set_aside_whose_stored_kv_must_go_is_said_to_be_read_again(
        model_dir: Path, chat_bytes: int, tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "kv")
    with loaded_worker(model_dir, snapshots=store, **_guarded(chat_bytes * 1.5)) as (worker, log):
        _open(worker, log, "a", "b", "c")
        assert isinstance(_chat(worker, log, "a"), Finished)
        assert isinstance(_chat(worker, log, "b", OTHER["b"]), Finished)  # A goes aside
        _within(worker, log, store, 1.5)
        third = worker.chat("c", OTHER["c"], GREEDY, threading.Event())  # B goes aside
        assert isinstance(log.ending(third), Finished)
        assert [info.name for info in store.per_snapshot()] == ["b"]
        (told,) = _general_notices(log)
        assert "another open chat was removed" in told and "read again" in told
        again = _chat(worker, log, "a")
        assert isinstance(again, Finished) and again.stats is not None
        assert again.stats.reused_tokens == 0


class _Ranks:
    """A pipeline's other ranks as rank 0's conductor sees them: the sessions
    opened there, and those closed again."""

    def __init__(self) -> None:
        self.fingerprint: dict[str, Any] = {}
        self.opened: list[int] = []
        self.closed: list[int] = []

    def open(self, mode: str, page_size: int, rotate: bool | None, chunk_size: int) -> Any:
        slot = len(self.opened) + 1
        self.opened.append(slot)
        return SimpleNamespace(close=lambda: self.closed.append(slot))

    def stop(self) -> None:
        """Nothing runs there to stop."""


def test_a_chat_rank_0_refuses_is_never_left_open_on_the_other_ranks(
        model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.errors import UnsupportedModeError
    from engine.runtime import held_sessions

    with loaded_worker(model_dir) as (worker, log):
        ranks = _Ranks()
        worker._held._conductor = ranks
        # Refused before the other ranks are sent it: one would end the group on it.
        failed = log.ending(worker.open_session("a", "q8", 0))
        assert isinstance(failed, Failed)
        assert "Page size and chunk size must be at least 1 token" in failed.message
        assert ranks.opened == []

        def refuse(*args: object, **kwargs: object) -> None:
            raise UnsupportedModeError("q8 cannot store this model's heads.")

        # Refused by rank 0's own cache once they opened theirs: they close it again.
        monkeypatch.setattr(held_sessions, "Session", refuse)
        failed = log.ending(worker.open_session("b", "q8", PAGE))
        assert isinstance(failed, Failed)
        assert "cannot store this model's heads" in failed.message
        assert ranks.opened == ranks.closed == [1]


class _RanksThatAnswerAlone(_Ranks):
    """Other ranks whose layers cannot share a batch's pass."""

    def open(self, mode: str, page_size: int, rotate: bool | None, chunk_size: int) -> Any:
        link = super().open(mode, page_size, rotate, chunk_size)
        link.batches, link.needs_checkpoints = False, False
        link.machines = lambda *args: ()
        return link

    def unopened_machines(self, chunk_size: int) -> tuple:
        return ()


def test_other_ranks_that_cannot_share_a_pass_make_every_answer_run_alone(
        model_dir: Path) -> None:
    with loaded_worker(model_dir, streams=4) as (worker, log):
        assert worker.streams().limit == 4
        worker._held._conductor = _RanksThatAnswerAlone()
        log.result(worker.open_session("a", "q8", PAGE), SessionOpened)
        # Before, a server counted its queue beyond four answers that never run
        # together (rank 0's own layers can share a pass).
        assert worker.streams().limit == 1
