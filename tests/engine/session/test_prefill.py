"""Chunked prefill on a pipeline: the next chunk goes to the other ranks before
rank 0 runs its own layers of the current one, and a chunk sent ahead is read; a
read run a chunk at a time sends ahead only while its caller allows it."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest

from engine.cache import adapter
from engine.errors import Cancelled, KvBudgetExceeded
from engine.events import IngestProgress
from engine.session.prefill import Chunk
from engine.session.session import Session
from tests.engine.tinymodels import load_tiny_model, make_tiny_model_dir

TEXT = "The quick brown fox jumps over the lazy dog. " * 6


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    return load_tiny_model(make_tiny_model_dir(tmp_path_factory.mktemp("prefill-models"),
                                               "qwen3_next"))


class Followers:
    """A pipeline's other ranks as rank 0's session sees them, each command logged."""

    needs_checkpoints = False

    def __init__(self, log: list[tuple[Any, ...]]) -> None:
        self.log = log

    def prefill(self, chunk: Chunk, position: int) -> None:
        self.log.append(("sent", position, len(chunk.ids), chunk.boundary))

    def checkpoint(self, boundary: bool, position: int) -> None:
        self.log.append(("checkpoint", position, boundary))

    def rewind(self, length: int, kept: int) -> None:
        self.log.append(("rewind", kept))

    def reset(self) -> None:
        self.log.append(("reset",))

    def close(self) -> None:
        pass


class Stage:
    """Rank 0's own layers: logs each forward pass with the position it starts at."""

    def __init__(self, model: Any, session: Session, log: list[tuple[Any, ...]]) -> None:
        self.model, self.session, self.log = model, session, log

    def __call__(self, inputs: Any, cache: list[Any]) -> Any:
        self.log.append(("stage", len(self.session.tokens), inputs.shape[1]))
        return self.model(inputs, cache=cache)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def _rank0(loaded: SimpleNamespace, log: list[tuple[Any, ...]]) -> Session:
    session = Session("s", loaded, "q8", page_size=16, chunk_size=8, followers=Followers(log))
    session.model = Stage(session.model, session, log)
    return session


def _prefill(session: Session, ids: list[int], cancel_after: int = 0) -> list[IngestProgress]:
    cancel, progress = threading.Event(), []

    def emit(event: object) -> None:
        if isinstance(event, IngestProgress):
            progress.append(event)
            if len(progress) == cancel_after:
                cancel.set()

    session.prefill(ids, request_id=1, cancel=cancel, emit=emit, tick=lambda: None,
                    boundaries=[13])
    return progress


def test_each_chunk_is_sent_before_rank_0_runs_the_one_before(hybrid) -> None:
    log: list[tuple[Any, ...]] = []
    session = _rank0(hybrid, log)
    ids = hybrid.tokenizer.encode(TEXT)[:40]
    _prefill(session, ids)
    sent = [entry for entry in log if entry[0] == "sent"]
    stages = [entry for entry in log if entry[0] == "stage"]
    # The plan's chunks, each sent once, in order, ending at the boundary and the end.
    assert [(p, n) for _, p, n, _ in sent] == [(0, 8), (8, 5), (13, 3), (16, 8), (24, 8),
                                               (32, 8)]
    assert [b for *_, b in sent] == [False, True, False, False, False, True]
    assert [(p, n) for _, p, n in stages] == [(p, n) for _, p, n, _ in sent]
    for index in range(1, len(sent)):
        assert log.index(sent[index]) < log.index(stages[index - 1])
    # The chunks' commands carry their checkpoints: only the read's start has its own.
    assert [entry for entry in log if entry[0] == "checkpoint"] == [("checkpoint", 0, True)]
    assert session.tokens == ids and adapter.cache_tokens(session.cache) == len(ids)
    assert session.checkpoints.newest().tokens == len(ids)  # rank 0's own hybrid layers


def test_a_stop_reads_the_chunk_already_sent_and_the_ranks_agree(hybrid) -> None:
    log: list[tuple[Any, ...]] = []
    session = _rank0(hybrid, log)
    ids = hybrid.tokenizer.encode(TEXT)[:40]
    with pytest.raises(Cancelled) as stopped:
        _prefill(session, ids, cancel_after=2)
    sent = [(p, n) for kind, p, n, *_ in log if kind == "sent"]
    # Stopped after chunk 2, with chunk 3 already on the other ranks: it is read too.
    assert sent == [(0, 8), (8, 5), (13, 3)]
    assert stopped.value.kept_tokens == len(session.tokens) == 16
    assert session.tokens == ids[:16]


def test_pages_that_cannot_hold_the_next_chunk_keep_it_from_being_sent(hybrid) -> None:
    log: list[tuple[Any, ...]] = []
    probe = Session("probe", hybrid, "q8", page_size=16)
    page = probe.kv_token_bytes * 16  # one page in every paged layer: 16 tokens
    session = Session("s", hybrid, "q8", page_size=16, chunk_size=8, budget_bytes=page,
                      followers=Followers(log))
    session.model = Stage(session.model, session, log)
    ids = hybrid.tokenizer.encode(TEXT)[:40]
    with pytest.raises(KvBudgetExceeded) as refused:
        _prefill(session, ids)
    # Chunk 3 fits the page left and went ahead; chunk 4 needs a second page: it
    # was neither sent ahead nor, refused, sent at all.
    assert [(p, n) for kind, p, n, *_ in log if kind == "sent"] == [(0, 8), (8, 5), (13, 3)]
    assert refused.value.kept_tokens == len(session.tokens) == 16



def test_a_read_a_chunk_at_a_time_sends_ahead_only_while_its_caller_allows(hybrid) -> None:
    ids = hybrid.tokenizer.encode(TEXT)[:40]

    def read(ahead: Any = None) -> tuple[list[bool], list[tuple[Any, ...]]]:
        log: list[tuple[Any, ...]] = []
        session = _rank0(hybrid, log)
        extra = {} if ahead is None else {"ahead": ahead}
        steps = session.prefill_chunks(ids, request_id=1, cancel=threading.Event(),
                                       emit=lambda event: None, tick=lambda: None,
                                       boundaries=[13], **extra)
        said = []
        while True:
            try:
                said.append(next(steps))
            except StopIteration:
                break
        assert session.tokens == ids
        return said, log

    # By default (a batch's reads, with its passes between the chunks): never
    # ahead, each chunk sent just before rank 0 runs it.
    said, log = read()
    assert not any(said)
    order = [(kind, position) for kind, position, *_ in log if kind in ("sent", "stage")]
    assert order == [(kind, p) for p in (0, 8, 13, 16, 24, 32) for kind in ("sent", "stage")]
    # A caller that stops allowing it after the second chunk: the third chunk was
    # sent ahead (said after the second), and nothing after it.
    asked = iter([True, True, False, False, False])
    said, log = read(lambda: next(asked))
    assert said == [True, True, False, False, False, False]
    sent = [entry for entry in log if entry[0] == "sent"]
    stages = [entry for entry in log if entry[0] == "stage"]
    assert log.index(sent[2]) < log.index(stages[1])
    assert log.index(stages[2]) < log.index(sent[3])
