"""The Models dialog on its own: the model in use, verdicts in words, errors with Retry."""

from __future__ import annotations

from types import SimpleNamespace

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QApplication, QLabel, QPushButton

from app.format import short_tokens
from app.window.downloads import unreachable_text
from app.window.model_library import fit_advice, library
from app.window.models_dialog import LOADED, ModelsDialog
from engine import RECOMMENDED_MODELS

GIB = 2**30
RAM = 24 * GIB  # the walkthrough's machine had 23.5 GB


def on_disk(name: str, size: int = GIB) -> SimpleNamespace:
    first = RECOMMENDED_MODELS[0]
    info = SimpleNamespace(attention_layers=first.attention_layers, kv_heads=first.kv_heads,
                           head_dim=first.head_dim, max_context=first.max_context,
                           outside=first.outside)
    return SimpleNamespace(name=name, path=f"/models/{name}", size_bytes=size,
                           weights_bytes=size, info=info)


def dialog_for(qtbot, models=(), loaded=None) -> ModelsDialog:
    installed, recommended = library(list(models), total_ram=RAM)
    dialog = ModelsDialog(installed, recommended, loaded=loaded, total_ram=RAM)
    qtbot.addWidget(dialog)
    return dialog


def verdict(dialog: ModelsDialog, key: str) -> str:
    return dialog.table.item(dialog.rows[key], dialog.verdict_column).text()


def test_the_model_in_use_says_loaded_and_offers_no_load(qtbot) -> None:
    dialog = dialog_for(qtbot, [on_disk("a"), on_disk("b")], loaded="/models/a")
    in_use = dialog.action_button("/models/a")
    assert isinstance(in_use, QLabel) and in_use.text() == LOADED
    other = dialog.action_button("/models/b")
    assert isinstance(other, QPushButton) and other.text() == "Load"


def test_a_model_too_big_for_this_machine_says_so_and_what_would_fit(qtbot) -> None:
    dialog = dialog_for(qtbot)
    small, moe, hybrid = (m.repo_id for m in RECOMMENDED_MODELS[1:])
    # 24 GB: Qwen3 4B holds its whole context in a mode; say which.
    assert verdict(dialog, small).startswith("Fits: the whole 262k context in ")
    # The 30B MoE leaves room beside its weights for part of the context only.
    text = verdict(dialog, moe)
    assert text.startswith("Too big at its full 262k context here. Fits in q4 up to ")
    # The 80B hybrid's weights alone pass this machine's RAM.
    assert "choose a smaller model" in verdict(dialog, hybrid)


def test_what_fits_is_the_largest_context_in_the_smallest_mode() -> None:
    _installed, recommended = library([], total_ram=RAM)
    moe = next(e for e in recommended if e.repo_id == RECOMMENDED_MODELS[2].repo_id)
    fits, text = fit_advice(moe, RAM)
    q4 = next(c for c in moe.costs if c.mode == "q4")
    assert not fits and not q4.fits
    assert f"up to {short_tokens(q4.tokens_fit)} tokens" in text  # rounded down: it fits
    assert all(c.tokens_fit <= q4.tokens_fit for c in moe.costs)


def test_a_failed_download_is_said_in_the_dialog_with_retry(qtbot) -> None:
    dialog = dialog_for(qtbot)
    dialog.show()
    entry = dialog.entries[RECOMMENDED_MODELS[0].repo_id]
    asked: list[str] = []
    dialog.downloadRequested.connect(asked.append)
    dialog.action_button(entry.repo_id).click()
    dialog.download_ended(entry, None, unreachable_text("huggingface.co"))
    assert dialog.error.isVisible()
    assert dialog.error.label.text() == (
        "Can't reach huggingface.co — check the network, then Retry.")
    assert dialog.action_button(entry.repo_id).text() == "Download"
    dialog.error.retry.click()
    assert asked == [entry.repo_id, entry.repo_id]
    assert not dialog.error.isVisible()
    assert dialog.action_button(entry.repo_id).text() == "Cancel"


def test_a_paused_download_says_so_without_retry(qtbot) -> None:
    dialog = dialog_for(qtbot)
    dialog.show()
    entry = dialog.entries[RECOMMENDED_MODELS[0].repo_id]
    dialog.download_ended(entry, None, "Download paused.", cancelled=True)
    assert dialog.error.isVisible() and not dialog.error.retry.isVisible()


def test_no_text_of_the_dialog_is_cut(qtbot, qapp) -> None:
    from app.style import apply_style
    from tests.app.layout import clipped_texts

    apply_style(qapp)
    try:
        dialog = dialog_for(qtbot, [on_disk("SmolLM2-135M-Instruct")],
                            loaded="/models/SmolLM2-135M-Instruct")
        dialog.show()
        qtbot.waitExposed(dialog)
        entry = dialog.entries[RECOMMENDED_MODELS[0].repo_id]
        dialog.download_ended(entry, None, unreachable_text("huggingface.co"))
        qtbot.wait(50)
        clipped = clipped_texts(dialog)
        assert not clipped, "\n".join(clipped)
    finally:
        qapp.setStyleSheet("")


def test_close_window_keys_close_the_dialog(qtbot) -> None:
    dialog = dialog_for(qtbot, [on_disk("a")])
    dialog.show()
    qtbot.waitExposed(dialog)
    dialog.activateWindow()
    qtbot.waitUntil(lambda: QApplication.activeWindow() is dialog, timeout=5_000)
    # Before, ⌘W (Ctrl+W here) did nothing in this window.
    qtbot.keyClick(dialog.table, Qt.Key.Key_W, Qt.KeyboardModifier.ControlModifier)
    assert not dialog.isVisible()


def test_each_rows_button_names_its_model_for_voiceover(qtbot) -> None:
    dialog = dialog_for(qtbot, [on_disk("a"), on_disk("b")], loaded="/models/a")
    # Before, every row's button was read as a bare "Load" or "Download".
    assert dialog.action_button("/models/b").accessibleName() == "Load b"
    first = RECOMMENDED_MODELS[0]
    download = dialog.action_button(first.repo_id)
    assert download.text() == "Download"
    assert download.accessibleName() == f"Download {dialog.entries[first.repo_id].name}"
    download.click()
    cancel = dialog.action_button(first.repo_id)
    assert cancel.accessibleName() == (
        f"Cancel the download of {dialog.entries[first.repo_id].name}")
