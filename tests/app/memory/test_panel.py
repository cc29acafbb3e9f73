"""The memory panel describes the chat on screen, and only that chat."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QLabel

from app.format import human_bytes, short_tokens
from app.memory.panel import NO_CACHE, MemoryPanel, pages_text, shared_note, together_line
from app.sessions.caches import KvTotal
from engine.cache.modes import MODES
from engine.session.sampling import SamplingParams
from tests.app.conftest import ANSWER_TIMEOUT_MS, send_and_wait
from tests.app.scripted import sample as scripted_sample

NOTHING = KvTotal(0, 0)  # no chat holds pages


def _bold_row(window) -> str | None:
    table = window.panel.table
    for row, mode in enumerate(MODES):
        item = table.item(row, 0)
        if item is not None and item.font().bold():
            return mode
    return None


def _assert_panel_shows(window, record) -> None:
    """Every panel field is the shown chat's: one sample of that session, or none."""
    panel, c = window.panel, window.controller
    assert panel.session_id == record.id
    # The badge says how the chat's cache in memory stores rows ("q4 · rotated").
    rotated = c.caches.rotations.get(record.id)
    badge = f"{record.kv_mode} · rotated" if rotated else record.kv_mode
    assert f">&nbsp;{badge}&nbsp;<" in panel.session_label.text()
    assert record.title in panel.session_label.text()
    assert _bold_row(window) == record.kv_mode
    sample = c.caches.sample_for(record.id)
    if sample is None:
        assert panel.kv_tokens is None
        assert panel.kv_label.text().startswith(NO_CACHE)
        assert panel.pool.in_use == panel.pool.allocated == 0
        assert panel.kv_bar.value() == 0
        return
    assert sample.session_id == record.id and sample.kv_mode == record.kv_mode
    assert panel.kv_tokens == sample.tokens_in_context > 0
    text = panel.kv_label.text()
    assert f"{sample.tokens_in_context:,} tokens" in text
    assert human_bytes(sample.kv_bytes_used) in text
    assert panel.pool.in_use == sample.pages_in_use
    assert panel.pool.allocated == sample.pages_allocated
    assert f"{sample.pages_in_use:,} pages in use across " in panel.pages_label.text()
    assert "per layer" in panel.pages_label.text()
    # The "Chat" column is computed for the same token count as the KV line.
    assert panel.now_tokens == sample.tokens_in_context
    assert f"Chat: its {sample.tokens_in_context:,} tokens" in panel.projection_note.text()


def _follows(qtbot, window, record) -> None:
    qtbot.waitUntil(lambda: _settled(window, record), timeout=ANSWER_TIMEOUT_MS)
    _assert_panel_shows(window, record)


def _settled(window, record) -> bool:
    sample = window.controller.caches.sample_for(record.id)
    tokens = sample.tokens_in_context if sample else None
    return window.panel.kv_tokens == tokens and (
        tokens is None or window.panel.now_tokens == tokens)


def test_every_panel_field_follows_the_chat_on_screen(qtbot, window) -> None:
    c = window.controller
    first = c.new_session("q8")
    assert send_and_wait(qtbot, window, "hello there") == "complete"
    _follows(qtbot, window, c.current)

    # A new empty chat in another mode shows no cache, not the previous chat's pages.
    second = c.new_session("q6")
    _assert_panel_shows(window, second)
    assert send_and_wait(qtbot, window, "a second chat, a little longer than the first") \
        == "complete"
    _follows(qtbot, window, c.current)
    second_tokens = window.panel.kv_tokens

    c.select_session(first.id)
    _follows(qtbot, window, c.current)
    assert window.panel.kv_tokens != second_tokens

    # While an answer streams, the panel follows that chat's samples as they grow.
    third = c.new_session("fp16")
    _assert_panel_shows(window, third)
    c.settings.sampling = SamplingParams(temperature=0.0, max_tokens=400)
    window.composer.set_text("Tell me a long story")
    with qtbot.waitSignal(c.answerFinished, timeout=ANSWER_TIMEOUT_MS):
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
        qtbot.waitUntil(lambda: (window.panel.kv_tokens or 0) > 0, timeout=ANSWER_TIMEOUT_MS)
        _follows(qtbot, window, c.store.session(third.id))
        c.stop()
    _follows(qtbot, window, c.store.session(third.id))

    c.select_session(second.id)
    _follows(qtbot, window, c.current)
    assert window.panel.kv_tokens == second_tokens


