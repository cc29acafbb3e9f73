"""Chats answering together through the worker: each starts at once, ends on its own,
and says the same as alone."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from engine.errors import ContextTooLong, EngineStopped
from engine.events import (
    AnswerWaiting,
    Failed,
    Finished,
    IngestProgress,
    ModelLoaded,
    Notice,
    SessionOpened,
    StatsSample,
    TokenChunk,
    WaitEnded,
)
from engine.format import human_bytes
from engine.memory.fit import MOST_STREAMS
from engine.runtime.answering import Answering, StreamCounts
from engine.runtime.commands import Chat, Command
from engine.runtime.worker import EngineWorker
from engine.session.sampling import SamplingParams
from engine.session.session import Session
from tests.engine.runtime.test_worker import EventLog, loaded_worker
from tests.engine.tinymodels import loaded_for_session, make_tiny_model_dir

LONG = SamplingParams(temperature=0.0, max_tokens=40)
ASKED = {
    "a": [{"role": "user", "content": "Tell me about the quick brown fox and the lazy dog."}],
    "b": [{"role": "user", "content": "What is the capital of France, and why is it there?"}],
    "c": [{"role": "user", "content": "Count the colours of the rainbow, one by one please."}],
}


@pytest.fixture(scope="module")
def endless_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Never ends its turn by itself: every answer runs to its length limit, so
    # answers overlap; these weights write a token a TokenChunk, not bytes of one.
    return make_tiny_model_dir(tmp_path_factory.mktemp("answering"), "llama", endless=True,
                               seed=1)


def _open(worker: Any, log: EventLog, *names: str, mode: str = "q8") -> None:
    for name in names:
        log.result(worker.open_session(name, mode, 16), SessionOpened)


def _tokens(log: EventLog, request_id: int) -> list[int]:
    return [i for e in log.for_request(request_id) if isinstance(e, TokenChunk)
            for i in e.token_ids]


def _alone(folder: Path, name: str, sampling: SamplingParams = LONG) -> list[int]:
    with loaded_worker(folder, chunk_size=16) as (worker, log):
        _open(worker, log, name)
        request = worker.chat(name, ASKED[name], sampling, threading.Event())
        ending = log.ending(request)
        assert isinstance(ending, Finished), ending
        return _tokens(log, request)


def _b_while_a_answers(worker: Any, log: EventLog, a_sampling: SamplingParams,
                       ) -> tuple[int, int, dict[int, Any]]:
    """Chat A, then chat B once A has a token; their requests and endings (both
    answered to their length limit)."""
    first = worker.chat("a", ASKED["a"], a_sampling, threading.Event())
    log.wait_for(lambda events: any(isinstance(e, TokenChunk) and e.request_id == first
                                    for e in events))
    second = worker.chat("b", ASKED["b"], LONG, threading.Event())
    ends = {request: log.ending(request) for request in (first, second)}
    assert all(isinstance(e, Finished) and e.reason == "length" for e in ends.values())
    return first, second, ends


def _position(log: EventLog, predicate: Any) -> int:
    with log.changed:
        return next(i for i, e in enumerate(log.events) if predicate(e))


def _starts(log: EventLog, request: int) -> int:
    """Where ``request`` begins to read or answer (past what says why it waits)."""
    return _position(log, lambda e: getattr(e, "request_id", None) == request
                     and not isinstance(e, AnswerWaiting | SessionOpened))


def _told_it_goes_on(log: EventLog, request: int) -> bool:
    """Whether ``request``, told it waits, was told it goes on before its first
    progress or token."""
    begun = next(e for e in log.for_request(request)
                 if not isinstance(e, AnswerWaiting | SessionOpened | Notice))
    return isinstance(begun, WaitEnded)


def _waited(log: EventLog, request: int) -> list[str]:
    """What ``request`` was told while it waited."""
    return [e.reason for e in log.for_request(request) if isinstance(e, AnswerWaiting)]


def test_a_chat_sent_while_another_answers_starts_at_once_and_both_say_what_alone_would(
        endless_dir: Path) -> None:
    # Long enough that A is still answering when B comes, drafts and all.
    longer = SamplingParams(temperature=0.0, max_tokens=400)
    alone = {"a": _alone(endless_dir, "a", longer), "b": _alone(endless_dir, "b")}
    with loaded_worker(endless_dir, chunk_size=16) as (worker, log):
        _open(worker, log, "a", "b")
        first, second, ended = _b_while_a_answers(worker, log, longer)
        # B answered while A did, not after it: its first token came before A ended.
        b_starts = _position(log, lambda e: isinstance(e, TokenChunk) and e.request_id == second)
        a_ends = _position(log, lambda e: e is ended[first])
        assert b_starts < a_ends
        # A began alone (with drafts) and went on in the batch; same tokens as alone.
        assert _tokens(log, first) == alone["a"]
        assert _tokens(log, second) == alone["b"]
        # Nothing left in flight; the limit free memory allows for this tiny model.
        assert worker.streams() == StreamCounts(limit=MOST_STREAMS)


def test_the_counts_follow_an_answer_alone_and_answers_together(endless_dir: Path) -> None:
    counted: list[tuple[type, StreamCounts]] = []
    log = EventLog()
    worker: EngineWorker

    def on_event(event: object) -> None:  # on the worker thread, as the counts change
        if isinstance(event, IngestProgress | TokenChunk | Finished):
            counted.append((type(event), worker.streams()))
        log(event)

    worker = EngineWorker(on_event, chunk_size=16)
    worker.start()
    try:
        log.result(worker.load_model(str(endless_dir)), ModelLoaded)
        _open(worker, log, "a", "b")
        counted.clear()
        request = worker.chat("a", [{"role": "user", "content": "fox and dog " * 20}], LONG,
                              threading.Event())
        assert isinstance(log.ending(request), Finished)
        alone = list(counted)
        counted.clear()
        # A long enough to be answering still when B comes, on a busy machine too
        # (40 tokens, drafted a few a step, were done before B's command was read).
        _b_while_a_answers(worker, log, replace(LONG, max_tokens=400))
    finally:
        worker.shutdown(timeout=10.0)
    idle = StreamCounts(limit=MOST_STREAMS)
    reading, decoding = replace(idle, reading=1), replace(idle, answering=1)
    # Alone: reading its conversation in, then decoding, then nothing.
    assert {counts for kind, counts in alone if kind is IngestProgress} == {reading}
    assert {counts for kind, counts in alone if kind is TokenChunk} == {decoding}
    assert alone[-1] == (Finished, idle)
    # Together: two at once at some point, and nothing left once the last one ended.
    assert max(counts.answering for _, counts in counted) == 2
    assert counted[-1] == (Finished, idle)


def test_a_read_that_fails_beside_an_answer_ends_both_and_the_engine_goes_on(
        endless_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    forward = Session.forward

    def broken(self: Session, chunk: Any, **kwargs: Any) -> bool:
        if self.session_id == "b":
            raise RuntimeError("the device went away")
        return forward(self, chunk, **kwargs)

    with loaded_worker(endless_dir, chunk_size=16) as (worker, log):
        _open(worker, log, "a", "b")
        first = worker.chat("a", ASKED["a"], LONG, threading.Event())
        log.wait_for(lambda events: any(isinstance(e, TokenChunk) and e.request_id == first
                                        for e in events))
        monkeypatch.setattr(Session, "forward", broken)
        second = worker.chat("b", ASKED["b"], LONG, threading.Event())
        # The read's failure takes the batch's pass with it: both requests end.
        endings = [log.ending(request) for request in (first, second)]
        assert all(isinstance(e, Failed) for e in endings), endings
        monkeypatch.setattr(Session, "forward", forward)
        again = worker.chat("b", ASKED["b"], LONG, threading.Event())
        assert isinstance(log.ending(again), Finished)


def test_a_chat_whose_other_ranks_cannot_batch_answers_alone(endless_dir: Path) -> None:
    loaded = loaded_for_session(endless_dir)
    answering = Answering(None, lambda event: None, lambda: None, None)  # only can_take runs
    for batches in (True, False):
        ranks = SimpleNamespace(needs_checkpoints=False, batches=batches)
        session = Session("s", loaded, "q8", page_size=16, followers=ranks)
        assert answering.can_take(session) is batches


def test_a_chat_refused_at_its_join_tells_the_other_ranks_it_ended(endless_dir: Path) -> None:
    ends: list[tuple[int, bool, bool]] = []
    ranks = SimpleNamespace(needs_checkpoints=False, batches=True, machines=lambda *_: (),
                            end=lambda held, cancelled, answer=True: ends.append(
                                (held, cancelled, answer)))
    # A context far shorter than the conversation: refused before anything is read.
    session = Session("s", loaded_for_session(endless_dir, max_context=8), "q8",
                      page_size=16, followers=ranks)
    stats = SimpleNamespace(publish=lambda session: None)
    answering = Answering(stats, lambda event: None, lambda: None, None)  # type: ignore[arg-type]
    chat = Chat("s", ASKED["a"], LONG)
    with pytest.raises(ContextTooLong):
        answering.join(Command(1, chat), chat, session, session.prompt(
            ASKED["a"], add_generation_prompt=True), 0)
    # As a read alone that fails its checks: they check their tokens and let go.
    assert ends == [(0, False, True)]


def test_stop_ends_only_its_own_answer(endless_dir: Path) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=200)
    with loaded_worker(endless_dir, chunk_size=16) as (worker, log):
        _open(worker, log, "a", "b")
        stop_a = threading.Event()
        first = worker.chat("a", ASKED["a"], long, stop_a)
        second = worker.chat("b", ASKED["b"], LONG, threading.Event())
        log.wait_for(lambda events: any(isinstance(e, TokenChunk) and e.request_id == second
                                        for e in events))
        stop_a.set()
        a_end, b_end = log.ending(first), log.ending(second)
        assert isinstance(a_end, Finished) and a_end.reason == "cancelled"
        assert isinstance(b_end, Finished) and b_end.reason == "length"
        assert b_end.stats is not None and b_end.stats.generated_tokens == LONG.max_tokens


def test_a_close_cancels_only_the_answer_in_its_session(endless_dir: Path) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=200)
    with loaded_worker(endless_dir, chunk_size=16) as (worker, log):
        _open(worker, log, "a", "b")
        first = worker.chat("a", ASKED["a"], long, threading.Event())
        second = worker.chat("b", ASKED["b"], LONG, threading.Event())
        log.wait_for(lambda events: any(isinstance(e, TokenChunk) and e.request_id == second
                                        for e in events))
        closed = worker.close_session("a")
        assert log.ending(closed) == Finished(closed, "done")
        a_end, b_end = log.ending(first), log.ending(second)
        assert isinstance(a_end, Finished) and a_end.reason == "cancelled"
        assert isinstance(b_end, Finished) and b_end.reason == "length"
        # The close ran once A's answer had left the batch, not before.
        assert _position(log, lambda e: e is a_end) < _position(log, lambda e: e is
                                                                log.ending(closed))


def test_an_ingest_waits_for_the_answers_and_a_chat_after_it_waits_for_the_ingest(
        endless_dir: Path) -> None:
    with loaded_worker(endless_dir, chunk_size=16) as (worker, log):
        _open(worker, log, "a", "b", "c")
        first = worker.chat("a", ASKED["a"], LONG, threading.Event())
        read = worker.ingest("b", ASKED["b"], threading.Event())
        third = worker.chat("c", ASKED["c"], LONG, threading.Event())
        endings = [log.ending(request) for request in (first, read, third)]
        assert all(isinstance(e, Finished) for e in endings), endings
        read_starts = _position(log, lambda e: isinstance(e, IngestProgress)
                                and e.request_id == read)
        assert _position(log, lambda e: e is endings[0]) < read_starts
        assert _position(log, lambda e: e is endings[1]) < _starts(log, third)
        assert _waited(log, third) == ["Waiting for the answers running now to end: a "
                                       "document is read in first."]
        assert _told_it_goes_on(log, third)


def test_chats_beyond_the_stream_limit_wait_their_turn(endless_dir: Path) -> None:
    with loaded_worker(endless_dir, chunk_size=16, streams=2) as (worker, log):
        _open(worker, log, "a", "b", "c")
        requests = [worker.chat(name, ASKED[name], LONG, threading.Event())
                    for name in ("a", "b", "c")]
        log.wait_for(lambda events: any(isinstance(e, TokenChunk) and e.request_id == requests[1]
                                        for e in events))
        counts = worker.streams()
        assert counts.limit == 2 and counts.in_flight <= 2
        endings = [log.ending(request) for request in requests]
        assert all(isinstance(e, Finished) and e.reason == "length" for e in endings)
        first_end = min(_position(log, lambda e, end=end: e is end) for end in endings[:2])
        assert first_end < _starts(log, requests[2])
        assert _waited(log, requests[2]) == [
            "Waiting for a place: 2 answers run at once here; this one starts when one of "
            "them ends."]
        assert _told_it_goes_on(log, requests[2])


def test_a_chat_memory_cannot_hold_beside_the_others_waits_and_says_why(
        endless_dir: Path) -> None:
    from engine.memory.guard import MemoryGuard

    # The budget holds one of these conversations' pages (about 40 tokens), not two.
    with loaded_worker(endless_dir, chunk_size=16) as (worker, log):
        _open(worker, log, "probe")
        one = worker.fit_check("probe", 40).for_mode("q8").bytes_needed
    guard = MemoryGuard(budget_bytes=int(one * 1.2))
    with loaded_worker(endless_dir, chunk_size=16, memory_guard=guard) as (worker, log):
        _open(worker, log, "a", "b")
        first = worker.chat("a", ASKED["a"], LONG, threading.Event())
        second = worker.chat("b", ASKED["b"], LONG, threading.Event())
        a_end = log.ending(first)
        waits = [e for e in log.for_request(second) if isinstance(e, AnswerWaiting)]
        assert waits and "Waiting for memory" in waits[0].reason and waits[0].short_bytes > 0
        assert "KV budget" in waits[0].reason
        b_end = log.ending(second)
        assert isinstance(a_end, Finished) and a_end.reason == "length"
        assert _position(log, lambda e: e is waits[0]) < _position(log, lambda e: e is a_end)
        # Once A's answer ended, A's pages (idle now) went aside for B, never before.
        assert isinstance(b_end, Finished) and b_end.reason == "length", b_end
        assert _told_it_goes_on(log, second)
        (aside,) = [e for e in log.for_request(second)
                    if isinstance(e, Notice) and e.message.startswith("Made room")]
        assert _position(log, lambda e: e is a_end) < _position(log, lambda e: e is aside)


def test_a_model_whose_layers_cannot_share_a_pass_answers_one_chat_at_a_time(
        endless_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.errors import EngineError
    from engine.runtime import answering

    def refuse(caches: object) -> None:
        raise EngineError("These layers cannot decode in a batch.")

    monkeypatch.setattr(answering, "check_batchable", refuse)
    with loaded_worker(endless_dir, chunk_size=16, streams=4) as (worker, log):
        # Counted as one at a time (a server's queue counts beyond it), though
        # four were asked for.
        assert worker.streams().limit == 1
        _open(worker, log, "a", "b")
        first = worker.chat("a", ASKED["a"], LONG, threading.Event())
        second = worker.chat("b", ASKED["b"], LONG, threading.Event())
        a_end, b_end = log.ending(first), log.ending(second)
        assert isinstance(a_end, Finished) and a_end.reason == "length"
        assert isinstance(b_end, Finished) and b_end.reason == "length"
        # Alone, in turn, with drafts: B began after A ended.
        assert _position(log, lambda e: e is a_end) < _starts(log, second)
        assert _waited(log, second) == ["Waiting for the answer running now to end: this "
                                        "model answers one chat at a time here."]
        assert a_end.stats is not None and a_end.stats.draft_tokens > 0


def test_answers_held_to_a_schema_keep_to_it_while_they_answer_together(
        endless_dir: Path) -> None:
    import json

    import jsonschema

    from engine.session.constraint import json_schema_grammar
    from tests.engine.session.test_constraint import SCHEMAS

    held = {"a": SCHEMAS[0], "b": SCHEMAS[1]}
    with loaded_worker(endless_dir, chunk_size=16) as (worker, log):
        _open(worker, log, "a", "b", "c")
        requests = {name: worker.chat(name, ASKED[name], SamplingParams(
            temperature=0.0, max_tokens=120, grammar=json_schema_grammar(schema)),
            threading.Event()) for name, schema in held.items()}
        free = worker.chat("c", ASKED["c"], LONG, threading.Event())
        assert isinstance(log.ending(free), Finished)
        for name, request in requests.items():
            ending = log.ending(request)
            assert isinstance(ending, Finished) and ending.reason == "stop", ending
            text = "".join(e.text for e in log.for_request(request)
                           if isinstance(e, TokenChunk))
            jsonschema.validate(json.loads(text), held[name])


def test_a_question_sent_while_another_chat_reads_a_document_answers_before_the_read_ends(
        endless_dir: Path) -> None:
    document = " ".join(f"Line {i}: the longleaf pine grows in the coastal plain."
                        for i in range(60))
    with loaded_worker(endless_dir, chunk_size=16) as (worker, log):
        _open(worker, log, "a")
        reading = worker.chat("a", [{"role": "user", "content": document}], LONG,
                              threading.Event())
        log.wait_for(lambda events: any(isinstance(e, IngestProgress) and e.request_id == reading
                                        for e in events))
        # As the app does: the question's chat is opened, then sent once it is open.
        _open(worker, log, "b")
        question = worker.chat("b", ASKED["b"], LONG, threading.Event())
        ends = [log.ending(request) for request in (reading, question)]
        assert all(isinstance(e, Finished) and e.reason == "length" for e in ends)
        read = [e for e in log.for_request(reading) if isinstance(e, IngestProgress)]
        assert read[-1].tokens_done == read[-1].tokens_total > 400
        # The question joined between two of the document's chunks and answered
        # beside the rest of the read, not after it.
        answered = _position(log, lambda e: isinstance(e, TokenChunk) and e.request_id == question)
        assert answered < _position(log, lambda e: e is read[-1])


def test_a_chat_cancelled_while_it_waits_for_room_ends_at_once(endless_dir: Path) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=400)
    with loaded_worker(endless_dir, chunk_size=16, streams=2) as (worker, log):
        _open(worker, log, "a", "b", "c")
        first = worker.chat("a", ASKED["a"], long, threading.Event())
        worker.chat("b", ASKED["b"], long, threading.Event())
        log.wait_for(lambda events: any(isinstance(e, TokenChunk) and e.request_id == first
                                        for e in events))
        stop_c = threading.Event()
        third = worker.chat("c", ASKED["c"], LONG, stop_c)
        stop_c.set()
        c_end = log.ending(third)
        assert c_end == Finished(third, "cancelled")
        a_end = log.ending(first)
        # C ended while A still answered, without a token of its own.
        assert _position(log, lambda e: e is c_end) < _position(log, lambda e: e is a_end)
        assert not any(isinstance(e, TokenChunk) for e in log.for_request(third))


def test_an_answer_short_of_a_page_says_it_waits_each_time_and_goes_on_as_alone(
        endless_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.cache import adapter
    from engine.errors import KvBudgetExceeded

    long = SamplingParams(temperature=0.0, max_tokens=80)
    alone = _alone(endless_dir, "a", long)
    ensure, caches = adapter.ensure_capacity, []
    with loaded_worker(endless_dir, chunk_size=16) as (worker, log):
        _open(worker, log, "a", "b")
        first = worker.chat("a", ASKED["a"], long, threading.Event())
        log.wait_for(lambda events: any(isinstance(e, TokenChunk) and e.request_id == first
                                        for e in events))
        second = -1

        def full_for_a_twice(cache: Any, tokens: int) -> None:
            # A's pages (read first) are full twice while B answers beside it.
            if not caches:
                caches.append(cache)
            b_tokens = len(_tokens(log, second))
            if cache is caches[0] and (5 <= b_tokens < 10 or 20 <= b_tokens < 25):
                raise KvBudgetExceeded(f"no page for {tokens} more")
            ensure(cache, tokens)

        monkeypatch.setattr(adapter, "ensure_capacity", full_for_a_twice)
        second = worker.chat("b", ASKED["b"], LONG, threading.Event())
        a_end, b_end = log.ending(first), log.ending(second)
    assert isinstance(b_end, Finished) and b_end.reason == "length"
    assert isinstance(a_end, Finished) and a_end.reason == "length"
    waits = [e for e in log.for_request(first) if isinstance(e, AnswerWaiting)]
    page = waits[0].short_bytes
    assert page > 0 and [e.reason for e in waits] == 2 * [
        f"Waiting for memory: this answer's next page ({human_bytes(page)}) does not fit "
        "in what is free; it goes on when another answer ends."]
    assert _tokens(log, first) == alone


def test_a_stream_limit_under_one_is_refused() -> None:
    from engine.errors import EngineError
    from engine.runtime.worker import EngineWorker

    with pytest.raises(EngineError, match="At least one answer"):
        EngineWorker(lambda event: None, streams=0)


def test_an_answer_that_ends_last_on_its_end_token_holds_it_before_its_session_is_free(
        tmp_path: Path) -> None:
    from engine.cache.paged_cache import cache_tokens
    from engine.runtime.answering import Answering
    from engine.runtime.commands import Chat, Command
    from engine.runtime.stats_reporter import StatsReporter
    from engine.session.session import Session
    from tests.engine.tinymodels import loaded_for_session

    loaded = loaded_for_session(make_tiny_model_dir(tmp_path, "llama"))
    plain = SamplingParams(temperature=0.0, max_tokens=8, speculative="off")
    first: list[int] = []
    alone = Session("alone", loaded, "q8")
    alone.chat(ASKED["b"], plain, request_id=1, cancel=threading.Event(),
               emit=lambda e: first.extend(getattr(e, "token_ids", [])), tick=lambda: None)
    session = Session("b", loaded, "q8")
    session.end_ids = frozenset(first[:1])  # its first token ends its turn
    events: list[Any] = []
    answering = Answering(StatsReporter(events.append, 60.0), events.append, lambda: None,
                          fault=lambda command, error: Failed(command.request_id, str(error),
                                                              "Error"))
    chat = Chat("b", ASKED["b"], plain)
    answering.join(Command(2, chat), chat, session,
                   session.prompt(ASKED["b"], add_generation_prompt=True), 0)
    while not any(isinstance(e, Finished) for e in events):
        answering.step()
    (ended,) = [e for e in events if isinstance(e, Finished)]
    assert ended.reason == "stop"
    # The pass queued before the answer ended feeds its end token: until that pass
    # is read the session is the batch's, and the worker goes on stepping.
    assert answering.busy and answering.session_ids() == {"b"}
    answering.step()
    assert not answering.busy and answering.session_ids() == set()
    assert len(session.tokens) == cache_tokens(session.cache)


def test_an_idle_chat_is_set_aside_for_a_chat_joining_while_another_answers(
        endless_dir: Path) -> None:
    document = [{"role": "user", "content": " ".join(
        f"Line {i}: the longleaf pine grows in the coastal plain." for i in range(40))}]
    with loaded_worker(endless_dir, chunk_size=16) as (worker, log):
        _open(worker, log, "idle", "a", "b")
        page = worker.fit_check("a", 16).for_mode("q8").bytes_needed
        assert isinstance(log.ending(worker.chat("idle", document, LONG, threading.Event())),
                          Finished)
        with log.changed:
            held = [e.kv_bytes_allocated for e in log.events
                    if isinstance(e, StatsSample) and e.session_id == "idle"][-1]
        # Beside the idle chat, room for A's conversation and answer (six pages),
        # not for B's too. A decodes plainly: more steps, for B to come during them.
        log.ending(worker.configure(budget_bytes=held + 6 * page,
                                    chunk_size=worker.chunk_size, read_share=0.5))
        plain = SamplingParams(temperature=0.0, max_tokens=60, speculative="off")
        first, second, ends = _b_while_a_answers(worker, log, plain)
        (aside,) = [e for e in log.for_request(second)
                    if isinstance(e, Notice) and e.message.startswith("Made room")]
        # B joined A's answer at once: no wait, its first token before A's end.
        assert not any(isinstance(e, AnswerWaiting) for e in log.for_request(second))
        b_starts = _position(log, lambda e: isinstance(e, TokenChunk) and e.request_id == second)
        assert _position(log, lambda e: e is aside) < b_starts < _position(
            log, lambda e: e is ends[first])


PLAIN = SamplingParams(temperature=0.0, max_tokens=30, speculative="off")


def _answering(events: list[Any]) -> Answering:
    from engine.runtime.stats_reporter import StatsReporter

    return Answering(StatsReporter(events.append, 60.0), events.append, lambda: None,
                     fault=lambda command, error: Failed(command.request_id, str(error),
                                                         "Error"))


def _join(answering: Answering, request_id: int, session: Session) -> Any:
    from engine.runtime.commands import Chat, Command

    chat = Chat(session.session_id, ASKED["a"], PLAIN)
    command = Command(request_id, chat)
    answering.join(command, chat, session,
                   session.prompt(ASKED["a"], add_generation_prompt=True), 0)
    return command


def _held_back_until(monkeypatch: pytest.MonkeyPatch, gate: dict[str, bool]) -> None:
    """Joining conversations wait for memory until ``gate["open"]``."""
    from engine.session import batch

    room_for = batch.BatchDecoder._room_for
    monkeypatch.setattr(batch.BatchDecoder, "_room_for", lambda self, joining: (
        room_for(self, joining) if gate["open"] else batch._Short(bytes=1)))


def _ended(events: list[Any]) -> set[int]:
    return {e.request_id for e in events if isinstance(e, (Finished, Failed))}


def _broken_start(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("[metal::malloc] Resource limit exceeded")
    yield  # a generator, as Session.answer_steps is


def test_a_waiting_chat_whose_start_fails_unexpectedly_ends_with_the_batch(
        endless_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loaded = loaded_for_session(endless_dir)
    events: list[Any] = []
    answering = _answering(events)
    _join(answering, 1, Session("a", loaded, "q8"))
    gate = {"open": False}
    _held_back_until(monkeypatch, gate)
    waiting = Session("w", loaded, "q8")
    _join(answering, 2, waiting)
    answering.step()
    assert any(isinstance(e, AnswerWaiting) and e.request_id == 2 for e in events)
    monkeypatch.setattr(waiting, "answer_steps", _broken_start)
    gate["open"] = True
    answering.step()  # its turn: its start raises what no EngineError says
    # Both requests end (the failure takes the batch with it) and the worker is
    # free again, instead of stepping an idle batch for a request nobody ends.
    assert _ended(events) == {1, 2} and not answering.busy
    assert all(isinstance(e, Failed) for e in events if isinstance(e, (Finished, Failed)))


def test_what_a_failing_step_ended_before_it_failed_still_ends(
        endless_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.session import batch

    loaded = loaded_for_session(endless_dir)
    events: list[Any] = []
    answering = _answering(events)
    _join(answering, 1, Session("a", loaded, "q8"))
    answering.step()
    _held_back_until(monkeypatch, {"open": False})
    _join(answering, 2, Session("w", loaded, "q8")).cancel.set()  # Stop while it waits

    def broken(self: Any, rows: Any, current: Any) -> Any:
        raise RuntimeError("the device went away")

    monkeypatch.setattr(batch.BatchDecoder, "_queue", broken)
    answering.step()  # ends the stopped one, then its pass fails
    ends = {e.request_id: e for e in events if isinstance(e, (Finished, Failed))}
    assert isinstance(ends[2], Finished) and ends[2].reason == "cancelled"
    assert isinstance(ends[1], Failed) and not answering.busy


def test_a_row_ended_in_the_pass_queued_before_a_failure_holds_what_its_cache_holds(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from engine.cache.paged_cache import cache_tokens

    loaded = loaded_for_session(make_tiny_model_dir(tmp_path, "llama"))
    first: list[int] = []
    Session("alone", loaded, "q8").chat(
        ASKED["a"], PLAIN, request_id=9, cancel=threading.Event(),
        emit=lambda e: first.extend(getattr(e, "token_ids", [])), tick=lambda: None)
    events: list[Any] = []
    answering = _answering(events)
    ending = Session("a", loaded, "q8")
    ending.end_ids = frozenset(first[2:3])  # its third token ends its turn
    _join(answering, 1, ending)
    _join(answering, 3, Session("c", loaded, "q8"))
    gate = {"open": False}
    _held_back_until(monkeypatch, gate)
    waiting = Session("w", loaded, "q8")
    _join(answering, 2, waiting)
    monkeypatch.setattr(waiting, "answer_steps", _broken_start)
    while 1 not in _ended(events):
        answering.step()
    assert "a" in answering.session_ids()  # the queued pass feeds its end token
    gate["open"] = True
    answering.step()  # the waiting chat's start fails before that pass is read
    assert len(ending.tokens) == cache_tokens(ending.cache)
    assert _ended(events) == {1, 2, 3} and not answering.busy


def broken_step(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """Once the returned event is set, the batch's step raises what no request's own
    handling catches (a bug)."""
    step = Answering.step
    broken = threading.Event()

    def buggy(self: Answering) -> None:
        if broken.is_set():
            raise RuntimeError("a bug past every request's own handling")
        step(self)

    monkeypatch.setattr(Answering, "step", buggy)
    return broken


def test_answers_end_when_the_engine_thread_stops_on_a_bug(
        endless_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = broken_step(monkeypatch)
    with loaded_worker(endless_dir, chunk_size=16) as (worker, log):
        _open(worker, log, "a", "b")
        long = SamplingParams(temperature=0.0, max_tokens=2000)
        requests = [worker.chat(name, ASKED[name], long, threading.Event()) for name in "ab"]
        log.wait_for(lambda events: {e.request_id for e in events
                                     if isinstance(e, TokenChunk)} >= set(requests))
        broken.set()
        # Both answers end, failed in the worker's words, and the thread is gone:
        # nobody waits for an ending that cannot come.
        endings = [log.ending(request) for request in requests]
        assert all(isinstance(e, Failed) and "a bug past" in e.message for e in endings)
        assert worker.join(10.0) and not worker.alive
        # A request after that is refused at once, saying so, rather than queued
        # where no thread will ever take it.
        with pytest.raises(EngineStopped, match=r"^The engine stopped on an unexpected "
                                                r"error \(RuntimeError: a bug past"):
            worker.chat("a", ASKED["a"], LONG, threading.Event())


STOPPED = "quit Longleaf and open it again"


def test_an_answer_ending_as_the_engine_stops_on_a_bug_still_ends(
        endless_dir: Path) -> None:
    with loaded_worker(endless_dir, chunk_size=16) as (worker, log):
        _open(worker, log, "a", "b")
        long = SamplingParams(temperature=0.0, max_tokens=2000)
        first = worker.chat("a", ASKED["a"], long, threading.Event())
        log.wait_for(lambda events: any(isinstance(e, TokenChunk) and e.request_id == first
                                        for e in events))
        short = worker.chat("b", ASKED["b"], SamplingParams(temperature=0.0, max_tokens=6),
                            threading.Event())
        log.wait_for(lambda events: any(isinstance(e, TokenChunk) and e.request_id == short
                                        for e in events))

        def buggy() -> None:
            raise RuntimeError("a bug as an answer ends")

        worker._answering._after_end = buggy  # the hook runs as the short answer ends
        assert isinstance(log.ending(short), Finished)
        ending = log.ending(first)
        # The other answer is told the engine stopped, not to send its message again.
        assert isinstance(ending, Failed) and STOPPED in ending.message
        assert worker.join(10.0) and not worker.alive


def test_the_request_running_as_the_engine_stops_on_a_bug_still_ends(
        endless_dir: Path) -> None:
    with loaded_worker(endless_dir, chunk_size=16) as (worker, log):
        _open(worker, log, "a")

        def buggy(chunk_size: int) -> None:
            raise RuntimeError("a bug after a request")

        worker._held.publish_fit = buggy  # type: ignore[method-assign]
        running = worker.configure(budget_bytes=None, chunk_size=16, read_share=0.5)
        queued = worker.chat("a", ASKED["a"], LONG, threading.Event())
        assert isinstance(log.ending(running), Finished)
        ending = log.ending(queued)
        assert isinstance(ending, Failed) and STOPPED in ending.message
        assert worker.join(10.0) and not worker.alive


def test_a_chat_cancelled_behind_a_document_read_ends_before_the_read(
        endless_dir: Path) -> None:
    """Stop on a chat waiting behind a long read (a server client gone) frees its
    place between two chunks, not when the whole document is in."""
    released = threading.Event()

    class HeldAtTheFirstChunk(EventLog):
        def __call__(self, event: object) -> None:
            super().__call__(event)
            if isinstance(event, IngestProgress):
                released.wait(30)  # the engine thread, between two chunks

    log = HeldAtTheFirstChunk()
    worker = EngineWorker(log, chunk_size=8)
    worker.start()
    try:
        log.result(worker.load_model(str(endless_dir)), ModelLoaded)
        _open(worker, log, "a", "b")
        document = [{"role": "user", "content": " ".join(f"word{i}" for i in range(300))}]
        read = worker.ingest("a", document, threading.Event())
        log.wait_for(lambda events: any(isinstance(e, IngestProgress) for e in events))
        cancel = threading.Event()
        waiting = worker.chat("b", ASKED["b"], LONG, cancel)
        cancel.set()
        released.set()
        assert log.ending(waiting).reason == "cancelled"
        assert log.ending(read).reason == "done"
        endings = [e.request_id for e in log.events if isinstance(e, Finished)]
        assert endings.index(waiting) < endings.index(read)
    finally:
        released.set()
        worker.shutdown(timeout=10.0)


def test_a_close_stops_the_requests_waiting_in_its_session_ahead_of_it(
        endless_dir: Path) -> None:
    # One answer at a time: B's chat waits behind A's, which runs alone to its end.
    with loaded_worker(endless_dir, chunk_size=16, streams=1) as (worker, log):
        _open(worker, log, "a", "b")
        long = SamplingParams(temperature=0.0, max_tokens=2000)
        first = worker.chat("a", ASKED["a"], long, threading.Event())
        log.wait_for(lambda events: any(isinstance(e, TokenChunk) and e.request_id == first
                                        for e in events))
        waiting = worker.chat("b", ASKED["b"], LONG, threading.Event())
        worker.close_session("b", store=False)  # e.g. the model is switched
        ending = log.ending(waiting)
        # Ended cancelled, without a word, while A still answers: not run on a
        # session about to go once A is done.
        assert isinstance(ending, Finished) and ending.reason == "cancelled"
        assert _tokens(log, waiting) == []
        assert not any(isinstance(e, Finished | Failed) and e.request_id == first
                       for e in log.events)


def _before(log: EventLog, first: Any, then: Any) -> bool:
    """Whether an event matching ``first`` came, before any matching ``then``."""
    with log.changed:
        events = list(log.events)
    firsts = [i for i, e in enumerate(events) if first(e)]
    thens = [i for i, e in enumerate(events) if then(e)]
    return bool(firsts) and (not thens or firsts[0] < thens[0])


def _told(log: EventLog, request: int) -> AnswerWaiting:
    """What ``request`` is told while it waits (once, waited for)."""
    log.wait_for(lambda events: any(isinstance(e, AnswerWaiting) and e.request_id == request
                                    for e in events))
    (waiting,) = [e for e in log.for_request(request) if isinstance(e, AnswerWaiting)]
    return waiting


def _first_token(log: EventLog, request: int) -> None:
    log.wait_for(lambda events: any(isinstance(e, TokenChunk) and e.request_id == request
                                    for e in events))


def test_settings_that_keep_the_chunk_size_apply_between_steps(endless_dir: Path) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=2000)
    with loaded_worker(endless_dir, chunk_size=16) as (worker, log):
        _open(worker, log, "a")
        first = worker.chat("a", ASKED["a"], long, threading.Event())
        _first_token(log, first)
        settings = worker.configure(budget_bytes=None, chunk_size=16, read_share=0.25)
        _open(worker, log, "b")  # A pauses for it: the settings apply between two steps
        second = worker.chat("b", ASKED["b"], LONG, threading.Event())
        # B opened and answered beside A: the settings did not wait for A's end.
        assert isinstance(log.ending(settings), Finished)
        assert isinstance(log.ending(second), Finished)
        assert _before(log, lambda e: isinstance(e, TokenChunk) and e.request_id == second,
                       lambda e: isinstance(e, Finished) and e.request_id == first)


def test_a_chat_held_before_it_starts_says_why(endless_dir: Path) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=2000)
    with loaded_worker(endless_dir, chunk_size=16, streams=1) as (worker, log):
        _open(worker, log, "a", "b")
        first = worker.chat("a", ASKED["a"], long, threading.Event())
        _first_token(log, first)
        # One answer at a time here: B waits for A's place.
        second = worker.chat("b", ASKED["b"], LONG, threading.Event())
        waiting = _told(log, second)
        assert waiting.reason == ("Waiting for a place: 1 answer runs at once here; this one "
                                  "starts when one of them ends.")
        assert isinstance(log.ending(first), Finished)
        assert isinstance(log.ending(second), Finished)
        assert _before(log, lambda e: e is waiting,
                       lambda e: isinstance(e, Finished) and e.request_id == first)


def test_a_chat_behind_a_new_chunk_size_says_it_waits_for_the_answers(
        endless_dir: Path) -> None:
    long = SamplingParams(temperature=0.0, max_tokens=2000)
    with loaded_worker(endless_dir, chunk_size=16) as (worker, log):
        _open(worker, log, "a", "b")
        first = worker.chat("a", ASKED["a"], long, threading.Event())
        _first_token(log, first)
        worker.configure(budget_bytes=None, chunk_size=32, read_share=0.5)
        second = worker.chat("b", ASKED["b"], LONG, threading.Event())
        assert _told(log, second).reason == (
            "Waiting for the answers running now to end: a new reading chunk size applies "
            "first.")
        assert isinstance(log.ending(first), Finished)
        assert isinstance(log.ending(second), Finished)
