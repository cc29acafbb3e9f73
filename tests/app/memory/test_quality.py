"""Check Quality: the shown chat's mode against fp16, its receipt shown and kept with the chat."""

from __future__ import annotations

import json
import threading
from dataclasses import replace

import pytest

import engine.session.quality_check as quality_check
from app.memory.panel import NOT_MEASURED, QUALITY_COLUMN
from app.memory.quality import (
    advice,
    receipt_details,
    receipt_line,
    receipt_numbers,
    receipt_summary,
    verdict,
)
from app.store import MEASURED_ROWS, HistoryStore
from engine import MemoryPressure, QualityReceipt
from engine.cache.modes import MODES
from tests.app.conftest import ANSWER_TIMEOUT_MS, send_and_wait

RECEIPT = QualityReceipt(mode="q6", rotated=True, window_tokens=1024, context_tokens=5210,
                         positions=1024, top1=0.987, kl_mean=0.004, kl_p99=0.05, model="m",
                         measured_at=0.0)


def _quality_cell(window, mode: str) -> str:
    return window.panel.table.item(MODES.index(mode), QUALITY_COLUMN).text()


def test_receipt_line_gives_a_verdict_and_the_details_the_numbers() -> None:
    assert receipt_line(RECEIPT) == "Minor differences from fp16 (q6 · rotated, this chat)"
    assert receipt_numbers(RECEIPT) == (
        "Same next token as fp16 for 98.7% of the last 1,024 tokens · "
        "mean KL 0.004 (read as one window)")
    assert receipt_numbers(RECEIPT) in receipt_details(RECEIPT)
    assert "read the chat as 5,210 tokens: closed as a finished turn" in receipt_details(RECEIPT)
    whole = QualityReceipt(**{**RECEIPT.__dict__, "rotated": False, "window_tokens": 300,
                              "context_tokens": 300, "positions": 300, "kl_mean": 2e-5})
    assert receipt_line(whole) == "Indistinguishable from fp16 (q6, this chat)"
    assert receipt_numbers(whole) == (
        "Same next token as fp16 for 98.7% of the whole chat · "
        "mean KL 2.0e-05 (read as one window)")
    # Perplexity on the chat's own text, beside fp16's (receipts stored before had none).
    scored = QualityReceipt(**{**RECEIPT.__dict__, "perplexity": 12.4,
                               "reference_perplexity": 12.0})
    assert receipt_numbers(scored) == (
        "Same next token as fp16 for 98.7% of the last 1,024 tokens · mean KL 0.004 · "
        "perplexity 12.40 against fp16's 12.00 (+3.3%) (read as one window)")


def test_a_verdict_says_what_to_do_and_the_panel_shows_its_numbers(qtbot) -> None:
    from dataclasses import replace

    from app.memory.panel import MemoryPanel

    assert advice(RECEIPT) == ("Keep q6 for everyday use; for exact quotes and figures, q8 "
                               "stays closer to fp16.")
    assert advice(replace(RECEIPT, kl_mean=2e-4)).startswith(
        "Keep q6: it answers as fp16 would. If you need more context in the same memory, "
        "try q4")
    assert advice(replace(RECEIPT, mode="q4", kl_mean=0.3)) == (
        "Reopen this chat in q6: its answers stay closer to fp16.")
    assert advice(replace(RECEIPT, mode="q4", kl_mean=2e-4)) == (
        "Keep q4: it answers as fp16 would.")
    # A short chat's verdict says how little it rests on.
    assert advice(replace(RECEIPT, positions=1, kl_mean=2e-4)) == (
        "Keep q6: it answers as fp16 would. If you need more context in the same memory, "
        "try q4: reopen the chat in it and check again. This chat is short yet, and a "
        "verdict on so few tokens says little of a long chat: check again once it is longer.")
    assert advice(replace(RECEIPT, positions=255)).endswith("check again once it is longer.")
    assert "short yet" not in advice(replace(RECEIPT, positions=256))
    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.set_session("Pines", "q6", "", "s1")
    panel.show_receipts({"q6": RECEIPT})
    shown = panel.quality_label.text()
    assert receipt_summary(RECEIPT) == "98.7% same next token as fp16 · mean KL 0.004"
    assert receipt_summary(RECEIPT) in shown and advice(RECEIPT) in shown


@pytest.mark.parametrize(("kl", "words"), [
    (3.87e-4, "Indistinguishable"), (6.93e-4, "Indistinguishable"),  # q8 rows
    (2.40e-3, "Minor"), (4.46e-3, "Minor"), (1.80e-2, "Minor"),  # q6 rows
    (1.36e-1, "Noticeable"),  # rotated q4
    (3.76e-1, "Large"), (0.452, "Large")])  # plain q4; the unrotated q6 the issue saw
