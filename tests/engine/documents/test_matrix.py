"""Bad-input matrix for dropped documents (engine.documents.reader): each row asserts the exact
message the user sees, or what the reader returns when it copes.

Complements test_documents.py (which covers the happy paths and phrases). Two rows
started as strict xfails (binary data after the first 8 KiB, a file truncated while
being read) and pass since documents.py was fixed.
"""

from __future__ import annotations

import os
import tracemalloc
import zipfile
from pathlib import Path

import pytest

from engine.documents.limits import DEFAULT_MAX_CHARS, READ_BLOCK
from engine.documents.reader import read_document
from engine.errors import DocumentError
from tests.engine.documents.test_reader import _pdf_with_text


def _refused(path: Path, **kwargs: object) -> str:
    with pytest.raises(DocumentError) as error:
        read_document(path, **kwargs)
    return str(error.value)


BINARY = ("“{name}” looks like a binary file, not text (it contains NUL bytes). Drop a text, "
          "Markdown, source, PDF or .docx file instead.")


def test_binary_file_named_txt(tmp_path: Path) -> None:
    path = tmp_path / "photo.txt"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)) * 8)
    assert _refused(path) == BINARY.format(name="photo.txt")


@pytest.mark.parametrize("text", ["plain notes", "Notes — 東京の会議 — итоги\n" * 20])
@pytest.mark.parametrize("encoding", ["utf-16-le", "utf-16-be"])
def test_utf16_without_a_byte_order_mark_is_read_and_said(
        tmp_path: Path, text: str, encoding: str) -> None:
    path = tmp_path / "notes.txt"
    path.write_bytes(text.encode(encoding))
    # Not "binary", also for text far from Latin letters (was refused with "save it as
    # UTF-8"): read in the byte order its NULs show, and said.
    doc = read_document(path)
    assert doc.text == text
    order = "little" if encoding.endswith("le") else "big"
    assert doc.notes == (f"“notes.txt” has no byte-order mark: it was read as UTF-16 "
                         f"({order}-endian) text.",)


@pytest.mark.parametrize("encoding", ["utf-16-be", "utf-16-le", "utf-8"])
def test_replacement_characters_the_file_holds_are_text_not_errors(
        tmp_path: Path, encoding: str) -> None:
    path = tmp_path / "marks.txt"
    bom = {"utf-16-be": b"\xfe\xff", "utf-16-le": b"\xff\xfe", "utf-8": b""}[encoding]
    path.write_bytes(bom + ("a lost character: \ufffd\n" * 40).encode(encoding))
    doc = read_document(path)
    assert doc.notes == () and doc.text.count("\ufffd") == 40
    # One across the 1 MiB read blocks, too.
    straddle = tmp_path / "straddle.txt"
    straddle.write_bytes(b"a" * (READ_BLOCK - 1) + "\ufffd".encode() + b"b")
    assert read_document(straddle).notes == ()


def test_a_folder_is_said_to_be_one_whatever_its_name(tmp_path: Path) -> None:
    folder = tmp_path / "Project"
    folder.mkdir()
    assert _refused(folder) == "“Project” is a folder; drop the files inside it instead."


def test_binary_after_the_first_8_kib_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "app.log"
    path.write_bytes(b"started\n" * 2048 + b"\x00\x01\x02\x03" * 256)
    assert _refused(path) == BINARY.format(name="app.log")


def test_empty_file(tmp_path: Path) -> None:
    for name in ("empty.txt", "empty.pdf", "empty.docx"):
        (tmp_path / name).write_bytes(b"")
        assert _refused(tmp_path / name) == f"“{name}” is empty — there is no text to add."


def test_device_files_behind_a_txt_link_are_empty_not_endless(tmp_path: Path) -> None:
    for device in ("/dev/zero", "/dev/urandom"):
        link = tmp_path / f"{Path(device).name}.txt"
        link.symlink_to(device)
        assert _refused(link) == f"“{link.name}” is empty — there is no text to add."


