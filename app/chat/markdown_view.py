"""Markdown text with pygments-highlighted code blocks, sized to its content.

Qt's own Markdown importer builds the document; a syntax highlighter colours
the fenced code blocks it marks with their language. Nothing here parses
Markdown itself beyond finding where a streamed answer may be cut in two:

A streamed answer only grows. Re-importing all of it at every flush would cost
time proportional to the whole answer, so the document is kept as settled
blocks plus a tail: text after the last blank line that begins a block nothing
before it can change (outside a code fence, not a list item, quote, table or
rule that could join or continue what came before). Each flush imports only the
tail again; what the tail has settled moves into the settled part.
"""

from __future__ import annotations

import re
from functools import cache, lru_cache

from pygments.lexer import Lexer
from pygments.lexers import get_lexer_by_name
from pygments.styles import get_style_by_name
from pygments.token import Token, _TokenType
from pygments.util import ClassNotFound
from PySide6.QtCore import QSize, QSizeF, Qt, QUrl
from PySide6.QtGui import (
    QColor,
    QDesktopServices,
    QFont,
    QFontDatabase,
    QImage,
    QPalette,
    QSyntaxHighlighter,
    QTextBlock,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
    QTextDocumentFragment,
    QTextFormat,
)
from PySide6.QtWidgets import QSizePolicy, QTextBrowser, QWidget

MARKDOWN_FEATURES = (QTextDocument.MarkdownFeature.MarkdownDialectGitHub
                     | QTextDocument.MarkdownFeature.MarkdownNoHTML)
# A fence's marks and what follows them; a fence closes only on a line of its own
# kind of marks, at least as many, and nothing after them (CommonMark).
FENCE = re.compile(r" {0,3}(`{3,}|~{3,})(.*)")
# A line that may join or continue the block before it even after a blank line
# (list items, quotes, tables, rules, indented code, setext underlines).
JOINS = re.compile(r"[\s>|*+\-_=]|\d+[.)]|.*\|")
RULE = re.compile(r" {0,3}([-*_])( *\1){2,} *$")  # a thematic break: Qt's import of one ends oddly


def settled_end(text: str, start: int = 0) -> int:
    """Where the last cut of ``text`` at or after ``start`` is (``start`` when there is none).

    A cut is the start of a complete line that follows a blank line (not after a
    rule) outside a code fence, begins a paragraph, heading or fence, and so starts a block that
    renders the same whether the text before it is imported with it or alone.
    ``start`` must itself be a cut (or 0).
    """
    cut, blank_before, after_rule = start, False, False
    fence: str | None = None  # the marks of the open code fence
    position = start
    while True:
        end = text.find("\n", position)
        if end < 0:
            return cut  # the last line is not complete yet: no cut in it
        line = text[position:end]
        if fence is None and blank_before and not after_rule and line and not JOINS.match(line):
            cut = position
        fence = _fence_after(fence, line)
        blank_before = not line.strip()
        if not blank_before:
            after_rule = fence is None and bool(RULE.match(line))
        position = end + 1


def _fence_after(fence: str | None, line: str) -> str | None:
    """The open fence's marks after ``line`` (None: outside any fence)."""
    found = FENCE.match(line)
    if found is None:
        return fence
    marks, rest = found.groups()
    if fence is None:
        return marks
    closes = marks[0] == fence[0] and len(marks) >= len(fence) and not rest.strip()
    return None if closes else fence


def open_link(url: QUrl) -> bool:
    """Open a link clicked in an answer when its scheme is a web or mail one (in the
    user's browser or mail app); True when it was."""
    if url.scheme().lower() not in OPEN_SCHEMES:
        return False
    return QDesktopServices.openUrl(url)


def is_dark(palette: QPalette) -> bool:
    """True when the palette's window colour is dark."""
    return palette.color(QPalette.ColorRole.Window).lightness() < 128


@cache
def _formats(style_name: str) -> dict[_TokenType, QTextCharFormat]:
    formats: dict[_TokenType, QTextCharFormat] = {}
    for token, spec in get_style_by_name(style_name):
        fmt = QTextCharFormat()
        if spec["color"]:
            fmt.setForeground(QColor(f"#{spec['color']}"))
        if spec["bold"]:
            fmt.setFontWeight(QFont.Weight.Bold)
        if spec["italic"]:
            fmt.setFontItalic(True)
        formats[token] = fmt
    return formats


@cache
def _lexer(language: str) -> Lexer | None:
    try:
        return get_lexer_by_name(language, stripnl=False, ensurenl=False)
    except ClassNotFound:
        return None


def _format_for(formats: dict[_TokenType, QTextCharFormat],
                token: _TokenType) -> QTextCharFormat | None:
    kind: _TokenType | None = token
    while kind is not None and kind is not Token and kind not in formats:
        kind = kind.parent
    return formats.get(kind) if kind is not None else None


@lru_cache(maxsize=8192)
def _line_tokens(language: str, text: str) -> tuple[tuple[int, int, _TokenType], ...]:
    """(offset, length, token) of each piece of a code line, lexed once: a streamed
    code block is imported again at every flush, and its lines highlighted again."""
    lexer = _lexer(language)
    if lexer is None:
        return ()
    pieces, offset = [], 0
    for token, value in lexer.get_tokens(text):
        if value:
            pieces.append((offset, len(value), token))
        offset += len(value)
    return tuple(pieces)


