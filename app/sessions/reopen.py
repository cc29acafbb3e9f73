"""Reopen in…: the chat shown, copied into a new chat in another KV mode.

The menu offers the other modes only, and each asks first, saying what will
happen: a copy in the new mode, read in again (with the expected wait), and
the original kept.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtWidgets import QMenu, QMessageBox, QWidget

from app.controller import ChatController
from app.format import human_bytes
from app.memory.fit_check import wait_sentence
from engine import MODES, EngineError, KvMode

REOPEN_TIP = ("Copy this chat into a new chat that keeps its memory (the KV cache) in another "
              "mode: smaller modes fit longer chats in less memory, at a small cost in "
              "exactness. The copy reads the conversation in again; this chat stays as it is.")


def fill_reopen_menu(menu: QMenu, controller: ChatController, parent: QWidget) -> None:
    """Put one action per mode other than the shown chat's into ``menu``."""
    menu.clear()
    menu.setToolTipsVisible(True)
    current = controller.current
    for mode in MODES:
        if current is not None and mode == current.kv_mode:
            continue

        def reopen_in(m: KvMode = mode) -> None:  # the default binds this loop's mode
            ask_reopen(controller, m, parent)

        action = menu.addAction(f"Reopen in {mode}…", reopen_in)
        action.setToolTip(f"A copy of this chat in {mode}: {MODES[mode].description}")


def reopen_text(controller: ChatController, mode: KvMode) -> str:
    """What reopening the shown chat in ``mode`` does, in plain words."""
    current = controller.current
    if current is None:
        return ""
    messages = sum(1 for m in controller.model.messages() if m.content or m.attachments)
    tokens = current.tokens
    parts = [f"Longleaf copies the {messages:,} messages of “{current.title}” into a new chat "
             f"with a {mode} KV cache and reads them in again"]
    if tokens:
        parts.append(f" ({tokens:,} tokens)")
    parts.append(". The original chat stays as it is, in "
                 f"{current.kv_mode}.")
    wait = wait_sentence(tokens, 0, controller.prefill_rate())
    if wait:
        parts.append(f" {wait}.")
    size = _kv_bytes(controller, mode, tokens)
    if size:
        parts.append(f" Its KV cache will take about {size} in {mode}.")
    return "".join(parts)


def _kv_bytes(controller: ChatController, mode: KvMode, tokens: int) -> str:
    if not tokens or not controller.model_ready:
        return ""
    try:
        report = controller.bridge.fit_check(None, tokens)
    except EngineError:  # no model any more: say nothing
        return ""
    entry = report.for_mode(mode)
    return human_bytes(entry.bytes_needed) if entry.supported else ""


def ask_reopen(controller: ChatController, mode: KvMode, parent: QWidget | None) -> None:
    """Say what reopening in ``mode`` does; reopen when the user agrees."""
    if controller.current is None:
        return
    box = QMessageBox(QMessageBox.Icon.Question, f"Reopen in {mode}",
                      f"Reopen this chat in {mode}?", parent=parent)
    box.setTextFormat(Qt.TextFormat.PlainText)  # a title is the user's text, never markup
    box.setInformativeText(reopen_text(controller, mode))
    reopen = box.addButton(f"Reopen in {mode}", QMessageBox.ButtonRole.AcceptRole)
    box.setDefaultButton(box.addButton(QMessageBox.StandardButton.Cancel))
    box.exec()
    if box.clickedButton() is reopen:
        controller.reopen_in(mode)
