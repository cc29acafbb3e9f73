"""The typed QSettings wrapper writes only under the redirected data dir."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from app.settings import DEFAULT_REPETITION_PENALTY, Setting, Settings, config_dir
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


# For each row of the settings table: a value other than its default, and what a new
# Settings reads back from the file. A row added without one fails its case.
ROUND_TRIP: dict[str, tuple[object, object]] = {
    "default_mode": ("q6", "q6"),
    "page_size": (128, 128),
    "rotate_kv": (False, False),
    "ingest_chunk": (1024, 1024),
    "read_share": (0.25, 0.25),
    "memory_budget_bytes": (2 * 2**30, 2 * 2**30),
    "stored_kv_budget_bytes": (5 * 10**9, 5 * 10**9),
    "system_prompt": ("Be brief.", "Be brief."),
    "speculative": (False, False),
    "server_enabled": (True, True),
    "server_port": (8080, 8080),
    "server_allow_network": (True, True),
    "server_api_key": ("  ll-key  ", "ll-key"),
    "server_allowed_hosts": (("mac.local", "studio.lan"), ("mac.local", "studio.lan")),
    "server_share_chats": (True, True),
    "pipeline_enabled": (True, True),
    "pipeline_hostfile": (" /macs/hosts.json ", "/macs/hosts.json"),
    "pipeline_split": ((10, 14), (10, 14)),
    "model_folders": (["/models/a", "/models/b", "/models/a"], ["/models/a", "/models/b"]),
    "last_model": ("/models/b", "/models/b"),
    "last_folder": ("/", "/"),
    "memory_panel_visible": (False, False),
    "window_geometry": (b"\x01\x02geometry", b"\x01\x02geometry"),
}

# The keys users' settings.ini files hold: a row may not move its key.
STORED_KEYS = {
    "default_mode": "engine/default_mode", "page_size": "engine/page_size",
    "rotate_kv": "engine/rotate_kv", "ingest_chunk": "engine/ingest_chunk",
    "read_share": "engine/read_share",
    "memory_budget_bytes": "engine/memory_budget_bytes",
    "stored_kv_budget_bytes": "engine/stored_kv_budget_bytes",
    "system_prompt": "chat/system_prompt", "speculative": "engine/speculative",
    "server_enabled": "server/enabled", "server_port": "server/port",
    "server_allow_network": "server/allow_network", "server_api_key": "server/api_key",
    "server_allowed_hosts": "server/allowed_hosts", "server_share_chats": "server/share_chats",
    "pipeline_enabled": "pipeline/enabled", "pipeline_hostfile": "pipeline/hostfile",
    "pipeline_split": "pipeline/split", "model_folders": "models/folders",
    "last_model": "models/last", "last_folder": "files/last_folder",
    "memory_panel_visible": "window/memory_panel", "window_geometry": "window/geometry",
}


def test_every_row_keeps_the_key_users_files_hold() -> None:
    assert {row.name: row.key for row in Settings.table()} == STORED_KEYS
    assert Settings.fields() == (*STORED_KEYS, "sampling")


@pytest.mark.parametrize("row", Settings.table(), ids=lambda row: row.name)
def test_each_setting_round_trips_through_the_file(row: Setting) -> None:
    written, read_back = ROUND_TRIP[row.name]
    s = Settings()
    assert getattr(s, row.name) != read_back  # not the default: the case can fail
    setattr(s, row.name, written)
    s.sync()
    assert getattr(Settings(), row.name) == read_back
    assert set(Settings().stored()) == {row.key}


@pytest.mark.parametrize(("name", "stored", "read"), [
    ("default_mode", "q6_k", "q8"),
    ("page_size", "3", 16),
    ("page_size", "many", 256),
    ("server_port", "70000", 1234),
    ("pipeline_split", "10,zero", None),
    ("memory_budget_bytes", "-5", None),
    ("read_share", "0", 0.5),
    ("read_share", "nan", 0.5),
    ("read_share", "half", 0.5),
    ("rotate_kv", "false", False),
    ("model_folders", "/one/folder", ["/one/folder"]),
])
def test_a_value_its_validator_refuses_reads_as_the_default(
        name: str, stored: str, read: object) -> None:
    group, key = STORED_KEYS[name].split("/")
    Settings().path.write_text(f"[{group}]\n{key}={stored}\n")
    assert getattr(Settings(), name) == read


def test_sampling_round_trips_through_the_file() -> None:
    s = Settings()
    s.sampling = SamplingParams(temperature=0.2, top_k=40, max_tokens=99, seed=7)
    s.sync()
    assert Settings().sampling == SamplingParams(temperature=0.2, top_k=40, max_tokens=99,
                                                 seed=7)
    # repetition_penalty too: the app's default is not SamplingParams' own.
    assert set(Settings().stored()) == {"sampling/temperature", "sampling/top_k",
                                        "sampling/max_tokens", "sampling/seed",
                                        "sampling/repetition_penalty"}


def test_a_sampling_value_no_answer_could_use_reads_as_the_default() -> None:
    Settings().path.write_text("[sampling]\ntemperature=nan\ntop_p=0\nmax_tokens=-4\n"
                               "top_k=12\n")
    read = Settings().sampling  # before, this raised at every send
    default = Settings(path=Settings().path.with_name("other.ini")).sampling
    assert (read.temperature, read.top_p, read.max_tokens) == (
        default.temperature, default.top_p, default.max_tokens)
    assert read.top_k == 12  # the valid one is kept
    # Dropped from the file: the model's own default applies to it again.
    assert "sampling/temperature" not in Settings().stored()
    assert Settings().sampling_for({"temperature": 0.6, "top_k": 40}).temperature == 0.6


def test_a_budget_set_back_to_the_default_removes_its_key() -> None:
    s = Settings()
    s.stored_kv_budget_bytes = 5 * 10**9
    s.stored_kv_budget_bytes = None
    s.sync()
    assert Settings().stored_kv_budget_bytes is None
    assert "stored_kv_budget_bytes" not in s.path.read_text()


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
    s = Settings()  # no OSError (a traceback at start)
    assert s.path == home / "config" / "settings.ini" and s.default_mode == "q8"
    s.default_mode = "q6"
    assert s.default_mode == "q6"  # kept for this run
    assert list(home.iterdir()) == []


def test_a_settings_file_that_cannot_be_written_is_said_not_saved() -> None:
    # /proc takes no new file, also for root (whom permission bits do not stop).
    s = Settings(Path("/proc/longleaf-test/settings.ini"))
    s.default_mode = "q6"
    assert s.default_mode == "q6"  # kept for this run
    assert not s.sync()  # and said to be: the window's banner tells the user


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


def test_a_comma_typed_into_the_file_without_quotes_stays_in_the_text() -> None:
    # QSettings reads such a value as a list; it writes its own with quotes.
    Settings().path.write_text("[chat]\nsystem_prompt=Be brief, be kind\n"
                               "[models]\nlast=/x/My Model, q4\n")
    s = Settings()
    assert s.system_prompt == "Be brief, be kind"  # before, "['Be brief', 'be kind']"
    assert s.last_model == "/x/My Model, q4"