class CodeHighlighter(QSyntaxHighlighter):
    """Colours the code blocks Qt's Markdown importer tags with a language they name.

    A block that names none stays plain, as GitHub shows it: guessing would run
    every one of pygments' lexers on each line, and colour neighbours unlike.
    """

    def __init__(self, document: QTextDocument, dark: bool) -> None:
        super().__init__(document)
        self.style_name = "monokai" if dark else "friendly"

    def highlightBlock(self, text: str) -> None:
        block_format = self.currentBlock().blockFormat()
        language = block_format.stringProperty(QTextFormat.Property.BlockCodeLanguage)
        if not language.strip():
            return
        formats = _formats(self.style_name)
        for offset, length, token in _line_tokens(language.strip().lower(), text):
            fmt = _format_for(formats, token)
            if fmt is not None:
                self.setFormat(offset, length, fmt)


# The schemes a link in an answer may open, in the browser or mail app. Any other
# (file:, a relative path, smb:, an app's own scheme) would load a file into the
# view or hand a URL a prompt injection chose to whatever handles it.
OPEN_SCHEMES = frozenset({"http", "https", "mailto"})


def no_resource(_kind: int, _name: QUrl | str) -> QImage:
    """What an image an answer names is loaded as: nothing. Qt would read any path it
    names (a FIFO hangs the window, /dev/zero fills memory); an empty image ends the
    lookup before Qt's own file read."""
    return QImage()


class _Fragment(QTextDocument):
    """A document a streamed answer's tail is imported into: it loads no resource."""

    def loadResource(self, kind: int, name: QUrl | str) -> QImage:
        return no_resource(kind, name)


class MarkdownView(QTextBrowser):
    """A read-only, selectable Markdown view as tall as its text; it shows no image
    and follows only web and mail links, out of the app."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setFrameShape(QTextBrowser.Shape.NoFrame)
        self.setOpenLinks(False)
        self.anchorClicked.connect(open_link)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
        self.viewport().setAutoFillBackground(False)
        self.setStyleSheet("QTextBrowser { background: transparent; }")
        self.document().setDocumentMargin(2)
        self._markdown = ""
        self._cut = 0  # where in ``_markdown`` the tail begins
        self._tail_at: int | None = None  # where in the document the tail's blocks begin
        self._highlighter = CodeHighlighter(self.document(), is_dark(self.palette()))
        self.document().documentLayout().documentSizeChanged.connect(self._fit_height)

    def loadResource(self, kind: int, name: QUrl | str) -> QImage:
        return no_resource(kind, name)

    def markdown(self) -> str:
        """The Markdown source shown."""
        return self._markdown

    def set_markdown(self, text: str) -> None:
        """Show ``text`` as Markdown (no-op when unchanged).

        When ``text`` extends what is shown (a streamed answer), only the blocks
        after the last cut are imported again.
        """
        if text == self._markdown:
            return
        document = self.document()
        if self._markdown and text.startswith(self._markdown) and self._tail_at is not None:
            cursor = QTextCursor(document)
            cursor.setPosition(self._tail_at)  # the tail's blocks go, and the break before them
            cursor.movePosition(QTextCursor.MoveOperation.End,
                                QTextCursor.MoveMode.KeepAnchor)
            cursor.removeSelectedText()
            if self._tail_at > 0:
                cursor.deletePreviousChar()
        else:
            document.clear()
            self._cut = 0
        self._markdown = text
        cut = settled_end(text, self._cut)
        if cut > self._cut:
            self._append(text[self._cut:cut])
            self._cut = cut
        self._tail_at = self._append(text[self._cut:])

    def _append(self, markdown: str) -> int:
        """Import ``markdown`` (which starts at a cut) at the document's end; where it begins."""
        document = self.document()
        if document.isEmpty():
            # Raw HTML in a model's answer is shown as text, never rendered.
            document.setMarkdown(markdown, MARKDOWN_FEATURES)
            self._shade_code_blocks(document.begin())
            return 0
        part = _Fragment()
        part.setMarkdown(markdown, MARKDOWN_FEATURES)
        cursor = QTextCursor(document)
        cursor.movePosition(QTextCursor.MoveOperation.End)
        cursor.insertBlock(QTextBlockFormat(), QTextCharFormat())
        listed = cursor.block().textList()
        if listed is not None:
            listed.remove(cursor.block())
        start = cursor.position()
        cursor.insertFragment(QTextDocumentFragment(part))
        # The fragment's first block lands in the block made for it, keeping that
        # block's plain format: give it its own.
        first = QTextCursor(document)
        first.setPosition(start)
        first.setBlockFormat(part.begin().blockFormat())
        first.setBlockCharFormat(part.begin().charFormat())
        self._shade_code_blocks(first.block())
        return start

    def set_plain(self, text: str) -> None:
        """Show ``text`` as typed, every line break kept (no-op when unchanged)."""
        if text == self._markdown:
            return
        self._markdown, self._cut, self._tail_at = text, 0, None
        self.document().setPlainText(text)

    def _shade_code_blocks(self, block: QTextBlock) -> None:
        """Shade the fenced code blocks from ``block`` to the end."""
        mono = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
        shade = self.palette().color(QPalette.ColorRole.AlternateBase)
        if shade == self.palette().color(QPalette.ColorRole.Base):
            shade = shade.darker(106)
        cursor = QTextCursor(self.document())
        while block.isValid():
            fmt = block.blockFormat()
            if fmt.hasProperty(QTextFormat.Property.BlockCodeFence):
                cursor.setPosition(block.position())
                extra = QTextBlockFormat()
                extra.setBackground(shade)
                extra.setLeftMargin(6)
                cursor.mergeBlockFormat(extra)
                char = QTextCharFormat()
                char.setFont(mono)
                cursor.select(QTextCursor.SelectionType.BlockUnderCursor)
                cursor.mergeCharFormat(char)
            block = block.next()

    def _fit_height(self, size: QSizeF) -> None:
        height = int(size.height()) + 4
        if self.height() != height:
            self.setFixedHeight(height)

    def sizeHint(self) -> QSize:
        return QSize(200, int(self.document().size().height()) + 4)
