"""The Markdown view: code highlighted by pygments, HTML shown as text."""

from __future__ import annotations

import pytest
from PySide6.QtCore import QPoint, Qt, QUrl
from PySide6.QtGui import QDesktopServices, QImage, QTextDocument, QTextFormat

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
    # A block naming no language stays plain, as GitHub shows it (no guessing,
    # which ran every lexer on each line at every flush of a streamed answer).
    view.set_markdown("```\ndef area(r):\n    return 3.14 * r\n```\n")
    assert not view.document().begin().layout().formats()


def test_html_in_an_answer_is_shown_as_text_not_rendered(qtbot) -> None:
    view = MarkdownView()
    qtbot.addWidget(view)
    view.set_markdown("<p>\n<em>Title</em> <img src='x.png'>\n\n* one\n* two")
    assert view.toPlainText().startswith("<p> <em>Title</em> <img src='x.png'>")
    assert "one\ntwo" in view.toPlainText()


ANSWER = """# Pines of the coast

Pines grow where **little else** does: sandy soil, salt wind.
They keep their needles for years.

## Kinds

- Longleaf pine, *Pinus palustris*
- Loblolly pine
  with a second line

1. Cones open in fire.
2. Seeds fall.

3. A loose third item.

> A quote about pines,
continued lazily.

Before a table:

| kind | needles |
|------|---------|
| longleaf | 3 |
| loblolly | 3 |

Rule below.

---

```python
def age(rings):

    return len(rings)
```

~~~
tilde fence
~~~

Setext heading
--------------

    indented code

Last paragraph with `code` and a [link](https://example.org).
"""


def _html(view: MarkdownView) -> str:
    return view.document().toHtml()


def test_a_streamed_answer_renders_as_the_whole_answer_does(qtbot) -> None:
    streamed, whole = MarkdownView(), MarkdownView()
    qtbot.addWidget(streamed)
    qtbot.addWidget(whole)
    # Pieces of every size, as tokens arrive: the document after each flush is the
    # one a single import of the text so far builds.
    position, step = 0, 1
    while position < len(ANSWER):
        position = min(len(ANSWER), position + step)
        step = step % 7 + 1
        streamed.set_markdown(ANSWER[:position])
        fresh = MarkdownView()
        fresh.set_markdown(ANSWER[:position])
        assert _html(streamed) == _html(fresh), ANSWER[:position]
    whole.set_markdown(ANSWER)
    assert _html(streamed) == _html(whole)
    assert streamed.markdown() == ANSWER
    assert streamed._cut > len(ANSWER) // 2  # most of it is settled, not imported again
    streamed.set_markdown("Something else.")  # not an extension: imported whole
    whole.set_markdown("Something else.")
    assert _html(streamed) == _html(whole)


def test_an_image_an_answer_names_is_never_read(qtbot, tmp_path) -> None:
    """An answer (or a prompt injection in a document) may name any path as an image:
    a FIFO would hang the window, /dev/zero fill memory. Nothing is read, in the
    answer's settled part or its streamed tail."""
    picture = tmp_path / "secret.png"
    image = QImage(30, 20, QImage.Format.Format_RGB32)
    image.fill(0)
    assert image.save(str(picture))
    view = MarkdownView()
    qtbot.addWidget(view)
    text = f"First ![a]({picture})\n\nThen ![b](file://{picture})"
    for end in (len(text) // 2, len(text)):  # a streamed answer, then the whole of it
        view.set_markdown(text[:end])
        view.show()
        for name in (str(picture), f"file://{picture}"):
            loaded = view.document().resource(QTextDocument.ResourceType.ImageResource.value,
                                              QUrl(name))
            assert isinstance(loaded, QImage) and loaded.isNull(), name


def _link_at(view: MarkdownView, words: str) -> QPoint:
    found = view.document().find(words)
    assert not found.isNull(), words
    return view.cursorRect(found).center()


# A click whose link opens nothing leaves its release unaccepted, and QTest says so.
@pytest.mark.qt_log_ignore("not accepted by receiving widget",
                           "does not support propagateSizeHints")
def test_only_web_and_mail_links_open_and_the_answer_stays(qtbot, monkeypatch) -> None:
    """A click on a link opens it out of the app when it is a web or mail link; a
    file:, relative or other scheme's link opens nothing and never replaces the
    answer in the view with a file's contents (or with nothing)."""
    opened: list[str] = []
    monkeypatch.setattr(QDesktopServices, "openUrl",
                        lambda url: opened.append(url.toString()) or True)
    view = MarkdownView()
    qtbot.addWidget(view)
    view.resize(600, 200)
    view.show()
    links = {"the file": "file:///etc/hostname", "the guide": "docs/guide.md",
             "a share": "smb://evil/share", "the site": "https://example.com/pines",
             "write": "mailto:pines@example.com"}
    view.set_markdown("\n\n".join(f"See [{words}]({url})." for words, url in links.items()))
    shown = view.toPlainText()
    for words in links:
        qtbot.mouseClick(view.viewport(), Qt.MouseButton.LeftButton,
                         pos=_link_at(view, words))
        assert view.toPlainText() == shown, words
    assert opened == ["https://example.com/pines", "mailto:pines@example.com"]


def test_a_fence_inside_a_longer_fence_streams_as_it_renders_whole(qtbot) -> None:
    """A fence closes only on its own kind of marks, at least as many: a code block
    quoting a shorter fence streams into the document a single import builds."""
    text = ("Here:\n\n````md\n```python\nx = 1\n\ny = 2\n```\n````\n\nDone.\n\n"
            "~~~\n```\n\nstill code\n~~~\n\nAfter.")
    streamed = MarkdownView()
    qtbot.addWidget(streamed)
    for end in range(1, len(text) + 1):
        streamed.set_markdown(text[:end])
    whole = MarkdownView()
    qtbot.addWidget(whole)
    whole.set_markdown(text)
    assert _html(streamed) == _html(whole)