def test_a_chat_whose_cache_was_dropped_says_so_and_what_is_on_disk(qtbot, window) -> None:
    c = window.controller
    c.new_session("q4")
    assert send_and_wait(qtbot, window, "hello") == "complete"
    _follows(qtbot, window, c.current)
    held = c.caches.sample_for(c.current.id).tokens_in_context
    assert c.bridge.stored_snapshot(c.current.id) is None  # in memory, not on disk yet
    c.caches.close(c.current.id)  # the worker stores it on disk as it leaves memory
    qtbot.waitUntil(lambda: c.bridge.stored_snapshot(c.current.id) is not None,
                    timeout=ANSWER_TIMEOUT_MS)
    window.panel_feed.refresh()
    _assert_panel_shows(window, c.current)
    on_disk = c.bridge.stored_snapshot(c.current.id)
    assert (on_disk.tokens, on_disk.mode) == (held, "q4")
    # One sentence says where the chat is; nothing else on the panel says it another way.
    sentence = (f"On disk: {held:,} tokens stored ({human_bytes(on_disk.disk_bytes)}); the "
                "next message reopens them instead of reading the chat again.")
    assert sentence in window.panel.session_label.text()
    assert window.panel.kv_label.text() == NO_CACHE
    assert window.panel.kv_total_label.text() == "All open chats together: 0 B"
    assert window.panel.projection_note.text().startswith(f"Chat: its {held:,} tokens · ")
    everything = " ".join(label.text() for label in window.panel.findChildren(QLabel))
    for other_wording in ("rebuilt on next send", "reopened on next send",
                          "read again on next send"):
        assert other_wording not in everything


def test_the_mode_badge_says_when_the_rows_are_rotated(qtbot, window) -> None:
    c = window.controller
    c.settings.rotate_kv = True
    c.new_session("q6")
    send_and_wait(qtbot, window, "Hello")
    qtbot.waitUntil(lambda: "q6 · rotated" in window.panel.session_label.text(), timeout=5000)
    c.settings.rotate_kv = False
    c.new_session("q6")
    send_and_wait(qtbot, window, "Hello")
    qtbot.waitUntil(lambda: c.current.id in c.caches.rotations, timeout=5000)
    window.panel_feed.refresh()
    assert "rotated" not in window.panel.session_label.text()


def test_a_new_chat_has_nothing_to_read_again(qtbot, window) -> None:
    c = window.controller
    c.new_session("q8")
    window.panel_feed.refresh()
    assert window.panel.kv_label.text() == NO_CACHE
    label = window.panel.session_label.text()
    assert "New chat: nothing to read yet." in label and "rebuilt" not in label
    assert c.cache_state(c.current.id) == "New chat: nothing to read yet."


def test_the_system_memory_gauge_shows_ram_when_the_chat_holds_nothing(qtbot, window) -> None:
    c = window.controller
    c.new_session("q8")
    window.panel.ram_label.setText("—")
    window.panel_feed.refresh()
    assert c.caches.sample_for(c.current.id) is None
    text = window.panel.ram_label.text()
    assert text != "—" and "% </b>" not in text and "free of" in text
    assert window.panel.ram_bar.value() > 0


