"""The app's bad-input matrix: what the window shows, and that nothing else changes.

The readers' and the engine's exact messages are pinned by
tests/engine/documents/test_matrix.py and tests/engine/runtime/test_bad_input.py; these
tests check that the window shows them where the user looks (the inline notice
for files, the banner for models and prompts) and that the draft, the attached
files and the conversation are left as they were.
"""

from __future__ import annotations

import os
import shutil
import time
import zipfile
from pathlib import Path

import pytest
from PySide6.QtCore import QMimeData, Qt
from PySide6.QtWidgets import QFileDialog

from app.chat.answers import TOO_LONG_TURN
from tests.app.chat.test_documents_drop import TEXT, drop_files
from tests.app.conftest import ANSWER_TIMEOUT_MS, send_and_wait
from tests.engine.documents.test_matrix import _encrypted
from tests.engine.runtime.test_bad_input import BROKEN_FOLDERS


def _blank_pdf(path: Path) -> None:
    import pypdf

    writer = pypdf.PdfWriter()
    writer.add_blank_page(612, 792)
    with path.open("wb") as handle:
        writer.write(handle)


def _sparse_gigabyte(path: Path) -> None:
    with path.open("wb") as handle:
        handle.write(b"log line\n" * 1_000_000)  # 9 MB of text in a 1 GiB sparse file
        handle.truncate(1 << 30)


def _link_loop(path: Path) -> None:
    path.symlink_to(path.with_name("other.txt"))
    path.with_name("other.txt").symlink_to(path)


def _corrupt_docx(path: Path) -> None:
    path.write_bytes(b"PK\x03\x04" + os.urandom(200))


