"""The Settings dialog's "Local server" page: on/off, port, network access, key, sharing."""

from __future__ import annotations

import secrets

from PySide6.QtWidgets import (
    QApplication,
    QCheckBox,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QSpinBox,
    QWidget,
)

from app.settings import Settings
from app.window.parts import ProblemLabel, add_field_row
from engine import MAX_PORT

LOCAL_HOST = "127.0.0.1"
ALL_INTERFACES = "0.0.0.0"
NEEDS_KEY = ("Other devices on the network can reach the server only with an API key: "
             "type one or press Generate.")
LOWEST_PORT = 1024  # the ports below it are privileged: only root may listen on them
LOW_PORT = (f"Ports below {LOWEST_PORT} need administrator rights; "
            f"choose {LOWEST_PORT}–{MAX_PORT}.")


def server_host(allow_network: bool) -> str:
    """The address the server listens on: this computer only, or every interface."""
    return ALL_INTERFACES if allow_network else LOCAL_HOST


def base_urls(port: int) -> tuple[str, str]:
    """The base URLs (OpenAI clients, Anthropic clients) on this computer."""
    root = f"http://{LOCAL_HOST}:{port}"
    return f"{root}/v1", root


def new_api_key() -> str:
    """A fresh random API key."""
    return "ll-" + secrets.token_urlsafe(24)


class LocalServerPage(QWidget):
    """The widgets of the local server's settings, filled from ``settings``."""

    def __init__(self, settings: Settings, parent: QWidget | None = None) -> None:
        super().__init__(parent)
        form = QFormLayout(self)
        intro = QLabel("Tools that speak the OpenAI or Anthropic API (editors, agents, "
                       "scripts) can use the loaded model and its KV cache. They wait in "
                       "line with your chats for the one engine.")
        intro.setWordWrap(True)
        form.addRow(intro)
        self.enabled = QCheckBox("Run the local server while Longleaf is open")
        self.enabled.setChecked(settings.server_enabled)
        form.addRow(self.enabled)
        # Any port can be typed, so "80" stays as typed (a box whose minimum is 1024
        # would keep its old value unseen) and Save says why it is refused.
        self.port = QSpinBox(minimum=1, maximum=MAX_PORT, value=settings.server_port)
        self.port.setGroupSeparatorShown(False)
        form.addRow("Port", self.port)
        self.allow_network = QCheckBox("Allow other devices on the network")
        self.allow_network.setToolTip("Listen on every network interface instead of this "
                                      "computer only. Requires an API key.")
        self.allow_network.setChecked(settings.server_allow_network)
        form.addRow(self.allow_network)
        self.api_key = QLineEdit(settings.server_api_key)
        self.api_key.setPlaceholderText("None (only this computer can connect)")
        # A secret: hidden on screen (a screen share, a shoulder) until asked for.
        self.api_key.setEchoMode(QLineEdit.EchoMode.Password)
        self.show_key = QPushButton("Show")
        self.show_key.setCheckable(True)
        self.show_key.setAccessibleName("Show the API key")
        self.show_key.toggled.connect(self._show_key)
        self.generate = QPushButton("Generate")
        self.generate.clicked.connect(self._generate_key)
        key_row = QHBoxLayout()
        key_row.addWidget(self.api_key, 1)
        key_row.addWidget(self.show_key)
        key_row.addWidget(self.generate)
        add_field_row(form, "API key", self.api_key, key_row)
        self.share = QCheckBox("Share stored chats with the local server")
        self.share.setToolTip(
            "Off: API requests reuse only KV made by API requests, so a client cannot tell "
            "from its cached tokens or response times what your chats hold. On: a request "
            "that starts like one of your chats reuses that chat's KV.")
        self.share.setChecked(settings.server_share_chats)
        form.addRow(self.share)
        self.openai_url, self.copy_openai = self._address_row(form, "OpenAI clients")
        self.anthropic_url, self.copy_anthropic = self._address_row(form, "Anthropic clients")
        self.elsewhere = QLabel("From another device, use this computer's network address "
                                "in place of 127.0.0.1.")
        self.elsewhere.setWordWrap(True)
        self.elsewhere.setVisible(self.allow_network.isChecked())
        self.allow_network.toggled.connect(self.elsewhere.setVisible)
        form.addRow(self.elsewhere)
        self.problem = ProblemLabel()
        form.addRow(self.problem)
        self.port.valueChanged.connect(self._show_addresses)
        self.enabled.toggled.connect(self._show_addresses)
        self._show_addresses()

    def _show_key(self, shown: bool) -> None:
        self.api_key.setEchoMode(QLineEdit.EchoMode.Normal if shown
                                 else QLineEdit.EchoMode.Password)
        self.show_key.setText("Hide" if shown else "Show")
        self.show_key.setAccessibleName("Hide the API key" if shown else "Show the API key")

    def _generate_key(self) -> None:
        # Shown: the next thing to do with a new key is to copy it into the clients.
        self.api_key.setText(new_api_key())
        self.show_key.setChecked(True)

    def _address_row(self, form: QFormLayout, caption: str) -> tuple[QLabel, QPushButton]:
        label = QLabel()
        label.setTextInteractionFlags(label.textInteractionFlags().TextSelectableByMouse)
        copy = QPushButton("Copy")
        copy.setAccessibleName(f"Copy the address for {caption}")  # not one of two "Copy"
        copy.clicked.connect(lambda: QApplication.clipboard().setText(label.text()))
        row = QHBoxLayout()
        row.addWidget(label, 1)
        row.addWidget(copy)
        form.addRow(caption, row)
        return label, copy

    def _show_addresses(self) -> None:
        openai, anthropic = base_urls(self.port.value())
        self.openai_url.setText(openai)
        self.anthropic_url.setText(anthropic)
        # Greyed, with nothing to copy, while the server is off: a client pasted
        # an address nothing answers would look like a broken server.
        running = self.enabled.isChecked()
        for widget in (self.openai_url, self.anthropic_url, self.copy_openai,
                       self.copy_anthropic):
            widget.setEnabled(running)

    def values(self) -> dict[str, object]:
        """The page's values, by the name of the setting each one edits."""
        return {
            "server_enabled": self.enabled.isChecked(),
            "server_port": self.port.value(),
            "server_allow_network": self.allow_network.isChecked(),
            "server_api_key": self.api_key.text().strip(),
            "server_share_chats": self.share.isChecked(),
        }

    def problem_text(self) -> str:
        """Why these values cannot be saved ("" when they can); also shown on the page."""
        return self.problem.say(self._problem())

    def _problem(self) -> str:
        if self.port.value() < LOWEST_PORT:
            return LOW_PORT
        if self.allow_network.isChecked() and not self.api_key.text().strip():
            return NEEDS_KEY
        return ""
