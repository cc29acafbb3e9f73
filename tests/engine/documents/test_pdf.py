"""What engine.documents.pdf says of PDFs that are empty, not PDFs, cut short, partly
scanned or typeset (ligatures, hyphens), each built by hand."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from engine.documents.reader import read_document
from engine.errors import Cancelled, DocumentError
from tests.engine.documents.pdf_files import assemble_pdf


def _refused(path: Path) -> str:
    with pytest.raises(DocumentError) as error:
        read_document(path)
    return str(error.value)


def test_a_pdf_with_no_pages_is_said_to_have_none(tmp_path: Path) -> None:
    path = tmp_path / "zero.pdf"
    path.write_bytes(assemble_pdf([b"<< /Type /Catalog /Pages 2 0 R >>",
                                   b"<< /Type /Pages /Kids [] /Count 0 >>"]))
    assert _refused(path) == (
        "“zero.pdf” is a PDF with no pages — there is no text to add. If it should have "
        "pages, export it again from the program that made it.")


HELVETICA = b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"


def _pages_pdf(texts: list[bytes], font: bytes = HELVETICA, more_fonts: bytes = b"") -> bytes:
    """A PDF with one page per content stream in ``texts``, each with ``font`` as /F1
    and the fonts named in ``more_fonts`` (a dictionary's entries)."""
    count = len(texts)
    kids = b" ".join(b"%d 0 R" % (3 + 2 * i) for i in range(count))
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>",
               b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, count)]
    for i, content in enumerate(texts):
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents %d 0 R "
                       b"/Resources << /Font << /F1 %d 0 R %s >> >> >>"
                       % (4 + 2 * i, 3 + 2 * count, more_fonts))
        objects.append(b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream")
    objects.append(font)
    return assemble_pdf(objects)


def _drawn(*lines: str) -> bytes:
    """A content stream drawing ``lines`` one under another."""
    shown = " ".join(f"({line}) Tj T*" for line in lines)
    return f"BT /F1 12 Tf 72 720 Td 14 TL {shown} ET".encode("latin-1")


NOT_A_PDF = ("“{name}” isn't a PDF: it looks like {kind}. If it came from a download, the "
             "site may have sent an error or sign-in page instead; download it again.")


@pytest.mark.parametrize(("data", "kind"), [
    (b"\n<!DOCTYPE html><html><body>Access denied</body></html>", "a web page (HTML)"),
    (b'{"error": "not found"}', "JSON data"),
    (b"PK\x03\x04" + bytes(60), "a zip archive"),
], ids=["html", "json", "zip"])
def test_a_file_named_pdf_that_is_not_one_says_what_it_looks_like(
        tmp_path: Path, data: bytes, kind: str) -> None:
    path = tmp_path / "paper.pdf"
    path.write_bytes(data)
    assert _refused(path) == NOT_A_PDF.format(name="paper.pdf", kind=kind)
    path.write_bytes(b"Quarterly figures, as plain text")
    assert _refused(path) == (
        "“paper.pdf” isn't a PDF: it does not start as one. Download it again, or export "
        "it to PDF again from the program that made it.")


def test_a_pdf_cut_short_is_said_to_end_early_and_a_whole_one_damaged(tmp_path: Path) -> None:
    whole = _pages_pdf([_drawn(f"Page {n} text") for n in range(10)])
    path = tmp_path / "download.pdf"
    for share in (0.3, 0.7, 0.98):
        path.write_bytes(whole[:int(len(whole) * share)])
        assert _refused(path) == (
            "“download.pdf” ends early: it is cut off, as by an interrupted download or "
            "copy. Download or copy it again, then drop the whole file.")
    # Ending as a PDF ends, it is not cut short but damaged inside.
    path.write_bytes(b"%PDF-1.4\n1 0 obj << /Type /Catalog /Pages 9 0 R >>\n"
                     b"startxref\n9999\n%%EOF\n")
    assert _refused(path).startswith("“download.pdf” is a damaged PDF that can't be read (")


def test_a_pdfs_ligatures_soft_hyphens_and_broken_words_are_undone(tmp_path: Path) -> None:
    # Times with two codes drawing the fi and fl ligatures, as typesetters set them,
    # over Windows' code page, whose 0xAD is the soft hyphen.
    font = (b"<< /Type /Font /Subtype /Type1 /BaseFont /Times-Roman /Encoding << /Type "
            b"/Encoding /BaseEncoding /WinAnsiEncoding /Differences [200 /fi /fl] >> >>")
    pdf = _pages_pdf([b"BT /F1 12 Tf 72 720 Td 14 TL (\xc8nd the \xc8rst \xc9ow) Tj T* "
                      b"(an exam-) Tj T* (ple of infor\xadmation) Tj ET"], font)
    path = tmp_path / "typeset.pdf"
    path.write_bytes(pdf)
    assert read_document(path).text == "find the first flow\nan example of information"


def test_pages_without_text_are_counted_in_a_note(tmp_path: Path) -> None:
    scanned = b"q 612 0 0 792 0 0 cm Q"  # where a scan draws its page image
    path = tmp_path / "scan.pdf"
    path.write_bytes(_pages_pdf([_drawn("SCANNED BY XEROX")] + [scanned] * 19))
    doc = read_document(path)
    assert doc.text == "SCANNED BY XEROX"
    assert doc.notes == (
        "“scan.pdf”: no text on 19 of its 20 pages (scanned images?), so only the rest was "
        "read. Run OCR on it first, e.g. Preview or ocrmypdf, to read those too.",)
    path.write_bytes(_pages_pdf([_drawn("Every page"), _drawn("has text")]))
    assert read_document(path).notes == ()


# A subset TrueType font without a ToUnicode map (the character map), as some PDF
# tools write: its glyph numbers, from 1, are all a reader gets.
UNMAPPED = (b"/F2 << /Type /Font /Subtype /Type0 /BaseFont /ABCDEF+Calibri /Encoding /Identity-H "
            b"/DescendantFonts [<< /Type /Font /Subtype /CIDFontType2 /BaseFont /ABCDEF+Calibri "
            b"/CIDSystemInfo << /Registry (Adobe) /Ordering (Identity) /Supplement 0 >> >>] >>")


def _unmapped(text: str) -> bytes:
    """A content stream drawing ``text`` in ``UNMAPPED``, glyphs numbered as first used."""
    glyphs: dict[str, int] = {}
    codes = "".join(f"{glyphs.setdefault(char, len(glyphs) + 1):04x}" for char in text)
    return f"BT /F2 12 Tf 72 720 Td <{codes}> Tj ET".encode()


def test_text_in_fonts_without_a_character_map_is_left_out_and_said(tmp_path: Path) -> None:
    # Icons a font maps to the private-use area (U+E000 on) beside ordinary text are kept.
    icons = (b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica /Encoding << /Type "
             b"/Encoding /Differences [200 /uniE001 /uniE002] >> >>")
    path = tmp_path / "report.pdf"
    path.write_bytes(_pages_pdf([
        b"BT /F1 12 Tf 72 720 Td (\xc8 Phone 555 0100 \xc9 Mail jane@example.com) Tj ET",
        _unmapped("Quarterly figures rose by four percent"),
    ], icons, UNMAPPED))
    doc = read_document(path)
    assert doc.text == "\ue001 Phone 555 0100 \ue002 Mail jane@example.com"
    assert doc.notes == (
        "“report.pdf”: the text on 1 of its 2 pages can't be decoded (its fonts give no "
        "character map) and was left out. Run OCR on it first, e.g. ocrmypdf --force-ocr, "
        "to read those too.",)
    path.write_bytes(_pages_pdf([_unmapped("Quarterly figures")] * 2, more_fonts=UNMAPPED))
    assert _refused(path) == (
        "“report.pdf” has text that can't be decoded: its fonts give no character map, so "
        "what they draw can't be read as letters. Run OCR on it first, e.g. ocrmypdf "
        "--force-ocr, then drop the result.")


def _form_pdf(content: bytes, *annotations: bytes) -> bytes:
    """A one-page PDF drawing ``content`` whose ``annotations`` (objects 6 on) are on
    its page and, those with a /T, in its form."""
    numbers = range(6, 6 + len(annotations))
    refs = b" ".join(b"%d 0 R" % n for n in numbers)
    fields = b" ".join(b"%d 0 R" % n
                       for n, a in zip(numbers, annotations, strict=True) if b"/T (" in a)
    return assemble_pdf([
        b"<< /Type /Catalog /Pages 2 0 R /AcroForm << /Fields [%s] >> >>" % fields,
        b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
        b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R "
        b"/Resources << /Font << /F1 5 0 R >> >> /Annots [%s] >>" % refs,
        b"<< /Length %d >>\nstream\n" % len(content) + content + b"\nendstream",
        HELVETICA, *annotations])


def _widget(entries: bytes) -> bytes:
    return b"<< /Type /Annot /Subtype /Widget /Rect [100 600 300 620] /P 3 0 R %s >>" % entries


def test_filled_in_form_fields_and_comments_are_read_after_the_pages(tmp_path: Path) -> None:
    path = tmp_path / "application.pdf"
    path.write_bytes(_form_pdf(
        _drawn("Applicant name:", "Languages:"),
        _widget(b"/FT /Tx /T (name) /TU (Applicant name) /V (Jane Doe)"),
        _widget(b"/FT /Tx /T (address) /V (1 Pine Road\r\nLongleaf)"),
        _widget(b"/FT /Tx /T (phone) /V ()"),  # left empty: not said
        _widget(b"/FT /Btn /T (agree) /V /Yes /AS /Yes"),
        _widget(b"/FT /Btn /T (newsletter) /V /Off /AS /Off"),  # unticked: not said
        _widget(b"/FT /Ch /T (languages) /V [(English) (French)]"),
        _widget(b"/FT /Btn /Ff 49152 /T (size) /V /Large /AS /Large "
                b"/AP << /N << /Large 4 0 R /Off 4 0 R >> >>"),
        b"<< /Type /Annot /Subtype /FreeText /Rect [100 500 300 520] "
        b"/Contents (Reviewer: this figure is wrong) >>",
        b"<< /Type /Annot /Subtype /Text /Rect [0 0 20 20] /Contents (Check the date) >>",
        b"<< /Type /Annot /Subtype /Link /Rect [0 0 20 20] /Contents (not a comment) >>",
    ))
    doc = read_document(path)
    assert doc.text == (
        "Applicant name:\nLanguages:\n\n"
        "Form fields:\nApplicant name: Jane Doe\naddress: 1 Pine Road\nLongleaf\n"
        "agree: checked\nlanguages: English, French\nsize: Large\n\n"
        "Comments:\nReviewer: this figure is wrong\nCheck the date")
    assert doc.notes == ()


def test_a_pdf_whose_text_is_all_in_its_fields_is_read_not_refused(tmp_path: Path) -> None:
    path = tmp_path / "filled.pdf"
    path.write_bytes(_form_pdf(b"", _widget(b"/FT /Tx /T (name) /V (Jane Doe)")))
    doc = read_document(path)
    assert doc.text == "Form fields:\nname: Jane Doe"
    assert doc.notes == (
        "“filled.pdf”: its pages have no text of their own, so only what was filled into "
        "its form fields or written in comments was read. If its pages are scanned images, "
        "run OCR on it first, e.g. Preview or ocrmypdf, to read them too.",)


def test_a_form_the_reader_cannot_follow_still_gives_its_pages_text(tmp_path: Path) -> None:
    # A radio button without an appearance: pypdf refuses the whole form tree.
    path = tmp_path / "odd form.pdf"
    path.write_bytes(_form_pdf(
        _drawn("Pick a size:"),
        b"<< /FT /Btn /Ff 49152 /T (size) /V /Large /Kids [7 0 R] >>",
        b"<< /Type /Annot /Subtype /Widget /Parent 6 0 R /AS /Large /Rect [0 0 9 9] >>"))
    doc = read_document(path)
    assert doc.text == "Pick a size:"
    assert doc.notes == (
        "“odd form.pdf”: its form fields could not be read (PdfReadError), so they were "
        "left out; its pages' text was read.",)


def test_a_pdf_read_stops_at_the_page_after_its_cancel(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import pypdf

    path = tmp_path / "book.pdf"
    path.write_bytes(_pages_pdf([_drawn(f"Page {n}") for n in range(1, 41)]))
    cancel = threading.Event()
    read: list[int] = []
    extract = pypdf.PageObject.extract_text

    def counted(page: pypdf.PageObject, *args: object, **kwargs: object) -> str:
        read.append(1)
        if len(read) == 3:  # the chip is removed while page 3 is read
            cancel.set()
        return extract(page, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(pypdf.PageObject, "extract_text", counted)
    with pytest.raises(Cancelled) as stopped:
        read_document(path, cancel=cancel)
    assert str(stopped.value) == "Reading “book.pdf” was stopped."
    assert len(read) == 3  # not the other 37 pages
    # Cancelled before it starts (it waited behind another file): no page is read.
    read.clear()
    with pytest.raises(Cancelled):
        read_document(path, cancel=cancel)
    assert read == []