def test_verdict_bands_follow_the_quality_bench(kl: float, words: str) -> None:
    assert verdict(kl).startswith(words)


def test_receipts_are_kept_per_mode_and_old_histories_load(tmp_path) -> None:
    path = tmp_path / "history.sqlite3"
    store = HistoryStore(path)
    record = store.create_session("t", "q6", "demo")
    # A history from before receipts: no such table.
    store._db.execute("DROP TABLE quality_receipts")
    store.close()
    store = HistoryStore(path)
    assert store.receipts(record.id) == {}
    q4 = QualityReceipt(**{**RECEIPT.__dict__, "mode": "q4"})
    newer = QualityReceipt(**{**RECEIPT.__dict__, "top1": 0.5})
    for receipt in (RECEIPT, q4, newer):
        store.save_receipt(record.id, receipt, "")
    assert store.receipts(record.id) == {"q6": newer, "q4": q4}  # the newer q6 replaced it
    copy = store.create_session("t · q8", "q8", "demo")
    store.copy_receipts(record.id, copy.id)
    assert store.receipts(copy.id) == store.receipts(record.id)
    # A copy holds the same text: its receipts speak for it, until it changes.
    assert store.outdated_receipts(copy.id, "") == set()
    store.add_message(copy.id, "user", "one more question", "complete")
    assert store.outdated_receipts(copy.id, "") == {"q6", "q4"}
    assert store.outdated_receipts(record.id, "") == set()
    # A receipt stored before receipts kept their text is taken as it was.
    store._db.execute("UPDATE quality_receipts SET receipt = ? WHERE session_id = ?",
                      (json.dumps(RECEIPT.__dict__), copy.id))
    assert store.outdated_receipts(copy.id, "") == set()
    # One stored while receipts kept every stored message's digest goes on comparing it.
    store._db.execute("UPDATE quality_receipts SET receipt = ? WHERE session_id = ?",
                      (json.dumps({**RECEIPT.__dict__, MEASURED_ROWS: store._rows_digest(copy.id)}),
                       copy.id))
    assert store.outdated_receipts(copy.id, "") == set()
    store.add_message(copy.id, "assistant", "an answer", "complete")
    assert store.outdated_receipts(copy.id, "") == {"q6", "q4"}
    store.delete_session(record.id)
    assert store.receipts(record.id) == {}
    store.close()


def test_check_quality_shows_and_stores_the_receipt(qtbot, window) -> None:
    c, panel = window.controller, window.panel
    record = c.new_session("q4")
    assert "send a message" in panel.quality_label.text()
    assert not panel.quality_action.isEnabled()
    assert send_and_wait(qtbot, window, "Tell me about the sea.") == "complete"
    qtbot.waitUntil(panel.quality_action.isEnabled, timeout=5_000)
    assert NOT_MEASURED in panel.quality_label.text()
    assert _quality_cell(window, "q4") == "—"
    progress: list = []
    c.ingestProgress.connect(progress.append)
    with qtbot.waitSignal(c.qualityChecked, timeout=ANSWER_TIMEOUT_MS) as done:
        panel.quality_action.trigger()
        assert c.active_kind == "quality"
        assert not panel.quality_action.isEnabled()  # one request at a time
        assert "quality check is running" in panel.quality_label.text()
    session_id, receipt = done.args
    assert session_id == record.id and receipt.mode == "q4"
    assert receipt.context_tokens > 0 and receipt.window_tokens == receipt.positions
    assert receipt.kl_mean > 0.0 and 0.0 <= receipt.top1 <= 1.0
    qtbot.waitUntil(lambda: not c.busy, timeout=ANSWER_TIMEOUT_MS)
    assert progress and progress[-1].tokens_done == receipt.window_tokens
    line = receipt_line(receipt)
    assert line in panel.quality_label.text().replace("&amp;", "&")
    # Two sentences: the verdict, then what to do about it.
    assert window.banner.label.text() == f"{line}. {advice(receipt)}"
    assert _quality_cell(window, "q4") == f"{receipt.top1:.1%}"
    assert c.store.receipts(record.id) == {"q4": receipt}
    # Shown again after reading another chat.
    other = c.new_session("q8")
    assert _quality_cell(window, "q4") == "—" and other.id != record.id
    c.select_session(record.id)
    assert _quality_cell(window, "q4") == f"{receipt.top1:.1%}"
    # A receipt of another model is not this model's verdict.
    c.store.save_receipt(record.id, replace(receipt, model="another-model"),
                         c.settings.system_prompt)
    c.select_session(other.id)
    c.select_session(record.id)
    assert _quality_cell(window, "q4") == "—"
    assert ("out of date: it ran on another-model, not the model loaded now"
            in panel.quality_label.text())
    c.store.save_receipt(record.id, receipt, c.settings.system_prompt)
    c.select_session(other.id)
    c.select_session(record.id)
    assert _quality_cell(window, "q4") == f"{receipt.top1:.1%}"
    # Nor one of pages rotated otherwise than the chat's (a receipt copied by Reopen in…).
    c.store.save_receipt(record.id, replace(receipt, rotated=not receipt.rotated),
                         c.settings.system_prompt)
    c.select_session(other.id)
    c.select_session(record.id)
    assert _quality_cell(window, "q4") == "—"
    said = ("it measured unrotated pages; this chat rotates them" if receipt.rotated
            else "it measured rotated pages; this chat keeps them unrotated")
    assert said in panel.quality_label.text()
    c.store.save_receipt(record.id, receipt, c.settings.system_prompt)
    c.select_session(other.id)
    c.select_session(record.id)
    assert _quality_cell(window, "q4") == f"{receipt.top1:.1%}"
    # Nor is one of text the chat no longer is: it says so, and what it said then.
    assert send_and_wait(qtbot, window, "And the sky?") == "complete"
    qtbot.waitUntil(lambda: "out of date" in panel.quality_label.text(), timeout=5_000)
    assert _quality_cell(window, "q4") == "—"
    assert "the chat has changed since" in panel.quality_label.text()
    assert f"Then: {receipt_summary(receipt)}" in panel.quality_label.text()
    assert advice(receipt) not in panel.quality_label.text()


