"""Sessions on tiny models: greedy parity with mlx-lm, reuse of held tokens,
chunked and cancellable ingest, streamed generation and context limits."""

from __future__ import annotations

import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from engine.cache import adapter
from engine.errors import Cancelled, ContextTooLong
from engine.events import IngestProgress, TokenChunk
from engine.session.prefill import chunk_plan
from engine.session.prompt_ids import common_prefix
from engine.session.sampling import AnswerStream, SamplingParams
from engine.session.session import Session
from tests.engine.tinymodels import load_tiny_model, make_tiny_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=24)
QUESTION = "What is the capital of France? The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SimpleNamespace]:
    root = tmp_path_factory.mktemp("session-models")
    return {
        arch: load_tiny_model(make_tiny_model_dir(root, arch))
        for arch in ("llama", "qwen3", "qwen3_next", "gemma3_text")
    }


class Recorder:
    """Collects events; optionally sets ``cancel`` after the n-th event of a type."""

    def __init__(self, cancel_after: tuple[type, int] | None = None) -> None:
        self.events: list[Any] = []
        self.cancel = threading.Event()
        self.cancel_after = cancel_after

    def __call__(self, event: object) -> None:
        self.events.append(event)
        if self.cancel_after and len(self.of(self.cancel_after[0])) >= self.cancel_after[1]:
            self.cancel.set()

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]

    def ids(self) -> list[int]:
        return [i for chunk in self.of(TokenChunk) for i in chunk.token_ids]


def _chat(session: Session, messages, sampling=GREEDY, recorder: Recorder | None = None):
    recorder = recorder or Recorder()
    reason, stats = session.chat(
        messages, sampling, request_id=1, cancel=recorder.cancel, emit=recorder, tick=lambda: None
    )
    return reason, stats, recorder


def _mlx_lm_greedy(loaded: SimpleNamespace, prompt: list[int], max_tokens: int) -> list[int]:
    out = []
    for token, _ in generate_step(mx.array(prompt), loaded.model, max_tokens=max_tokens):
        if token in loaded.tokenizer.eos_token_ids:
            break
        out.append(token)
    return out


