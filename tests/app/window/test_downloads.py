"""One-click downloads of recommended models, against a local Hub-layout server."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from engine import RECOMMENDED_MODELS
from engine.models.download_plan import destination_for
from tests.app.window.test_main_window import bare_window  # noqa: F401 - a fixture
from tests.engine.models.test_download import FakeHub, FakeRepo

REPO = RECOMMENDED_MODELS[0].repo_id


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with FakeHub() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
        yield server


def open_library(qtbot, window):
    qtbot.waitUntil(lambda: bool(window.model_picker.recommended), timeout=30_000)
    window.open_models()
    return window.models_dialog


def test_download_in_one_click_then_load(qtbot, bare_window, hub, tiny_llama,  # noqa: F811
                                         monkeypatch) -> None:
    files = {p.name: p.read_bytes() for p in tiny_llama.iterdir() if p.is_file()}
    hub.repos[REPO] = FakeRepo(commit="e" * 40, files=files,
                               lfs=frozenset({"model.safetensors"}))
    loaded: list[str] = []
    monkeypatch.setattr(bare_window, "choose_model", loaded.append)
    dialog = open_library(qtbot, bare_window)
    assert dialog.action_button(REPO).text() == "Download"

    dialog.action_button(REPO).click()
    assert dialog.action_button(REPO).text() == "Cancel"
    qtbot.waitUntil(lambda: not bare_window.downloads.running, timeout=60_000)

    folder = str(destination_for(REPO))
    assert loaded == [folder]
    assert (destination_for(REPO) / "model.safetensors").read_bytes() == files["model.safetensors"]
    assert dialog.action_button(folder).text() == "Load"
    assert "Downloaded" in bare_window.banner.label.text()
    qtbot.waitUntil(lambda: bare_window.model_picker.findData(folder) >= 0, timeout=30_000)
    assert REPO not in [e.repo_id for e in bare_window.model_picker.recommended]


def test_a_failed_download_says_why_and_can_be_retried(qtbot, bare_window, hub,  # noqa: F811
                                                       monkeypatch) -> None:
    loaded: list[str] = []
    monkeypatch.setattr(bare_window, "choose_model", loaded.append)
    dialog = open_library(qtbot, bare_window)
    dialog.action_button(REPO).click()  # the server has no such repo
    qtbot.waitUntil(lambda: not bare_window.downloads.running, timeout=60_000)
    assert loaded == []
    assert not bare_window.banner.isHidden()
    assert f"Could not download {REPO}" in bare_window.banner.label.text()
    assert bare_window.banner.property("kind") == "error"
    assert dialog.action_button(REPO).text() == "Download"


def test_cancel_keeps_the_bytes_and_shows_progress_meanwhile(
        qtbot, bare_window, hub, monkeypatch) -> None:  # noqa: F811
    from tests.engine.models.test_download import PIECE, _tiny_repo

    hub.repos[REPO] = _tiny_repo()
    hub.pause_at["model.safetensors"] = 8 * PIECE
    paused = []
    hub.on_pause = lambda: paused.append(True)
    monkeypatch.setattr(bare_window, "choose_model", lambda path: None)
    dialog = open_library(qtbot, bare_window)
    dialog.action_button(REPO).click()
    qtbot.waitUntil(lambda: bool(paused), timeout=60_000)
    qtbot.waitUntil(lambda: "%" in dialog.table.item(dialog.rows[REPO], 1).text(),
                    timeout=10_000)
    dialog.action_button(REPO).click()  # Cancel
    hub.release.set()
    qtbot.waitUntil(lambda: not bare_window.downloads.running, timeout=60_000)
    assert "paused" in bare_window.banner.label.text()
    assert bare_window.banner.property("kind") == "info"
    assert dialog.action_button(REPO).text() == "Download"
    assert dialog.table.item(dialog.rows[REPO], 1).text().startswith("≈ ")
    partial = destination_for(REPO) / ".longleaf-partial" / "model.safetensors"
    assert partial.stat().st_size > 0
