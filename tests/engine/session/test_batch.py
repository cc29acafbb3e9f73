"""Conversations answering together (engine.session.batch): each as it would alone.

Every conversation is answered twice, alone (``Session.chat``, plain decoding)
and as a row of a ``BatchDecoder`` beside conversations of other lengths and KV
modes, and the two answers must agree token for token, up to a near-tie. On every step
both fed the same tokens, the batch may move a logit by rounding only (at most
``BATCH_NOISE``); where the answers part, the alone answer's top-1 minus top-2
logit must be below twice that (a flip needs the two logits to move by more than
their gap, and each moves by at most ``BATCH_NOISE``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import adapter
from engine.errors import (
    Cancelled,
    ContextTooLong,
    EngineError,
    KvBudgetExceeded,
    MachineShort,
)
from engine.events import IngestProgress, TokenChunk
from engine.format import GB, human_bytes
from engine.memory.guard import MemoryGuard, MemoryReading
from engine.session import reuse
from engine.session.batch import ASK_AGAIN_S, BatchDecoder, Waiting
from engine.session.sampling import AnswerStream, SamplingParams
from engine.session.session import Session
from tests.engine.session.batch_noise import first_divergence
from tests.engine.tinymodels import CORPUS, loaded_for_session, make_tiny_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, speculative="off")
MODES = ("fp16", "q8", "q6", "q4")
# The most a row's logit may move in a batch against its step alone: the rounding
# of B-row matmuls against one-row ones. Measured on these tiny float32 models on
# the CPU: 0 to 8.5e-6 (float32 rounding of logits of a few units) where the BLAS
# sums B rows as it sums one; where it does not (OpenBLAS's AVX2 kernels), 1.1e-4
# alone and 7.6e-3 in a full suite run (gemma3), where a row's rounding moved a
# stored value across a quantization step. The bound leaves a margin over that; a
# wrong position, page or mode in a row moves a logit by tenths to units.
BATCH_NOISE = 2e-2
# Tokens per prefill chunk where a test reads a long conversation beside answers.
CHUNK = 32
# Prompt lengths in characters: conversations of about 30 to 250 tokens.
LENGTHS = (60, 700, 250, 400)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("batch-models")
    return {arch: loaded_for_session(make_tiny_model_dir(root, arch))
            for arch in ("llama", "qwen3_next", "gemma3_text")}


@pytest.fixture
def logits(monkeypatch: pytest.MonkeyPatch) -> dict[int, list[np.ndarray]]:
    """Every step's logits, by request id (alone and in a batch alike)."""
    seen: dict[int, list[np.ndarray]] = {}
    sample = AnswerStream.sample

    def recording(self: AnswerStream, token: mx.array, row: mx.array) -> mx.array:
        seen.setdefault(self.request_id, []).append(np.array(row.astype(mx.float32))[0])
        return sample(self, token, row)

    monkeypatch.setattr(AnswerStream, "sample", recording)
    return seen


def _messages(index: int) -> list[dict[str, str]]:
    text = (CORPUS * 2)[index * 37:index * 37 + LENGTHS[index % len(LENGTHS)]]
    return [{"role": "user", "content": text}]


@dataclass
class Answer:
    """One conversation's answer: its tokens, finish reason and the ids it holds."""

    tokens: list[int] = field(default_factory=list)
    reason: str | None = None
    held: int = 0
    cancel: threading.Event = field(default_factory=threading.Event)
    chunks: int = 0  # prefill chunks read
    progress: list[IngestProgress] = field(default_factory=list)

    def emit(self, event: object) -> None:
        if isinstance(event, TokenChunk):
            self.tokens.extend(event.token_ids)
        elif isinstance(event, IngestProgress):
            self.chunks += 1
            self.progress.append(event)


def _alone(loaded: Any, mode: str, messages, sampling: SamplingParams,
           request_id: int, **settings: Any) -> Answer:
    session = Session(f"alone-{request_id}", loaded, mode, **settings)
    answer = Answer()
    answer.reason, _ = session.chat(messages, sampling, request_id=request_id,
                                    cancel=answer.cancel, emit=answer.emit, tick=lambda: None)
    answer.held = len(session.tokens)
    return answer


def _join(batch: BatchDecoder, loaded: Any, mode: str, messages, sampling: SamplingParams,
          request_id: int) -> tuple[Session, Answer]:
    session = Session(f"batch-{request_id}", loaded, mode)
    answer = Answer()
    batch.join(session, messages, sampling, request_id=request_id, cancel=answer.cancel,
               emit=answer.emit, tick=lambda: None)
    return session, answer


def _finish(batch: BatchDecoder, rows: dict[int, tuple[Session, Answer]]) -> None:
    for result in batch.run():
        session, answer = rows[result.request_id]
        answer.reason = result.finish
    for session, answer in rows.values():
        answer.held = len(session.tokens)


def _assert_same_up_to_a_near_tie(alone: Answer, batched: Answer, alone_logits: list,
                                  batch_logits: list) -> None:
    first = first_divergence(alone.tokens, batched.tokens)
    same = len(alone.tokens) + 1 if first is None else first + 1
    # Up to step ``first`` both answers fed the same tokens: their logits there
    # differ by the batch's rounding only, and by no more than BATCH_NOISE.
    shift = max(float(np.abs(a - b).max())
                for a, b in zip(alone_logits[:same], batch_logits[:same], strict=False))
    assert shift <= BATCH_NOISE, (first, shift)
    if first is None:
        assert (batched.reason, batched.held) == (alone.reason, alone.held)
        return
    top2 = np.sort(alone_logits[first])[-2:]
    assert top2[1] - top2[0] < 2 * BATCH_NOISE, (first, top2, shift, batched.reason)


@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "gemma3_text"])
def test_four_modes_answer_together_as_they_do_alone(tiny, logits, arch: str) -> None:
    loaded = tiny[arch]
    alone = {i: _alone(loaded, mode, _messages(i), GREEDY, request_id=i)
             for i, mode in enumerate(MODES)}
    alone_logits = {i: logits.pop(i) for i in alone}
    batch = BatchDecoder(loaded.model)
    rows = {i: _join(batch, loaded, mode, _messages(i), GREEDY, request_id=i)
            for i, mode in enumerate(MODES)}
    assert batch.reading_ids == tuple(range(len(MODES))) and len(batch) == 0
    _finish(batch, rows)
    assert len(batch) == 0
    for i in alone:
        assert alone[i].tokens, "a greedy answer of the tiny model has tokens"
        _assert_same_up_to_a_near_tie(alone[i], rows[i][1], alone_logits[i], logits[i])