def _not_a_docx(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("readme.txt", "not a Word document")


# file name, how to make it, the message shown ({max_chars}: the model's limit)
BAD_FILES = [
    ("blob.txt", lambda p: p.write_bytes(b"\x00\x01\x02binary" * 10),
     "“blob.txt” looks like a binary file, not text (it contains NUL bytes)."),
    ("empty.md", lambda p: p.write_bytes(b""), "“empty.md” is empty — there is no text to add."),
    ("noise.txt", lambda p: p.write_bytes(bytes([0x81, 0x8D, 0x8F, 0x90, 0x9D, 0x41]) * 50),
     "“noise.txt” isn't readable text: 250 of its 300 bytes are not valid Windows-1252"),
    ("dump.txt", _sparse_gigabyte,
     "“dump.txt” is 1.0 GB — far more than the {room:,} tokens left in this model's "
     "context (after the chat so far and room for the answer). Split it into smaller files."),
    ("scan.pdf", _blank_pdf, "“scan.pdf” has no text layer (it is probably scanned images, "
     "1 page). Run OCR on it first"),
    ("locked.pdf", lambda p: _encrypted(p.parent, p.name, user_password="secret"),
     "“locked.pdf” is an encrypted PDF that needs a password."),
    ("garbage.docx", _corrupt_docx, "“garbage.docx” is a damaged Word file that can't be opened."),
    ("archive.docx", _not_a_docx, "“archive.docx” is a damaged Word file that can't be opened."),
    ("loop.txt", _link_loop, "“loop.txt” is a symbolic link that points back to itself"),
    ("photo.heic", lambda p: p.write_bytes(b"abc"), "can't read .heic files"),
    ("chapter.md", lambda p: p.mkdir(), "“chapter.md” is a folder; drop the files inside it"),
    ("gone.txt", lambda p: None,  # moved or deleted between the drag and the read
     "“gone.txt” is gone — it was moved or deleted before it could be read."),
]


def _snapshot(window) -> tuple:
    c = window.controller
    return ([(m.role, m.content, m.status) for m in c.model.messages()],
            [(m.role, m.content, m.status) for m in c.store.messages(c.current.id)],
            len(window.conversation.widgets))


def test_every_bad_file_shows_its_message_and_disturbs_nothing(qtbot, window, tmp_path) -> None:
    send_and_wait(qtbot, window, "Hello")
    good = tmp_path / "good.txt"
    good.write_text(TEXT)
    drop_files(window, [good])
    qtbot.waitUntil(lambda: bool(window.attachments), timeout=20_000)
    window.composer.set_text("my draft")
    before = _snapshot(window)
    for name, make, expected in BAD_FILES:
        path = tmp_path / name
        make(path)
        message = expected.format(room=window.fit.room(name))
        drop_files(window, [path])
        qtbot.waitUntil(lambda: not window.loader.pending, timeout=20_000)
        assert message in window.composer.notice.text(), (name, window.composer.notice.text())
        assert window.composer.notice.isVisible() and not window.banner.isVisible()
        assert [r.name for r in window.attachments.values()] == ["good.txt"], name
        assert len(window.composer.chips) == 1 and not window.loader.pending
        assert window.composer.text() == "my draft"
        assert _snapshot(window) == before
    # The good file and the draft still go out together.
    assert send_and_wait(qtbot, window, "my draft") == "complete"
    sent = window.controller.store.messages(window.controller.current.id)[-2]
    assert [a.name for a in sent.attachments] == ["good.txt"] and sent.content == "my draft"


def test_a_file_not_in_utf8_is_read_as_windows_1252_and_said(qtbot, window, tmp_path) -> None:
    path = tmp_path / "menu.txt"
    path.write_bytes(b"cr\xe8me br\xfbl\xe9e\n" + b"dessert of the day\n" * 20)
    window.composer.set_text("my draft")
    drop_files(window, [path])
    qtbot.waitUntil(lambda: bool(window.attachments), timeout=20_000)
    (record,) = window.attachments.values()
    assert record.text.startswith("crème brûlée\n")
    assert window.composer.notice.text() == (
        "“menu.txt” is not UTF-8: it was read as Windows-1252 (Western) text.")
    assert window.composer.text() == "my draft"


def test_a_million_character_paste_is_refused_without_a_freeze(qtbot, window) -> None:
    c = window.controller
    send_and_wait(qtbot, window, "Hello")
    before = _snapshot(window)
    context = window.fit.max_context()
    limits = (f"more than this model's {context:,}-token context can hold (at most about "
              f"{context * 8:,} characters)")
    text = ("All work and no play makes Jack a dull boy. " * 23_000)[:1_000_000]
    mime = QMimeData()
    mime.setText(text)
    window.composer.set_text("my draft")
    began = time.perf_counter()
    window.composer.edit.insertFromMimeData(mime)  # what Cmd+V does
    print(f"the refused paste blocked the GUI thread "
          f"{(time.perf_counter() - began) * 1000:.1f} ms")  # shown with -s
    assert window.banner.isVisible() and window.banner.label.text() == (
        f"That paste is 1,000,000 characters, {limits}, so it was not pasted. Paste a part "
        "of it, or use a model with a longer context.")
    assert window.composer.text() == "my draft" and _snapshot(window) == before
    small = QMimeData()
    small.setText("[pasted]")
    window.composer.edit.insertFromMimeData(small)  # an ordinary paste still goes in
    assert sorted(window.composer.text()) == sorted("my draft[pasted]")

    # Text that reaches the box another way is refused at send, before it is saved.
    window.composer.edit.setPlainText(text)
    began = time.perf_counter()
    qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    print(f"refusing the send blocked the GUI thread "
          f"{(time.perf_counter() - began) * 1000:.1f} ms")  # shown with -s
    assert window.banner.label.text() == (
        f"This message is 1,000,000 characters, {limits}. It was not sent and is still in the "
        "box: shorten it, or use a model with a longer context.")
    assert window.composer.text() == text and not c.busy
    assert _snapshot(window) == before
    # A short message goes out and is answered; the chat is not stuck on the paste.
    window.composer.set_text("")
    assert send_and_wait(qtbot, window, "A short question") == "complete"


def test_a_prompt_with_control_characters_is_answered_and_saved_as_typed(qtbot, window) -> None:
    c = window.controller
    prompt = "bell\x07 nul\x00 esc\x1b[31mred\x1b[0m del\x7f bom\ufeff rlo\u202e c1\x85 end"
    window.composer.edit.setPlainText(prompt)
    assert window.composer.text() == prompt
    with qtbot.waitSignal(c.answerFinished, timeout=ANSWER_TIMEOUT_MS) as done:
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    assert done.args == ["complete"]
    user, answer = c.store.messages(c.current.id)
    assert user.content == prompt and answer.status == "complete"
    assert c.model.message(0).content == prompt
    assert send_and_wait(qtbot, window, "And again") == "complete"


@pytest.mark.parametrize("case", ["no config.json", "unknown architecture",
                                  "weights truncated mid-tensor", "corrupt tokenizer.json"])
def test_a_broken_model_folder_is_refused_and_the_loaded_model_keeps_working(
        qtbot, window, tiny_llama, tmp_path, monkeypatch, case) -> None:
    c = window.controller
    send_and_wait(qtbot, window, "Hello")
    folders_before = c.settings.model_folders
    folder = tmp_path / "My Model"
    shutil.copytree(tiny_llama, folder)
    damage, expected = BROKEN_FOLDERS[case]
    damage(folder)
    monkeypatch.setattr(QFileDialog, "getExistingDirectory", lambda *a, **k: str(folder))
    with qtbot.waitSignal(c.modelStateChanged, timeout=ANSWER_TIMEOUT_MS,
                          check_params_cb=lambda _text, ready: ready):
        window.open_model_folder()
    text = window.banner.label.text()
    assert window.banner.isVisible()
    assert text.startswith(expected.format(folder=folder, name=folder.name))
    assert text.endswith(f" Still using {tiny_llama.name}.")
    assert c.model_ready and c.model_id == str(tiny_llama)
    assert window.model_state.text() == f"● {tiny_llama.name}"
    assert c.settings.last_model == str(tiny_llama)
    assert c.settings.model_folders == folders_before  # the broken folder is not kept
    assert send_and_wait(qtbot, window, "Still there?") == "complete"


def test_a_turn_too_long_for_the_context_is_set_aside_and_the_chat_goes_on(
        qtbot, window) -> None:
    c = window.controller
    send_and_wait(qtbot, window, "Hello")
    long_text = TEXT * 300  # 22,500 characters: under the paste bound, over 4,096 tokens
    assert send_and_wait(qtbot, window, long_text) == "failed"
    assert window.banner.label.text().startswith("This conversation needs ")
    rows = c.model.messages()
    assert [(r.role, r.status) for r in rows[2:]] == [("user", "failed"), ("assistant", "failed")]
    stored = c.store.messages(c.current.id)[2]
    assert (stored.content, stored.status, stored.reason) == (long_text, "failed", TOO_LONG_TURN)
    status = window.conversation.widget_for(2).status
    assert (status.text(), status.toolTip()) == ("Failed", TOO_LONG_TURN)
    assert all(long_text not in m["content"] for m in c.model.engine_messages(""))
    # Without this, every later message would fail with the same refusal.
    assert send_and_wait(qtbot, window, "A short one then") == "complete"
