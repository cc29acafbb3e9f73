"""A test helper: every visible text of a widget must fit the room it is given.

``clipped_texts(widget)`` walks the visible labels, buttons, check boxes, combo
boxes (their current text) and table cells and headers under ``widget`` and
returns one line per text that does not fit. A word-wrapped label fits when all
its lines fit its height and no word is wider than it; anything else must fit on
one line. A table cell may elide its text only when the view elides, does not
wrap, and the cell's tooltip holds the whole text (a long chat title in a narrow
column); a cell must also lie inside the view's viewport, and no text widget may
be hidden sideways by the views it sits in. Widths come from
``QFontMetrics.horizontalAdvance`` (a rich-text label is laid out by a
``QTextDocument``, as ``QLabel`` does) against the room the style leaves for the
text, so the check follows the real fonts, not a wording.
"""

from __future__ import annotations

from PySide6.QtCore import QModelIndex, Qt
from PySide6.QtGui import QFont, QFontMetrics, QTextDocument, QTextOption
from PySide6.QtGui import Qt as GuiQt
from PySide6.QtWidgets import (
    QAbstractButton,
    QCheckBox,
    QComboBox,
    QHeaderView,
    QLabel,
    QPushButton,
    QStyle,
    QStyleOptionButton,
    QStyleOptionComboBox,
    QTableView,
    QWidget,
)

SLACK = 1  # pixels of rounding the style's own layout allows itself


def clipped_texts(root: QWidget) -> list[str]:
    """A line for each visible text under ``root`` (itself included) that is cut."""
    found: list[str] = []
    for widget in [root, *root.findChildren(QWidget)]:
        if not widget.isVisibleTo(root.window()) or not widget.isVisible():
            continue
        found += _cut_sideways(widget)
        if isinstance(widget, QLabel):
            found += _label(widget)
        elif isinstance(widget, (QPushButton, QCheckBox)):
            found += _button(widget)
        elif isinstance(widget, QComboBox):
            found += _combo(widget)
        elif isinstance(widget, QTableView):
            found += _table(widget)
    return found


def _cut_sideways(widget: QWidget) -> list[str]:
    """A text widget partly hidden to its left or right by the views it sits in.

    Scrolled out of view up or down is fine (a conversation scrolls); a column too
    narrow for its contents hides them sideways, where nothing scrolls them back.
    """
    if isinstance(widget, QComboBox):
        text = widget.currentText()
    elif isinstance(widget, (QLabel, QAbstractButton)):
        text = widget.text()
    else:
        return []
    shown = widget.visibleRegion().boundingRect()
    if not text or shown.isEmpty() or shown.width() >= widget.width():
        return []
    return [f"{_name(widget)} {text[:60]!r}: {shown.width()} of its {widget.width()} px "
            "in view sideways"]


def _name(widget: QWidget) -> str:
    return f"{type(widget).__name__}({widget.objectName() or '?'})"


def _document(text: str, font: QFont, rich: bool) -> QTextDocument:
    doc = QTextDocument()
    doc.setDefaultFont(font)
    doc.setDocumentMargin(0)
    option = QTextOption()
    option.setWrapMode(QTextOption.WrapMode.WordWrap)
    doc.setDefaultTextOption(option)
    if rich:
        doc.setHtml(text)
    else:
        doc.setPlainText(text)
    return doc


def _label(label: QLabel) -> list[str]:
    text = label.text()
    if not text or (label.pixmap() is not None and not label.pixmap().isNull()):
        return []
    rect = label.contentsRect()
    inset = 2 * label.margin() + max(label.indent(), 0)
    room_w, room_h = rect.width() - inset, rect.height() - 2 * label.margin()
    rich = label.textFormat() == Qt.TextFormat.RichText or (
        label.textFormat() == Qt.TextFormat.AutoText and GuiQt.mightBeRichText(text))
    doc = _document(text, label.font(), rich)
    if label.wordWrap():
        doc.setTextWidth(max(room_w, 1))
        widest = doc.idealWidth()  # a word that cannot be broken sticks out
        height = doc.size().height()
        if widest > room_w + SLACK:
            return [f"{_name(label)} {_short(doc)!r}: a word is {widest:.0f} px in {room_w} px"]
        if height > room_h + SLACK:
            return [f"{_name(label)} {_short(doc)!r}: wraps to {height:.0f} px in {room_h} px"]
        return []
    width = doc.idealWidth()
    if width > room_w + SLACK:
        return [f"{_name(label)} {_short(doc)!r}: {width:.0f} px in {room_w} px"]
    return []


def _short(doc: QTextDocument) -> str:
    plain = doc.toPlainText().replace("\n", " ")
    return plain if len(plain) <= 60 else plain[:57] + "…"


def _mnemonic_free(text: str) -> str:
    return text.replace("&&", "\0").replace("&", "").replace("\0", "&")