def test_each_row_keeps_its_own_sampling_and_limits(tiny, logits) -> None:
    loaded = tiny["llama"]
    end = loaded.tokenizer.eos_token_id
    settings = [
        replace(GREEDY, max_tokens=5),
        # Ends its turn at once: the end token is fed, as alone.
        replace(GREEDY, logit_bias=((end, 1000.0),)),
        replace(GREEDY, repetition_penalty=1.3, max_tokens=20),
        replace(GREEDY, logit_bias=((42, 1000.0),), max_tokens=7),
    ]
    modes = ("q6", "fp16", "q4", "q8")
    alone = {i: _alone(loaded, modes[i], _messages(i), s, request_id=i)
             for i, s in enumerate(settings)}
    alone_logits = {i: logits.pop(i) for i in alone}
    batch = BatchDecoder(loaded.model)
    rows = {i: _join(batch, loaded, modes[i], _messages(i), s, request_id=i)
            for i, s in enumerate(settings)}
    _finish(batch, rows)
    assert [alone[i].reason for i in range(4)] == ["length", "stop", "length", "length"]
    assert len(rows[0][1].tokens) == 5 and rows[3][1].tokens == [42] * 7
    assert rows[1][1].tokens == [] and rows[1][1].held == alone[1].held
    for i in alone:
        _assert_same_up_to_a_near_tie(alone[i], rows[i][1], alone_logits[i], logits[i])


def test_seeded_answers_draw_in_a_batch_what_they_draw_alone(tiny) -> None:
    # MLX's sampler draws from one random state: answers beside each other must
    # not take each other's numbers, or a seed no longer gives its answer.
    loaded = tiny["llama"]
    settings = [replace(GREEDY, temperature=1.0, seed=seed, max_tokens=24) for seed in (3, 4)]
    settings.append(replace(GREEDY, temperature=1.0, max_tokens=24))  # draws unseeded between
    alone = [_alone(loaded, "q6", _messages(i), s, request_id=i)
             for i, s in enumerate(settings[:2])]
    batch = BatchDecoder(loaded.model)
    rows = {i: _join(batch, loaded, "q6", _messages(i), s, request_id=i)
            for i, s in enumerate(settings)}
    _finish(batch, rows)
    for i, answer in enumerate(alone):
        assert len(answer.tokens) > 5
        assert rows[i][1].tokens == answer.tokens, i
    assert alone[0].tokens != alone[1].tokens


def test_an_unseeded_answer_beside_or_after_a_seeded_one_stays_random(tiny) -> None:
    """A seed is its own request's: the unseeded answer drawn beside a seeded one in
    a batch, or right after one alone, is not the same on every try (it was, each
    seeded draw leaving MLX's shared state where the seed put it)."""
    loaded = tiny["llama"]
    seeded = replace(GREEDY, temperature=1.0, seed=3, max_tokens=12)
    unseeded = replace(GREEDY, temperature=1.0, max_tokens=12)
    beside, after = [], []
    for attempt in range(3):
        mx.random.seed(100 + attempt)  # each try starts from its own state
        batch = BatchDecoder(loaded.model)
        rows = {i: _join(batch, loaded, "q6", _messages(i), s, request_id=i)
                for i, s in enumerate((seeded, unseeded))}
        _finish(batch, rows)
        beside.append(tuple(rows[1][1].tokens))
        mx.random.seed(200 + attempt)
        _alone(loaded, "q6", _messages(0), seeded, request_id=0)
        after.append(tuple(_alone(loaded, "q6", _messages(1), unseeded, request_id=1).tokens))
    assert len(set(beside)) > 1 and len(set(after)) > 1


def _reader(batch: BatchDecoder, loaded: Any, request_id: int,
            content: str) -> tuple[Session, Answer]:
    """A chat joining ``batch`` to read ``content`` in, 16 tokens a chunk."""
    session, answer = Session(f"read-{request_id}", loaded, "q8", chunk_size=16), Answer()
    batch.join(session, [{"role": "user", "content": content}], GREEDY,
               request_id=request_id, cancel=answer.cancel, emit=answer.emit,
               tick=lambda: None)
    return session, answer


def test_a_stopped_read_ends_at_the_next_step_wherever_it_stands_in_line(tiny) -> None:
    """Stop on a read behind a shorter one ends it at once: it held its place (a
    stream, a server slot, a close waiting behind it) until every shorter read was in."""
    batch = BatchDecoder(tiny["llama"].model, clock=lambda: 0.0)
    _, long = _reader(batch, tiny["llama"], 1, CORPUS * 3)
    _, short = _reader(batch, tiny["llama"], 2, CORPUS[:1200])
    long.cancel.set()
    ended = [(r.request_id, r.finish) for r in batch.step() if r.finish]
    assert ended == [(1, "cancelled")] and long.chunks == 0 and short.chunks == 0
    assert batch.reading_ids == (2,)


def test_a_read_stopped_beside_answers_ends_at_the_next_step(tiny) -> None:
    """Beside answers a read waits its share of the time between chunks: Stop does
    not wait for its next turn (a chunk's time on a large model)."""
    loaded = tiny["llama"]
    now = [0.0]

    def clock() -> float:
        now[0] += 1.0
        return now[0]

    batch = BatchDecoder(loaded.model, clock=clock)
    answer = Answer()
    batch.join(Session("answering", loaded, "q8", chunk_size=CHUNK), _messages(1),
               replace(GREEDY, max_tokens=500), request_id=1, cancel=answer.cancel,
               emit=answer.emit, tick=lambda: None)
    while not answer.tokens:
        batch.step()
    _, document = _reader(batch, loaded, 2, CORPUS * 3)
    while not document.chunks:
        batch.step()
    document.cancel.set()  # right after its chunk: the answers' turn now
    ended = [(r.request_id, r.finish) for r in batch.step() if r.finish]
    assert ended == [(2, "cancelled")] and batch.reading_ids == ()


def test_the_read_with_the_fewest_tokens_left_goes_first(tiny) -> None:
    """A read almost in is not held back behind a shorter read that joins after it:
    reads go by the tokens they have left, not by their length when they joined."""
    batch = BatchDecoder(tiny["llama"].model, clock=lambda: 0.0)
    long_session, _ = _reader(batch, tiny["llama"], 1, CORPUS * 2)
    while batch.reading[0].left > 48:
        batch.step()
    _, medium = _reader(batch, tiny["llama"], 2, CORPUS[:800])
    while 2 not in batch.reading_ids:  # admitted: both read now
        batch.step()
    assert medium.chunks == 0 and batch.reading[0].left > 0
    while 1 in batch.reading_ids:
        batch.step()
    # The long read, three chunks from its end, went on; the medium one waited.
    assert medium.chunks == 0 and batch.request_ids == (1,) and long_session.tokens


