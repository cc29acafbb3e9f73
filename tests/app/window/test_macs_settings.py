"""Settings → "Use other Macs": off by default, saved, a bad split refused, hosts checked."""

from __future__ import annotations

import json
from pathlib import Path

from PySide6.QtGui import QAccessible
from PySide6.QtWidgets import QDialogButtonBox, QMessageBox

from app.settings import Settings
from app.window.dialogs import SettingsDialog
from tests.app.layout import clipped_texts


def _hostfile(tmp_path: Path, hosts: list[str]) -> Path:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps({"hosts": [{"ssh": host, "ips": ["127.0.0.1"]}
                                          for host in hosts]}), encoding="utf-8")
    return path


def _dialog(qtbot, model_folder: str | None = None) -> SettingsDialog:
    dialog = SettingsDialog(Settings(), model_folder=model_folder)
    qtbot.addWidget(dialog)
    dialog.show()
    return dialog


def _save(dialog: SettingsDialog) -> None:
    dialog.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Save).click()


def test_off_by_default_and_saved_once_set(qtbot, tmp_path: Path) -> None:
    settings = Settings()
    assert not settings.pipeline_enabled and settings.pipeline_hostfile == ""
    assert settings.pipeline_split is None
    dialog = _dialog(qtbot)
    page = dialog.macs
    assert not page.enabled.isChecked()
    assert "stays on this Mac" in page.intro.text() and "naming it" in page.intro.text()
    hosts = _hostfile(tmp_path, ["127.0.0.1", "mac2.local"])
    page.enabled.setChecked(True)
    page.hostfile.setText(f" {hosts} ")
    page.split.setText("10, 14")
    _save(dialog)
    assert not dialog.isVisible()
    again = Settings()
    assert again.pipeline_enabled and again.pipeline_hostfile == str(hosts)
    assert again.pipeline_split == (10, 14)
    reopened = _dialog(qtbot)
    shown = reopened.macs
    assert shown.enabled.isChecked() and shown.split.text() == "10,14"
    assert shown.hostfile.text() == str(hosts)


def test_an_invalid_split_is_refused_with_a_message(qtbot, tmp_path: Path) -> None:
    dialog = _dialog(qtbot)
    page = dialog.macs
    for text, words in (("10;14", "for example 10,14"), ("0,24", "at least 1"),
                        ("24", "for example 10,14")):
        page.split.setText(text)
        dialog.tabs.setCurrentIndex(0)
        _save(dialog)
        assert dialog.isVisible() and dialog.tabs.currentWidget() is page
        assert words in page.problem.text() and page.problem.isVisible()
    # One number per Mac of the hostfile.
    page.enabled.setChecked(True)
    page.hostfile.setText(str(_hostfile(tmp_path, ["127.0.0.1", "a", "b"])))
    page.split.setText("10,14")
    _save(dialog)
    assert dialog.isVisible() and "the hostfile names 3" in page.problem.text()
    assert Settings().stored() == {}  # nothing saved


def test_on_without_a_usable_hostfile_is_refused(qtbot, tmp_path: Path) -> None:
    dialog = _dialog(qtbot)
    page = dialog.macs
    page.enabled.setChecked(True)
    _save(dialog)
    assert dialog.isVisible() and "Choose the hostfile" in page.problem.text()
    (tmp_path / "bad.json").write_text("{", encoding="utf-8")
    page.hostfile.setText(str(tmp_path / "bad.json"))
    _save(dialog)
    assert dialog.isVisible() and "An MLX hostfile is JSON" in page.problem.text()
    page.enabled.setChecked(False)  # off: a hostfile being edited is not in the way
    _save(dialog)
    assert not dialog.isVisible()


def test_check_hosts_shows_each_host(qtbot, tmp_path: Path, monkeypatch) -> None:
    dialog = _dialog(qtbot, model_folder="demo")  # no folder to compare: reachability only
    page = dialog.macs
    page.hostfile.setText(str(_hostfile(tmp_path, ["127.0.0.1", "mac-two.invalid"])))
    page.check.click()
    assert not page.check.isEnabled() and page.result.text() == "Checking hosts…"
    qtbot.waitUntil(page.check.isEnabled, timeout=60_000)
    lines = page.result.text().splitlines()
    # Each Mac by its name, not the engine's rank numbers.
    assert lines[0].startswith("✓ This Mac: reachable")
    assert lines[1].startswith("✗ mac-two.invalid cannot be reached by ssh")
    assert "Rank" not in page.result.text()
    # Saving that hostfile asks first, and Cancel keeps the dialog open.
    page.enabled.setChecked(True)
    asked: list[str] = []

    def answer(_parent, _title, text, *_args):
        asked.append(text)
        return QMessageBox.StandardButton.Cancel

    monkeypatch.setattr(QMessageBox, "question", answer)
    _save(dialog)
    assert asked and asked[0].startswith("mac-two.invalid failed the host check.")
    assert dialog.isVisible() and not Settings().pipeline_enabled


def test_check_without_a_hostfile_asks_for_one_and_says_the_model_runs_here(qtbot) -> None:
    dialog = _dialog(qtbot, model_folder="demo")
    page = dialog.macs
    assert not page.enabled.isChecked()
    page.check.click()
    assert page.result.text() == ("Choose the hostfile that names the Macs (MLX's JSON "
                                  "format) first.")
    assert page.model_note.text() == ("The built-in demo model cannot be split: it runs on "
                                      "this Mac alone, whatever is set here.")


def test_no_text_of_the_page_is_cut_within_700_px(qtbot, tmp_path: Path) -> None:
    dialog = _dialog(qtbot)
    dialog.tabs.setCurrentWidget(dialog.macs)
    page = dialog.macs
    page.split.setText("x")
    page.problem_text()  # the longest message shown with the check's lines
    page.result.setText("✓ This Mac: reachable, Longleaf 0.1.0 (no model folder "
                        "to compare).\n✗ mac-two.invalid cannot be reached by ssh.")
    page.result.show()
    qtbot.wait(50)
    assert dialog.sizeHint().height() <= 700
    assert clipped_texts(dialog) == []


def test_the_hostfile_field_is_named_by_its_label(qtbot) -> None:
    dialog = _dialog(qtbot)
    field = dialog.macs.hostfile
    name = QAccessible.queryAccessibleInterface(field).text(QAccessible.Text.Name)
    assert name == "Hostfile"


def test_a_hostfile_that_cannot_run_here_is_refused_and_home_is_understood(
        qtbot, tmp_path: Path, monkeypatch) -> None:
    # Another Mac first: "Check hosts" called it a failure, Save took it, and the
    # load failed. "~/hosts.json" was refused as missing.
    dialog = _dialog(qtbot)
    page = dialog.macs
    page.enabled.setChecked(True)
    page.hostfile.setText(str(_hostfile(tmp_path, ["mac2.local", "127.0.0.1"])))
    _save(dialog)
    assert dialog.isVisible() and "must be this Mac" in page.problem.text()
    monkeypatch.setenv("HOME", str(tmp_path))
    _hostfile(tmp_path, ["127.0.0.1", "mac2.local"])
    page.hostfile.setText("~/hosts.json")
    _save(dialog)
    assert not dialog.isVisible()
    assert Settings().pipeline_hostfile == str(tmp_path / "hosts.json")
