"""What a PDF holds beside its pages' drawn text: filled-in form fields and comments.

A form's values live in its fields (the AcroForm), not in the page content that
``extract_text`` reads, and a reviewer's comments live in annotations; both are
what the user typed, so they are read as labelled blocks after the pages' text.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

# A button field with this flag is a radio group, whose value names the option chosen.
RADIO_FLAG = 1 << 15
# Annotations whose /Contents is a comment someone wrote: sticky notes and text boxes.
COMMENT_KINDS = frozenset({"/Text", "/FreeText"})
# A checkbox or radio group left unticked says this, the same as a form never filled in.
UNSET = "/Off"


def marked_text(name: str, reader: Any) -> tuple[str, tuple[str, ...]]:
    """The form fields' values and the comments, each group under a label
    ("Form fields:", "Comments:") after a blank line, and notes on any group that
    could not be read; "" when there are none.

    Args:
        name: the file's name, for the notes.
        reader: a ``pypdf.PdfReader`` whose pages were read.
    """
    text = ""
    notes: list[str] = []
    for label, read in (("Form fields:", _field_lines), ("Comments:", _comment_lines)):
        lines, failed = _guarded(read, reader)
        if lines:
            text += "\n\n" + label + "\n" + "\n".join(lines)
        if failed:
            notes.append(f"“{name}”: its {label.rstrip(':').lower()} could not be read "
                         f"({failed}), so they were left out; its pages' text was read.")
    return text, tuple(notes)


def _guarded(read: Callable[[Any], Iterator[str]], reader: Any) -> tuple[list[str], str]:
    """The lines ``read`` gives, each different line once, and what failed (or "").

    pypdf refuses form trees that bend its rules (a radio button without an
    appearance, a field nested past its limit) where the pages read fine: the
    pages' text is still worth attaching.
    """
    try:
        return list(dict.fromkeys(read(reader))), ""
    except Exception as exc:  # pypdf raises many internal types on broken input
        return [], type(exc).__name__


def _field_lines(reader: Any) -> Iterator[str]:
    """ "label: value" for each field that holds a value, in the form's order."""
    for qualified, field in (reader.get_fields() or {}).items():
        value = _shown_value(field)
        if value:
            yield f"{_label(field, qualified)}: {value}"


def _label(field: Any, qualified: str) -> str:
    """The field's tooltip (/TU, written for people), else its own name."""
    for key in ("/TU", "/T"):
        text = _plain(field.get(key))
        if text:
            return text
    return qualified


def _shown_value(field: Any) -> str:
    """A field's value as words: text as typed, a choice's options, a ticked
    checkbox as "checked" and a radio group as its option; "" when unset."""
    from pypdf.generic import NameObject

    value = field.get("/V")
    if isinstance(value, NameObject):
        if value == UNSET:
            return ""
        return value[1:] if int(field.get("/Ff") or 0) & RADIO_FLAG else "checked"
    if isinstance(value, list):
        return ", ".join(text for item in value if (text := _plain(item)))
    return _plain(value)


def _plain(value: Any) -> str:
    """A PDF string's text, its line ends made "\\n"; "" for anything else (a rich
    text stream, a dictionary)."""
    if not isinstance(value, str):
        return ""
    return value.replace("\r\n", "\n").replace("\r", "\n").strip()


def _comment_lines(reader: Any) -> Iterator[str]:
    """The text of each sticky note and text box, page by page."""
    for page in reader.pages:
        annotations = page.get("/Annots")
        for entry in annotations.get_object() if annotations is not None else ():
            annotation = entry.get_object()
            if isinstance(annotation, dict) and annotation.get("/Subtype") in COMMENT_KINDS:
                text = _plain(annotation.get("/Contents"))
                if text:
                    yield text