def test_a_row_leaving_and_one_joining_leave_the_others_as_alone(tiny, logits) -> None:
    loaded = tiny["llama"]
    alone = {i: _alone(loaded, MODES[i], _messages(i), GREEDY, request_id=i) for i in range(4)}
    alone_logits = {i: logits.pop(i) for i in alone}
    # A clock that stands still: a read goes at every step beside the answers, so
    # how far row 0 gets before row 1 answers does not depend on the machine's load.
    batch = BatchDecoder(loaded.model, clock=lambda: 0.0)
    rows = {i: _join(batch, loaded, MODES[i], _messages(i), GREEDY, request_id=i)
            for i in range(3)}
    while len(rows[1][1].tokens) < 6:
        assert all(r.finish is None for r in batch.step())
    rows[1][1].cancel.set()
    left = batch.step()
    # Its pass was queued before the Stop: its token is read, then it leaves.
    assert [(r.request_id, r.finish) for r in left if r.finish] == [(1, "cancelled")]
    assert batch.request_ids == (0, 2)
    assert batch.step() and batch.request_ids == (0, 2)
    cancelled = rows[1][1].tokens
    assert len(cancelled) == 7 and cancelled == alone[1].tokens[:7]
    for _ in range(3):
        batch.step()
    # A conversation joins mid-answer (read in beside the others' steps).
    rows[3] = _join(batch, loaded, MODES[3], _messages(3), GREEDY, request_id=3)
    _finish(batch, {i: rows[i] for i in (0, 2, 3)})
    for i in (0, 2, 3):
        _assert_same_up_to_a_near_tie(alone[i], rows[i][1], alone_logits[i], logits[i])


def test_a_long_read_goes_a_chunk_a_step_beside_the_answers(tiny, logits) -> None:
    loaded = tiny["llama"]
    document = [{"role": "user", "content": CORPUS * 2 + "\nSummarise the text above."}]
    answering = replace(GREEDY, max_tokens=60)
    chats = {  # request id: (mode, messages, sampling)
        1: ("fp16", _messages(1), answering),
        2: ("q6", document, GREEDY),
        3: ("q8", _messages(0), GREEDY),
    }

    def session(name: str, mode: str) -> Session:
        return Session(name, loaded, mode, chunk_size=CHUNK)

    alone = {}
    for request_id, (mode, messages, sampling) in chats.items():
        alone[request_id] = answer = Answer()
        single = session(f"alone-{request_id}", mode)
        answer.reason, _ = single.chat(messages, sampling, request_id=request_id,
                                       cancel=answer.cancel, emit=answer.emit,
                                       tick=lambda: None)
        answer.held = len(single.tokens)
    alone_logits = {i: logits.pop(i) for i in alone}
    # A clock that stands still: reading takes no time, so its turn comes every step.
    batch = BatchDecoder(loaded.model, clock=lambda: 0.0)
    rows: dict[int, tuple[Session, Answer]] = {}

    def join(request_id: int) -> None:
        mode, messages, sampling = chats[request_id]
        rows[request_id] = (session(f"batch-{request_id}", mode), Answer())
        batch.join(rows[request_id][0], messages, sampling, request_id=request_id,
                   cancel=rows[request_id][1].cancel, emit=rows[request_id][1].emit,
                   tick=lambda: None)

    join(1)
    while not rows[1][1].tokens:
        batch.step()
    join(2)
    assert batch.reading_ids == (2,)
    for _ in range(4):  # the document reads a chunk a step; the answer a token a step
        made, chunks = len(rows[1][1].tokens), rows[2][1].chunks
        assert [r.request_id for r in batch.step()] == [1]
        assert (len(rows[1][1].tokens), rows[2][1].chunks) == (made + 1, chunks + 1)
    join(3)  # a short question while the document is still read in
    steps = 0
    while not rows[3][1].tokens:
        batch.step()
        steps += 1
    # Its chunks went first: its answer started two steps after them (one to
    # find the read done, one pass), long before the document was read in.
    assert steps <= rows[3][1].chunks + 2 and batch.reading_ids == (2,)
    _finish(batch, rows)
    assert rows[2][1].chunks == alone[2].chunks > 10
    for i in chats:
        _assert_same_up_to_a_near_tie(alone[i], rows[i][1], alone_logits[i], logits[i])


@pytest.mark.parametrize("changed", [False, True])
@pytest.mark.parametrize(("share", "decoded"), [(0.5, 11), (0.75, 4), (1.0, 0)])
def test_beside_answers_the_reads_and_the_decoding_take_turns_by_their_share(
        tiny, share: float, decoded: int, changed: bool) -> None:
    loaded = tiny["llama"]
    now = [0.0]

    def clock() -> float:  # a second passes at each look at the clock
        now[0] += 1.0
        return now[0]

    batch = BatchDecoder(loaded.model, clock=clock, read_share=0.25 if changed else share)
    if changed:  # as the app's Settings change it under way
        batch.set_read_share(share)
    answering = Session("answering", loaded, "q8", chunk_size=CHUNK)
    answer = Answer()
    batch.join(answering, _messages(1), replace(GREEDY, max_tokens=500), request_id=1,
               cancel=answer.cancel, emit=answer.emit, tick=lambda: None)
    while not answer.tokens:
        batch.step()
    reader = Session("reader", loaded, "q6", chunk_size=CHUNK)
    forward = reader.forward

    def slow_forward(*args: Any, **kwargs: Any) -> Any:  # a chunk takes ten seconds
        now[0] += 10.0
        return forward(*args, **kwargs)

    reader.forward = slow_forward  # type: ignore[method-assign]
    document = Answer()
    batch.join(reader, [{"role": "user", "content": CORPUS * 2}], GREEDY, request_id=2,
               cancel=document.cancel, emit=document.emit, tick=lambda: None)
    reads = []
    for _ in range(25):
        made, chunks = len(answer.tokens), document.chunks
        batch.step()
        assert len(answer.tokens) == made + 1  # the answer goes on at every step
        reads.append(document.chunks - chunks)
    # A chunk's step took 11 s; then the steps of 1 s that give the reads their
    # share decode before the next chunk (as many as the chunk took at 0.5).
    assert reads == [int(step % (decoded + 1) == 0) for step in range(25)]
    # Its progress says the share it has (for the time left), and times no chunk:
    # a decode pass ran in each one's time too.
    assert {(p.read_share, p.chunk_seconds) for p in document.progress} == {(share, 0.0)}
    answer.cancel.set()  # nothing answers now: the read takes every step
    batch.step()
    for _ in range(3):
        chunks = document.chunks
        batch.step()
        assert document.chunks == chunks + 1
        alone = document.progress[-1]
        assert alone.read_share == 1.0 and alone.chunk_seconds > 0


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5, float("nan")])
def test_a_share_of_the_time_the_reads_cannot_take_is_refused(tiny, share: float) -> None:
    with pytest.raises(EngineError, match="above 0 and at most 1"):
        BatchDecoder(tiny["llama"].model, read_share=share)