def _user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_next", "gemma3_text"])
def test_fp16_greedy_matches_mlx_lm_generate(models, arch: str) -> None:
    loaded = models[arch]
    session = Session("s", loaded, "fp16")
    reason, stats, rec = _chat(session, _user(QUESTION))
    prompt = session.render(_user(QUESTION), add_generation_prompt=True)
    assert rec.ids() == _mlx_lm_greedy(loaded, prompt, GREEDY.max_tokens)
    assert reason == "length" and stats.generated_tokens == GREEDY.max_tokens
    assert stats.prompt_tokens == len(prompt) and stats.time_to_first_token is not None
    assert stats.prefill_tps > 0 and stats.decode_tps > 0
    # The cache holds exactly the ids the session says it holds.
    assert adapter.cache_tokens(session.cache) == len(session.tokens)
    assert session.tokens[: len(prompt)] == prompt


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_multi_chunk_prefill_gives_the_same_tokens(models, arch: str) -> None:
    loaded = models[arch]
    messages = _user(QUESTION * 3)
    session = Session("s", loaded, "fp16", page_size=16, chunk_size=16)
    _, _, rec = _chat(session, messages)
    prompt = session.render(messages, add_generation_prompt=True)
    progress = rec.of(IngestProgress)
    assert len(progress) == -(-(len(prompt) - 1) // 16)
    assert rec.ids() == _mlx_lm_greedy(loaded, prompt, GREEDY.max_tokens)


def test_ingest_progress_counts_up_to_the_total(models) -> None:
    session = Session("s", models["llama"], "q8", page_size=16, chunk_size=10)
    rec = Recorder()
    stats = session.ingest(_user(QUESTION * 2), request_id=7, cancel=rec.cancel, emit=rec,
                           tick=lambda: None)
    progress = rec.of(IngestProgress)
    total = len(session.render(_user(QUESTION * 2), add_generation_prompt=False))
    assert [p.tokens_done for p in progress] == [min(total, 10 * i) for i in
                                                 range(1, len(progress) + 1)]
    assert all(p.tokens_total == total and p.request_id == 7 for p in progress)
    assert progress[-1].eta_seconds == 0 and all(p.tokens_per_second > 0 for p in progress)
    assert stats.prompt_tokens == total and session.tokens_ingested == total


def _answer_text(rec: Recorder) -> str:
    return "".join(chunk.text for chunk in rec.of(TokenChunk))


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_three_turn_chat_reprefills_nothing_it_holds(models, arch: str) -> None:
    session = Session("s", models[arch], "q6")
    messages = _user(QUESTION)
    previous_prompt: list[int] = []
    for turn in range(3):
        prompt = session.render(messages, add_generation_prompt=True)
        held = list(session.tokens)
        reusable = common_prefix(held, prompt)
        # Everything the previous turn's prompt shares with this one is still held.
        assert reusable >= common_prefix(previous_prompt, prompt)
        before = session.tokens_ingested
        _, _, rec = _chat(session, messages, SamplingParams(temperature=0.0, max_tokens=8))
        # Only the tokens not held are fed; the prompt's last token goes with decoding.
        assert session.tokens_ingested - before == len(prompt) - 1 - reusable
        if turn:
            assert reusable > len(previous_prompt) // 2
        previous_prompt = prompt
        messages = [*messages, {"role": "assistant", "content": _answer_text(rec)},
                    {"role": "user", "content": f"Turn {turn + 2}: tell me more."}]


def test_ingested_conversation_is_extended_not_reingested(models) -> None:
    session = Session("s", models["llama"], "q4")
    history = [*_user(QUESTION), {"role": "assistant", "content": "The capital is Paris."}]
    rec = Recorder()
    session.ingest(history, request_id=1, cancel=rec.cancel, emit=rec, tick=lambda: None)
    held = len(session.tokens)
    assert session.tokens_ingested == held
    messages = [*history, *_user("And of Germany?")]
    _chat(session, messages)
    prompt = session.render(messages, add_generation_prompt=True)
    assert session.tokens_ingested == len(prompt) - 1  # nothing ingested twice


@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "gemma3_text"])
def test_regenerate_and_edit_trim_and_answer_like_a_fresh_session(models, arch: str) -> None:
    loaded = models[arch]
    session = Session("s", loaded, "fp16")
    first = _chat(session, _user(QUESTION))[2].ids()
    before = session.tokens_ingested
    again = _chat(session, _user(QUESTION))[2].ids()  # regenerate: trims the answer
    assert again == first
    if arch == "llama":  # trimmable: the prompt was not ingested again
        assert session.tokens_ingested == before
    edited = _user(QUESTION.replace("France", "Spain"))
    answer = _chat(session, edited)[2].ids()
    assert answer == _chat(Session("fresh", loaded, "fp16"), edited)[2].ids()
    assert adapter.cache_tokens(session.cache) == len(session.tokens)


