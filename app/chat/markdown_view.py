"""Markdown text with pygments-highlighted code blocks, sized to its content.

Qt's own Markdown importer builds the document; a syntax highlighter colours
the fenced code blocks it marks with their language. Nothing here parses
Markdown by hand.
"""

from __future__ import annotations

from functools import cache

from pygments.lexers import get_lexer_by_name, guess_lexer
from pygments.styles import get_style_by_name
from pygments.token import Token, _TokenType
from pygments.util import ClassNotFound
from PySide6.QtCore import QSize, Qt
from PySide6.QtGui import (
    QColor,
    QFont,
    QFontDatabase,
    QPalette,
    QSyntaxHighlighter,
    QTextBlockFormat,
    QTextCharFormat,
    QTextCursor,
    QTextDocument,
    QTextFormat,
)
from PySide6.QtWidgets import QSizePolicy, QTextBrowser, QWidget

MARKDOWN_FEATURES = (QTextDocument.MarkdownFeature.MarkdownDialectGitHub
                     | QTextDocument.MarkdownFeature.MarkdownNoHTML)


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
def _lexer(language: str):
    try:
        return get_lexer_by_name(language, stripnl=False, ensurenl=False)
    except ClassNotFound:
        return None


def _format_for(formats: dict[_TokenType, QTextCharFormat], token: _TokenType):
    while token is not Token and token not in formats:
        token = token.parent
    return formats.get(token)


class CodeHighlighter(QSyntaxHighlighter):
    """Colours the code blocks Qt's Markdown importer tags with a language."""

    def __init__(self, document: QTextDocument, dark: bool) -> None:
        super().__init__(document)
        self.style_name = "monokai" if dark else "friendly"

    def highlightBlock(self, text: str) -> None:
        block_format = self.currentBlock().blockFormat()
        if not block_format.hasProperty(QTextFormat.Property.BlockCodeFence) and not (
            block_format.hasProperty(QTextFormat.Property.BlockCodeLanguage)
        ):
            return
        language = block_format.stringProperty(QTextFormat.Property.BlockCodeLanguage)
        lexer = _lexer(language.strip().lower()) if language else None
        if lexer is None:
            try:
                lexer = guess_lexer(text)
            except ClassNotFound:
                return
        formats = _formats(self.style_name)
        offset = 0
        for token, value in lexer.get_tokens(text):
            fmt = _format_for(formats, token)
            if fmt is not None and value:
                self.setFormat(offset, len(value), fmt)
            offset += len(value)


class MarkdownView(QTextBrowser):
    """A read-only, selectable Markdown view as tall as its text."""

    def __init__(self, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.setFrameShape(QTextBrowser.Shape.NoFrame)
        self.setOpenExternalLinks(True)
        self.setVerticalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setHorizontalScrollBarPolicy(Qt.ScrollBarPolicy.ScrollBarAlwaysOff)
        self.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
        self.viewport().setAutoFillBackground(False)
        self.setStyleSheet("QTextBrowser { background: transparent; }")
        self.document().setDocumentMargin(2)
        self._markdown = ""
        self._highlighter = CodeHighlighter(self.document(), is_dark(self.palette()))
        self.document().documentLayout().documentSizeChanged.connect(self._fit_height)

    def markdown(self) -> str:
        """The Markdown source shown."""
        return self._markdown

    def set_markdown(self, text: str) -> None:
        """Show ``text`` as Markdown (no-op when unchanged)."""
        if text == self._markdown:
            return
        self._markdown = text
        # Raw HTML in a model's answer is shown as text, never rendered.
        self.document().setMarkdown(text, MARKDOWN_FEATURES)
        self._shade_code_blocks()

    def set_plain(self, text: str) -> None:
        """Show ``text`` as typed, every line break kept (no-op when unchanged)."""
        if text == self._markdown:
            return
        self._markdown = text
        self.document().setPlainText(text)

    def _shade_code_blocks(self) -> None:
        mono = QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont)
        shade = self.palette().color(QPalette.ColorRole.AlternateBase)
        if shade == self.palette().color(QPalette.ColorRole.Base):
            shade = shade.darker(106)
        block = self.document().begin()
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

    def _fit_height(self, size) -> None:
        height = int(size.height()) + 4
        if self.height() != height:
            self.setFixedHeight(height)

    def sizeHint(self) -> QSize:
        return QSize(200, int(self.document().size().height()) + 4)