def test_a_session_joins_one_batch_of_its_own_model_once(tiny) -> None:
    batch = BatchDecoder(tiny["llama"].model)
    session, _ = _join(batch, tiny["llama"], "q8", _messages(0), GREEDY, request_id=1)
    with pytest.raises(EngineError, match="answering already"):
        batch.join(session, _messages(0), GREEDY, request_id=2, cancel=threading.Event(),
                   emit=lambda _: None, tick=lambda: None)
    other = Session("other", tiny["qwen3_next"], "q8")
    with pytest.raises(EngineError, match="same model"):
        batch.join(other, _messages(0), GREEDY, request_id=3, cancel=threading.Event(),
                   emit=lambda _: None, tick=lambda: None)
    assert batch.reading_ids == (1,)


def test_a_row_out_of_pages_ends_as_alone_and_the_others_go_on(tiny, monkeypatch) -> None:
    loaded = tiny["llama"]
    long = replace(GREEDY, max_tokens=200)

    def tight(name: str) -> Session:
        # 3 fp16 pages of 16 tokens (8 KiB each on the tiny llama); the up-front
        # clamp bypassed, so the pool itself runs out mid-answer.
        session = Session(name, loaded, "fp16", page_size=16, budget_bytes=3 * 8192)
        monkeypatch.setattr(session, "room_for", lambda count: 10_000)
        return session

    alone = Answer()
    alone_session = tight("alone")
    alone.reason, _ = alone_session.chat(_messages(0), long, request_id=1, cancel=alone.cancel,
                                         emit=alone.emit, tick=lambda: None)
    other_alone = _alone(loaded, "q8", _messages(1), GREEDY, request_id=2)
    batch = BatchDecoder(loaded.model)
    session, answer = tight("batched"), Answer()
    batch.join(session, _messages(0), long, request_id=1, cancel=answer.cancel,
               emit=answer.emit, tick=lambda: None)
    rows = {1: (session, answer), 2: _join(batch, loaded, "q8", _messages(1), GREEDY, 2)}
    _finish(batch, rows)
    assert alone.reason == answer.reason == "length"
    assert answer.tokens == alone.tokens and 0 < len(answer.tokens) < 200
    assert len(session.tokens) == len(alone_session.tokens) == 48  # 3 pages, all held
    assert adapter.cache_tokens(session.cache) == 48
    assert rows[2][1].tokens == other_alone.tokens


class _SetsAside:
    """The runtime's idle chats as a batch sees them: ``make_room`` sets the one
    idle chat aside (its pages gone) when the conversation does not fit without."""

    def __init__(self, session: Session) -> None:
        self.session, self.set_aside_for = session, []

    def idle(self, keep: Any) -> list[str]:
        return [] if self.session.session_id in keep else [self.session.session_id]

    def make_room(self, fits: Any, keep: Any, request_id: int) -> bool:
        if self.session.session_id not in keep and self.session.tokens:
            self.session.close()
            self.set_aside_for.append(request_id)
        return fits(frozenset())


@pytest.mark.parametrize("freed", ["closed", "set aside", "never"])
def test_a_row_short_of_a_page_waits_while_another_answer_may_give_pages_back(
        tiny, logits, monkeypatch, freed: str) -> None:
    loaded = tiny["llama"]
    alone = _alone(loaded, "fp16", _messages(0), GREEDY, request_id=0)
    alone_logits = logits.pop(0)
    guard = _tight_guard(64 * 2**20)  # one memory for both, as the app's chats have
    sessions = {i: Session(f"batch-{i}", loaded, "fp16", guard=guard) for i in (0, 1)}
    room = _SetsAside(sessions[1])
    batch = BatchDecoder(loaded.model, room=room if freed == "set aside" else None)
    answers = {i: Answer() for i in sessions}
    for i, session in sessions.items():
        batch.join(session, _messages(i), GREEDY, request_id=i, cancel=answers[i].cancel,
                   emit=answers[i].emit, tick=lambda: None)
    # Once answering, row 0's pages are full (another chat's pool grew into the room
    # its admission counted) until request 1's chat gives its pages back (closed when
    # its answer ends, as the server's are, or set aside once idle, as the app's
    # chats are), or for good.
    ensure = adapter.ensure_capacity

    def full_for_row_0(cache: Any, tokens: int) -> None:
        answering = len(answers[0].tokens) >= 2
        given_back = not sessions[1].tokens and freed != "never"
        if cache is sessions[0].cache and answering and not given_back:
            raise KvBudgetExceeded(f"no page for {tokens} more")
        ensure(cache, tokens)

    monkeypatch.setattr(adapter, "ensure_capacity", full_for_row_0)
    held_when_1_ended = 0

    def on_end(request_id: int) -> None:
        nonlocal held_when_1_ended
        if request_id == 1:
            held_when_1_ended = len(answers[0].tokens)
            if freed != "set aside":
                sessions[1].close()

    paused: list[tuple[Waiting, ...]] = []
    ended = _run_to_the_end(batch, sessions, answers, on_end,
                            after_step=lambda _: paused.append(batch.paused))
    assert ended == [1, 0] and held_when_1_ended < len(alone.tokens)  # it waited
    # It said so while it waited, and not once it went on or ended.
    page = human_bytes(sessions[0].page_size * sessions[0].kv_token_bytes)
    assert set(paused) == {(), (Waiting(0, (
        f"Waiting for memory: this answer's next page ({page}) does not fit in what "
        "the KV budget leaves; it goes on when another answer ends."),
        sessions[0].page_size * sessions[0].kv_token_bytes),)}
    assert paused[-1] == ()
    if freed == "never":  # nothing gives pages back: it ends as alone out of pages would
        assert answers[0].reason == "length"
        assert answers[0].tokens == alone.tokens[:len(answers[0].tokens)]
        assert len(answers[0].tokens) == held_when_1_ended
        return
    # Then it goes on as alone, up to near-ties.
    _assert_same_up_to_a_near_tie(alone, answers[0], alone_logits, logits[0])
    assert room.set_aside_for == ([0] if freed == "set aside" else [])


def test_a_row_that_ends_as_it_is_paused_is_not_said_to_wait(tiny, monkeypatch) -> None:
    loaded = tiny["llama"]
    guard = _tight_guard(64 * 2**20)
    sessions = {i: Session(f"batch-{i}", loaded, "fp16", guard=guard) for i in (0, 1)}
    # Row 0's first token ends its answer, whatever it is.
    sessions[0].end_ids = set(range(loaded.model.args.vocab_size))
    batch = BatchDecoder(loaded.model)
    answers = {i: Answer() for i in sessions}
    for i, session in sessions.items():
        batch.join(session, _messages(i), GREEDY, request_id=i, cancel=answers[i].cancel,
                   emit=answers[i].emit, tick=lambda: None)
    ensure = adapter.ensure_capacity

    def full_once_row_0_is_fed(cache: Any, tokens: int) -> None:
        fed = batch._queued is not None and any(row.session is sessions[0]
                                                for row in batch._queued.rows)
        if cache is sessions[0].cache and fed:  # its next pass finds no page
            raise KvBudgetExceeded(f"no page for {tokens} more")
        ensure(cache, tokens)

    monkeypatch.setattr(adapter, "ensure_capacity", full_once_row_0_is_fed)
    said_to_wait_after_its_end: list[Waiting] = []

    def after_step(ended: list[int]) -> None:
        said_to_wait_after_its_end.extend(wait for wait in batch.paused
                                          if wait.request_id in ended)

    ended = _run_to_the_end(batch, sessions, answers, lambda request_id: None, after_step)
    assert ended[0] == 0 and answers[0].reason == "stop"
    assert said_to_wait_after_its_end == []