def _button(button: QAbstractButton) -> list[str]:
    text = _mnemonic_free(button.text())
    if not text:
        return []
    option = QStyleOptionButton()
    button.initStyleOption(option)
    element = (QStyle.SubElement.SE_CheckBoxContents if isinstance(button, QCheckBox)
               else QStyle.SubElement.SE_PushButtonContents)
    room = button.style().subElementRect(element, option, button).width()
    if not button.icon().isNull():
        room -= button.iconSize().width() + 4
    if isinstance(button, QPushButton):
        # The style pads a push button's label on both sides (Fusion: 2×4 px).
        room -= 2 * button.style().pixelMetric(QStyle.PixelMetric.PM_ButtonMargin, option,
                                               button) // 2
    width = QFontMetrics(button.font()).horizontalAdvance(text)
    if width > room + SLACK:
        return [f"{_name(button)} {text!r}: {width} px in {room} px"]
    return []


def _combo(combo: QComboBox) -> list[str]:
    text = combo.currentText()
    if not text:
        return []
    option = QStyleOptionComboBox()
    combo.initStyleOption(option)
    field = combo.style().subControlRect(QStyle.ComplexControl.CC_ComboBox, option,
                                         QStyle.SubControl.SC_ComboBoxEditField, combo)
    room = field.width()
    if not combo.itemIcon(combo.currentIndex()).isNull():
        room -= combo.iconSize().width() + 4
    width = QFontMetrics(combo.font()).horizontalAdvance(text)
    if width > room + SLACK:
        return [f"{_name(combo)} {text!r}: {width} px in {room} px"]
    return []


def _cell_margin(view: QTableView) -> int:
    # QItemDelegate/QStyledItemDelegate pad text by the focus frame margin + 1 on each side.
    return 2 * (view.style().pixelMetric(QStyle.PixelMetric.PM_FocusFrameHMargin, None, view) + 1)


def _table(view: QTableView) -> list[str]:
    model = view.model()
    if model is None:
        return []
    found: list[str] = []
    margin = _cell_margin(view)
    for row in range(model.rowCount()):
        if view.isRowHidden(row):
            continue
        for column in range(model.columnCount()):
            index = model.index(row, column)
            if view.isColumnHidden(column) or view.indexWidget(index) is not None:
                continue
            found += _cell(view, index, margin)
    for header in (view.horizontalHeader(), view.verticalHeader()):
        if header.isVisible():
            found += _header(view, header)
    return found


def _cell(view: QTableView, index: QModelIndex, margin: int) -> list[str]:
    text = index.data(Qt.ItemDataRole.DisplayRole)
    if text in (None, ""):
        return []
    text = str(text)
    font = index.data(Qt.ItemDataRole.FontRole)
    metrics = QFontMetrics(font if isinstance(font, QFont) else view.font())
    rect = view.visualRect(index)
    width = max(metrics.horizontalAdvance(line) for line in text.split("\n"))
    lines = text.count("\n") + 1
    where = f"{_name(view)} cell ({index.row()},{index.column()}) {text!r}"
    if rect.right() > view.viewport().width() + SLACK:
        return [f"{where}: ends at {rect.right()} px, past the view's {view.viewport().width()}"]
    if width > rect.width() - margin + SLACK and _elided_with_tooltip(view, index, text):
        return []
    if width > rect.width() - margin + SLACK and view.wordWrap():
        # Wrapped onto more lines: fine while the row is tall enough for all of them.
        doc = _document(text, metrics_font(font, view), rich=False)
        doc.setTextWidth(max(rect.width() - margin, 1))
        if doc.idealWidth() <= rect.width() - margin + SLACK \
                and doc.size().height() <= rect.height() + SLACK:
            return []
        return [f"{where}: wraps to {doc.size().height():.0f} px in {rect.height()} px"]
    if width > rect.width() - margin + SLACK:
        return [f"{where}: {width} px in {rect.width() - margin} px"]
    if lines * metrics.height() > rect.height() + SLACK:
        return [f"{where}: {lines} lines in {rect.height()} px"]
    return []


def metrics_font(font: object, view: QTableView) -> QFont:
    """A cell's own font, or its view's."""
    return font if isinstance(font, QFont) else view.font()


def _elided_with_tooltip(view: QTableView, index: QModelIndex, text: str) -> bool:
    tip = index.data(Qt.ItemDataRole.ToolTipRole) or ""
    return (not view.wordWrap() and view.textElideMode() != Qt.TextElideMode.ElideNone
            and text in str(tip))


def _header(view: QTableView, header: QHeaderView) -> list[str]:
    model = view.model()
    horizontal = header.orientation() == Qt.Orientation.Horizontal
    count = model.columnCount() if horizontal else model.rowCount()
    metrics = QFontMetrics(header.font())
    found = []
    for section in range(count):
        if header.isSectionHidden(section):
            continue
        text = model.headerData(section, header.orientation(), Qt.ItemDataRole.DisplayRole)
        if not text:
            continue
        width = metrics.horizontalAdvance(str(text))
        # The header's style pads each section by its margin on both sides.
        margin = 2 * header.style().pixelMetric(QStyle.PixelMetric.PM_HeaderMargin, None, header)
        room = (header.sectionSize(section) if horizontal else header.width()) - margin
        if width > room + SLACK:
            found.append(f"{_name(view)} header {text!r}: {width} px in {room} px")
    return found
