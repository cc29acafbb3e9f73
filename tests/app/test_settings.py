"""The typed QSettings wrapper writes only under the redirected data dir."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from app.settings import DEFAULT_REPETITION_PENALTY, Settings, config_dir
from engine.paths import data_dir
from engine.session.sampling import SamplingParams


def test_defaults() -> None:
    s = Settings()
    assert s.path.parent == config_dir() != data_dir()
    assert (s.default_mode, s.page_size, s.ingest_chunk) == ("q8", 256, 512)
    assert s.memory_budget_bytes is None
    assert s.stored_kv_budget_bytes is None  # the engine's: min(20 GB, 10% of free disk)
    assert s.sampling == SamplingParams(repetition_penalty=DEFAULT_REPETITION_PENALTY)
    # Lookup never decodes slower beyond noise (docs/benchmarks.md): on until turned off.
    assert s.speculative and s.sampling.speculative == "lookup"
    assert s.last_model == "demo"
    assert s.model_folders == []


def test_round_trip_through_the_file() -> None:
    s = Settings()
    s.default_mode = "q6"
    s.page_size = 128
    s.ingest_chunk = 1024
    s.memory_budget_bytes = 2 * 2**30
    s.stored_kv_budget_bytes = 5 * 10**9
    s.sampling = SamplingParams(temperature=0.2, top_k=40, max_tokens=99, seed=7)
    s.system_prompt = "Be brief."
    s.model_folders = ["/models/a", "/models/b", "/models/a"]
    s.last_model = "/models/b"
    s.sync()
    again = Settings()
    assert (again.default_mode, again.page_size, again.ingest_chunk) == ("q6", 128, 1024)
    assert again.memory_budget_bytes == 2 * 2**30
    assert again.stored_kv_budget_bytes == 5 * 10**9
    again.stored_kv_budget_bytes = None  # back to the default, and the key is gone
    assert Settings().stored_kv_budget_bytes is None
    assert "stored_kv_budget_bytes" not in s.path.read_text()
    assert again.sampling == SamplingParams(temperature=0.2, top_k=40, max_tokens=99, seed=7)
    assert again.system_prompt == "Be brief."
    assert again.model_folders == ["/models/a", "/models/b"]
    assert again.last_model == "/models/b"
    assert s.path.read_text().count("default_mode=q6") == 1


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="fp16, q8, q6, q4"):
        Settings().default_mode = "q6_k"


def test_lives_in_the_config_folder_not_among_the_data(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("LONGLEAF_CONFIG_HOME", str(tmp_path / "conf"))
    assert Settings().path == tmp_path / "conf" / "settings.ini"
    monkeypatch.delenv("LONGLEAF_CONFIG_HOME")
    monkeypatch.delenv("LONGLEAF_HOME")
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    if sys.platform.startswith("linux"):
        assert Settings().path == tmp_path / "xdg" / "Longleaf" / "settings.ini"


def test_a_read_only_data_folder_without_a_config_folder_keeps_settings_for_the_run(
        monkeypatch, tmp_path) -> None:
    from tests.engine.read_only import make_read_only

    home = tmp_path / "read-only-home"
    home.mkdir(mode=0o700)
    monkeypatch.setenv("LONGLEAF_HOME", str(home))
    monkeypatch.delenv("LONGLEAF_CONFIG_HOME", raising=False)
    make_read_only(home, monkeypatch)  # no config/ can be made there
    s = Settings()  # was an OSError (a traceback at start)
    assert s.path == home / "config" / "settings.ini" and s.default_mode == "q8"
    s.default_mode = "q6"
    assert s.default_mode == "q6"  # kept for this run
    assert list(home.iterdir()) == []


def test_an_older_data_folder_file_moves_to_the_config_folder() -> None:
    (data_dir() / "settings.ini").write_text("[engine]\ndefault_mode=q4\n")
    s = Settings()
    assert s.default_mode == "q4"
    assert s.path.parent == config_dir()
    assert not (data_dir() / "settings.ini").exists()


def test_no_invalid_values_are_written() -> None:
    s = Settings()
    s.model_folders = []
    s.memory_budget_bytes = None
    s.last_folder = ""
    s.window_geometry = b"geometry"
    s.sampling = SamplingParams()
    s.sync()
    assert "@Invalid" not in s.path.read_text()
    assert s.model_folders == []
    s.model_folders = ["/only/one"]
    assert Settings().model_folders == ["/only/one"]


def test_file_dialogs_start_in_documents_then_the_last_folder(tmp_path) -> None:
    s = Settings()
    assert Path(s.last_folder).is_dir()
    assert s.last_folder != str(Path.cwd())
    s.last_folder = str(tmp_path)
    assert Settings().last_folder == str(tmp_path)
    s.last_folder = str(tmp_path / "gone")  # deleted since: back to Documents
    assert s.last_folder != str(tmp_path / "gone")