class _SetsAsideWhenItFits:
    """``HeldSessions.make_room`` over one idle chat: it is set aside only when the
    conversation fits without it and not with it."""

    def __init__(self, session: Session) -> None:
        self.session, self.set_aside_for = session, []

    def idle(self, keep: Any) -> list[str]:
        held = self.session.session_id not in keep and self.session.tokens
        return [self.session.session_id] if held else []

    def make_room(self, fits: Any, keep: Any, request_id: int) -> bool:
        if fits(frozenset()):
            return True
        idle = self.idle(keep)
        if not idle or not fits(frozenset(idle)):
            return False
        self.session.reset()
        self.set_aside_for.append(request_id)
        return fits(frozenset())


def test_a_row_out_of_pages_at_a_page_boundary_has_an_idle_chat_set_aside(tiny) -> None:
    loaded = tiny["llama"]
    guard = _tight_guard(GB)
    sessions = {i: Session(f"batch-{i}", loaded, "fp16", page_size=16, guard=guard)
                for i in (0, 1)}
    room = _SetsAsideWhenItFits(sessions[1])
    # A clock that stands still reads a chunk every step: where row 0 stands when
    # chat 1 ends is then the same on any machine, however long a step takes.
    batch = BatchDecoder(loaded.model, room=room, clock=lambda: 0.0)
    answers = {i: Answer() for i in sessions}
    for i, sampling in ((0, replace(GREEDY, max_tokens=40)), (1, replace(GREEDY, max_tokens=2))):
        batch.join(sessions[i], _messages(i), sampling, request_id=i,
                   cancel=answers[i].cancel, emit=answers[i].emit, tick=lambda: None)

    def tighten(ended: list[int]) -> None:
        # Once chat 1 is idle, the KV budget drops to the pages held (a lower
        # budget in Settings): row 0 keeps only the slots it has, chat 1's pages
        # stand in its way until set aside.
        if 1 in ended and guard.budget_bytes == GB and "batch-1" not in batch.session_ids():
            guard.budget_bytes = guard.held_bytes()
            guard.refresh("batch-0")

    _run_to_the_end(batch, sessions, answers, lambda i: None, after_step=tighten)
    # Where row 0's next token needs a page past the last the pass fed it, the
    # idle chat goes, and the answer runs to its limit as alone.
    assert room.set_aside_for == [0]
    assert answers[0].reason == "length" and len(answers[0].tokens) == 40


def test_a_read_stopped_midway_leaves_with_its_chunks_held(tiny) -> None:
    loaded = tiny["llama"]
    document = [{"role": "user", "content": CORPUS * 2}]
    batch = BatchDecoder(loaded.model)
    session, answer = Session("reading", loaded, "q8", chunk_size=CHUNK), Answer()
    batch.join(session, document, GREEDY, request_id=7, cancel=answer.cancel,
               emit=answer.emit, tick=lambda: None)
    for _ in range(3):
        assert batch.step() == []
    answer.cancel.set()
    (result,) = batch.step()
    assert (result.request_id, result.finish, result.token) == (7, "cancelled", None)
    assert isinstance(result.error, Cancelled) and result.error.kept_tokens == 3 * CHUNK
    assert len(session.tokens) == 3 * CHUNK and batch.idle


def _tight_guard(budget_bytes: int) -> MemoryGuard:
    """A guard whose KV budget is ``budget_bytes`` on a machine where the pages it
    counts take free RAM as they would (free RAM is not what runs short here)."""
    guard: MemoryGuard

    def probe() -> MemoryReading:
        return MemoryReading(16 * GB, 8 * GB - guard.held_bytes())

    guard = MemoryGuard(budget_bytes=budget_bytes, headroom_bytes=GB, probe=probe)
    return guard


def _run_to_the_end(batch: BatchDecoder, sessions: dict[int, Session],
                    answers: dict[int, Answer], on_end: Callable[[int], None],
                    after_step: Callable[[list[int]], None] = lambda ended: None,
                    ) -> list[int]:
    """Step ``batch`` until idle: each ending's reason and held tokens go to its
    ``answers`` entry, then ``on_end`` gets its request; ``after_step`` sees the
    requests ended so far after each step. The requests in the order they ended."""
    ended: list[int] = []
    while not batch.idle:
        for result in batch.step():
            if result.finish is None:
                continue
            ended.append(result.request_id)
            answers[result.request_id].reason = result.finish
            answers[result.request_id].held = len(sessions[result.request_id].tokens)
            on_end(result.request_id)
        after_step(ended)
    return ended


def _pages_bytes(session: Session, messages, extra: int) -> int:
    """Bytes of the pages ``messages`` and ``extra`` more tokens take in ``session``."""
    ids = session.prompt(messages, add_generation_prompt=True).ids
    return session.fit_report(len(ids) + extra).for_mode(session.mode).bytes_needed


