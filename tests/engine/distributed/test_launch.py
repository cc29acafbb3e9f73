"""Where a launched rank reports: the launcher's folder, or one of its own elsewhere."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.distributed import launch
from engine.distributed.launch import REPORT_DIR, rank_report_dir, write_rank_report


def test_a_rank_on_the_launchers_machine_reports_into_its_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(REPORT_DIR, str(tmp_path))
    assert rank_report_dir() == tmp_path


def test_a_rank_on_another_machine_reports_into_a_folder_of_its_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The launcher's temporary folder exists on the launcher's disk only.
    monkeypatch.setenv(REPORT_DIR, str(tmp_path / "on-the-other-mac" / "pipeline-x1"))
    monkeypatch.setattr(launch.tempfile, "tempdir", str(tmp_path))
    folder = rank_report_dir()
    assert folder is not None and folder.is_dir() and folder.parent == tmp_path
    (folder / "rank1.pid").write_text("1", encoding="utf-8")  # what rank_started writes
    write_rank_report(folder, 1, {"rank_stats": {}})
    assert (folder / "rank1.json").exists()


def test_outside_a_launch_there_is_no_report_folder(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(REPORT_DIR, raising=False)
    assert rank_report_dir() is None