def test_engineering_numbers_are_under_details_and_plain_words_first(qtbot, window) -> None:
    panel = window.panel
    assert send_and_wait(qtbot, window, "hello") == "complete"
    qtbot.waitUntil(lambda: panel.kv_tokens is not None, timeout=ANSWER_TIMEOUT_MS)
    assert not panel.details.isVisible()
    for label in (panel.pages_label, panel.ram_detail, panel.kv_detail, panel.storage_note):
        assert panel.details.isAncestorOf(label)
    assert "MLX" in panel.ram_detail.text() and "allocated" in panel.kv_detail.text()
    shown = " ".join(label.text() for label in panel.findChildren(QLabel)
                     if label.isVisible())
    for jargon in ("MLX", "allocated", "pressure n/a", "tokens/page", "RAM fits",
                   "Storage arithmetic"):
        assert jargon not in shown
    sections = [label.text() for label in panel.findChildren(QLabel)
                if label.objectName() == "panelSection"]
    assert "MEMORY THIS CHAT USES" in sections
    assert panel.fits_label.text().startswith("Fits in free memory: the whole context (")
    assert "per layer" in panel.pages_label.toolTip()
    panel.details_button.click()
    assert panel.details.isVisible() and panel.pages_label.isVisible()


def test_free_ram_fits_is_capped_at_the_model_context(window) -> None:
    from app.memory.panel import _fits_text

    # The context as the toolbar and the Models dialog say it ("8.1k context").
    assert _fits_text(10**9, 8192) == "all 8.1k"
    assert _fits_text(4000, 8192) == "4k"
    # Rounded down: part of the context never reads as the whole of it.
    assert _fits_text(7_600, 8192) == "7.6k"
    # Just short of it, the count in full: its short figure is the context's own.
    assert _fits_text(8_150, 8192) == "8,150"
    assert _fits_text(131_000, 131_072) == "131,000"
    window.panel_feed.refresh()
    fits = [window.panel.table.item(row, 2) for row in range(len(MODES))]
    # The tiny model's context is far below what free RAM holds, in every mode.
    assert all(item is not None and item.text().startswith("all ") for item in fits)


def test_the_shared_part_of_a_chats_pages_is_named() -> None:
    def note(shared: int, others: int) -> str:
        return shared_note(SimpleNamespace(kv_shared_bytes=shared, kv_shared_with=others))

    assert note(0, 0) == "" and note(0, 1) == ""
    assert note(4 * 2**20, 1) == f" · {human_bytes(4 * 2**20)} shared with 1 other chat"
    assert note(2**20, 2).endswith("shared with 2 other chats")


def test_layers_outside_the_pages_have_their_own_line(qtbot) -> None:
    from dataclasses import replace

    from app.memory.panel import MemoryPanel
    from engine.memory.stats import MemoryUsage, stats_sample

    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.set_session("Notes", "q6", "held", "s1")
    plain = replace(stats_sample("s1", None, MemoryUsage(1, 2, 3, 4, 5, 6, 7.5, 8, None)),
                    tokens_in_context=10)
    panel.update_sample(plain, NOTHING)
    assert "Other layers" not in panel.kv_label.text()
    windows = replace(plain, other_cache_bytes=20 << 20, other_cache_bound_bytes=24 << 20,
                      other_cache_kinds="sliding windows")
    panel.update_sample(windows, NOTHING)
    assert "<br>Other layers: 20.0 MB of ≤ 24.0 MB (sliding windows)" in panel.kv_label.text()
    assert "checkpoints" not in panel.kv_label.text()
    kept = replace(windows, checkpoint_bytes=72 << 20, checkpoint_bound_bytes=96 << 20)
    panel.update_sample(kept, NOTHING)
    assert ("<br>Other layers: 20.0 MB of ≤ 24.0 MB (sliding windows) · checkpoints "
            "72.0 MB of ≤ 96.0 MB") in panel.kv_label.text()


def test_the_panel_keeps_each_chats_history_and_labels_what_it_shows(qtbot) -> None:
    from tests.app.scripted import sample

    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.show()
    panel.set_session("A", "q8", "", "a")
    for tokens in (100, 200, 300):
        panel.update_sample(sample("a", tokens, tokens * 1000), NOTHING)
    panel.set_session("B", "q4", "", "b")
    assert list(panel.chart.kv) == []  # B's own history, empty so far
    panel.update_sample(sample("b", 50, 50_000), NOTHING)
    panel.set_session("A", "q8", "", "a")  # back to A: its history is still there
    assert list(panel.chart.kv) == [100_000, 200_000, 300_000]
    # No bar without a label: how full the pages are sits under the line saying it.
    assert panel.details.isAncestorOf(panel.kv_bar) and not panel.kv_bar.isVisible()
    # The table's first column is the chat's tokens in each mode, held now or not.
    assert panel.table.horizontalHeaderItem(0).text() == "Chat"