def test_a_conversation_waits_for_memory_and_joins_when_an_answer_ends(tiny, logits) -> None:
    loaded = tiny["llama"]
    alone = {i: _alone(loaded, "fp16", _messages(i), GREEDY, request_id=i, page_size=16)
             for i in (1, 3, 0)}
    alone_logits = {i: logits.pop(i) for i in alone}
    # Holds request 1's conversation and answer, or request 3's, not both at once.
    guard = _tight_guard(200 * 1024)
    sessions = {i: Session(f"batch-{i}", loaded, "fp16", page_size=16, guard=guard)
                for i in (1, 3, 0, 2)}
    first = _pages_bytes(sessions[1], _messages(1), 1 + GREEDY.max_tokens)
    assert first <= guard.budget_bytes < first + _pages_bytes(sessions[3], _messages(3), 1)
    batch = BatchDecoder(loaded.model)
    answers = {i: Answer() for i in sessions}
    for i, session in sessions.items():
        batch.join(session, _messages(i), GREEDY, request_id=i, cancel=answers[i].cancel,
                   emit=answers[i].emit, tick=lambda: None)
    # Request 1 is read in; 3 waits for its pages, 0 and 2 wait their turn behind it:
    # each answer's pages up to its length limit are counted, so neither would run
    # out of pages beside the other sooner than alone.
    assert batch.reading_ids == (1,)
    answer = GREEDY.max_tokens
    short = (_pages_bytes(sessions[1], _messages(1), answer)
             + _pages_bytes(sessions[3], _messages(3), answer) - guard.budget_bytes)
    behind = (f"Waiting for memory: the conversation before it needs {human_bytes(short)} "
              "more than the KV budget leaves; it starts after that one.")
    assert [(w.request_id, w.reason, w.behind) for w in batch.waiting] == [
        (3, f"Waiting for memory: {human_bytes(short)} more is needed than the KV budget "
            "leaves; it starts when another answer ends.", None),
        (0, behind, 3), (2, behind, 3),
    ]
    answers[2].cancel.set()
    assert [(r.request_id, r.token, r.finish) for r in batch.step()] == [(2, None, "cancelled")]

    def until_1_ends(ended: list[int]) -> None:
        if 1 not in ended:
            assert [w.request_id for w in batch.waiting] == [3, 0]
            assert batch.request_ids in ((), (1,))

    # A request that ends closes its conversation (as the server's do): its pages go
    # back to the budget.
    ended = _run_to_the_end(batch, sessions, answers, lambda i: sessions[i].close(),
                            after_step=until_1_ends)
    assert ended[0] == 1 and sorted(ended[1:]) == [0, 3]
    for i in (1, 3, 0):
        _assert_same_up_to_a_near_tie(alone[i], answers[i], alone_logits[i], logits[i])


def test_answers_admitted_side_by_side_never_wait_for_pages_they_were_counted(
        tiny, logits) -> None:
    loaded = tiny["llama"]
    alone = {i: _alone(loaded, "fp16", _messages(i), GREEDY, request_id=i, page_size=16)
             for i in (1, 3)}
    alone_logits = {i: logits.pop(i) for i in alone}
    probe = Session("probe", loaded, "fp16", page_size=16)
    # The budget holds both conversations and their answers to their limits, and
    # not a page more: a pool that grew ahead of its tokens into it would take
    # pages counted for the other answer.
    guard = _tight_guard(sum(_pages_bytes(probe, _messages(i), GREEDY.max_tokens)
                             for i in (1, 3)))
    sessions = {i: Session(f"batch-{i}", loaded, "fp16", page_size=16, guard=guard)
                for i in (1, 3)}
    batch = BatchDecoder(loaded.model)
    answers = {i: Answer() for i in sessions}
    for i, session in sessions.items():
        batch.join(session, _messages(i), GREEDY, request_id=i, cancel=answers[i].cancel,
                   emit=answers[i].emit, tick=lambda: None)
    assert batch.waiting == ()  # both joined at once
    paused: list[tuple[int, ...]] = []
    _run_to_the_end(batch, sessions, answers, lambda i: None, after_step=lambda _: paused.append(
        tuple(wait.request_id for wait in batch.paused)))
    assert set(paused) == {()}
    for i in (1, 3):
        assert answers[i].reason == "length"
        _assert_same_up_to_a_near_tie(alone[i], answers[i], alone_logits[i], logits[i])
    # Once their answers ended their pages may grow as alone again.
    assert all(guard.refresh(f"batch-{i}") == guard.kv_share(f"batch-{i}") for i in (1, 3))


