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
