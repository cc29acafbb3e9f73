"""The Settings dialog's "Use other Macs" page: the hostfile, the layer split, a host check."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from PySide6.QtCore import Qt
from PySide6.QtWidgets import (
    QCheckBox,
    QFileDialog,
    QFormLayout,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPushButton,
    QWidget,
)

from app.background import Background
from app.settings import Settings, parse_split
from app.window.parts import ProblemLabel, add_field_row
from engine import EngineError

if TYPE_CHECKING:  # imported where the check runs: it reads no more at startup
    from engine import HostCheck

INTRO = (
    "A model too big for this Mac can be split across several: each Mac holds some of "
    "its layers and their share of the KV cache. Longleaf stays on this Mac, the first "
    "in the hostfile; the others need the same Longleaf and the model at the same path. "
    "Only models that can be split use them (the model list says which). If a Mac drops "
    "out, its answer stops with a message naming it, your chat is kept, and Longleaf "
    "goes back to this Mac alone if the model fits here.")
HOSTFILE_HELP = ('MLX\'s hostfile (as mlx.launch reads it): JSON such as {"hosts": '
                 '[{"ssh": "127.0.0.1", "ips": ["10.0.0.1"]}, {"ssh": "mac2.local", '
                 '"ips": ["10.0.0.2"]}]}, this Mac first. Each other Mac must accept '
                 "ssh with a key, without a password.")
NEEDS_HOSTFILE = ("Choose the hostfile that names the Macs (MLX's JSON format), or turn "
                  "\"Use other Macs\" off.")
CHECK_NEEDS_HOSTFILE = "Choose the hostfile that names the Macs (MLX's JSON format) first."


def hostfile_path(text: str) -> str:
    """A hostfile as typed, as the path to keep: "~" expanded, and a relative path
    taken from the home folder (an app started from the Finder runs in "/")."""
    text = text.strip()
    if not text:
        return ""
    path = Path(text).expanduser()
    return str(path if path.is_absolute() else Path.home() / path)


def hosts_of(hostfile: str) -> list[str]:
    """The hosts a hostfile names, this Mac first.

    Raises:
        EngineError: the file is missing or not an MLX hostfile (its message says why).
    """
    from engine import read_hostfile

    return read_hostfile(Path(hostfile))


def check_text(outcome: list[HostCheck] | BaseException) -> str:
    """The host check's outcome in words: one line per host, or why it could not run."""
    if isinstance(outcome, BaseException):
        return str(outcome) if isinstance(outcome, EngineError) else (
            f"The host check failed: {type(outcome).__name__}: {outcome}")
    return "\n".join(("✓ " if check.ok else "✗ ") + _named(rank, check)
                     for rank, check in enumerate(outcome))


def _named(rank: int, check: HostCheck) -> str:
    """A check's message naming the Mac as a person would: "This Mac" or its host
    name, not the engine's "Rank 1 (mac2)"."""
    engine_name = f"Rank {rank} ({check.host})"
    return check.message.replace(engine_name, "This Mac" if rank == 0 else check.host, 1)


def split_note(model_folder: str | None) -> str:
    """Whether the loaded model can use other Macs, in words ("" with none loaded)."""
    if not model_folder:
        return ""
    from app.machines import can_split_model

    name = "The built-in demo model" if model_folder == "demo" else (
        f"The loaded model ({Path(model_folder).name})")
    try:
        if can_split_model(model_folder):
            return f"{name} can be split across Macs."
    except (OSError, ValueError, EngineError):  # an unreadable config: it is not split
        pass
    return f"{name} cannot be split: it runs on this Mac alone, whatever is set here."