def test_mismatched_retokenization_is_trimmed_and_stays_correct(models) -> None:
    loaded = models["qwen3"]
    session = Session("s", loaded, "fp16")
    _chat(session, _user(QUESTION))
    messages = [*_user(QUESTION), {"role": "assistant", "content": " odd  spacing\n"},
                *_user("Again?")]
    prompt = session.render(messages, add_generation_prompt=True)
    assert common_prefix(session.tokens, prompt) < len(session.tokens)  # must trim
    answer = _chat(session, messages)[2].ids()
    assert answer == _chat(Session("fresh", loaded, "fp16"), messages)[2].ids()


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_cancelled_ingest_keeps_the_chunks_read_and_a_usable_session(models, arch) -> None:
    loaded = models[arch]
    session = Session("s", loaded, "q8", page_size=16, chunk_size=8)
    messages = [*_user(QUESTION), {"role": "assistant", "content": "Paris."},
                *_user(QUESTION * 2)]
    _chat(session, messages[:1], SamplingParams(temperature=0.0, max_tokens=2))
    rec = Recorder(cancel_after=(IngestProgress, 2))
    with pytest.raises(Cancelled) as stopped:
        _chat(session, messages, recorder=rec)
    assert not rec.of(TokenChunk)
    prompt = session.render(messages, add_generation_prompt=True)
    assert (stopped.value.kept_tokens, stopped.value.total_tokens) == (len(session.tokens),
                                                                       len(prompt))
    kept = session.sync(prompt, keep_last=True)  # what the two chunks left held
    assert kept == len(session.tokens) == stopped.value.kept_tokens
    assert session.tokens == prompt[:kept] and kept > len(prompt) // 3
    assert adapter.cache_tokens(session.cache) == len(session.tokens)
    answer = _chat(session, messages)[2].ids()
    assert answer == _chat(Session("fresh", loaded, "q8", page_size=16), messages)[2].ids()


def test_ingest_cancelled_before_start_raises_and_changes_nothing(models) -> None:
    session = Session("s", models["llama"], "fp16")
    rec = Recorder()
    rec.cancel.set()
    with pytest.raises(Cancelled):
        session.ingest(_user(QUESTION), request_id=1, cancel=rec.cancel, emit=rec,
                       tick=lambda: None)
    assert session.tokens == [] and adapter.cache_tokens(session.cache) == 0


def test_generation_cancels_between_tokens(models) -> None:
    session = Session("s", models["qwen3"], "fp16")  # its greedy answer is printable
    rec = Recorder(cancel_after=(TokenChunk, 2))
    reason, stats, _ = _chat(session, _user(QUESTION), SamplingParams(temperature=0.0,
                                                                      max_tokens=200),
                             recorder=rec)
    assert reason == "cancelled" and stats.generated_tokens <= 3
    assert adapter.cache_tokens(session.cache) == len(session.tokens)


def test_stops_on_end_of_turn_without_streaming_it(models) -> None:
    loaded = models["gemma3_text"]  # its greedy answer varies, so a stop token can be picked
    prompt = Session("p", loaded, "fp16").render(_user(QUESTION), add_generation_prompt=True)
    reference = _mlx_lm_greedy(loaded, prompt, 24)
    stop_at = next(i for i, t in enumerate(reference) if t not in reference[:i] and i > 0)
    session = Session("s", loaded, "fp16")
    session.end_ids = frozenset({reference[stop_at]})
    reason, stats, rec = _chat(session, _user(QUESTION))
    assert reason == "stop" and rec.ids() == reference[:stop_at]
    assert stats.generated_tokens == stop_at
    # The end-of-turn token was fed, so the next turn's template extends the cache.
    assert session.tokens[-1] == reference[stop_at]


def test_sampling_with_a_seed_is_reproducible(models) -> None:
    sampling = SamplingParams(temperature=1.0, top_k=20, top_p=0.9, min_p=0.05,
                              repetition_penalty=1.3, max_tokens=12, seed=11)
    runs = [_chat(Session(f"s{i}", models["qwen3"], "q4"), _user(QUESTION), sampling)[2].ids()
            for i in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) > 0


def test_streamed_text_never_splits_a_character(models) -> None:
    session = Session("s", models["llama"], "fp16")
    text = "Zürich 東京 🌲🔥 café naïve"
    ids = session.tokenizer.encode(text, add_special_tokens=False)
    rec = Recorder()
    answer = AnswerStream(session.model, session.cache, session.tokenizer, session.end_ids, [],
                          GREEDY, request_id=1, cancel=rec.cancel, emit=rec, tick=lambda: None)
    for token in ids:
        answer.stream(token)
    answer.flush()
    chunks = rec.of(TokenChunk)
    assert "".join(c.text for c in chunks) == text
    assert [i for c in chunks for i in c.token_ids] == ids
    assert all("\ufffd" not in c.text for c in chunks)
    assert any(len(c.token_ids) > 1 for c in chunks)  # multi-token characters waited


