"""Widgets on their own: Markdown with highlighted code, session list, model picker."""

from __future__ import annotations

from PySide6.QtGui import QTextFormat
from PySide6.QtWidgets import QInputDialog, QMessageBox

from app.markdown_view import MarkdownView
from app.model_picker import DEMO, ModelPicker
from app.session_list import SessionList
from app.store import HistoryStore


def test_markdown_code_blocks_are_highlighted_by_pygments(qtbot) -> None:
    view = MarkdownView()
    qtbot.addWidget(view)
    view.set_markdown("Some **bold** text.\n\n```python\ndef area(r):\n    return 3.14 * r\n```\n")
    doc = view.document()
    blocks = []
    block = doc.begin()
    while block.isValid():
        blocks.append(block)
        block = block.next()
    code = [b for b in blocks if b.blockFormat().hasProperty(QTextFormat.Property.BlockCodeFence)]
    assert [b.text() for b in code] == ["def area(r):", "    return 3.14 * r"]
    assert code[0].blockFormat().stringProperty(QTextFormat.Property.BlockCodeLanguage) == "python"
    coloured = code[0].layout().formats()
    keyword = next(f for f in coloured if f.start == 0)
    assert keyword.length == 3 and keyword.format.foreground().color().isValid()
    prose = [b for b in blocks if b.text().startswith("Some")]
    assert prose and not prose[0].layout().formats()  # prose is left alone
    assert view.height() >= int(doc.size().height())


def test_html_in_an_answer_is_shown_as_text_not_rendered(qtbot) -> None:
    view = MarkdownView()
    qtbot.addWidget(view)
    view.set_markdown("<p>\n<em>Title</em> <img src='x.png'>\n\n* one\n* two")
    assert view.toPlainText().startswith("<p> <em>Title</em> <img src='x.png'>")
    assert "one\ntwo" in view.toPlainText()


def test_session_list_search_rename_and_confirmed_delete(qtbot, monkeypatch) -> None:
    store = HistoryStore()
    a = store.create_session("Tax return", "q8", "demo")
    b = store.create_session("Holiday", "q4", "demo")
    sidebar = SessionList()
    qtbot.addWidget(sidebar)
    sidebar.set_sessions(store.sessions(), b.id)
    assert [r.id for r in sidebar.records()] == [b.id, a.id]
    with qtbot.waitSignal(sidebar.sessionSelected) as selected:
        sidebar.list.setCurrentRow(1)
    assert selected.args == [a.id]

    monkeypatch.setattr(QInputDialog, "getText", lambda *args, **kw: ("Taxes 2025", True))
    with qtbot.waitSignal(sidebar.renameRequested) as renamed:
        sidebar.ask_rename(store.session(a.id))
    assert renamed.args == [a.id, "Taxes 2025"]

    clicks = iter(["Cancel", "Delete"])

    def answer(box: QMessageBox) -> int:
        wanted = next(clicks)
        next(b for b in box.buttons() if b.text().replace("&", "") == wanted).click()
        return 0

    monkeypatch.setattr(QMessageBox, "exec", answer)
    deleted: list[str] = []
    sidebar.deleteRequested.connect(deleted.append)
    sidebar.ask_delete(store.session(b.id))  # cancelled: nothing happens
    assert deleted == []
    sidebar.ask_delete(store.session(b.id))
    assert deleted == [b.id]
    store.close()


def test_model_picker_lists_discovered_folders(qtbot, tiny_llama) -> None:
    picker = ModelPicker()
    qtbot.addWidget(picker)
    with qtbot.waitSignal(picker.discovered, timeout=30_000) as found:
        picker.refresh([str(tiny_llama.parent)])
    assert found.args[0] >= 1
    index = picker.findData(str(tiny_llama))
    assert index > 0
    assert "attention layers" in picker.itemData(index, 3)  # tooltip role
    assert picker.itemData(0) == DEMO
    with qtbot.waitSignal(picker.modelChosen) as chosen:
        picker.activated.emit(index)
    assert chosen.args == [str(tiny_llama)]
    picker.wait()