def test_the_chats_answering_together_are_listed_with_their_kv_bytes(qtbot) -> None:
    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.show_together([("Pines", 2 << 20)])  # one chat answers: nothing to list
    assert panel.together_label.isHidden()
    long_title = "Notes on the longleaf pine savanna and its fire regime over a century"
    panel.show_together([("Pines", 2 << 20), ("<b>Oaks</b>", 1 << 20), (long_title, None)])
    assert not panel.together_label.isHidden()
    assert panel.together_label.text() == (
        "Answering together: ‘Pines’ 2.0 MB · ‘<b>Oaks</b>’ 1.0 MB · "
        "‘Notes on the longleaf…’ no pages yet")
    assert panel.together_label.textFormat() == Qt.TextFormat.PlainText  # a title is text
    assert together_line([]) == "" and together_line([("Pines", 1)]) == ""
    panel.show_together([])
    assert panel.together_label.isHidden()


def test_the_page_figures_add_up_where_a_chat_shares_storage_with_others() -> None:
    # A chat on a shared document: 32 pages of its own and the document's, in storage
    # of 96 whose other 64 hold another chat's answer.
    sample = replace(scripted_sample("b", 512), pages_in_use=32, pages_allocated=96,
                     pages_free=0, layers=())
    assert "32 pages in use · 96 allocated · 0 free · 64 other chats' ·" in pages_text(sample)
    alone = replace(sample, pages_allocated=40, pages_free=8)
    assert "other chats'" not in pages_text(alone)


def test_the_fits_column_and_sentence_count_the_memory_limit(qtbot) -> None:
    """Under a memory limit (Settings) smaller than free RAM, the panel's "Fits"
    says what the limit holds, as the fit line above the composer does."""
    from engine.memory.fit import fit_report

    def report(tokens: int, budget: int | None):
        return fit_report(token_count=tokens, attention_layers=2, kv_heads=2, head_dim=64,
                          max_context=131_072, page_size=16, available_bytes=16 << 30,
                          budget_bytes=budget, session_mode="q8")

    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.set_session("Notes", "q8", "held", "s1")
    panel.update_projection(report(300, None), report(131_072, None))
    assert panel.fits_label.text() == (
        "Fits in free memory: the whole context (131,072 tokens) in q8.")
    limited = report(300, 1 << 20)
    held = limited.for_mode("q8").tokens_fit_budget
    assert held is not None and held < 131_072
    panel.update_projection(limited, report(131_072, 1 << 20))
    assert panel.fits_label.text() == (
        f"Fits in your memory limit (Settings): {held:,} of 131,072 tokens in q8.")
    row = list(MODES).index("q8")
    assert panel.table.item(row, 2).text() == short_tokens(held)


def test_deleting_a_chat_not_on_screen_takes_its_bytes_out_of_the_total(qtbot, window) -> None:
    controller = window.controller
    first = controller.new_session("q8")
    assert send_and_wait(qtbot, window, "hello there, first chat") == "complete"
    controller.new_session("q8")
    assert send_and_wait(qtbot, window, "a second chat, a little longer than the first") == \
        "complete"
    qtbot.waitUntil(lambda: len(controller.caches.samples) == 2, timeout=ANSWER_TIMEOUT_MS)
    both = controller.caches.total()
    controller.delete_session(first.id)
    left = controller.caches.total()
    assert left.used < both.used and left.held < both.held
    # A chat's storage holds room ahead of its pages (it grows in steps).
    assert left.held > left.used
    assert window.panel.kv_total_label.text() == (
        f"All open chats together: {human_bytes(left.used)} ({human_bytes(left.held)} held)")


def test_the_total_says_the_storage_held_only_when_it_is_more(qtbot) -> None:
    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.show_total(KvTotal(1_500_000, 1_500_000))
    assert panel.kv_total_label.text() == "All open chats together: 1.4 MB"
    panel.show_total(KvTotal(1_500_000, 2_600_000))
    assert panel.kv_total_label.text() == "All open chats together: 1.4 MB (2.5 MB held)"


