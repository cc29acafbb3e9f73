"""A document is read once: a session takes the prefix another open chat holds."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine.cache.paged_cache import PagedKVCache
from engine.session import reuse
from engine.session.session import Session
from tests.engine.tinymodels import loaded_for_session, make_tiny_model_dir

PAGE = 16
DOC = "The quick brown fox jumps over the lazy dog. Longleaf pines grow in sand. " * 6
QUESTION = "What is the capital of France?"
OTHER = "Summarise this document, please."


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SimpleNamespace]:
    root = tmp_path_factory.mktemp("reuse-models")
    # 16k: room for the 6k-token document and a question.
    return {arch: loaded_for_session(make_tiny_model_dir(root, arch), max_context=16384)
            for arch in ("llama", "qwen3_next")}


def _session(loaded: SimpleNamespace, name: str, mode: str = "fp16", **kwargs: Any) -> Session:
    return Session(name, loaded, mode, page_size=PAGE, **kwargs)


def _user(*texts: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text} for text in texts]


def _ingest(session: Session, messages: list[dict[str, str]]) -> int:
    stats = session.ingest(messages, request_id=1, cancel=threading.Event(),
                           emit=lambda e: None, tick=lambda: None)
    return stats.prefill_tokens


def _share(session: Session, others: list[Session], messages) -> int:
    prompt = session.render(messages, add_generation_prompt=False)
    found = reuse.best_offer(session, others, prompt, keep_last=False)
    return 0 if found is None else reuse.adopt(session, found)


def _next_logits(session: Session, token: int = 5) -> np.ndarray:
    """Logits after one more token (the session's cache moves on by it)."""
    logits = session.model(mx.array([[token]]), cache=session.cache)[0, -1]
    session.tokens.append(token)
    return np.array(logits.astype(mx.float32))


def _close(a: np.ndarray, b: np.ndarray) -> bool:
    # The reused prefix was computed in other chunks than a full read's: float noise.
    return float(np.max(np.abs(a - b))) <= 1e-3 * float(np.max(np.abs(b)))


def _assert_answers_like_a_full_read(loaded: SimpleNamespace, session: Session, messages) -> None:
    alone = _session(loaded, "alone")
    _ingest(alone, messages)
    assert session.tokens == alone.tokens
    assert _close(_next_logits(session), _next_logits(alone))


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_the_second_chat_reads_only_what_differs_and_answers_alike(models, arch):
    loaded = models[arch]
    first = _session(loaded, "a")
    _ingest(first, _user(DOC))
    second = _session(loaded, "b")
    messages = _user(DOC, QUESTION)
    taken = _share(second, [first], messages)
    assert taken == len(first.tokens)
    prompt = second.render(messages, add_generation_prompt=False)
    assert _ingest(second, messages) == len(prompt) - taken
    _assert_answers_like_a_full_read(loaded, second, messages)
    # The donor is untouched.
    again = _session(loaded, "d")
    _ingest(again, _user(DOC))
    assert _close(_next_logits(first), _next_logits(again))


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_chats_that_part_midway_reuse_up_to_where_their_layers_can(models, arch):
    loaded = models[arch]
    first = _session(loaded, "a")
    _ingest(first, _user(DOC, QUESTION))
    second = _session(loaded, "b")
    messages = _user(DOC, OTHER)
    prompt = second.render(messages, add_generation_prompt=False)
    taken = _share(second, [first], messages)
    if arch == "llama":  # every layer paged: up to the first differing token
        parted = next(i for i, (x, y) in enumerate(zip(first.tokens, prompt, strict=False))
                      if x != y)
        assert taken == parted
    else:  # linear attention: back to the donor's checkpoint at the document's end
        document = len(first.render(_user(DOC), add_generation_prompt=False))
        checkpoint = first.checkpoints.at_most(document)
        assert checkpoint is not None and taken == checkpoint.tokens > 0
        # Every checkpoint of the donor up to there too: an edit further back
        # rewinds to its own boundary, not to the start.
        assert ([kept.tokens for kept in second.checkpoints.kept]
                == [kept.tokens for kept in first.checkpoints.kept if kept.tokens <= taken])
    _ingest(second, messages)
    _assert_answers_like_a_full_read(loaded, second, messages)


def test_a_hybrid_chat_lends_its_document_after_several_turns(models):
    """Each turn adds message boundaries; the one that ends the document, the
    longest message, is kept past them, so a new chat on it reads none of it."""
    loaded = models["qwen3_next"]
    first = _session(loaded, "a", chunk_size=64)
    turns = _user(DOC)
    for question in (QUESTION, OTHER, "And the pines?", "Thank you, and the dog?"):
        turns += [*_user(question), {"role": "assistant", "content": "Noted."}]
        _ingest(first, turns)
    document = len(first.render(_user(DOC), add_generation_prompt=False))
    second = _session(loaded, "b")
    messages = _user(DOC, "Who jumps?")
    assert document - PAGE < _share(second, [first], messages) <= document
    _ingest(second, messages)
    _assert_answers_like_a_full_read(loaded, second, messages)


def test_rotated_chats_share_pages_and_answer_exactly_as_one_that_read_in_the_same_steps(models):
    loaded = models["llama"]
    first = _session(loaded, "a", mode="q6", rotate=True)
    _ingest(first, _user(DOC))
    second = _session(loaded, "b", mode="q6", rotate=True)
    messages = _user(DOC, QUESTION)
    assert _share(second, [first], messages) == len(first.tokens)
    _ingest(second, messages)
    # The same chunks as the two chats together: the same stored rows, so the same
    # logits up to the order the attention sums pages in (they sit in other slots).
    steps = _session(loaded, "c", mode="q6", rotate=True)
    _ingest(steps, _user(DOC))
    _ingest(steps, messages)
    expected = _next_logits(steps)
    np.testing.assert_allclose(_next_logits(second), expected, rtol=0,
                               atol=1e-5 * float(np.max(np.abs(expected))))


def test_other_modes_rotations_and_short_prefixes_are_not_reused(models):
    loaded = models["llama"]
    first = _session(loaded, "a", mode="q8", rotate=False)
    _ingest(first, _user(DOC))
    messages = _user(DOC, QUESTION)
    for other in (_session(loaded, "b", mode="q4"), _session(loaded, "c", mode="q8", rotate=True)):
        assert _share(other, [first], messages) == 0 and other.tokens == []
    # A prefix shorter than a page is not worth a reuse.
    short = _session(loaded, "d", mode="q8", rotate=False)
    assert _share(short, [first], _user("The quick", QUESTION)) == 0
    # A session already holding as much keeps its own.
    held = _session(loaded, "e", mode="q8", rotate=False)
    _ingest(held, _user(DOC))
    assert _share(held, [first], messages) == 0


# -- one document held once --------------------------------------------------------

BOOK = " ".join(f"Line {i}: the longleaf pine keeps its needles for two years." for i in range(152))
BOOK_PAGE = 64


def _book_session(loaded: SimpleNamespace, name: str) -> Session:
    return Session(name, loaded, "q8", page_size=BOOK_PAGE, rotate=False)


def _slots(session: Session) -> list[set[int]]:
    return [set(c.block_table) for c in session.cache if isinstance(c, PagedKVCache)]


def _slab_bytes(session: Session) -> int:
    stores = {id(c.store): c.store for c in session.cache if isinstance(c, PagedKVCache)}
    return sum(a.nbytes for s in stores.values() for a in s.arrays())


def test_two_chats_on_one_6k_token_document_hold_its_pages_once(models):
    loaded = models["llama"]
    first = _book_session(loaded, "a")
    _ingest(first, _user(BOOK))
    held = len(first.tokens)
    assert held >= 6000 and held % BOOK_PAGE  # its last page is partly filled
    second = _book_session(loaded, "b")
    messages = _user(BOOK, QUESTION)
    assert _share(second, [first], messages) == held
    prompt = second.render(messages, add_generation_prompt=False)
    assert _ingest(second, messages) == len(prompt) - held  # only what differs is read
    # One copy of the document's full pages, plus each chat's own pages.
    layers = zip(_slots(first), _slots(second), strict=True)
    page_bytes = next(c for c in first.cache if isinstance(c, PagedKVCache)).store.layout.page_bytes
    shared_pages = held // BOOK_PAGE
    own_second = -(-len(prompt) // BOOK_PAGE) - shared_pages
    for mine, theirs in layers:
        assert len(mine & theirs) == shared_pages and len(theirs - mine) == own_second
    stats = second.stats()
    assert stats.shared_bytes == shared_pages * page_bytes * len(_slots(first))
    stores = [c.store for c in second.cache if isinstance(c, PagedKVCache)]
    in_use = sum(s.in_use for s in stores) * page_bytes
    assert in_use == (shared_pages + 1 + own_second) * page_bytes * len(stores)
    alone = _book_session(loaded, "c")
    _ingest(alone, messages)
    # Measured from the storage: both chats take less than the one that read alone
    # plus the document again.
    assert _slab_bytes(second) == second.stats().bytes_allocated
    assert _slab_bytes(second) < _slab_bytes(alone) + shared_pages * page_bytes * len(stores)
    assert stats.bytes_once + first.stats().bytes_once == in_use
    # Both answer as the chat that read everything itself; writing on in one (the
    # second copied the document's partly filled last page) leaves the other alone.
    expected_second = _next_logits(alone)
    assert _close(_next_logits(first), _next_logits(_solo(loaded, BOOK)))
    assert _close(_next_logits(second), expected_second)
    # Closing the first keeps the second's pages and frees only the first's own.
    second.trim_to(len(prompt))
    first.close()
    assert sum(s.in_use for s in stores) == (shared_pages + own_second) * len(stores)
    assert second.stats().shared_bytes == 0
    assert _close(_next_logits(second), expected_second)


def _solo(loaded: SimpleNamespace, text: str) -> Session:
    session = _book_session(loaded, "solo")
    _ingest(session, _user(text))
    return session


def test_a_chat_whose_next_pass_is_queued_lends_its_state_only_as_of_a_checkpoint(models):
    from engine.cache.paged_cache import cache_tokens
    from engine.session.batch import BatchDecoder
    from engine.session.prefill import Chunk
    from engine.session.sampling import SamplingParams

    loaded = models["qwen3_next"]
    donor = _session(loaded, "donor")
    batch = BatchDecoder(loaded.model)
    batch.join(donor, _user(QUESTION), SamplingParams(temperature=0.0, max_tokens=64,
                                                      speculative="off"),
               request_id=1, cancel=threading.Event(), emit=lambda e: None, tick=lambda: None)
    for _ in range(6):
        batch.step()
    # Answering in the batch: its linear-attention state already holds the token
    # the queued pass feeds, one past the tokens it holds.
    assert cache_tokens(donor.cache) == len(donor.tokens) + 1
    found = reuse.offer(donor, len(donor.tokens))
    assert found is None or found.tokens < len(donor.tokens)
    if found is not None:  # what it lends is what a read of those tokens holds
        taker = _session(loaded, "taker")
        assert reuse.adopt(taker, found) == found.tokens
        fresh = _session(loaded, "fresh")
        fresh.forward(Chunk(donor.tokens[:found.tokens], True))
        assert _close(_next_logits(taker), _next_logits(fresh))
    batch.run()
