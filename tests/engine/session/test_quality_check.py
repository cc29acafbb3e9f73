"""The quality receipt's engine side: a chat's mode against fp16 on its own last tokens."""

from __future__ import annotations

import threading
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from engine.errors import Cancelled, EngineError
from engine.session import quality_check
from engine.session.quality_check import check_quality, divergence, log_probs, summarize
from tests.engine.tinymodels import make_tiny_model_dir

CONTEXT = 72
WINDOW = 40
CHUNK = 16


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from engine.models.loader import load_model

    return load_model(make_tiny_model_dir(tmp_path_factory.mktemp("quality"), "llama"))


@pytest.fixture(scope="module")
def ids(loaded: Any) -> list[int]:
    vocab = loaded.model.args.vocab_size
    return [(13 * i + 5) % vocab for i in range(CONTEXT)]


def test_fp16_against_itself_is_exact(loaded, ids) -> None:
    receipt = check_quality(loaded, ids, "fp16", rotate=False, window=WINDOW, chunk=CHUNK)
    assert receipt.kl_mean == 0.0 and receipt.kl_p99 == 0.0 and receipt.top1 == 1.0
    assert (receipt.mode, receipt.rotated) == ("fp16", False)
    assert (receipt.window_tokens, receipt.positions, receipt.context_tokens) == (
        WINDOW, WINDOW, CONTEXT)
    assert receipt.model == loaded.info.name and receipt.measured_at > 0


def test_q4_costs_something_and_the_receipt_says_how_it_was_stored(loaded, ids) -> None:
    plain = check_quality(loaded, ids, "q4", rotate=False, window=WINDOW, chunk=CHUNK)
    rotated = check_quality(loaded, ids, "q4", rotate=True, window=WINDOW, chunk=CHUNK)
    for receipt in (plain, rotated):
        assert receipt.mode == "q4"
        assert receipt.kl_p99 >= receipt.kl_mean > 0.0
        assert 0.0 <= receipt.top1 <= 1.0
    assert (plain.rotated, rotated.rotated) == (False, True)
    assert plain.kl_mean != rotated.kl_mean  # two storages, two measurements


def test_the_window_is_the_last_tokens_read_alone(loaded, ids) -> None:
    last = check_quality(loaded, ids, "q4", rotate=False, window=WINDOW, chunk=CHUNK)
    alone = check_quality(loaded, ids[-WINDOW:], "q4", rotate=False, window=WINDOW, chunk=CHUNK)
    first = check_quality(loaded, ids[:WINDOW], "q4", rotate=False, window=WINDOW, chunk=CHUNK)
    assert (last.kl_mean, last.top1) == (alone.kl_mean, alone.top1)
    assert last.kl_mean != first.kl_mean
    assert alone.context_tokens == WINDOW and last.context_tokens == CONTEXT
    short = check_quality(loaded, ids[:10], "q4", rotate=False, window=WINDOW, chunk=CHUNK)
    assert short.window_tokens == short.positions == short.context_tokens == 10


def test_scores_one_chunk_at_a_time(loaded, ids, monkeypatch) -> None:
    seen: list[tuple[int, ...]] = []

    def recording(reference, variant):
        seen.append(tuple(reference.shape))
        return divergence(reference, variant)

    monkeypatch.setattr(quality_check, "divergence", recording)
    progress: list[tuple[int, int]] = []
    check_quality(loaded, ids, "q8", rotate=False, window=WINDOW, chunk=CHUNK,
                  progress=lambda done, total: progress.append((done, total)))
    vocab = loaded.model.args.vocab_size
    assert seen == [(CHUNK, vocab), (CHUNK, vocab), (WINDOW - 2 * CHUNK, vocab)]
    assert progress == [(16, WINDOW), (32, WINDOW), (WINDOW, WINDOW)]


def test_steps_shrink_with_the_vocabulary(loaded, ids, monkeypatch) -> None:
    # The default step: one token, whose logits show the vocabulary, then as many
    # tokens as the logits budget holds for it.
    vocab = loaded.model.args.vocab_size
    assert quality_check.chunk_for_vocabulary(248_320) == 45
    assert quality_check.chunk_for_vocabulary(49_152) == quality_check.CHUNK_TOKENS
    monkeypatch.setattr(quality_check, "LOGITS_BUDGET_BYTES", 4 * 6 * vocab * 7)
    seen: list[int] = []

    def recording(reference, variant):
        seen.append(reference.shape[0])
        return divergence(reference, variant)

    monkeypatch.setattr(quality_check, "divergence", recording)
    stepped = check_quality(loaded, ids, "q8", rotate=False, window=WINDOW)
    assert seen == [1] + [7] * 5 + [4]
    whole = check_quality(loaded, ids, "q8", rotate=False, window=WINDOW, chunk=WINDOW)
    assert stepped.positions == whole.positions == WINDOW


