"""The numbers and bullets Word shows before list paragraphs.

They are not in a paragraph's text: a list paragraph names a list (``w:numId``)
and its level (``w:ilvl``), and numbering.xml says how that level is written
("%1.%2.", lower-case letters, a bullet). Word counts them as the document
runs; so does :class:`ListNumbers`, or "see clause 2 above" points nowhere.
Numbering a paragraph style carries (numbered headings) is not read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from docx.oxml.ns import qn

BULLET = "•"
MAX_LEVELS = 9  # Word's list levels: w:ilvl 0 to 8
_PLACEHOLDER = re.compile(r"%([1-9])")
_ROMAN = ((1000, "m"), (900, "cm"), (500, "d"), (400, "cd"), (100, "c"), (90, "xc"),
          (50, "l"), (40, "xl"), (10, "x"), (9, "ix"), (5, "v"), (4, "iv"), (1, "i"))


@dataclass(frozen=True)
class _Level:
    """How one level of a list is written: its number format, text and first number."""

    style: str  # w:numFmt: "decimal", "lowerLetter", "bullet", ...
    text: str  # w:lvlText: "%1." holds level 1's number
    start: int


class ListNumbers:
    """Counts a document's lists in its order and says each list paragraph's label.

    Args:
        numbering: the numbering part's ``w:numbering`` element (None: no lists).
    """

    def __init__(self, numbering: Any | None) -> None:
        self._lists: dict[str, dict[int, _Level]] = {}  # w:numId -> level -> format
        # w:numId -> each level's last number (None: not begun since a shallower one)
        self._counts: dict[str, list[int | None]] = {}
        if numbering is not None:
            self._read(numbering)

    @classmethod
    def of(cls, document: Any) -> ListNumbers:
        """The lists of a python-docx ``Document`` (none when it has no numbering part)."""
        try:
            part = document.part.numbering_part
        except (KeyError, NotImplementedError):
            return cls(None)
        return cls(part.element)

    def label(self, paragraph: Any) -> str:
        """The number or bullet before ``paragraph`` with its space ("2.1. ", "• "),
        counting it; "" for a paragraph of no list."""
        numbered = paragraph.find(f"{qn('w:pPr')}/{qn('w:numPr')}")
        if numbered is None:
            return ""
        list_id = _value(numbered.find(qn("w:numId")))
        levels = self._lists.get(list_id or "")
        depth = _number(_value(numbered.find(qn("w:ilvl"))), 0)
        if not levels or depth not in levels or list_id is None:
            return ""
        counts = self._counts.setdefault(list_id, [None] * MAX_LEVELS)
        here = counts[depth]
        counts[depth] = levels[depth].start if here is None else here + 1
        for deeper in range(depth + 1, MAX_LEVELS):
            counts[deeper] = None  # a sub-list starts again under the next item
        level = levels[depth]
        if level.style == "bullet":
            return f"{BULLET} "
        if level.style == "none":
            return ""
        text = _PLACEHOLDER.sub(lambda found: self._written(levels, counts, found), level.text)
        return f"{text} " if text else ""

    @staticmethod
    def _written(levels: dict[int, _Level], counts: list[int | None],
                 found: re.Match[str]) -> str:
        depth = int(found.group(1)) - 1
        level = levels.get(depth)
        if level is None:
            return ""
        count = counts[depth]
        return written(level.start if count is None else count, level.style)

    def _read(self, numbering: Any) -> None:
        formats: dict[str, dict[int, _Level]] = {}
        for abstract in numbering.iterchildren(qn("w:abstractNum")):
            formats[abstract.get(qn("w:abstractNumId"), "")] = {
                _number(level.get(qn("w:ilvl")), 0): _level(level)
                for level in abstract.iterchildren(qn("w:lvl"))}
        for listed in numbering.iterchildren(qn("w:num")):
            levels = dict(formats.get(_value(listed.find(qn("w:abstractNumId"))) or "", {}))
            for override in listed.iterchildren(qn("w:lvlOverride")):
                depth = _number(override.get(qn("w:ilvl")), 0)
                start = _value(override.find(qn("w:startOverride")))
                if depth in levels and start is not None:
                    old = levels[depth]
                    levels[depth] = _Level(old.style, old.text, _number(start, old.start))
            self._lists[listed.get(qn("w:numId"), "")] = levels


def written(number: int, style: str) -> str:
    """``number`` as a list level of ``style`` writes it (decimal for a style not known)."""
    if style in ("lowerLetter", "upperLetter"):
        # Word's letters past z double: aa, bb, ...
        letter = chr(ord("a") + (number - 1) % 26) * ((number - 1) // 26 + 1)
        return letter.upper() if style == "upperLetter" else letter
    if style in ("lowerRoman", "upperRoman") and 0 < number < 4000:
        roman = ""
        for value, digits in _ROMAN:
            count, number = divmod(number, value)
            roman += digits * count
        return roman.upper() if style == "upperRoman" else roman
    if style == "decimalZero":
        return f"{number:02d}"
    return str(number)


def _level(element: Any) -> _Level:
    return _Level(_value(element.find(qn("w:numFmt"))) or "decimal",
                  _value(element.find(qn("w:lvlText"))) or "",
                  _number(_value(element.find(qn("w:start"))), 1))


def _value(element: Any | None) -> str | None:
    return None if element is None else element.get(qn("w:val"))


def _number(text: str | None, default: int) -> int:
    try:
        return int(text) if text is not None else default
    except ValueError:
        return default