class OtherMacsPage(QWidget):
    """The widgets of the "Use other Macs" settings, filled from ``settings``.

    Args:
        settings: where the values come from.
        model_folder: the loaded model's folder, which "Check hosts" compares on
            every Mac (None: the versions and reachability only).
    """

    def __init__(self, settings: Settings, model_folder: str | None = None,
                 parent: QWidget | None = None) -> None:
        super().__init__(parent)
        self.model_folder = model_folder
        self.jobs = Background(threads=1, parent=self)
        form = QFormLayout(self)
        self.intro = QLabel(INTRO)
        self.intro.setWordWrap(True)
        form.addRow(self.intro)
        self.enabled = QCheckBox("Use other Macs for models that can be split")
        self.enabled.setChecked(settings.pipeline_enabled)
        form.addRow(self.enabled)
        self.model_note = QLabel(split_note(model_folder))
        self.model_note.setWordWrap(True)
        self.model_note.setVisible(bool(self.model_note.text()))
        form.addRow(self.model_note)
        self._checked_hosts: tuple[str, list] | None = None  # (hostfile, its checks)
        self.hostfile = QLineEdit(settings.pipeline_hostfile)
        self.hostfile.setPlaceholderText("hosts.json")
        self.hostfile.setToolTip(HOSTFILE_HELP)
        self.choose = QPushButton("Choose…")
        self.choose.clicked.connect(self._choose_hostfile)
        row = QHBoxLayout()
        row.addWidget(self.hostfile, 1)
        row.addWidget(self.choose)
        add_field_row(form, "Hostfile", self.hostfile, row)
        split = settings.pipeline_split
        self.split = QLineEdit(",".join(map(str, split)) if split else "")
        self.split.setPlaceholderText("Even (or e.g. 10,14)")
        self.split.setToolTip("Layers per Mac, this Mac first, separated by commas: give a "
                              "Mac with more free memory more layers. Empty: an even split.")
        form.addRow("Layers per Mac", self.split)
        self.check = QPushButton("Check hosts")
        self.check.setToolTip("Ask each Mac over ssh whether it runs the same Longleaf and "
                              "holds the loaded model with the same weights.")
        self.check.clicked.connect(self.check_hosts)
        form.addRow(self.check)
        self.result = QLabel()
        self.result.setObjectName("hostCheck")
        self.result.setWordWrap(True)
        self.result.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.result.hide()
        form.addRow(self.result)
        self.problem = ProblemLabel()
        form.addRow(self.problem)

    def _choose_hostfile(self) -> None:
        start = self._hostfile() or str(Path.home())
        path, _ = QFileDialog.getOpenFileName(self, "MLX hostfile", start,
                                              "Hostfiles (*.json);;All files (*)")
        if path:
            self.hostfile.setText(path)

    def check_hosts(self) -> None:
        """Check every Mac of the hostfile on a pool thread; the result shows below."""
        hostfile = self._hostfile()
        if not hostfile:
            self._show_result(CHECK_NEEDS_HOSTFILE)
            return
        folder = self.model_folder
        folder = folder if folder and Path(folder).is_dir() else None
        self.check.setEnabled(False)
        self._show_result("Checking hosts…")

        def work() -> list[HostCheck]:
            from engine import check_hosts

            return check_hosts(Path(hostfile), folder)

        self.jobs.run(work, lambda outcome: self._checked(hostfile, outcome))

    def _checked(self, hostfile: str, outcome: list[HostCheck] | BaseException) -> None:
        self.check.setEnabled(True)
        if not isinstance(outcome, BaseException):
            self._checked_hosts = (hostfile, list(outcome))
        self._show_result(check_text(outcome))

    def failed_hosts(self) -> list[str]:
        """The Macs that failed the last check of the hostfile to be saved, while on."""
        if not self.enabled.isChecked() or self._checked_hosts is None:
            return []
        hostfile, checks = self._checked_hosts
        if hostfile != self._hostfile():
            return []
        return ["this Mac" if rank == 0 else check.host
                for rank, check in enumerate(checks) if not check.ok]

    def _show_result(self, text: str) -> None:
        self.result.setText(text)
        self.result.show()
        window = self.window()
        if window is not self and window.isVisible():  # room for the lines, never less
            window.resize(window.width(), max(window.height(), window.sizeHint().height()))

    def values(self) -> dict[str, object]:
        """The page's values, by the name of the setting each one edits."""
        try:
            split = parse_split(self.split.text())
        except ValueError:  # refused by ``problem_text`` before anything is saved
            split = None
        return {
            "pipeline_enabled": self.enabled.isChecked(),
            "pipeline_hostfile": self._hostfile(),
            "pipeline_split": split,
        }

    def problem_text(self) -> str:
        """Why these values cannot be saved ("" when they can); also shown on the page."""
        text = self._problem()
        return self.problem.say(text)

    def _hostfile(self) -> str:
        return hostfile_path(self.hostfile.text())

    def _problem(self) -> str:
        try:
            split = parse_split(self.split.text())
        except ValueError as error:
            return str(error)
        hostfile = self._hostfile()
        if not self.enabled.isChecked():
            return ""
        if not hostfile:
            return NEEDS_HOSTFILE
        try:
            hosts = hosts_of(hostfile)
        except EngineError as error:
            return str(error)
        from engine import rank_zero_problem

        if (why := rank_zero_problem(hosts)):
            return why
        if split is not None and len(split) != len(hosts):
            return (f"The layer split gives {len(split)} Macs layers, but the hostfile "
                    f"names {len(hosts)}: give one number per Mac, this Mac first.")
        return ""