def test_stop_cancels_the_check_and_nothing_is_stored(qtbot, window, monkeypatch) -> None:
    c = window.controller
    record = c.new_session("q8")
    assert send_and_wait(qtbot, window, "Tell me about the sea.") == "complete"
    # Small chunks, and the first one waits for Stop: the check is mid-window when it lands.
    monkeypatch.setattr(quality_check, "CHUNK_TOKENS", 4)
    stopped = threading.Event()
    original = quality_check.divergence

    def wait_for_stop(reference, variant):
        stopped.wait(30)
        return original(reference, variant)

    monkeypatch.setattr(quality_check, "divergence", wait_for_stop)
    assert c.check_quality()
    qtbot.waitUntil(lambda: (c.active_request or -1) > 0, timeout=ANSWER_TIMEOUT_MS)
    with qtbot.waitSignal(c.busyChanged, timeout=ANSWER_TIMEOUT_MS,
                          check_params_cb=lambda busy: not busy):
        c.stop()
        stopped.set()
    assert window.banner.label.text() == "Quality check cancelled; nothing was stored."
    assert c.store.receipts(record.id) == {}


def test_disabled_with_a_reason(qtbot, window) -> None:
    c, panel = window.controller, window.panel
    c.new_session("fp16")
    assert not panel.quality_action.isEnabled()
    assert "fp16, the reference itself" in panel.quality_label.text()
    assert "fp16, the reference itself" in panel.quality_action.toolTip()
    assert not c.check_quality()
    assert "nothing to compare" in window.banner.label.text()


def test_a_receipt_stays_with_its_chat_while_another_is_read(qtbot, window) -> None:
    c = window.controller
    checked = c.new_session("q6")
    assert send_and_wait(qtbot, window, "Tell me about the sea.") == "complete"
    with qtbot.waitSignal(c.qualityChecked, timeout=ANSWER_TIMEOUT_MS) as done:
        assert c.check_quality()
        c.new_session("q4")  # read another chat meanwhile
    assert done.args[0] == checked.id
    assert "on this document" not in window.banner.label.text()
    assert _quality_cell(window, "q6") == "—"  # the q4 chat has no q6 receipt
    assert set(c.store.receipts(checked.id)) == {"q6"}
    c.select_session(checked.id)
    assert _quality_cell(window, "q6") == f"{done.args[1].top1:.1%}"


def _row_line(window, session_id: str) -> str:
    from app.sessions.session_list import RecordRole, StateRole, detail_text

    items = (window.sessions.list.item(i) for i in range(window.sessions.list.count()))
    item = next(i for i in items if i.data(RecordRole).id == session_id)
    return detail_text(item.data(RecordRole), item.data(StateRole))