def test_invalid_utf8_past_the_first_block_is_replaced_and_said(tmp_path: Path) -> None:
    path = tmp_path / "menu.txt"
    path.write_bytes(b"dessert of the day\n" * (READ_BLOCK // 19 + 1) + b"cr\xe8me br\xfbl\xe9e\n")
    doc = read_document(path)
    assert doc.text.endswith("cr\ufffdme br\ufffdl\ufffde\n")
    assert doc.notes == ("3 bytes of “menu.txt” were not valid UTF-8 and were replaced with �.",)
    one = tmp_path / "one.txt"
    one.write_bytes(b"a" * READ_BLOCK + b"\xff")
    assert read_document(one).notes == (
        "1 byte of “one.txt” was not valid UTF-8 and was replaced with �.",)
    # A character split across the 1 MiB read blocks is not an invalid byte.
    split = tmp_path / "split.txt"
    split.write_bytes(b"a" * (READ_BLOCK - 1) + "é".encode() + b"b")
    doc = read_document(split)
    assert doc.notes == () and doc.text.endswith("aéb")


def test_latin_1_and_windows_1252_text_is_read_and_said(tmp_path: Path) -> None:
    """Older Windows and Excel exports: accented letters and curly quotes."""
    path = tmp_path / "latin1.csv"
    path.write_bytes("naïve,café,crème\n".encode("latin-1") * 50)
    doc = read_document(path)
    assert doc.text == "naïve,café,crème\n" * 50
    assert doc.notes == ("“latin1.csv” is not UTF-8: it was read as Windows-1252 (Western) "
                         "text.",)
    quotes = tmp_path / "quotes.txt"
    quotes.write_bytes("“Longleaf” – 10 €\n".encode("cp1252"))
    assert read_document(quotes).text == "“Longleaf” – 10 €\n"


def test_mostly_undecodable_bytes_are_refused_with_counts(tmp_path: Path) -> None:
    path = tmp_path / "noise.txt"
    path.write_bytes(bytes([0x81, 0x8D, 0x8F, 0x90, 0x9D, 0x41]) * 50)  # none in Windows-1252
    assert _refused(path) == ("“noise.txt” isn't readable text: 250 of its 300 bytes are not "
                              "valid Windows-1252 (Western). Save it as UTF-8 text and try again.")


def test_one_gigabyte_text_file_is_streamed_and_refused_with_numbers(tmp_path: Path) -> None:
    path = tmp_path / "dump.txt"
    with path.open("wb") as handle:
        handle.write(b"log line\n" * 1_000_000)  # 9 MB of text ...
        handle.truncate(1 << 30)  # ... in a 1 GiB file, sparse on disk
    tracemalloc.start()
    try:
        message = _refused(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert message == (f"“dump.txt” has more than {DEFAULT_MAX_CHARS:,} characters of text, "
                       f"more than the {DEFAULT_MAX_CHARS:,} that fit in this model's context. "
                       "Attach a part of it, or use a model with a longer context.")
    assert peak < 64 * 2**20  # streamed: a few blocks and the text so far, not 1 GiB


def test_pdf_without_a_text_layer(tmp_path: Path) -> None:
    import pypdf

    writer = pypdf.PdfWriter()
    writer.add_blank_page(612, 792)
    path = tmp_path / "scan.pdf"
    with path.open("wb") as handle:
        writer.write(handle)
    assert _refused(path) == (
        "“scan.pdf” has no text layer (it is probably scanned images, 1 page). Run OCR on "
        "it first, e.g. Preview or ocrmypdf, then drop the result.")


def _encrypted(tmp_path: Path, name: str, user_password: str,
               algorithm: str = "RC4-128") -> Path:
    import pypdf

    source = tmp_path / "source.pdf"
    source.write_bytes(_pdf_with_text(["quarterly numbers"]))
    writer = pypdf.PdfWriter(clone_from=pypdf.PdfReader(source))
    writer.encrypt(user_password=user_password, owner_password="owner", algorithm=algorithm)
    path = tmp_path / name
    with path.open("wb") as handle:
        writer.write(handle)
    return path


def test_encrypted_pdf(tmp_path: Path) -> None:
    path = _encrypted(tmp_path, "locked.pdf", user_password="secret")
    assert _refused(path) == (
        "“locked.pdf” is an encrypted PDF that needs a password. Save an unprotected copy "
        "(e.g. Print → Save as PDF) and drop that.")
    # Encrypted with only an owner password: opens without one, so it is read, in the
    # AES that Acrobat and most tools write as in the older RC4.
    for algorithm in ("RC4-128", "AES-128", "AES-256"):
        opened = _encrypted(tmp_path, f"open-{algorithm}.pdf", "", algorithm)
        assert "quarterly numbers" in read_document(opened).text


def test_corrupt_docx(tmp_path: Path) -> None:
    damaged = ("“{name}” is a damaged Word file that can't be opened. Open and re-save it in "
               "Word or Pages, then try again.")
    garbage = tmp_path / "garbage.docx"
    garbage.write_bytes(b"PK\x03\x04" + os.urandom(200))
    assert _refused(garbage) == damaged.format(name="garbage.docx")
    other_zip = tmp_path / "archive.docx"
    with zipfile.ZipFile(other_zip, "w") as archive:
        archive.writestr("readme.txt", "not a Word document")
    assert _refused(other_zip) == damaged.format(name="archive.docx")


def test_symlink_loop_and_dangling_link(tmp_path: Path) -> None:
    (tmp_path / "a.txt").symlink_to(tmp_path / "b.txt")
    (tmp_path / "b.txt").symlink_to(tmp_path / "a.txt")
    assert _refused(tmp_path / "a.txt") == (
        "“a.txt” is a symbolic link that points back to itself (a link loop); drop the "
        "real file instead.")
    (tmp_path / "dangling.md").symlink_to(tmp_path / "moved.md")
    assert _refused(tmp_path / "dangling.md") == (
        "“dangling.md” is gone — it was moved or deleted before it could be read.")


def test_folder_named_like_a_file(tmp_path: Path) -> None:
    (tmp_path / "chapter.md").mkdir()
    assert _refused(tmp_path / "chapter.md") == (
        "“chapter.md” is a folder; drop the files inside it instead.")


def _open_then(action, target: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    real_open = Path.open

    def patched(self: Path, *args, **kwargs):
        if self == target:
            action(self)
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", patched)


def test_file_deleted_between_drop_and_read(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "draft.txt"
    path.write_text("draft " * 100)
    _open_then(Path.unlink, path, monkeypatch)
    assert _refused(path) == (
        "“draft.txt” is gone — it was moved or deleted before it could be read.")


def test_file_deleted_while_open_is_read_whole(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "notes.txt"
    text = "notes line\n" * 300_000  # several read blocks
    path.write_text(text)
    real_open = Path.open

    def open_then_delete(self: Path, *args, **kwargs):
        handle = real_open(self, *args, **kwargs)
        if self == path:
            os.unlink(self)  # the open handle still reads every byte (POSIX)
        return handle

    monkeypatch.setattr(Path, "open", open_then_delete)
    assert read_document(path).text == text


def test_file_truncated_while_being_read_is_refused(tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "growing.txt"
    path.write_text("row\n" * 500_000)
    real_open = Path.open

    def open_then_truncate(self: Path, *args, **kwargs):
        handle = real_open(self, *args, **kwargs)
        if self == path:
            os.truncate(self, 1000)  # another program rewrites the file
        return handle

    monkeypatch.setattr(Path, "open", open_then_truncate)
    assert "changed or disappeared while it was being read" in _refused(path)
