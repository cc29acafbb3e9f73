"""The Markdown view: code highlighted by pygments, HTML shown as text."""

from __future__ import annotations

from PySide6.QtGui import QTextFormat

from app.chat.markdown_view import MarkdownView


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