def test_too_long_for_the_model_context_is_refused_with_numbers(tmp_path: Path) -> None:
    loaded = load_tiny_model(make_tiny_model_dir(tmp_path, "llama", max_position_embeddings=48))
    session = Session("s", loaded, "fp16", page_size=16)
    with pytest.raises(ContextTooLong, match="48") as error:
        _chat(session, _user(QUESTION * 3))
    assert "shorten" in str(error.value)
    assert session.tokens == [] and session.tokens_ingested == 0


def test_answer_is_cut_at_the_context_limit(tmp_path: Path) -> None:
    loaded = load_tiny_model(make_tiny_model_dir(tmp_path, "llama", max_position_embeddings=48))
    session = Session("s", loaded, "fp16", page_size=16)
    prompt = session.render(_user("Hi"), add_generation_prompt=True)
    reason, stats, _ = _chat(session, _user("Hi"), SamplingParams(temperature=0.0,
                                                                  max_tokens=500))
    assert reason == "length" and stats.generated_tokens == 48 - len(prompt)
    assert adapter.cache_tokens(session.cache) <= 48


def test_page_budget_refusal_names_a_mode_that_fits(models) -> None:
    loaded = models["llama"]
    # llama tiny: 2 layers x 2 KV heads x head_dim 32 -> an fp16 16-token page is 8 KiB.
    session = Session("s", loaded, "fp16", page_size=16, budget_bytes=2 * 8192)
    prompt = session.render(_user(QUESTION * 2), add_generation_prompt=True)
    report = session.fit_report(len(prompt))
    assert not report.fits and report.suggested_mode in ("q8", "q6", "q4")
    with pytest.raises(ContextTooLong, match=report.suggested_mode):
        _chat(session, _user(QUESTION * 2))
    assert session.tokens == []
    roomy = Session("s2", loaded, report.suggested_mode, page_size=16, budget_bytes=2 * 8192)
    reason, _, rec = _chat(roomy, _user(QUESTION * 2), SamplingParams(temperature=0.0,
                                                                      max_tokens=4))
    assert rec.ids() and reason in ("length", "stop")