def test_a_memory_limit_saved_in_settings_shows_in_the_fit_at_once(qtbot, window,
                                                                   monkeypatch) -> None:
    """No stats sample follows the engine taking a new limit: the window asks for
    the fit again itself, in the panel and in the fit line above the composer."""
    from app.window import main_window

    window.controller.new_session("q8")
    window.panel_feed.refresh()
    assert window.panel.fits_label.text().startswith("Fits in free memory:")
    monkeypatch.setattr(main_window.SettingsDialog, "exec", lambda dialog: 1)  # Save pressed
    window.settings.memory_budget_bytes = 1 << 20  # what the dialog saves for "1 MB"
    window.open_settings()
    qtbot.waitUntil(lambda: window.panel.fits_label.text().startswith(
        "Fits in your memory limit (Settings):"), timeout=5_000)
    qtbot.waitUntil(lambda: window.fit.last_report is not None
                    and window.fit.last_report.budget_bytes is not None, timeout=5_000)


def test_no_model_ready_empties_the_projection_of_the_chat_before(qtbot) -> None:
    """A model loading (or none that fits) gives no fit report: the table and the
    "Fits" sentence must not keep the previous chat's figures and mode tint."""
    from engine.memory.fit import fit_report

    def report(tokens: int):
        return fit_report(token_count=tokens, attention_layers=2, kv_heads=2, head_dim=64,
                          max_context=131_072, page_size=16, available_bytes=16 << 30,
                          session_mode="q8")

    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.set_session("A", "q8", "held", "a")
    panel.update_projection(report(300), report(131_072))
    assert panel.fits_label.text()
    panel.set_session("B", "q4", "on disk", "b")
    panel.update_projection(None, None)
    assert panel.fits_label.text() == "" and panel.fits_label.isHidden()
    assert panel.projection_note.isHidden() and panel.now_tokens is None
    for row, mode in enumerate(MODES):
        for column in range(3):
            item = panel.table.item(row, column)
            assert item is not None and item.text() == ""
            assert item.font().bold() == (mode == "q4")  # the chat shown now's row


def test_one_token_and_one_other_chat_are_said_in_the_singular(qtbot) -> None:
    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.set_session("C", "q8", "held", "c")
    one = replace(scripted_sample("c", 1, 4096), kv_shared_bytes=4096, kv_shared_with=1)
    panel.update_sample(one, NOTHING)
    assert panel.kv_label.text().startswith(
        "<b>4.0 KB</b> for 1 token · 4.0 KB shared with 1 other chat")


def test_the_last_page_is_0_or_100_percent_full_only_when_it_is() -> None:
    page = replace(scripted_sample("c", 257), page_size=256, pages_in_use=2,
                   pages_allocated=2, pages_free=0, layers=())
    said = {fill: pages_text(replace(page, last_page_fill=fill))
            for fill in (1 / 256, 255 / 256, 1.0, 128 / 256)}
    assert "last page <1% full" in said[1 / 256]
    assert "last page >99% full" in said[255 / 256]
    assert "last page 100% full" in said[1.0] and "last page 50% full" in said[128 / 256]


def test_the_history_legend_holds_no_kv_figure_once_the_cache_is_dropped(qtbot) -> None:
    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.set_session("C", "q8", "held", "c")
    panel.update_sample(scripted_sample("c", 300, 4096), NOTHING)
    assert panel.chart.legend()[0] == "● KV 4.0 KB"
    panel.show_no_cache()  # the chat's cache left memory
    assert panel.chart.legend()[0] == "● KV none in memory"
    assert list(panel.chart.kv) == [4096]  # its history stays


def test_the_bars_and_drawings_have_names_a_screen_reader_can_say(qtbot) -> None:
    panel = MemoryPanel()
    qtbot.addWidget(panel)
    names = [w.accessibleName() for w in (panel.ram_bar, panel.kv_bar, panel.pool, panel.chart,
                                          panel.stored_kv.bar)]
    assert all(names) and len(set(names)) == len(names), names
