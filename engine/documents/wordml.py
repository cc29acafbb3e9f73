"""The text of a Word document's XML, as Word shows it, in the document's order.

python-docx's ``Paragraph.text`` and ``_Cell.text`` see only the runs and
hyperlinks placed directly in a paragraph, so the text Word shows inside a
tracked insertion, a content control, a field's result, a smart tag, a text
box or a nested table, and every header, footer and note, never reached
the model. Here every run below a paragraph is read, whatever wraps it, except
what Word does not show as text: deleted and moved-away revisions, a field's
instructions and hidden text. An equation is read as a line of text ("x^2",
"a/b"), a list paragraph after its number or bullet (``word_lists``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from docx.oxml.ns import qn
from docx.oxml.parser import parse_xml

from engine.documents.word_lists import ListNumbers

_MC = "{http://schemas.openxmlformats.org/markup-compatibility/2006}"
_ALTERNATE = f"{_MC}AlternateContent"
_CHOICE = f"{_MC}Choice"
_FALLBACK = f"{_MC}Fallback"

_P = qn("w:p")
_R = qn("w:r")
_TBL = qn("w:tbl")
_TR = qn("w:tr")
_TC = qn("w:tc")
_TEXT_BOX = qn("w:txbxContent")
_HIDDEN_RUN = f"{qn('w:rPr')}/{qn('w:vanish')}"
_OFF = ("0", "false", "off")
CELL_LINES = " / "  # a cell's paragraphs on its row's line: a new line would be a new row
NESTED_CELLS = " | "  # a nested table's cells, inside the tab-parted cells of its own

# An equation (OMML): its text is in m:t; the parts a flat line must mark.
_MATH_TEXT = qn("m:t")
_MATH_MARKS = {qn("m:sup"): "^", qn("m:sub"): "_", qn("m:num"): "", qn("m:den"): "/"}

# Elements whose content is not text a reader sees: revisions that took text
# out, a field's code, and properties (a paragraph's w:tabs holds tab stops,
# not tabs).
_HIDDEN = frozenset(
    qn(tag)
    for tag in (
        "w:del",
        "w:moveFrom",
        "w:delText",
        "w:instrText",
        "w:delInstrText",
        "w:pPr",
        "w:rPr",
        "w:sectPr",
        "w:tblPr",
        "w:tblGrid",
        "w:trPr",
        "w:tcPr",
        "w:sdtPr",
        "w:sdtEndPr",
    )
)

# A run's pieces that are not w:t, as python-docx's ``Run.text`` writes them.
_RUN_MARKS = {
    qn("w:tab"): "\t",
    qn("w:ptab"): "\t",
    qn("w:cr"): "\n",
    qn("w:noBreakHyphen"): "-",
}


def block_lines(container: Any, numbers: ListNumbers | None = None) -> Iterator[str]:
    """The lines of the paragraphs and table rows below ``container``, in order.

    Args:
        container: a body, header, footer, note, table cell or text box element.
        numbers: the document's lists, counted as its paragraphs are read (None:
            list paragraphs without their numbers).

    Yields:
        One line per paragraph (which may hold line breaks), then the lines of
        any text box anchored in it; one line per table row, its cells joined
        by tabs.
    """
    for child in _children(container):
        if child.tag == _P:
            yield from _paragraph_lines(child, numbers)
        elif child.tag == _TBL:
            yield from _table_lines(child, numbers)
        elif child.tag not in _HIDDEN:  # a content control, w:customXml, ...
            yield from block_lines(child, numbers)


def _paragraph_lines(paragraph: Any, numbers: ListNumbers | None) -> Iterator[str]:
    pieces: list[str] = [numbers.label(paragraph)] if numbers is not None else []
    boxes: list[Any] = []
    _collect(paragraph, pieces, boxes)
    yield "".join(pieces)
    for box in boxes:
        yield from block_lines(box, numbers)


def _collect(element: Any, pieces: list[str], boxes: list[Any]) -> None:
    """Append the text of the runs below ``element`` to ``pieces``, at any depth.

    A text box's paragraphs are put in ``boxes``, to be read as lines of their
    own after the paragraph that anchors them.
    """
    for child in _children(element):
        if child.tag == _R:
            if not _hidden(child):
                _collect_run(child, pieces, boxes)
        elif child.tag == _TEXT_BOX:
            boxes.append(child)
        elif child.tag == _MATH_TEXT:
            pieces.append(child.text or "")
        elif child.tag in _MATH_MARKS:
            pieces.append(_MATH_MARKS[child.tag] + _bracketed(_math_text(child)))
        elif child.tag not in _HIDDEN:
            _collect(child, pieces, boxes)


def _hidden(run: Any) -> bool:
    """Whether ``run`` is hidden text (Word shows it only with formatting marks on)."""
    vanish = run.find(_HIDDEN_RUN)
    return vanish is not None and vanish.get(qn("w:val"), "true") not in _OFF


def _math_text(element: Any) -> str:
    pieces: list[str] = []
    _collect(element, pieces, [])
    return "".join(pieces)


def _bracketed(text: str) -> str:
    """An exponent, index or denominator as a line writes it: ``2``, ``(n+1)``."""
    return text if len(text) <= 1 or text.isalnum() else f"({text})"


def _collect_run(run: Any, pieces: list[str], boxes: list[Any]) -> None:
    for child in _children(run):
        if child.tag == qn("w:t"):
            pieces.append(child.text or "")
        elif child.tag == qn("w:br"):
            # A line, page or column break all part the words on either side
            # (python-docx drops the last two, joining "end.Chapter").
            pieces.append("\n")
        elif child.tag in _RUN_MARKS:
            pieces.append(_RUN_MARKS[child.tag])
        elif child.tag not in _HIDDEN:  # a drawing or picture holding a text box
            _collect(child, pieces, boxes)


def _table_lines(table: Any, numbers: ListNumbers | None) -> Iterator[str]:
    """One line per row, each cell once however many columns or rows it spans,
    a cell's paragraphs (and a nested table's rows) on that line."""
    for row in _wrapped(table, _TR):
        if row.find(f"{qn('w:trPr')}/{qn('w:del')}") is not None:
            continue  # a row deleted with Track Changes on
        yield "\t".join(_cell_text(cell, numbers) for cell in _wrapped(row, _TC))


def _cell_text(cell: Any, numbers: ListNumbers | None) -> str:
    lines = (line.strip().replace("\t", NESTED_CELLS).replace("\n", CELL_LINES)
             for line in block_lines(cell, numbers))
    return CELL_LINES.join(line for line in lines if line)


def _wrapped(element: Any, tag: str) -> Iterator[Any]:
    """The children of ``element`` with ``tag``, and those wrapped in content controls."""
    for child in _children(element):
        if child.tag == tag:
            yield child
        elif child.tag not in _HIDDEN:
            yield from _wrapped(child, tag)


def _children(element: Any) -> Iterable[Any]:
    """The child elements of ``element`` that hold its content.

    Of an mc:AlternateContent only the first branch: Word writes a text box
    twice, as a drawing (the Choice) and as VML for older readers (the
    Fallback), and reading both would double its text.
    """
    if element.tag == _ALTERNATE:
        branch = next(element.iterchildren(_CHOICE, _FALLBACK), None)
        return () if branch is None else _elements(branch)
    return _elements(element)


def _elements(element: Any) -> Iterator[Any]:
    # XML comments and processing instructions are children too, with no text.
    return (child for child in element.iterchildren() if isinstance(child.tag, str))


def margin_text(document: Any, numbers: ListNumbers | None = None) -> str:
    """The page headers, footers, footnotes and endnotes, each group labelled.

    Args:
        document: a python-docx ``Document``.
        numbers: the document's lists, as counted through its body.

    Returns:
        For each group that has text, a blank line, its label ("Footnotes:")
        and the text of each of its parts, each different text once; "" when
        none has text.
    """
    groups = (
        ("Page headers:", _referenced_stories(document, "w:headerReference")),
        ("Page footers:", _referenced_stories(document, "w:footerReference")),
        ("Footnotes:", _notes(document, "footnotes", "w:footnote")),
        ("Endnotes:", _notes(document, "endnotes", "w:endnote")),
    )
    text = ""
    for label, stories in groups:
        texts = list(dict.fromkeys(_story_texts(stories, numbers)))
        if texts:
            text += "\n\n" + label + "\n" + "\n".join(texts)
    return text


def _story_texts(stories: Iterable[Any], numbers: ListNumbers | None) -> Iterator[str]:
    for story in stories:
        text = "\n".join(block_lines(story, numbers)).strip()
        if text:
            yield text


def _referenced_stories(document: Any, reference: str) -> Iterator[Any]:
    """Each header (or footer) the sections name, in their order, each part once.

    A section may name three (first page, even pages, the rest); one that names
    none shows the previous section's, already read.
    """
    parts = document.part.related_parts
    seen: set[str] = set()
    for element in document.element.body.iter(qn(reference)):
        rid = element.get(qn("r:id"))
        if rid in seen or rid not in parts:
            continue
        seen.add(rid)
        yield _root(parts[rid])


def _notes(document: Any, kind: str, tag: str) -> Iterator[Any]:
    """The footnotes (or endnotes), less the separator lines Word keeps among them."""
    for relationship in document.part.rels.values():
        if relationship.is_external or not relationship.reltype.endswith(f"/{kind}"):
            continue
        for note in _root(relationship.target_part).iterchildren(qn(tag)):
            if note.get(qn("w:type"), "normal") == "normal":
                yield note


def _root(part: Any) -> Any:
    """A part's XML; python-docx parses headers and footers, but not notes."""
    element = getattr(part, "element", None)
    return element if element is not None else parse_xml(part.blob)