def test_quantized_session_reports_its_pages(models) -> None:
    session = Session("s", models["qwen3_next"], "q6", page_size=16)
    _chat(session, _user(QUESTION), SamplingParams(temperature=0.0, max_tokens=4))
    stats = session.stats()
    assert stats.mode == "q6" and stats.tokens == len(session.tokens)
    assert stats.pages_in_use == 2 * -(-len(session.tokens) // 16)  # two attention layers
    assert stats.bytes_used > 0 and stats.bytes_allocated >= stats.bytes_used
    session.close()
    assert session.tokens == []


def test_page_budget_reached_mid_answer_ends_it_cleanly(models, monkeypatch) -> None:
    session = Session("s", models["llama"], "fp16", page_size=16, budget_bytes=3 * 8192)
    # Bypass the up-front clamp so the pool itself runs out while decoding.
    monkeypatch.setattr(session, "room_for", lambda count: 10_000)
    reason, stats, _ = _chat(session, _user("Hi"), SamplingParams(temperature=0.0,
                                                                  max_tokens=500))
    assert reason == "length" and 0 < stats.generated_tokens < 500
    assert adapter.cache_tokens(session.cache) == len(session.tokens) == 48  # 3 pages


def _chunk_sizes(session: Session, messages: list[dict[str, str]], step: float) -> list[int]:
    """Ingest ``messages`` with every chunk "taking" ``step`` seconds; the chunk sizes."""
    clock = iter(range(10_000))
    session.clock = lambda: next(clock) * step
    rec = Recorder()
    session.ingest(messages, request_id=1, cancel=rec.cancel, emit=rec, tick=lambda: None)
    done = [p.tokens_done for p in rec.of(IngestProgress)]
    return [b - a for a, b in zip([0, *done], done, strict=False)]


def test_the_chunk_plan_ends_chunks_at_multiples_of_the_size_and_at_boundaries() -> None:
    assert chunk_plan(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    # A read that starts mid-chunk (a held prefix) catches up with the same grid.
    assert chunk_plan(6, 17, 4) == [(6, 8), (8, 12), (12, 16), (16, 17)]
    assert chunk_plan(0, 10, 4, [3, 4, 9, 10, 12]) == [(0, 3), (3, 4), (4, 8), (8, 9),
                                                       (9, 10)]
    assert chunk_plan(5, 5, 4) == []


def test_chunks_are_the_same_on_a_slow_and_a_fast_machine(models) -> None:
    fast = _chunk_sizes(Session("f", models["llama"], "fp16", chunk_size=64),
                        _user(QUESTION * 16), step=0.001)
    slow = _chunk_sizes(Session("s", models["llama"], "fp16", chunk_size=64),
                        _user(QUESTION * 16), step=5.0)
    assert fast == slow and fast[:-1] == [64] * (len(fast) - 1) and len(fast) > 2


def test_a_new_chunk_size_applies_from_the_next_prefill(models) -> None:
    session = Session("f", models["llama"], "fp16", chunk_size=16)
    session.set_chunk_size(48)
    assert _chunk_sizes(session, _user(QUESTION * 4), step=1.0)[:2] == [48, 48]


@pytest.mark.parametrize(("mode", "kind"), [("fp16", "mlx-lm"), ("q8", "mlx-lm quantized")])
def test_a_model_the_probe_sends_to_mlx_lm_runs_on_mlx_lms_cache(
    models, mode: str, kind: str
) -> None:
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from engine.models.loader import load_model
    from engine.models.probe import ProbeResult

    base = models["llama"]
    probe = ProbeResult("mlx-lm", "KV-shared layers (test)", 0.5, quantized=True)
    real = load_model(base.folder, probe=False)
    loaded = replace(real, model=base.model, tokenizer=base.tokenizer, probe=probe)
    session = Session("s", loaded, mode, page_size=16)
    assert session.cache_kind == kind and "KV-shared layers" in session.cache_note
    expected_type = KVCache if mode == "fp16" else QuantizedKVCache
    assert all(type(c) is expected_type for c in session.cache)
    _, stats, rec = _chat(session, _user("Where do longleaf pines grow?"))
    assert stats.generated_tokens > 0
    if mode == "fp16":
        prompt = session.render(_user("Where do longleaf pines grow?"), add_generation_prompt=True)
        assert rec.ids() == _mlx_lm_greedy(base, prompt, len(rec.ids()))


def test_each_progress_times_its_own_chunk_from_the_context_before_it(models) -> None:
    session = Session("s", models["llama"], "q8", page_size=16, chunk_size=10)
    rec = Recorder()
    session.ingest(_user(QUESTION), request_id=1, cancel=rec.cancel, emit=rec, tick=lambda: None)
    first = rec.of(IngestProgress)
    session.ingest(_user(QUESTION * 2), request_id=2, cancel=rec.cancel, emit=rec,
                   tick=lambda: None)
    second = rec.of(IngestProgress)[len(first):]
    for progress in (first, second):
        # Chunks tile the read: each starts where the one before it ended.
        assert [p.chunk_start + p.chunk_tokens for p in progress[:-1]] == \
            [p.chunk_start for p in progress[1:]]
        assert all(p.chunk_tokens > 0 and p.chunk_seconds > 0 for p in progress)
    # The longer conversation's read starts after the prefix the first one left held.
    total = len(session.render(_user(QUESTION * 2), add_generation_prompt=False))
    assert 0 < second[0].chunk_start <= first[-1].tokens_done
    assert second[0].chunk_start + second[-1].tokens_total == total
    assert sum(p.chunk_tokens for p in second) == second[-1].tokens_done


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_conversation_ending_with_an_answer_continues_it_in_place(models, arch) -> None:
    loaded = models[arch]
    session = Session("s", loaded, "fp16", page_size=16, chunk_size=16)
    question = _user(QUESTION)
    _chat(session, question)
    answer = "Once upon a time, far away"  # an answer cut short (random weights make none)
    messages = [*question, {"role": "assistant", "content": answer}]
    prompt = session.prompt(messages, add_generation_prompt=True)
    # The answer's own text ends the prompt: no end of turn, no new turn after it.
    assert prompt.text.endswith(answer)
    assert prompt.text.startswith(session.prompt(question, add_generation_prompt=True).text)
    _, _, rec = _chat(session, messages)
    assert rec.ids() == _mlx_lm_greedy(loaded, prompt.ids, GREEDY.max_tokens)
    assert adapter.cache_tokens(session.cache) == len(session.tokens)
    # The text goes on from the answer's: a first word's leading space is kept
    # (and a character the length limit cut in two is left out, not replaced).
    streamed = "".join(chunk.text for chunk in rec.of(TokenChunk))
    assert streamed == loaded.tokenizer.decode(rec.ids()).rstrip("\ufffd")


def test_the_next_step_is_queued_while_the_host_handles_a_token(models, monkeypatch) -> None:
    # mlx-lm's overlap: step t+1's graph is built and queued (async_eval) before
    # the host reads, detokenizes and reports step t's token, so the device computes
    # meanwhile. At the k-th token's tick, k + 1 steps are queued (the last token's,
    # at the length limit, queues none).
    session = Session("s", models["qwen3"], "q6")
    queued: list[int] = []
    async_eval = mx.async_eval
    monkeypatch.setattr(mx, "async_eval", lambda *a: queued.append(1) or async_eval(*a))
    at_tick: list[int] = []
    recorder = Recorder()
    plain = SamplingParams(temperature=0.0, max_tokens=6, speculative="off")
    session.chat(_user(QUESTION), plain, request_id=1, cancel=recorder.cancel, emit=recorder,
                 tick=lambda: at_tick.append(len(queued)))
    made = len(recorder.ids())
    decoding = [count for count in at_tick if count]  # the read's ticks queue nothing
    assert made >= 3
    assert decoding[:made - 1] == [k + 1 for k in range(1, made)], at_tick


def test_an_answer_told_to_pause_pauses_though_asked_again_it_would_not(models) -> None:
    session = Session("s", models["llama"], "fp16")
    answer = session.start_answer([{"role": "user", "content": QUESTION}],
                                  SamplingParams(temperature=0.0, max_tokens=32,
                                                 speculative="off"),
                                  request_id=1, cancel=threading.Event(),
                                  emit=lambda event: None, tick=lambda: None)
    asked: list[int] = []

    def pause() -> bool:
        # Another chat comes at the third step, then is stopped before anyone
        # could ask again: the answer paused all the same.
        asked.append(1)
        return len(asked) == 3

    assert session.run_answer(answer, pause) == "paused"
    assert len(answer.stream.generated) < 32


def test_a_pipelines_other_ranks_hear_of_a_new_chunk_size_only(models) -> None:
    told: list[int] = []
    ranks = SimpleNamespace(needs_checkpoints=False, batches=True, set_chunk_size=told.append)
    session = Session("s", models["llama"], "fp16", chunk_size=64, followers=ranks)
    session.set_chunk_size(64)  # Settings applied with the same size: nothing to send
    session.set_chunk_size(256)
    assert told == [256] and session.chunk_size == 256


def test_a_chats_pages_never_grow_past_the_models_context(models) -> None:
    context = 48  # tokens: three pages of 16
    loaded = SimpleNamespace(**{**vars(models["llama"]),
                                "info": SimpleNamespace(max_context=context)})
    session = Session("s", loaded, "q8", page_size=16)
    reason, _stats, _ = _chat(session, _user(QUESTION),
                              replace(GREEDY, max_tokens=context))
    assert reason == "length" and len(session.tokens) <= context
    pool = session.page_pool()
    assert pool is not None
    assert {store.capacity for store in pool.stores} == {3}  # no page past the context
