"""One-click downloads of recommended models, against a local Hub-layout server."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from app.window.downloads import unreachable_text
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


def _hub_serves(hub: FakeHub, folder) -> dict[str, bytes]:
    """The hub serves ``folder``'s files as REPO; those files."""
    files = {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}
    hub.repos[REPO] = FakeRepo(commit="e" * 40, files=files,
                               lfs=frozenset({"model.safetensors"}))
    return files


def _loads(window, monkeypatch) -> list[str]:
    """The models the window is asked to load from now on (none loads)."""
    loaded: list[str] = []
    monkeypatch.setattr(window, "choose_model", loaded.append)
    return loaded


def test_download_in_one_click_then_load(qtbot, bare_window, hub, tiny_llama,  # noqa: F811
                                         monkeypatch) -> None:
    files = _hub_serves(hub, tiny_llama)
    loaded = _loads(bare_window, monkeypatch)
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


def test_a_download_done_after_another_model_was_chosen_does_not_switch_to_it(
        qtbot, bare_window, hub, tiny_llama, monkeypatch) -> None:  # noqa: F811
    _hub_serves(hub, tiny_llama)
    loaded = _loads(bare_window, monkeypatch)
    dialog = open_library(qtbot, bare_window)
    dialog.action_button(REPO).click()
    # The user picks another model while it downloads.
    monkeypatch.setattr(type(bare_window.controller), "model_id",
                        property(lambda self: "/models/picked-since"))
    qtbot.waitUntil(lambda: not bare_window.downloads.running, timeout=60_000)
    # Before, the download switched to itself: every chat's cache dropped, unasked.
    assert loaded == []
    assert bare_window.banner.label.text() == (
        f"Downloaded {REPO}. Choose it in the toolbar's model list when you want it.")


def test_a_failed_download_says_why_and_can_be_retried(qtbot, bare_window, hub,  # noqa: F811
                                                       monkeypatch) -> None:
    loaded: list[str] = []
    monkeypatch.setattr(bare_window, "choose_model", loaded.append)
    dialog = open_library(qtbot, bare_window)
    dialog.action_button(REPO).click()  # the server has no such repo
    qtbot.waitUntil(lambda: not bare_window.downloads.running, timeout=60_000)
    assert loaded == []
    # Said in the dialog, not in the window's banner behind it.
    assert bare_window.banner.isHidden()
    assert dialog.error.isVisible() and dialog.error.retry.isVisible()
    assert f"Could not download {REPO}" in dialog.error.label.text()
    assert dialog.action_button(REPO).text() == "Download"


def test_an_unreachable_hub_is_said_in_words_with_retry(qtbot, bare_window,  # noqa: F811
                                                        monkeypatch) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setattr(bare_window, "choose_model", lambda path: None)
    dialog = open_library(qtbot, bare_window)
    dialog.action_button(REPO).click()
    qtbot.waitUntil(lambda: not bare_window.downloads.running, timeout=60_000)
    assert dialog.error.label.text() == unreachable_text(f"127.0.0.1:{port}")
    assert "Errno" not in dialog.error.label.text()
    dialog.error.retry.click()
    assert REPO in bare_window.downloads.running
    qtbot.waitUntil(lambda: not bare_window.downloads.running, timeout=60_000)


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
    assert "paused" in dialog.error.label.text() and not dialog.error.retry.isVisible()
    assert dialog.action_button(REPO).text() == "Download"
    assert dialog.table.item(dialog.rows[REPO], 1).text().startswith("≈ ")
    partial = destination_for(REPO) / ".longleaf-partial" / "model.safetensors"
    assert partial.stat().st_size > 0