@pytest.mark.parametrize("spare_pages", [0, -1])
def test_a_chat_sharing_a_documents_pages_answers_beside_another_as_counted(
        tiny, logits, spare_pages: int) -> None:
    loaded = tiny["llama"]
    document = [{"role": "user", "content": CORPUS[:700]}]
    asking = [*document, {"role": "assistant", "content": "Read."},
              {"role": "user", "content": "And the first line?"}]
    other = _messages(3)
    alone = {1: _alone(loaded, "fp16", asking, GREEDY, request_id=1, page_size=16),
             3: _alone(loaded, "fp16", other, GREEDY, request_id=3, page_size=16)}
    alone_logits = {i: logits.pop(i) for i in alone}
    probe = Session("probe", loaded, "fp16", page_size=16)
    read = len(probe.render(document, add_generation_prompt=False))
    page = probe.fit_report(16).for_mode("fp16").bytes_needed
    asked = len(probe.prompt(asking, add_generation_prompt=True).ids) + GREEDY.max_tokens
    # The document's pages, then the asking chat's own past the ones it shares
    # whole (the document's partial last page it copies), and the other chat's:
    # the budget holds that and not a page more, or one page less.
    own = -(-asked // 16) - read // 16
    budget = ((-(-read // 16) + own + spare_pages) * page
              + _pages_bytes(probe, other, GREEDY.max_tokens))
    guard = _tight_guard(budget)
    donor = Session("donor", loaded, "fp16", page_size=16, guard=guard)
    donor.ingest(document, request_id=0, cancel=threading.Event(), emit=lambda _: None,
                 tick=lambda: None)
    sessions = {i: Session(f"batch-{i}", loaded, "fp16", page_size=16, guard=guard)
                for i in (1, 3)}
    prompt = sessions[1].render(asking, add_generation_prompt=False)
    found = reuse.best_offer(sessions[1], [donor], prompt, keep_last=False)
    assert found is not None and reuse.adopt(sessions[1], found) == len(donor.tokens) == read
    batch = BatchDecoder(loaded.model)
    answers = {i: Answer() for i in sessions}
    for i, messages in ((1, asking), (3, other)):
        batch.join(sessions[i], messages, GREEDY, request_id=i, cancel=answers[i].cancel,
                   emit=answers[i].emit, tick=lambda: None)
    # A page short, the other chat waits for the first answer to end (counted as
    # the other chats' pages in the shared store and the copy the asking chat
    # makes, not as the store's bytes it already has).
    assert [w.request_id for w in batch.waiting] == ([] if spare_pages == 0 else [3])
    paused: list[tuple[int, ...]] = []
    ended = _run_to_the_end(batch, sessions, answers, lambda i: None,
                            after_step=lambda _: paused.append(
                                tuple(wait.request_id for wait in batch.paused)))
    # The shared pages' growth kept to what was counted: the other chat's read
    # never found its pages taken, and no answer waited for a page.
    assert set(paused) == {()} and ended[0] == 1
    _assert_same_up_to_a_near_tie(alone[1], answers[1], alone_logits[1], logits[1])
    if spare_pages == 0:
        _assert_same_up_to_a_near_tie(alone[3], answers[3], alone_logits[3], logits[3])
    else:  # the asking chat keeps its pages: the other answers as far as the rest holds
        assert answers[3].reason == "length" and 0 < len(answers[3].tokens) < GREEDY.max_tokens
        assert answers[3].tokens == alone[3].tokens[:len(answers[3].tokens)]


class _OtherRank:
    """A pipeline's other machine as rank 0's sessions see it: it follows every
    command at once and holds one conversation's share beside another only when
    ``full`` says it has room."""

    needs_checkpoints = False
    batches = True

    def __init__(self, full: Any) -> None:
        self.full = full
        self.asked = 0
        self.counts: list[int] = []  # the tokens each ask said the session will hold
        self.coming: list[dict[str, int]] = []  # what each ask said the others may add
        self.rows: list[int] = []  # the decode step's rows each ask said it joins
        self.held: list[int] = []  # the tokens each session's pages were held to there

    def room(self, token_count: int, mode: str, coming: Any = None,
             decode_rows: int = 0) -> int:
        self.asked += 1
        self.counts.append(token_count)
        self.coming.append(dict(coming or {}))
        self.rows.append(decode_rows)
        if self.full():
            raise MachineShort(f"rank 1 (mac2) holds only a few tokens in {mode}.",
                               "rank 1 (mac2)")
        return 1 << 20

    def hold_to(self, tokens: int) -> None:
        self.held.append(tokens)

    def decoding(self, model: Any) -> Any:
        return model

    def decoding_rows(self, model: Any, links: Any) -> Any:
        return model

    def machines(self, *args: Any) -> tuple:
        return ()

    def prefill(self, *args: Any) -> None:
        pass

    checkpoint = rewind = prefill

    def reset(self) -> None:
        pass

    close = reset


def test_a_conversation_another_machine_cannot_hold_yet_waits_for_it(tiny) -> None:
    loaded = tiny["llama"]
    done: list[int] = []
    first: Session | None = None
    rank = _OtherRank(lambda: first is not None and bool(first.tokens) and 1 not in done)
    first = Session("first", loaded, "q8", page_size=16, chunk_size=CHUNK, followers=rank)
    second = Session("second", loaded, "fp16", page_size=16, followers=rank)
    now = [0.0]
    batch = BatchDecoder(loaded.model, clock=lambda: now[0])
    # An answer limit that ends mid-page, so what is counted there is whole pages.
    longer = replace(GREEDY, max_tokens=40)
    batch.join(first, _messages(1), longer, request_id=1, cancel=threading.Event(),
               emit=lambda _: None, tick=lambda: None)
    batch.step()  # its first chunk: the other machine now holds its share
    answer = Answer()
    batch.join(second, _messages(0), GREEDY, request_id=2, cancel=answer.cancel,
               emit=answer.emit, tick=lambda: None)
    # This machine holds both; the other one not yet: it waits, saying for which.
    assert [(w.request_id, w.reason, w.short_bytes) for w in batch.waiting] == [
        (2, "Waiting for memory on rank 1 (mac2): its share of this conversation does "
            "not fit beside the other answers yet; it starts when another answer ends.", 0)]
    # Asked for its read and its answer up to its length limit, as here; the first
    # conversation's read, not done yet, and its answer count there in its own mode.
    asked_for = len(second.prompt(_messages(0), add_generation_prompt=True).ids)
    assert rank.counts[-1] == asked_for + GREEDY.max_tokens
    first_ids = len(first.prompt(_messages(1), add_generation_prompt=True).ids)
    # In whole pages past the one its held tokens fill, as pages take room there.
    pages = -(-(first_ids + longer.max_tokens) // 16) - -(-len(first.tokens) // 16)
    assert rank.coming[-1] == {"q8": pages * 16}
    assert rank.rows[-1] == 2  # beside the first one's row, as here
    asked = rank.asked
    for _ in range(3):  # nothing changed beside it: the other machine is not asked again
        batch.step()
    assert rank.asked == asked and batch.waiting
    now[0] += ASK_AGAIN_S  # but after a while (other programs may have freed memory)
    batch.step()
    assert rank.asked == asked + 1 and batch.waiting
    while not batch.idle:
        for result in batch.step():
            if result.finish is not None:
                done.append(result.request_id)
        if 1 not in done:
            assert batch.waiting and answer.tokens == []
    # It joined once the first answer ended, and answered as alone; there, each
    # conversation's pages were held to what it was counted for.
    assert done == [1, 2]
    assert {first_ids + longer.max_tokens, asked_for + GREEDY.max_tokens} <= set(rank.held)
    assert answer.tokens == _alone(loaded, "fp16", _messages(0), GREEDY, request_id=3,
                                   page_size=16).tokens


def test_a_conversation_that_could_never_fit_is_refused_as_alone(tiny) -> None:
    loaded = tiny["llama"]
    long = _messages(1)
    budget = 100 * 1024
    alone = Session("alone", loaded, "fp16", page_size=16, guard=_tight_guard(budget))
    with pytest.raises(ContextTooLong) as refused_alone:
        alone.chat(long, GREEDY, request_id=9, cancel=threading.Event(),
                   emit=lambda _: None, tick=lambda: None)
    guard = _tight_guard(budget)
    batch = BatchDecoder(loaded.model)
    answering = Session("answering", loaded, "fp16", page_size=16, guard=guard)
    batch.join(answering, _messages(0), GREEDY, request_id=1, cancel=threading.Event(),
               emit=lambda _: None, tick=lambda: None)
    for _ in range(3):
        batch.step()
    assert batch.request_ids == (1,) and guard.held_bytes() > 0
    session = Session("long", loaded, "fp16", page_size=16, guard=guard)
    with pytest.raises(ContextTooLong) as refused:
        batch.join(session, long, GREEDY, request_id=2, cancel=threading.Event(),
                   emit=lambda _: None, tick=lambda: None)
    assert str(refused.value) == str(refused_alone.value)
    assert batch.waiting == () and batch.reading_ids == () and batch.request_ids == (1,)


def test_a_conversation_that_fits_once_a_waiting_chat_is_idle_waits_for_it(
        tiny, monkeypatch) -> None:
    from engine.session import batch as batch_module

    loaded = tiny["llama"]
    long = _messages(1)
    probe = Session("probe", loaded, "fp16", page_size=16)
    guard = _tight_guard(_pages_bytes(probe, long, 1))  # the long one alone, no more
    batch = BatchDecoder(loaded.model)
    batch.join(Session("answering", loaded, "fp16", page_size=16, guard=guard), _messages(0),
               GREEDY, request_id=1, cancel=threading.Event(), emit=lambda _: None,
               tick=lambda: None)
    batch.step()
    held = Session("held", loaded, "fp16", page_size=16, guard=guard)
    held.ingest(_messages(3), request_id=0, cancel=threading.Event(), emit=lambda _: None,
                tick=lambda: None)
    room_for = batch_module.BatchDecoder._room_for
    monkeypatch.setattr(batch_module.BatchDecoder, "_room_for", lambda self, joining: (
        batch_module._Short(bytes=1) if joining.request_id == 2 else room_for(self, joining)))
    batch.join(held, _messages(3), GREEDY, request_id=2, cancel=threading.Event(),
               emit=lambda _: None, tick=lambda: None)
    # The long conversation fits only without the waiting chat's pages: alone, that
    # chat would have answered and be idle by its turn, and set aside for it.
    batch.join(Session("long", loaded, "fp16", page_size=16, guard=guard), long, GREEDY,
               request_id=3, cancel=threading.Event(), emit=lambda _: None, tick=lambda: None)
    assert [wait.request_id for wait in batch.waiting] == [2, 3]


def test_a_conversation_waits_for_free_ram_as_for_the_budget(tiny) -> None:
    loaded = tiny["llama"]
    alone = _alone(loaded, "fp16", _messages(3), GREEDY, request_id=3, page_size=16)
    guard: MemoryGuard
    free = [8 * GB]  # bytes free after the headroom, with no page held

    def probe() -> MemoryReading:
        return MemoryReading(16 * GB, GB + free[0] - guard.held_bytes())

    guard = MemoryGuard(headroom_bytes=GB, probe=probe)
    sessions = {i: Session(f"batch-{i}", loaded, "fp16", page_size=16, guard=guard)
                for i in (1, 3)}
    reading_in = sessions[1].prefill_facts.transient_bytes(sessions[1].chunk_size)
    # Free RAM holds request 1's pages and answer beside a chunk's read, and one
    # more page (8 KiB in fp16 here), not request 3's pages too: the RAM limit,
    # not a KV budget, keeps 3 waiting.
    free[0] = (reading_in + _pages_bytes(sessions[1], _messages(1), 1 + GREEDY.max_tokens)
               + 8192)
    batch = BatchDecoder(loaded.model)
    answers = {i: Answer() for i in sessions}
    for i, session in sessions.items():
        batch.join(session, _messages(i), GREEDY, request_id=i, cancel=answers[i].cancel,
                   emit=answers[i].emit, tick=lambda: None)
    (waiting,) = batch.waiting
    assert waiting.request_id == 3 and waiting.short_bytes > 0
    assert waiting.reason == (f"Waiting for memory: {human_bytes(waiting.short_bytes)} more "
                              "is needed than is free; it starts when another answer ends.")
    while not batch.idle:
        for result in batch.step():
            if result.finish is not None:
                answers[result.request_id].reason = result.finish
                sessions[result.request_id].close()
                assert result.request_id == 1 or answers[1].reason is not None
    assert answers[1].reason == "length" and answers[3].tokens == alone.tokens


def test_a_waiting_conversation_still_short_when_the_batch_ends_is_refused_as_alone(
        tiny) -> None:
    loaded = tiny["llama"]
    guard = _tight_guard(200 * 1024)
    first = Session("first", loaded, "fp16", page_size=16, guard=guard)
    batch = BatchDecoder(loaded.model)
    batch.join(first, _messages(1), GREEDY, request_id=1, cancel=threading.Event(),
               emit=lambda _: None, tick=lambda: None)
    waiting = Session("waiting", loaded, "fp16", page_size=16, guard=guard)
    batch.join(waiting, _messages(3), GREEDY, request_id=3, cancel=threading.Event(),
               emit=lambda _: None, tick=lambda: None)
    assert [w.request_id for w in batch.waiting] == [3]
    # The first conversation stays open after its answer: its pages stay held, so
    # the waiting one gets what it would get asked alone beside it.
    ended = batch.run()
    assert [(r.request_id, r.finish) for r in ended] == [(1, "length"), (3, "error")]
    with pytest.raises(ContextTooLong) as alone:
        waiting.chat(_messages(3), GREEDY, request_id=4, cancel=threading.Event(),
                     emit=lambda _: None, tick=lambda: None)
    assert isinstance(ended[1].error, ContextTooLong)
    assert str(ended[1].error) == str(alone.value) and batch.idle


class _IdleChat:
    """A Room holding one idle session outside the batch; setting it aside drops
    its pages (the runtime's ``HeldSessions`` also stores them first)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.asked: list[tuple[frozenset[str], int]] = []

    def idle(self, keep: Any) -> list[str]:
        name = self.session.session_id
        return [name] if self.session.tokens and name not in keep else []

    def make_room(self, fits: Any, keep: Any, request_id: int) -> bool:
        self.asked.append((frozenset(keep), request_id))
        if fits(frozenset()):
            return True
        if not self.idle(keep) or not fits(frozenset(self.idle(keep))):
            return False
        self.session.reset()
        return fits(frozenset())


def test_an_idle_session_in_the_way_is_set_aside_and_the_conversation_joins_at_once(
        tiny) -> None:
    loaded = tiny["llama"]
    alone = {i: _alone(loaded, "fp16", _messages(i), GREEDY, request_id=i, page_size=16)
             for i in (1, 0)}

    def setup(room: bool) -> tuple[BatchDecoder, dict[int, Session], _IdleChat]:
        guard = _tight_guard(2**30)
        idle = Session("idle", loaded, "fp16", page_size=16, guard=guard)
        idle.chat(_messages(3), GREEDY, request_id=9, cancel=threading.Event(),
                  emit=lambda _: None, tick=lambda: None)
        sessions = {i: Session(f"batch-{i}", loaded, "fp16", page_size=16, guard=guard)
                    for i in (1, 0)}
        # Request 1's pages and answer fit beside the idle chat; request 0's too
        # only with the idle chat's pages gone.
        first = _pages_bytes(sessions[1], _messages(1), 1 + GREEDY.max_tokens)
        guard.budget_bytes = guard.held_bytes() + first + 2 * 1024
        assert _pages_bytes(sessions[0], _messages(0), 1) > 2 * 1024
        chat = _IdleChat(idle)
        return BatchDecoder(loaded.model, room=chat if room else None), sessions, chat

    batch, sessions, chat = setup(room=False)
    for i in (1, 0):
        batch.join(sessions[i], _messages(i), GREEDY, request_id=i, cancel=threading.Event(),
                   emit=lambda _: None, tick=lambda: None)
    assert [w.request_id for w in batch.waiting] == [0] and chat.session.tokens

    batch, sessions, chat = setup(room=True)
    answers = {i: Answer() for i in sessions}
    for i, session in sessions.items():
        batch.join(session, _messages(i), GREEDY, request_id=i, cancel=answers[i].cancel,
                   emit=answers[i].emit, tick=lambda: None)
    assert batch.waiting == () and batch.reading_ids == (1, 0)
    assert not chat.session.tokens
    # Asked for room with every session the batch holds kept out of it.
    assert chat.asked[-1] == (frozenset({"batch-1", "batch-0"}), 0)
    for result in batch.run():
        answers[result.request_id].reason = result.finish
    for i in (1, 0):
        assert answers[i].tokens == alone[i].tokens and answers[i].reason == alone[i].reason