def test_cancel_stops_between_chunks(loaded, ids) -> None:
    cancel = threading.Event()
    progress: list[int] = []

    def stop_after_first(done: int, _total: int) -> None:
        progress.append(done)
        cancel.set()

    with pytest.raises(Cancelled, match=f"after {CHUNK} of {WINDOW} tokens"):
        check_quality(loaded, ids, "q6", rotate=False, window=WINDOW, chunk=CHUNK,
                      cancel=cancel, progress=stop_after_first)
    assert progress == [CHUNK]


def test_a_stop_during_the_last_chunk_stores_nothing(loaded, ids) -> None:
    # Checked only between chunks, a Stop pressed while the last chunk ran still
    # gave a receipt: the check seemed to ignore it.
    cancel = threading.Event()

    def stop_in_the_last(done: int, total: int) -> None:
        if done == total:
            cancel.set()  # pressed while the last chunk ran: seen once it ends

    with pytest.raises(Cancelled):
        check_quality(loaded, ids, "q4", rotate=False, window=WINDOW, chunk=CHUNK,
                      cancel=cancel, progress=stop_in_the_last)


def test_an_empty_chat_has_nothing_to_check(loaded) -> None:
    with pytest.raises(EngineError, match="Send a message first"):
        check_quality(loaded, [], "q6", rotate=False)


def test_divergence_and_summary_math() -> None:
    p = log_probs(mx.log(mx.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]])))
    q = log_probs(mx.log(mx.array([[0.25, 0.5, 0.25], [0.1, 0.8, 0.1]])))
    kl, same = divergence(p, q)
    expected = 0.5 * np.log(2) + 0.25 * np.log(0.5)
    assert kl[0] == pytest.approx(expected, rel=1e-5) and kl[1] == pytest.approx(0.0, abs=1e-6)
    assert same.tolist() == [False, True]
    scores = summarize(kl, same)
    assert scores["top1"] == 0.5
    assert scores["kl_mean"] == pytest.approx(expected / 2, rel=1e-5)
    assert scores["kl_mean"] <= scores["kl_p99"] <= kl.max()



def test_a_mode_the_model_stores_whole_is_not_checked(loaded, ids) -> None:
    """Where mlx-lm's own cache runs the model and cannot quantize it, a q6 chat keeps
    fp16's keys and values: a verdict would approve a mode that saves nothing."""
    from dataclasses import replace

    from engine.models.probe import MLX_LM, ProbeResult

    whole = replace(loaded, probe=ProbeResult(MLX_LM, "a test's reason", None, quantized=False))
    with pytest.raises(EngineError, match=r"Nothing to check: .*q6 keeps them whole.*fp16's"):
        check_quality(whole, ids, "q6", rotate=False, window=WINDOW, chunk=CHUNK)
    quantized = replace(whole, probe=replace(whole.probe, quantized=True))
    assert check_quality(quantized, ids, "q8", rotate=False, window=WINDOW,
                         chunk=CHUNK).kl_mean > 0


def test_perplexity_scores_the_windows_own_next_tokens(loaded, ids) -> None:
    same = check_quality(loaded, ids, "fp16", rotate=False, window=WINDOW, chunk=CHUNK)
    assert same.perplexity is not None and same.perplexity == same.reference_perplexity
    # Fed whole or in chunks, the same positions are scored against the same tokens
    # (each chunk's last position against the next chunk's first token).
    whole = check_quality(loaded, ids, "q4", rotate=False, window=WINDOW, chunk=WINDOW)
    chunked = check_quality(loaded, ids, "q4", rotate=False, window=WINDOW, chunk=CHUNK)
    assert whole.perplexity == pytest.approx(chunked.perplexity, rel=1e-4)
    assert whole.reference_perplexity == pytest.approx(same.reference_perplexity, rel=1e-4)
    assert whole.perplexity != whole.reference_perplexity  # q4 costs something
    # Against the model's own logits: exp of the mean -log p of each next token.
    logits = loaded.model(mx.array(ids[-WINDOW:])[None])[0]
    lp = log_probs(logits)
    nll = [-float(lp[i, ids[-WINDOW + i + 1]]) for i in range(WINDOW - 1)]
    assert same.reference_perplexity == pytest.approx(float(np.exp(np.mean(nll))), rel=1e-4)
    # One token has no next token to score.
    assert check_quality(loaded, ids[:1], "q4", rotate=False, window=WINDOW).perplexity is None