def test_a_running_check_says_checking_everywhere_without_a_rate(qtbot, window,
                                                                 monkeypatch) -> None:
    c = window.controller
    record = c.new_session("q8")
    assert send_and_wait(qtbot, window, "Tell me about the sea.") == "complete"
    monkeypatch.setattr(quality_check, "CHUNK_TOKENS", 4)
    stopped = threading.Event()
    original = quality_check.divergence
    calls: list[int] = []

    def wait_for_stop(reference, variant):
        calls.append(1)
        if len(calls) > 1:  # the first chunk (one token) is said, the second waits
            stopped.wait(30)
        return original(reference, variant)

    monkeypatch.setattr(quality_check, "divergence", wait_for_stop)
    assert c.check_quality()
    # The first chunk's progress has come: the row shows counts only.
    composer = window.composer
    qtbot.waitUntil(lambda: "/" in composer.progress_label.text(), timeout=ANSWER_TIMEOUT_MS)
    assert composer.progress_title.text() == "Checking quality"
    label = composer.progress_label.text().replace("\u00a0", " ")
    assert " / " in label and label.endswith(" tokens")
    assert "tokens/s" not in label and "left" not in label
    assert _row_line(window, record.id).startswith("Checking quality…")
    assert "Checking quality…" in window.panel.session_label.text()
    with qtbot.waitSignal(c.busyChanged, timeout=ANSWER_TIMEOUT_MS,
                          check_params_cb=lambda busy: not busy):
        c.stop()
        stopped.set()


def test_a_check_on_a_stored_chat_leaves_it_on_disk_with_one_count(qtbot, window) -> None:
    c, panel = window.controller, window.panel
    record = c.new_session("q6")
    assert send_and_wait(qtbot, window, "Tell me about the sea.") == "complete"
    c.caches.close(record.id)  # stored on disk as it leaves memory
    qtbot.waitUntil(lambda: c.bridge.stored_snapshot(record.id) is not None,
                    timeout=ANSWER_TIMEOUT_MS)
    stored = c.bridge.stored_snapshot(record.id).tokens
    with qtbot.waitSignal(c.qualityChecked, timeout=ANSWER_TIMEOUT_MS) as done:
        assert c.check_quality()
    qtbot.waitUntil(lambda: not c.busy, timeout=ANSWER_TIMEOUT_MS)
    window.panel_feed.refresh()
    # Its cache was opened for the check but holds nothing: still on disk, said once.
    label = panel.session_label.text()
    assert f"On disk: {stored:,} tokens stored" in label and "in memory" not in label.lower()
    assert "0 tokens" not in panel.kv_label.text() and "0 B" not in panel.kv_label.text()
    assert _row_line(window, record.id).startswith(f"On disk · {stored:,} tokens · ")
    # The receipt names no other count of the chat than the one shown everywhere;
    # its details say why the check's own count is a little higher.
    receipt = done.args[1]
    assert 0 <= receipt.context_tokens - stored <= 8  # the closing marks of one turn
    shown = panel.quality_label.text() + " " + receipt_numbers(receipt)
    assert f"{receipt.context_tokens:,}" not in shown.replace(f"{stored:,}", "")
    assert "end-of-turn marks" in panel.quality_label.toolTip()


def test_a_check_that_fails_while_another_chat_is_read_names_its_chat(
        qtbot, window, monkeypatch) -> None:
    c = window.controller
    c.new_session("q6")
    assert send_and_wait(qtbot, window, "Tell me about the sea.") == "complete"
    checking = threading.Event()

    def out_of_memory(*args, **kwargs):
        checking.wait(30)
        raise MemoryPressure("Memory turned critical, so the quality check stopped.")

    monkeypatch.setattr(quality_check, "check_quality", out_of_memory)
    assert c.check_quality()
    c.new_session("q4")  # read another chat meanwhile
    with qtbot.waitSignal(c.errorRaised, timeout=ANSWER_TIMEOUT_MS) as failed:
        checking.set()
    assert failed.args[0] == ("In ‘Tell me about the sea.’: Memory turned critical, so the "
                              "quality check stopped.")


def test_a_receipt_speaks_for_the_text_the_engine_read(tmp_path) -> None:
    store = HistoryStore(tmp_path / "history.sqlite3")
    record = store.create_session("t", "q6", "demo")
    store.add_message(record.id, "user", "Summarise the pines", "complete")
    store.add_message(record.id, "assistant", "", "failed")  # the model never read it
    store.add_message(record.id, "user", "Summarise the pines", "complete")
    store.add_message(record.id, "assistant", "They grow tall.", "complete")
    store.save_receipt(record.id, RECEIPT, "Be brief.")
    assert store.outdated_receipts(record.id, "Be brief.") == set()
    # Another system prompt: the engine now reads another conversation.
    assert store.outdated_receipts(record.id, "Be thorough.") == {"q6"}
    # Reopen in… copies only the turns the engine read: the copy's receipts still speak
    # for it (were "the chat has changed since", comparing every stored row).
    copy = store.create_session("t · q4", "q4", "demo")
    for message in store.messages(record.id):
        if message.status != "failed":
            store.add_message(copy.id, message.role, message.content, message.status)
    store.copy_receipts(record.id, copy.id)
    assert store.outdated_receipts(copy.id, "Be brief.") == set()
    store.close()
