"""The fit line above the composer."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from app.memory.fit_check import TokenParts, fit_html, wait_sentence
from app.settings import Settings
from engine import IngestProgress
from engine.memory.prefill_rate import ChunkTiming, PrefillRate
from tests.app.conftest import ANSWER_TIMEOUT_MS, send_and_wait


def _report() -> SimpleNamespace:
    entries = {m: SimpleNamespace(bytes_needed=n, supported=True, fits=True)
               for m, n in (("q4", 1 << 20), ("q6", 2 << 20), ("q8", 3 << 20), ("fp16", 4 << 20))}
    return SimpleNamespace(for_mode=entries.__getitem__, max_context=8192, budget_bytes=None,
                           available_bytes=8 << 30)


def test_the_fit_line_lists_modes_in_the_one_order_used_everywhere() -> None:
    html, ok = fit_html(_report(), "q6", 1000)
    assert ok
    positions = [html.index(f"{mode} ") for mode in ("fp16", "q8", "q6", "q4")]
    assert positions == sorted(positions)


def test_the_fit_line_shows_the_prefill_peak_when_the_engine_knows_it() -> None:
    report = _report()
    assert "Reading it in" not in fit_html(report, "q6", 1000)[0]
    report.for_mode("q6").prefill_peak_bytes = 3 << 30
    html, _ = fit_html(report, "q6", 1000)
    assert ("Reading it in needs up to ≈ 3.0 GB at once (the model, this memory and "
            "working space)") in html, html


def test_the_fit_line_speaks_plainly() -> None:
    html, _ = fit_html(_report(), "q6", 1000)
    assert html.startswith("✓ After this message: 1,000 of 8,192 tokens · memory for them: ")
    for jargon in ("KV", "RAM", "budget", "turn", "scratch"):
        assert jargon not in html


def test_the_fit_line_says_what_the_memory_limit_leaves_this_chat() -> None:
    report = _report()
    report.budget_bytes = 2 << 20  # what a 4 MB limit leaves beside another chat's pages
    html, _ = fit_html(report, "q6", 1000)
    assert "· 8.0 GB free · 2.0 MB left of your memory limit" in html


def _past_the_context() -> SimpleNamespace:
    report = _report()
    for mode in ("fp16", "q8", "q6", "q4"):
        entry = report.for_mode(mode)
        entry.fits, entry.fits_context, entry.fits_budget = False, False, True
    return report


def test_a_message_that_fits_but_leaves_the_answer_short_says_so_and_can_be_sent() -> None:
    html, ok = fit_html(_past_the_context(), "q8", 8_213, answer_room=491)
    assert not ok
    assert ("The answer has room for only 491 tokens: the model's context ends at 8,192 "
            "tokens in any mode.") in html
    assert "won't fit" not in html


def test_a_message_past_the_context_says_send_is_off() -> None:
    html, _ = fit_html(_past_the_context(), "q8", 9_000, answer_room=-300)
    assert ("This won't fit: 9,000 tokens is more than the model's context of 8,192 tokens "
            "in any mode.") in html and "Send is off until it fits" in html


def test_the_wait_counts_only_new_tokens_and_says_when_nothing_was_measured() -> None:
    rate = PrefillRate(0.01, 1e-5)
    # From 2,098 held tokens to 4,347: ∫ (0.01 + 1e-5·c) dc = 22.49 + 72.47 s.
    assert wait_sentence(2249, 2098, rate) == \
        "Reading 2,249 new tokens (2,098 reused) takes about 1m 35s here"
    assert wait_sentence(4347, 0, rate) == "Reading 4,347 tokens takes about 2m 18s here"
    assert wait_sentence(4347, 0, None) == \
        "Reading 4,347 tokens · first read on this machine: no estimate yet"
    assert wait_sentence(500, 4000, rate) == ""  # a short read: no sentence


def _timings(rate: PrefillRate, total: int, chunk: int = 512) -> tuple[ChunkTiming, ...]:
    return tuple(ChunkTiming(min(chunk, total - c), c, rate.seconds(c, min(c + chunk, total)))
                 for c in range(0, total, chunk))


def test_before_any_read_the_fit_line_says_there_is_no_estimate_yet(qtbot, window) -> None:
    c = window.controller
    c.new_session("q8")
    window.composer.set_text("word " * 3000)
    window.fit.run()
    assert "first read on this machine: no estimate yet" in window.composer.fit.text()


def test_the_fit_line_counts_what_the_held_cache_and_the_snapshot_already_hold(
        qtbot, window) -> None:
    c = window.controller
    c.new_session("q8")
    assert send_and_wait(qtbot, window, "word " * 300) == "complete"
    rate = PrefillRate(2e-3, 1e-6)
    c.settings.set_prefill_timings(c.model_id, _timings(rate, 4096))
    window.composer.set_text("word " * 3000)
    prompt, _ = window.fit.prompt_tokens()
    context = window.fit.context_tokens()
    assert prompt >= 2048 and context > 300
    # Held in memory: only the new text is read, after the whole chat.
    assert window.fit.tokens_to_read(prompt) == (prompt, context)
    window.fit.run()
    assert wait_sentence(prompt, context, c.prefill_rate()) in window.composer.fit.text()
    assert f"({context:,} reused)" in window.composer.fit.text()
    # Out of memory, on disk: the snapshot's tokens are reused, the rest read again.
    c.caches.close(c.current.id)
    qtbot.waitUntil(lambda: c.bridge.stored_snapshot(c.current.id) is not None,
                    timeout=ANSWER_TIMEOUT_MS)
    stored = c.bridge.stored_snapshot(c.current.id).tokens
    context = window.fit.context_tokens()
    assert 0 < stored <= context
    assert window.fit.tokens_to_read(prompt) == (context - stored + prompt, stored)


def test_reads_teach_the_rate_model_which_survives_a_restart_and_gives_the_eta(
        qtbot, window) -> None:
    c = window.controller
    assert c.prefill_rate() is None
    c.settings.ingest_chunk = 64
    window.composer.set_text("word " * 400)
    with qtbot.waitSignal(c.answerFinished, timeout=ANSWER_TIMEOUT_MS):
        c.send(window.composer.text())
    timed = c.settings.prefill_timings(c.model_id)
    assert timed and all(t.tokens > 0 and t.seconds > 0 for t in timed)
    # Not the read's first chunk, which carries its start-up (and after a load the
    # first run of every kernel).
    assert min(t.start for t in timed) > 0
    assert c.prefill_rate() is not None
    # Kept in the settings file per model: a new Settings on the same file has them.
    c.settings.sync()
    assert Settings(c.settings.path).prefill_timings(c.model_id) == timed
    assert Settings(c.settings.path).prefill_timings("another model") == ()
    # The ETA at a point of a read is the rate model's integral over what is left.
    rate = PrefillRate(0.01, 1e-5)
    c.settings.set_prefill_timings(c.model_id, _timings(rate, 6000))
    progress = IngestProgress(1, 1024, 4096, 50.0, 61.0, 512, 2512, 9.0)
    assert c.read_eta(progress) == pytest.approx(rate.seconds(3024, 3024 + 3072), rel=1e-6)
    # Beside answers the read has its share of the time: at half, twice as long.
    beside = replace(progress, chunk_seconds=0.0, read_share=0.5)
    assert c.read_eta(beside) == pytest.approx(2 * rate.seconds(3024, 3024 + 3072), rel=1e-6)
    # ... and its untimed chunk teaches the rate model nothing.
    known = c.settings.prefill_timings(c.model_id)
    c._on_read_chunk(beside)
    assert c.settings.prefill_timings(c.model_id) == known
    # Before any chunk was timed the engine's own figure stands.
    assert c.read_eta(IngestProgress(1, 0, 4096, 0.0, 61.0)) == 61.0


def test_the_fit_lines_count_is_what_the_engine_reads_for_the_message(
        qtbot, window, tmp_path) -> None:
    # The composer's text alone leaves out the chat template's tokens: the system
    # prompt on a first message, role markers, the generation prompt, and on a
    # later one the previous answer's end of turn.
    c = window.controller
    c.new_session("q8")
    totals: list[int] = []
    c.answers.ingestProgress.connect(lambda event: totals.append(event.tokens_total))
    for text in ("Where do longleaf pines grow?", "And how tall do they get, usually?"):
        window.composer.set_text(text)
        counted, estimated = window.fit.prompt_tokens()
        assert not estimated
        assert counted > c.bridge.count_tokens(text)
        assert send_and_wait(qtbot, window, text) == "complete"
        stats = c.model.message(c.model.rowCount() - 1).stats
        assert counted == stats["prefill_tokens"], (text, counted, stats)
        # The progress row's total is the same count.
        assert totals[-1] == counted
    # An attachment is read inside its document block. (A new chat: the tiny
    # model's random answers need not tokenize again into the ids it made, and a
    # cache keeps only the ids that match the conversation rendered anew.)
    c.new_session("q8")
    doc = tmp_path / "pines.md"
    doc.write_text("Longleaf pines grow in the sandy coastal plain.\n" * 5)
    window.add_files([str(doc)])
    qtbot.waitUntil(lambda: bool(window.attachments), timeout=20_000)
    window.composer.set_text("Summarize it.")
    counted, _ = window.fit.prompt_tokens()
    assert send_and_wait(qtbot, window, "Summarize it.") == "complete"
    assert counted == c.model.message(c.model.rowCount() - 1).stats["prefill_tokens"]


def test_the_fit_line_names_what_its_total_is_made_of() -> None:
    parts = TokenParts(chat=0, message=4_716, formatting=54, answer=512)
    html, _ = fit_html(_report(), "q6", 5_228, parts=parts)
    assert html.startswith("✓ After this message: 5,228 of 8,192 tokens (this message 4,716 "
                           "(54 of them chat formatting) + 512 kept for the answer) · ")
    later = TokenParts(chat=1_200, message=40, formatting=0, answer=512)
    assert later.words() == "the chat 1,200 + this message 40 + 512 kept for the answer"


def test_a_new_chats_fit_line_counts_the_page_size_set_in_settings(qtbot, window) -> None:
    """A chat opens with the page size set in Settings; before it is opened, its fit
    line counts those pages, so opening it does not change what it says it needs."""
    c = window.controller
    c.settings.page_size = 1024
    c.new_session("q8")
    assert c.current.id not in c.opened
    planned = window.fit.report_for(1100).for_mode("q8").bytes_needed
    assert send_and_wait(qtbot, window, "hi") == "complete"
    assert c.current.id in c.opened
    assert window.fit.report_for(1100).for_mode("q8").bytes_needed == planned


def test_an_edit_counts_the_chat_before_the_message_it_replaces(qtbot, window) -> None:
    # Re-sending a long last message as an edit must not count it (and its answer)
    # twice: before, 2,200 tokens twice passed the tiny model's 4,096 and Send was off.
    c = window.controller
    c.new_session("q8")
    assert send_and_wait(qtbot, window, "Where do longleaf pines grow?") == "complete"
    before = window.fit.context_tokens()
    long_text = "word " * 730  # three tokens a word: about 2,200
    window.composer.set_text(long_text)
    sent_prompt, _ = window.fit.prompt_tokens()
    assert sent_prompt > 2048
    assert send_and_wait(qtbot, window, long_text) == "complete"
    assert window.fit.context_tokens() > before + sent_prompt
    c.begin_edit()
    assert c.editing and window.composer.text() == long_text
    window.fit.run()
    assert window.fit.context_tokens() == before
    assert window.fit.prompt_tokens() == (sent_prompt, False)
    assert window.composer.send_blocked == "" and window.composer.send_button.isEnabled()
    # Cancelling the edit counts the whole chat again.
    c.cancel_edit()
    assert window.fit.context_tokens() > before + sent_prompt
