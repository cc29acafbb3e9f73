"""Dropping files on the window: chips, token counts, bad files, the fit check."""

from __future__ import annotations

import json
from pathlib import Path

from PySide6.QtCore import QMimeData, QPoint, QPointF, Qt, QUrl
from PySide6.QtGui import QDragEnterEvent, QDropEvent, QFileOpenEvent
from PySide6.QtWidgets import QApplication, QToolButton

from app.chat.model import ChatMessage, engine_content
from app.format import human_bytes
from engine.cache.kvquant import project_kv_bytes

TEXT = "Longleaf pines grow in the sandy coastal plain. Fire keeps the floor open.\n"


def drop_files(window, paths: list[Path]) -> None:
    """A real drag enter + drop with file URLs, aimed at the conversation area."""
    mime = QMimeData()
    mime.setUrls([QUrl.fromLocalFile(str(p)) for p in paths])
    target = window.conversation.viewport()
    pos = QPoint(40, 40)
    enter = QDragEnterEvent(pos, Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                            Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(target, enter)
    assert enter.isAccepted()
    drop = QDropEvent(QPointF(pos), Qt.DropAction.CopyAction, mime, Qt.MouseButton.LeftButton,
                      Qt.KeyboardModifier.NoModifier)
    QApplication.sendEvent(target, drop)
    assert drop.isAccepted()


def test_dropped_document_becomes_a_chip_with_its_tokens(qtbot, window, tmp_path) -> None:
    doc = tmp_path / "pines.md"
    doc.write_text(TEXT * 20)
    window.composer.set_text("keep this draft")
    drop_files(window, [doc])
    qtbot.waitUntil(lambda: bool(window.attachments), timeout=20_000)
    (record,) = window.attachments.values()
    assert record.name == "pines.md" and record.size == doc.stat().st_size
    assert record.tokens == window.controller.bridge.count_tokens(TEXT * 20)
    (chip,) = window.composer.chips.values()
    assert chip.label.text() == (
        f"pines.md · {human_bytes(record.size)} · {record.tokens:,} tokens")
    assert window.composer.text() == "keep this draft"


def test_a_file_dropped_again_is_attached_once(qtbot, window, tmp_path) -> None:
    doc = tmp_path / "pines.md"
    doc.write_text(TEXT * 5)
    copy = tmp_path / "pines copy.md"  # the same text under another name: one copy too
    copy.write_text(TEXT * 5)
    chat = window.controller.new_session("q8")
    drop_files(window, [doc])
    qtbot.waitUntil(lambda: bool(window.attachments), timeout=20_000)
    for again, said in ((doc, "“pines.md” is already attached"),
                        (copy, "“pines copy.md” holds the same text as “pines.md”")):
        drop_files(window, [again])
        qtbot.waitUntil(lambda s=said: s in window.composer.notice.text(), timeout=20_000)
        assert [r.name for r in window.attachments.values()] == ["pines.md"]
        assert len(window.composer.chips) == 1
    # Dropped again, then its chat left before the read ended: its draft takes no copy.
    drop_files(window, [doc])
    window.controller.new_session("q4")
    qtbot.waitUntil(lambda: not window.loader.pending, timeout=20_000)
    assert [r.name for r in window.controller.store.draft_attachments(chat.id)] == ["pines.md"]


def test_bad_files_get_an_inline_message_and_disturb_nothing(qtbot, window, tmp_path) -> None:
    good = tmp_path / "good.txt"
    good.write_text(TEXT)
    drop_files(window, [good])
    qtbot.waitUntil(lambda: bool(window.attachments), timeout=20_000)
    window.composer.set_text("my draft")
    cases = {
        "blob.txt": (b"\x00\x01\x02binary" * 10, "looks like a binary file"),
        "empty.md": (b"", "is empty"),
        "photo.heic": (b"abc", "can't read .heic files"),
    }
    for name, (data, message) in cases.items():
        (tmp_path / name).write_bytes(data)
        drop_files(window, [tmp_path / name])
        qtbot.waitUntil(lambda m=message: m in window.composer.notice.text(), timeout=20_000)
        assert window.composer.notice.isVisible()
        assert name in window.composer.notice.text()
        assert [r.name for r in window.attachments.values()] == ["good.txt"]
        assert len(window.composer.chips) == 1
        assert window.composer.text() == "my draft"
        assert not window.banner.isVisible()


def test_fit_check_numbers_match_the_kv_projection(qtbot, window, tiny_llama, tmp_path) -> None:
    config = json.loads((tiny_llama / "config.json").read_text())
    layers = config["num_hidden_layers"]
    kv_heads = config["num_key_value_heads"]
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    doc = tmp_path / "report.txt"
    doc.write_text(TEXT * 40)
    drop_files(window, [doc])
    qtbot.waitUntil(lambda: bool(window.attachments), timeout=20_000)
    window.fit.run()
    (record,) = window.attachments.values()
    answer = window.controller.settings.sampling.max_tokens
    # The document as the engine reads it: in its block, in the chat's first turn.
    bridge = window.controller.bridge
    read = (bridge.count_tokens(engine_content(ChatMessage("user", "", attachments=(record,))))
            + bridge.turn_overhead(window.controller.settings.system_prompt).first)
    assert read > record.tokens
    assert window.fit.last_total == window.fit.context_tokens() + read + answer
    report = window.fit.last_report
    pages = -(-window.fit.last_total // 256) * 256
    text = window.composer.fit.text()
    assert window.composer.fit.isVisible() and f"{window.fit.last_total:,} of " in text
    for mode in ("fp16", "q8", "q6", "q4"):
        expected = project_kv_bytes(layers, kv_heads, head_dim, pages, mode)
        assert report.for_mode(mode).bytes_needed == expected
        assert f"{mode} {human_bytes(expected)}" in text


def test_fit_check_says_plainly_when_it_wont_fit(qtbot, window, tmp_path) -> None:
    doc = tmp_path / "long.txt"
    doc.write_text(TEXT * 300)  # more tokens than the tiny model's 4,096 context
    drop_files(window, [doc])
    qtbot.waitUntil(window.composer.offer_box.isVisible, timeout=20_000)
    window.composer.offer_accept.click()  # the part that fits fills the room left...
    qtbot.waitUntil(lambda: bool(window.attachments), timeout=20_000)
    window.composer.set_text("and a question " * 40)  # ...so a typed question is too much
    window.fit.run()
    assert window.fit.last_total > window.fit.last_report.max_context
    text = window.composer.fit.text()
    assert "won't fit" in text and f"{window.fit.last_report.max_context:,} tokens" in text
    assert window.composer.fit.property("ok") is False
    # What the line says is what Send does: it is off, and Return sends nothing.
    assert not window.composer.send_button.isEnabled()
    assert "longer than the model's context" in window.composer.send_button.toolTip()
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    assert not window.controller.busy and window.controller.model.rowCount() == 0
    assert "longer than the model's context" in window.banner.label.text()
    # Shortened, the message fits: Send is on again.
    window.composer.set_text("and a question")
    window.fit.run()
    assert window.composer.send_button.isEnabled()


def test_the_part_offered_fits_once_it_is_attached(qtbot, window, tmp_path) -> None:
    # The offer leaves room for what the fit line adds to the file's own tokens:
    # the chat template's, the document block's and the answer's reserve.
    window.controller.new_session("q8")
    doc = tmp_path / "long.txt"
    doc.write_text(TEXT * 300)  # more tokens than the tiny model's 4,096 context
    drop_files(window, [doc])
    qtbot.waitUntil(window.composer.offer_box.isVisible, timeout=20_000)
    window.composer.offer_accept.click()
    qtbot.waitUntil(lambda: bool(window.attachments), timeout=20_000)
    window.fit.run()
    report = window.fit.last_report
    assert window.fit.last_total <= report.max_context
    assert window.composer.fit.property("ok") is True, window.composer.fit.text()
    # The line names what its total holds besides the file's own tokens.
    (record,) = window.attachments.values()
    formatting = window.fit.last_prompt_tokens - record.tokens
    assert (f"this message {window.fit.last_prompt_tokens:,} ({formatting:,} of them chat "
            "formatting) + 24 kept for the answer") in window.composer.fit.text()


def test_documents_opened_on_the_app_icon_are_attached(qtbot, window, tmp_path) -> None:
    doc = tmp_path / "from-finder.txt"
    doc.write_text(TEXT)
    QApplication.sendEvent(QApplication.instance(), QFileOpenEvent(str(doc)))
    qtbot.waitUntil(lambda: bool(window.attachments), timeout=20_000)
    assert [r.name for r in window.attachments.values()] == ["from-finder.txt"]


def test_a_file_too_long_is_measured_in_tokens_and_its_fitting_part_offered(
        qtbot, window, tmp_path) -> None:
    room = window.fit.room("big.txt")
    doc = tmp_path / "big.txt"
    text = TEXT * (room // 8 + 200)  # well past the room left in the context
    doc.write_text(text)
    tokens = window.controller.bridge.count_tokens(text)
    assert tokens > room
    composer = window.composer
    drop_files(window, [doc])
    qtbot.waitUntil(composer.offer_box.isVisible, timeout=60_000)
    (chip,) = composer.chips.values()  # read, and waiting for the choice: not "reading…"
    assert chip.label.text() == "big.txt · too long: choose below"
    part_tokens = int(composer.offer_accept.text().split()[3].replace(",", ""))
    assert 0.8 * room < part_tokens <= room
    said = (f"“big.txt” is {human_bytes(doc.stat().st_size)}, about {tokens:,} tokens — more "
            f"than the {room:,} tokens left in this model's context (after the chat so far "
            "and room for the answer).")
    if part_tokens < room:  # two counts side by side: the offer says why they differ
        said += (f" The part offered, {part_tokens:,} tokens, ends at the last whole line "
                 "that fits.")
    assert composer.offer_label.text() == said
    assert not window.attachments  # nothing attached until the user says so
    composer.offer_accept.click()
    qtbot.waitUntil(lambda: bool(window.attachments), timeout=20_000)
    (record,) = window.attachments.values()
    assert record.tokens == part_tokens and text.startswith(record.text)
    assert record.text.endswith("\n")  # cut at a line end
    assert "Attached the first" in composer.notice.text()

    composer.show_notice("“old.pdf” could not be read.")  # an old error, then a new offer
    drop_files(window, [doc])
    qtbot.waitUntil(composer.offer_box.isVisible, timeout=60_000)
    assert not composer.notice.isVisible()
    composer.offer_decline.click()
    qtbot.waitUntil(lambda: len(composer.chips) == 1, timeout=20_000)
    assert list(window.attachments.values()) == [record]
    assert not composer.offer_box.isVisible()


def test_what_one_file_of_a_drop_says_stays_beside_what_the_next_says(
        qtbot, window, tmp_path) -> None:
    """A refused file, then one read with a note, then a good one: all three said."""
    empty, odd, good = tmp_path / "empty.txt", tmp_path / "odd.txt", tmp_path / "good.md"
    empty.write_bytes(b"")
    odd.write_bytes(TEXT.encode() * 40 + b"\xff")  # one byte that is not UTF-8
    good.write_text(TEXT)
    drop_files(window, [empty, odd, good])
    qtbot.waitUntil(lambda: len(window.attachments) == 2, timeout=20_000)
    qtbot.waitUntil(lambda: not window.loader.pending, timeout=20_000)
    said = window.composer.notice.text()
    assert "“empty.txt”" in said and "odd.txt" in said, said
    assert [r.name for r in window.attachments.values()] == ["odd.txt", "good.md"]


def test_two_files_too_long_are_each_offered_in_turn(qtbot, window, tmp_path) -> None:
    room = window.fit.room("big.txt")
    docs = [tmp_path / "first.txt", tmp_path / "second.txt"]
    for doc in docs:
        doc.write_text(TEXT * (room // 8 + 200))
    composer = window.composer
    drop_files(window, docs)
    qtbot.waitUntil(lambda: "second.txt" in " ".join(
        chip.label.text() for chip in composer.chips.values()
        if "choose below" in chip.label.text()), timeout=60_000)
    assert composer.offer_label.text().startswith("“first.txt”")
    composer.offer_accept.click()
    qtbot.waitUntil(lambda: len(window.attachments) == 1, timeout=20_000)
    assert composer.offer_box.isVisible()  # the second's turn
    assert composer.offer_label.text().startswith("“second.txt”")
    composer.offer_decline.click()
    qtbot.waitUntil(lambda: len(composer.chips) == 1, timeout=20_000)
    assert [r.name for r in window.attachments.values()] == ["first.txt"]
    assert not composer.offer_box.isVisible()


def test_the_fitting_prefix_is_the_longest_that_fits() -> None:
    from app.chat.attachments import fitting_prefix

    text = "".join(f"line {i:04d} of the document\n" for i in range(1000))
    ends = list(range(4, len(text) + 1, 4))  # a token every four characters
    part, tokens = fitting_prefix(text, 1000, ends)
    assert tokens == len(part) // 4 and text.startswith(part) and part.endswith("\n")
    assert 900 < tokens <= 1000
    assert fitting_prefix("short", 1000, [5]) == ("short", 1)
    assert fitting_prefix(text, 0, ends) == ("", 0)


def test_a_file_opened_as_the_app_starts_waits_for_the_model(qtbot, tiny_llama, tmp_path) -> None:
    # "Open With Longleaf" on a closed app: the file arrives before the model has
    # loaded. It was refused with "Load a model first." and lost.
    from app.controller import ChatController
    from app.engine_bridge import EngineBridge
    from app.settings import Settings
    from app.store import HistoryStore
    from app.window.main_window import MainWindow
    from tests.app.conftest import MODEL_LOAD_TIMEOUT_MS, close_window, configure

    doc = tmp_path / "pines.md"
    doc.write_text(TEXT * 5)
    settings = Settings()
    configure(settings)
    controller = ChatController(settings, HistoryStore(),
                                EngineBridge(settings.memory_budget_bytes, settings.ingest_chunk))
    window = MainWindow(controller)
    qtbot.addWidget(window)
    window.show()
    try:
        window.add_files([str(doc)])
        assert window.composer.notice.text() == (
            "“pines.md” will be attached once the model has loaded.")
        with qtbot.waitSignal(controller.modelStateChanged, timeout=MODEL_LOAD_TIMEOUT_MS,
                              check_params_cb=lambda _text, ready: ready):
            controller.start(str(tiny_llama))
        qtbot.waitUntil(lambda: bool(window.attachments), timeout=20_000)
        (record,) = window.attachments.values()
        assert record.name == "pines.md"
        assert "Load a model first" not in window.composer.notice.text()
    finally:
        close_window(window)


def test_removing_a_chip_still_reading_stops_its_read_and_the_next_file_starts(
        qtbot, window, tmp_path, monkeypatch) -> None:
    import threading

    import pypdf

    import engine.documents.reader as reader
    from tests.engine.documents.test_pdf import _drawn, _pages_pdf

    book = tmp_path / "book.pdf"
    book.write_bytes(_pages_pdf([_drawn(f"Page {n}") for n in range(1, 201)]))
    waiting, after = tmp_path / "waiting.md", tmp_path / "after.md"
    waiting.write_text(TEXT)
    after.write_text(TEXT * 2)
    read: list[int] = []
    at_page_2, removed = threading.Event(), threading.Event()
    extract = pypdf.PageObject.extract_text

    def held(page, *args, **kwargs):
        read.append(1)
        if len(read) == 2:  # hold the read on page 2 until its chip is removed
            at_page_2.set()
            removed.wait(20)
        return extract(page, *args, **kwargs)

    opened: list[str] = []
    stat_size = reader.stat_size
    monkeypatch.setattr(pypdf.PageObject, "extract_text", held)
    monkeypatch.setattr(reader, "stat_size", lambda p: opened.append(p.name) or stat_size(p))
    drop_files(window, [book, waiting, after])
    qtbot.waitUntil(at_page_2.is_set, timeout=20_000)
    chips = {chip.name: chip for chip in window.composer.chips.values()}
    for name in ("book.pdf", "waiting.md"):  # one being read, one waiting behind it
        chips[name].findChild(QToolButton).click()
    removed.set()
    qtbot.waitUntil(lambda: bool(window.attachments) and not window.loader.pending,
                    timeout=20_000)
    assert window.loader.wait()
    assert len(read) == 2  # not the other 198 pages
    assert opened == ["book.pdf", "after.md"]  # the one waiting was never read
    assert [r.name for r in window.attachments.values()] == ["after.md"]
    assert list(window.composer.chips) == list(window.attachments)
    assert "book.pdf" not in window.composer.notice.text()
