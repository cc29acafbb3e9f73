"""Checkpoints of layers that cannot trim: the store's bounds, copies that never alias,
and sessions on hybrid (qwen3_next) and sliding-window (gemma3_text) models that
regenerate, edit, cancel and recover from a failed chunk without re-reading what they
held."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

from engine.cache import adapter
from engine.errors import Cancelled, InsufficientMemory
from engine.events import IngestProgress, TokenChunk
from engine.session import checkpoints
from engine.session.checkpoints import Checkpoint, CheckpointStore
from engine.session.sampling import SamplingParams
from engine.session.session import Session
from tests.engine.tinymodels import load_tiny_model, make_tiny_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
QUESTION = "What is the capital of France? The quick brown fox jumps over the lazy dog."
DOCUMENT = ("A paged cache holds pages of 256 tokens. Each page stores codes and scales "
            "for the keys and values of every head. ") * 6
ALL = ("llama", "qwen3_next", "gemma3_text")
UNTRIMMABLE = ("qwen3_next", "gemma3_text")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SimpleNamespace]:
    root = tmp_path_factory.mktemp("checkpoint-models")
    return {arch: load_tiny_model(make_tiny_model_dir(root, arch)) for arch in ALL}


class Recorder:
    """Collects events; sets ``cancel`` once ``cancel_after`` progress events came."""

    def __init__(self, cancel_after: int | None = None) -> None:
        self.events: list[Any] = []
        self.cancel = threading.Event()
        self.cancel_after = cancel_after

    def __call__(self, event: object) -> None:
        self.events.append(event)
        progress = [e for e in self.events if isinstance(e, IngestProgress)]
        if self.cancel_after is not None and len(progress) >= self.cancel_after:
            self.cancel.set()

    def ids(self) -> list[int]:
        return [i for e in self.events if isinstance(e, TokenChunk) for i in e.token_ids]


def _chat(session: Session, messages, recorder: Recorder | None = None,
          sampling: SamplingParams = GREEDY) -> tuple[str, Recorder]:
    recorder = recorder or Recorder()
    reason, _ = session.chat(messages, sampling, request_id=1, cancel=recorder.cancel,
                             emit=recorder, tick=lambda: None)
    return reason, recorder


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def _fresh_answer(loaded: SimpleNamespace, messages, **kwargs: Any) -> list[int]:
    return _chat(Session("fresh", loaded, "fp16", **kwargs), messages)[1].ids()


def _feed(session: Session, ids: list[int], boundaries: list[int] | None = None) -> None:
    """Prefill ``ids`` past what the session holds of them."""
    kept = session.sync(ids, keep_last=False)
    session.prefill(ids[kept:], request_id=0, cancel=threading.Event(),
                    emit=lambda e: None, tick=lambda: None, boundaries=boundaries)


def _next_logits(session: Session, prompt: list[int]) -> mx.array:
    """Logits after ``prompt``: syncs the session to it and feeds the last token."""
    _feed(session, prompt[:-1])
    logits = session.model(mx.array(prompt[-1:])[None], cache=session.cache)[0, -1]
    session.tokens.append(prompt[-1])
    mx.eval(logits)
    return logits


# -- the store -------------------------------------------------------------------


def _mark(tokens: int, boundary: bool) -> Checkpoint:
    return Checkpoint(tokens, (), boundary, 0)


def test_store_keeps_the_newest_boundaries_and_one_chunk_end() -> None:
    store = CheckpointStore(max_boundaries=2)
    for tokens, boundary in [(0, True), (8, False), (16, False), (20, True), (28, False),
                             (35, True), (40, False)]:
        store.add(_mark(tokens, boundary))
    assert [(c.tokens, c.boundary) for c in store.kept] == [(20, True), (35, True),
                                                             (40, False)]
    assert store.at_most(39).tokens == 35 and store.at_most(19) is None
    store.drop_after(36)
    assert [c.tokens for c in store.kept] == [20, 35]
    store.add(_mark(35, False))  # same count: replaced, not duplicated
    assert [(c.tokens, c.boundary) for c in store.kept] == [(20, True), (35, False)]


def test_store_keeps_the_end_of_the_longest_message_past_newer_boundaries() -> None:
    store = CheckpointStore(max_boundaries=2)
    # A 900-token document, then short turns: its end outlives their boundaries.
    for tokens, boundary in [(0, True), (512, False), (900, True), (930, True), (960, True),
                             (990, True), (1004, False), (1010, True)]:
        store.add(_mark(tokens, boundary))
    assert [(c.tokens, c.boundary) for c in store.kept] == [
        (900, True), (990, True), (1004, False), (1010, True)]
    store.drop_after(950)  # an edit of the question after the document
    assert [c.tokens for c in store.kept] == [900]
    for tokens in (1200, 1210, 1220):  # new turns: a 240-token message is no longer
        store.add(_mark(tokens, True))
    assert [c.tokens for c in store.kept] == [900, 1210, 1220]
    store.add(_mark(2300, True))  # a 1,080-token message is: its end is kept now
    store.add(_mark(2310, True))
    store.add(_mark(2320, True))
    assert [c.tokens for c in store.kept] == [2300, 2310, 2320]


def test_a_checkpoint_survives_in_place_updates_of_the_layers() -> None:
    arrays = ArraysCache(size=2)
    arrays[0] = mx.ones((1, 3, 4))
    arrays[1] = mx.full((1, 2, 4, 4), 2.0)
    window = RotatingKVCache(max_size=4)
    for step in range(6):  # wraps: no longer trimmable
        window.update_and_fetch(mx.full((1, 1, 1, 2), float(step)),
                                mx.full((1, 1, 1, 2), float(-step)))
    cache = [arrays, window]
    store = CheckpointStore()
    store.add(checkpoints.take(cache, 6, boundary=True))
    before = [mx.array(a) for a in (arrays[0], arrays[1], window.keys, window.values)]
    assert store.newest().nbytes == sum(a.nbytes for a in before)

    arrays[0] = arrays[0] * 5  # how mlx-lm's linear attention writes its state
    arrays[1][..., 0] = 7.0
    window.update_and_fetch(mx.full((1, 1, 1, 2), 9.0), mx.full((1, 1, 1, 2), -9.0))
    # Nothing can trim, so going back to 6 tokens restores the checkpoint.
    assert checkpoints.rewind(cache, 6, store) == 6
    after = (arrays[0], arrays[1], window.keys, window.values)
    assert all(mx.array_equal(a, b).item() for a, b in zip(before, after, strict=True))
    assert window.offset == 6
    # Restored state is a copy too: writing into it leaves the checkpoint alone.
    window.update_and_fetch(mx.full((1, 1, 1, 2), 3.0), mx.full((1, 1, 1, 2), -3.0))
    assert checkpoints.rewind(cache, 6, store) == 6
    assert mx.array_equal(window.keys, before[2]).item()
    assert checkpoints.rewind(cache, 5, store) is None  # nothing that far back


def test_only_models_with_unpaged_layers_need_checkpoints(models) -> None:
    needs = {arch: checkpoints.needs_checkpoints(Session("s", models[arch], "q8").cache)
             for arch in ALL}
    assert needs == {"llama": False, "qwen3_next": True, "gemma3_text": True}


# -- sessions --------------------------------------------------------------------


@pytest.mark.parametrize("arch", UNTRIMMABLE)
def test_regenerate_reingests_nothing_and_answers_like_a_fresh_session(models, arch) -> None:
    loaded = models[arch]
    session = Session("s", loaded, "fp16")
    messages = _user(QUESTION)
    first = _chat(session, messages)[1].ids()
    before = session.tokens_ingested
    again = _chat(session, messages)[1].ids()  # regenerate: the answer is trimmed
    # The prompt was held up to its last token (which goes with decoding).
    assert session.tokens_ingested == before
    assert again == first == _fresh_answer(loaded, messages)
    assert adapter.cache_tokens(session.cache) == len(session.tokens)
    # What the checkpoints hold is in the predicted prefill peak.
    held = session.checkpoints.nbytes
    assert held > 0 and len(session.checkpoints.kept) <= checkpoints.MAX_KEPT
    peak = session.prefill_peak_bytes()
    session.checkpoints.clear()
    assert peak - session.prefill_peak_bytes() == held


@pytest.mark.parametrize("arch", UNTRIMMABLE)
def test_follow_up_that_diverges_in_the_answer_reingests_only_the_answer(models, arch):
    # A template that hides earlier reasoning renders the last answer differently
    # from what was generated: the held ids diverge inside the answer.
    loaded = models[arch]
    session = Session("s", loaded, "fp16", chunk_size=16)
    first = _user(QUESTION)
    _chat(session, first)
    asked = session.render(first, add_generation_prompt=True)
    follow = [*first, {"role": "assistant", "content": "It is Paris."}, *_user("And Spain?")]
    prompt = session.render(follow, add_generation_prompt=True)
    before = session.tokens_ingested
    answer = _chat(session, follow)[1].ids()
    # Re-read from the first prompt's end: the answer as rendered and the new turn.
    assert session.tokens_ingested - before == len(prompt) - len(asked)
    assert len(prompt) - len(asked) < len(prompt) // 2
    assert answer == _fresh_answer(loaded, follow, chunk_size=16)
    # Fed with the same chunk cuts, a fresh session's logits are the same bits: the
    # restored state is exactly what the first prompt left.
    fresh = Session("fresh", loaded, "fp16", chunk_size=16)
    _feed(fresh, asked[:-1])
    rendered = fresh.prompt(follow, add_generation_prompt=True)
    _feed(fresh, prompt[:-1], fresh._boundaries(rendered, len(asked) - 1))
    expected = _next_logits(fresh, prompt)
    got = _next_logits(session, prompt)
    assert mx.array_equal(got, expected).item()


@pytest.mark.parametrize("arch", UNTRIMMABLE)
def test_editing_the_last_message_goes_back_only_to_its_start(models, arch) -> None:
    loaded = models[arch]
    session = Session("s", loaded, "q8", chunk_size=16)
    history = [*_user(QUESTION), {"role": "assistant", "content": "Paris."}]
    _chat(session, [*history, *_user("And Spain? " + QUESTION)])
    edited = [*history, *_user("And Italy? " + QUESTION)]
    start = len(session.render(history, add_generation_prompt=False))
    prompt = session.render(edited, add_generation_prompt=True)
    before = session.tokens_ingested
    answer = _chat(session, edited)[1].ids()
    assert session.tokens_ingested - before == len(prompt) - 1 - start
    fresh = Session("fresh", loaded, "q8", chunk_size=16)
    assert answer == _chat(fresh, edited)[1].ids()


@pytest.mark.parametrize("arch", ALL)
def test_cancel_keeps_the_ingested_prefix_and_the_next_send_continues(models, arch) -> None:
    loaded = models[arch]
    session = Session("s", loaded, "q8", page_size=16, chunk_size=8)
    messages = _user(DOCUMENT)
    prompt = session.render(messages, add_generation_prompt=True)
    recorder = Recorder(cancel_after=3)
    with pytest.raises(Cancelled) as stopped:
        _chat(session, messages, recorder)
    done = [e.tokens_done for e in recorder.events if isinstance(e, IngestProgress)]
    assert not recorder.ids()
    # Three chunks were read and stay held: not rewound to a message boundary.
    assert len(session.tokens) == done[-1] == 24
    assert (stopped.value.kept_tokens, stopped.value.total_tokens) == (24, len(prompt))
    assert session.tokens == prompt[:24]
    assert adapter.cache_tokens(session.cache) == 24
    before = session.tokens_ingested
    answer = _chat(session, messages)[1].ids()
    assert session.tokens_ingested - before == len(prompt) - 1 - 24
    fresh = Session("fresh", loaded, "q8", page_size=16, chunk_size=8)
    assert answer == _chat(fresh, messages)[1].ids()


class FailingModel:
    """The model, whose ``fail_at``-th call runs (layers change) and then fails."""

    def __init__(self, model: Any, fail_at: int, error: Exception) -> None:
        self.model = model
        self.calls = 0
        self.fail_at = fail_at
        self.error = error

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        out = self.model(*args, **kwargs)
        if self.calls == self.fail_at:
            raise self.error
        return out


@pytest.mark.parametrize("arch", ALL)
@pytest.mark.parametrize("error", [MemoryError(),
                                   RuntimeError("[malloc] Unable to allocate 4294967296 bytes")])
def test_a_failed_allocation_keeps_the_chunks_that_finished(models, arch, error) -> None:
    loaded = models[arch]
    session = Session("s", loaded, "q6", page_size=16, chunk_size=8)
    messages = _user(DOCUMENT)
    prompt = session.render(messages, add_generation_prompt=True)
    session.model = FailingModel(loaded.model, fail_at=4, error=error)
    with pytest.raises(InsufficientMemory) as raised:
        _chat(session, messages)
    assert f"kept 24 of {len(prompt):,} tokens" in str(raised.value)
    assert session.tokens == prompt[:24] and adapter.cache_tokens(session.cache) == 24
    assert (raised.value.kept_tokens, raised.value.total_tokens) == (24, len(prompt))
    session.model = loaded.model
    answer = _chat(session, messages)[1].ids()
    fresh = Session("fresh", loaded, "q6", page_size=16, chunk_size=8)
    assert answer == _chat(fresh, messages)[1].ids()


def test_an_unexpected_error_mid_prefill_rolls_back_and_is_raised(models) -> None:
    loaded = models["qwen3_next"]
    session = Session("s", loaded, "fp16", chunk_size=8)
    session.model = FailingModel(loaded.model, fail_at=2, error=ValueError("bug"))
    with pytest.raises(ValueError, match="bug"):
        _chat(session, _user(DOCUMENT))
    assert len(session.tokens) == 8 == adapter.cache_tokens(session.cache)


@pytest.mark.parametrize("arch", ALL)
def test_a_failed_decode_step_goes_back_to_the_prompt_not_to_empty(models, arch) -> None:
    loaded = models[arch]
    session = Session("s", loaded, "q8", chunk_size=8)
    messages = _user(DOCUMENT)
    prompt = session.render(messages, add_generation_prompt=True)
    chunks = -(-(len(prompt) - 1) // 8)
    session.model = FailingModel(loaded.model, fail_at=chunks + 3, error=ValueError("bug"))
    with pytest.raises(ValueError, match="bug"):
        _chat(session, messages)
    # Paged layers trim to what every layer holds; the others go back to the
    # checkpoint at the prompt's end.
    held = len(session.tokens)
    assert held >= len(prompt) - 1 and session.tokens[: len(prompt) - 1] == prompt[:-1]
    assert arch == "llama" or held == len(prompt) - 1
    assert adapter.cache_tokens(session.cache) == held
    session.model = loaded.model
    before = session.tokens_ingested
    answer = _chat(session, messages)[1].ids()
    assert session.tokens_ingested == before  # the prompt stayed held
    assert answer == _chat(Session("fresh", loaded, "q8", chunk_size=8), messages)[1].ids()
