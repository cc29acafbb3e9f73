"""The Settings dialog: it shows the saved values, Save writes them, and the engine follows."""

from __future__ import annotations

from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import pytest
from PySide6.QtCore import QTimer
from PySide6.QtGui import QAccessible
from PySide6.QtTest import QTest
from PySide6.QtWidgets import QApplication, QDialogButtonBox

from app.format import human_bytes
from app.memory.panel import MemoryPanel
from app.settings import Settings
from app.window.dialogs import NewChatDialog, SettingsDialog
from app.window.server_settings import LOW_PORT
from engine import SnapshotStore, default_budget, snapshots_dir
from engine.runtime.worker import EngineWorker
from engine.session.sampling import SamplingParams
from tests.app.conftest import close_window, open_window


def _saved() -> Settings:
    s = Settings()
    s.default_mode = "q6"
    s.page_size = 128
    s.ingest_chunk = 1024
    s.memory_budget_bytes = 3 * 2**30
    s.stored_kv_budget_bytes = 12 * 2**30
    s.sampling = SamplingParams(temperature=0.3, top_p=0.9, top_k=40, max_tokens=99, seed=7)
    s.system_prompt = "Be brief."
    s.model_folders = ["/models/a"]
    s.sync()
    return Settings()


def _edit(dialog: SettingsDialog) -> None:
    dialog.mode.setCurrentText("q4")
    dialog.page_size.setValue(64)
    dialog.chunk.setValue(256)
    dialog.budget.setValue(0)  # "Automatic"
    dialog.disk_budget.setValue(2.5)
    dialog.temperature.setValue(0.0)
    dialog.top_k.setValue(0)
    dialog.max_tokens.setValue(500)
    dialog.system_prompt.setPlainText("  Answer in French.  \n")
    dialog.folders.setPlainText("/models/a\n\n  /models/b  \n")


def test_dialog_shows_the_saved_values(qtbot) -> None:
    dialog = SettingsDialog(_saved())
    qtbot.addWidget(dialog)
    assert dialog.mode.currentText() == "q6"
    assert (dialog.page_size.value(), dialog.chunk.value()) == (128, 1024)
    assert dialog.budget.value() == 3 * 1024  # MB
    assert dialog.disk_budget.value() == 12.0  # GB
    assert (dialog.temperature.value(), dialog.top_p.value()) == (0.3, 0.9)
    assert (dialog.top_k.value(), dialog.max_tokens.value()) == (40, 99)
    assert dialog.system_prompt.toPlainText() == "Be brief."
    assert dialog.folders.toPlainText() == "/models/a"


def test_save_writes_every_field(qtbot) -> None:
    dialog = SettingsDialog(_saved())
    qtbot.addWidget(dialog)
    _edit(dialog)
    dialog.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Save).click()
    again = Settings()
    assert (again.default_mode, again.page_size, again.ingest_chunk) == ("q4", 64, 256)
    assert again.memory_budget_bytes is None
    assert again.stored_kv_budget_bytes == int(2.5 * 2**30)
    assert again.sampling == SamplingParams(temperature=0.0, top_p=0.9, top_k=0,
                                            max_tokens=500, seed=7)
    assert again.system_prompt == "Answer in French."
    assert again.model_folders == ["/models/a", "/models/b"]


def test_cancel_writes_nothing(qtbot) -> None:
    before = _saved().path.read_text()
    dialog = SettingsDialog(Settings())
    qtbot.addWidget(dialog)
    _edit(dialog)
    dialog.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Cancel).click()
    assert Settings().path.read_text() == before
    assert Settings().default_mode == "q6"


def test_saved_budget_chunk_and_read_share_reach_the_running_engine(
        qtbot, tiny_llama: Path) -> None:
    workers: list[EngineWorker] = []

    def worker_factory(on_event, budget_bytes, chunk_size, read_share):
        workers.append(EngineWorker(on_event, budget_bytes=budget_bytes, chunk_size=chunk_size,
                                    read_share=read_share))
        return workers[0]

    window = open_window(qtbot, tiny_llama, worker_factory=worker_factory)
    worker = workers[0]
    assert worker.guard.budget_bytes is None and worker.chunk_size == 512
    assert worker._answering.read_share == 0.5  # the worker is idle: read here

    def fill_in_and_save() -> None:
        dialog = QApplication.activeModalWidget()
        assert isinstance(dialog, SettingsDialog)
        dialog.budget.setValue(700)
        dialog.chunk.setValue(128)
        assert dialog.read_share.currentText() == "Equal turns (default)"
        dialog.read_share.setCurrentIndex(dialog.read_share.findData(0.25))
        dialog.accept()

    try:
        QTimer.singleShot(0, fill_in_and_save)
        window.open_settings()
        # The share is the last of the settings the worker applies.
        qtbot.waitUntil(lambda: worker._answering.read_share == 0.25, timeout=10_000)
        assert worker.chunk_size == 128 and worker.guard.budget_bytes == 700 * 2**20
        assert window.settings.read_share == 0.25
    finally:
        close_window(window)


def test_the_automatic_disk_budget_says_what_it_is(qtbot) -> None:
    dialog = SettingsDialog(Settings())
    qtbot.addWidget(dialog)
    assert dialog.disk_budget.value() == 0
    shown = dialog.disk_budget.text()
    # Said as every size is said: 20 GB of 1,024³ bytes, not 18.6 of them.
    assert "smaller of 20.0 GB and 10% of free disk" in shown
    assert f"({human_bytes(default_budget(snapshots_dir()))} now)" in shown
    dialog.disk_budget.setValue(0)
    dialog.apply()
    assert Settings().stored_kv_budget_bytes is None


def test_a_lowered_disk_budget_reaches_the_running_engines_store(qtbot, tiny_llama: Path,
                                                               tmp_path: Path) -> None:
    stores: list[SnapshotStore] = []

    def worker_factory(on_event, budget_bytes, chunk_size, read_share):
        stores.append(SnapshotStore(tmp_path / "kv"))
        return EngineWorker(on_event, snapshots=stores[0])

    window = open_window(qtbot, tiny_llama, worker_factory=worker_factory)
    store = stores[0]

    def fill_in_and_save() -> None:
        dialog = QApplication.activeModalWidget()
        assert isinstance(dialog, SettingsDialog)
        dialog.disk_budget.setValue(1.5)
        dialog.accept()

    try:
        # Free disk moves as other programs write: the default, give or take.
        assert store.budget_bytes == pytest.approx(default_budget(store.directory), rel=0.01)
        QTimer.singleShot(0, fill_in_and_save)
        window.open_settings()
        qtbot.waitUntil(lambda: store.budget_bytes == int(1.5 * 2**30), timeout=10_000)
        qtbot.waitUntil(lambda: window.panel.stored_kv.listing is not None
                        and window.panel.stored_kv.listing.budget_bytes == int(1.5 * 2**30),
                        timeout=10_000)
        assert "1.5 GB budget" in window.panel.stored_kv.summary.text()
    finally:
        close_window(window)


def _full_report(free_bytes: int):
    from engine.memory.fit import fit_report

    return fit_report(token_count=8192, attention_layers=30, kv_heads=3, head_dim=64,
                      max_context=8192, page_size=256, available_bytes=free_bytes)


def test_new_chat_caps_what_fits_at_the_models_context(qtbot) -> None:
    dialog = NewChatDialog("q8", _full_report(64 * 2**30))
    qtbot.addWidget(dialog)
    text = dialog.buttons["q6"].text()
    assert "all 8,192 tokens fit in free memory" in text
    assert "1,6" not in text  # never more tokens than the model's context
    tight = NewChatDialog("q8", _full_report(3 * 2**20))
    qtbot.addWidget(tight)
    assert "all 8,192" not in tight.buttons["fp16"].text()


def test_new_chat_says_what_the_memory_limit_holds_as_the_panel_does(qtbot) -> None:
    """Under a memory limit smaller than free memory, each mode says the tokens the
    limit holds, the figure and words of the panel's "Fits" sentence."""
    from engine.memory.fit import fit_report

    limited = fit_report(token_count=131_072, attention_layers=2, kv_heads=2, head_dim=64,
                         max_context=131_072, page_size=16, available_bytes=16 << 30,
                         budget_bytes=64 << 20, session_mode="q8")
    held = limited.for_mode("q8").tokens_fit_budget
    assert held is not None and held < 131_072
    dialog = NewChatDialog("q8", limited)
    qtbot.addWidget(dialog)
    text = dialog.buttons["q8"].text()
    assert text.endswith(f"{held:,} tokens fit in your memory limit (Settings)"), text
    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.set_session("Notes", "q8", "held", "s1")
    panel.update_projection(limited, limited)
    assert f"{held:,} of 131,072 tokens" in panel.fits_label.text()


def test_modes_are_listed_best_quality_first(qtbot) -> None:
    dialog = NewChatDialog("q8", _full_report(64 * 2**30))
    qtbot.addWidget(dialog)
    assert list(dialog.buttons) == ["fp16", "q8", "q6", "q4"]
    assert dialog.mode() == "q8"


def test_rotation_is_a_saved_choice_that_new_chats_open_with(qtbot) -> None:
    settings = Settings()
    assert settings.rotate_kv is None  # never chosen: the engine's default
    dialog = SettingsDialog(settings)
    qtbot.addWidget(dialog)
    assert dialog.rotate.isChecked()  # what the engine does when not told
    dialog.rotate.setChecked(False)
    dialog.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Save).click()
    assert Settings().rotate_kv is False

    from app.sessions.caches import SessionCaches

    opened: list[tuple] = []
    bridge = type("Bridge", (), {"open_session": lambda self, *a, **k: opened.append((a, k))
                                 or 1, "close_session": lambda self, sid, store=True: None})()
    caches = SessionCaches(bridge, Settings())
    caches.ensure_open(type("Record", (), {"id": "s", "kv_mode": "q6"})(), lambda: None,
                       lambda _failed: None)
    assert opened and opened[0][0][3] is False  # (session, mode, page size, rotate, handler)


# A value for every setting that differs from its default and that a widget could
# misshow (outside a spin box's range, more decimals than shown, padded text).
# A field added to Settings without a value here fails its parametrized case.
SET_VALUES = {
    "default_mode": "q6",
    "page_size": 8192,
    "rotate_kv": False,
    "ingest_chunk": 777,
    "read_share": 0.6,  # not on the menu: shown as it is, kept
    "memory_budget_bytes": 3 * 2**30 + 12_345,
    "stored_kv_budget_bytes": 12_345_678_901,
    "system_prompt": "  Be brief.\n",
    "sampling": SamplingParams(temperature=0.123, top_p=0.951, top_k=40, min_p=0.051,
                               repetition_penalty=1.234, max_tokens=2_000_000, seed=7),
    "model_folders": ["/models/a", "/models/b"],
    "last_model": "/models/a/m",
    "last_folder": "/",
    "memory_panel_visible": False,
    "speculative": True,
    "server_enabled": True,
    "server_port": 80,  # a privileged port: shown as it is, Save refused, never written
    "server_allow_network": True,
    "server_api_key": "  ll-key  ",
    "server_share_chats": True,
    "server_allowed_hosts": ("mac.local", "studio.lan"),
    "pipeline_enabled": True,  # without a hostfile: refused, so nothing is written
    "pipeline_hostfile": "/macs/hosts.json",
    "pipeline_split": (10, 14),
    "window_geometry": b"\x01\x02geometry",
}


def _save_untouched() -> None:
    dialog = SettingsDialog(Settings())
    dialog.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Save).click()
    dialog.deleteLater()


def _everything(settings: Settings) -> dict:
    return {name: getattr(settings, name) for name in Settings.fields()}


@pytest.mark.parametrize("state", ["unset", "set"])
@pytest.mark.parametrize("field", Settings.fields())
def test_save_changes_no_field_the_user_did_not_touch(qtbot, field: str, state: str) -> None:
    settings = Settings()
    if state == "set":
        setattr(settings, field, SET_VALUES[field])
        settings.sync()
    before, values = Settings().stored(), _everything(Settings())
    _save_untouched()
    assert Settings().stored() == before
    assert _everything(Settings()) == values


def test_unset_rotation_shows_the_engines_default_and_stays_unset(qtbot) -> None:
    dialog = SettingsDialog(Settings())
    qtbot.addWidget(dialog)
    assert dialog.rotate.isChecked()  # the engine rotates q8/q6/q4 unless told not to
    dialog.apply()
    assert Settings().rotate_kv is None
    dialog.rotate.setChecked(False)
    dialog.apply()
    assert Settings().rotate_kv is False


def test_one_changed_sampling_value_writes_only_that_key(qtbot) -> None:
    dialog = SettingsDialog(Settings())
    qtbot.addWidget(dialog)
    dialog.temperature.setValue(0.2)
    dialog.apply()
    assert set(Settings().stored()) == {"sampling/temperature"}
    assert Settings().sampling.temperature == 0.2


def test_the_answers_page_shows_the_models_defaults_and_saves_only_an_edit(qtbot) -> None:
    model = replace(Settings().sampling, temperature=0.6, top_p=0.95)  # generation_config's
    dialog = SettingsDialog(Settings(), sampling=model)
    qtbot.addWidget(dialog)
    assert (dialog.temperature.value(), dialog.top_p.value()) == (0.6, 0.95)
    dialog.apply()
    assert Settings().stored() == {}  # untouched: answers keep following the model
    dialog.top_p.setValue(0.8)
    dialog.apply()
    assert set(Settings().stored()) == {"sampling/top_p"}
    assert Settings().sampling_for({"temperature": 0.6, "top_p": 0.95}).top_p == 0.8


def test_a_value_set_to_the_apps_own_default_over_a_models_is_kept(qtbot) -> None:
    model = replace(Settings().sampling, temperature=0.6, top_p=0.95, top_k=20)
    dialog = SettingsDialog(Settings(), sampling=model)
    qtbot.addWidget(dialog)
    # Back to the app's defaults (0.7, top-p off, top-k off) over the model's.
    dialog.temperature.setValue(0.7)
    dialog.top_p.setValue(1.0)
    dialog.top_k.setValue(0)
    dialog.apply()
    # Before, none was stored (each equals the app's default): the model's stayed.
    answers = Settings().sampling_for({"temperature": 0.6, "top_p": 0.95, "top_k": 20})
    assert (answers.temperature, answers.top_p, answers.top_k) == (0.7, 1.0, 0)


def test_settings_are_in_sections_that_fit_a_700_px_screen(qtbot) -> None:
    dialog = SettingsDialog(Settings())
    qtbot.addWidget(dialog)
    titles = [dialog.tabs.tabText(i) for i in range(dialog.tabs.count())]
    assert titles == ["Chats", "Answers", "Memory && storage", "Local server",
                      "Use other Macs"]
    dialog.show()
    assert dialog.sizeHint().height() <= 700
    assert dialog.minimumSizeHint().height() <= 700
    labels = {dialog.tabs.widget(0).layout().labelForField(w).text()
              for w in (dialog.mode, dialog.page_size, dialog.chunk)}
    assert "Read documents in chunks of" in labels
    assert not any("ngest" in text or "KV" in text for text in labels)


def test_speculative_checkbox_writes_only_its_setting(qtbot) -> None:
    before = Settings().speculative
    dialog = SettingsDialog(Settings())
    qtbot.addWidget(dialog)
    assert dialog.speculative.isChecked() == before
    dialog.speculative.setChecked(not before)
    dialog.apply()
    assert set(Settings().stored()) == {"engine/speculative"}
    assert Settings().sampling.speculative == ("off" if before else "lookup")


def test_local_server_is_off_and_private_by_default(qtbot) -> None:
    settings = Settings()
    assert not settings.server_enabled and settings.server_port == 1234
    assert not settings.server_allow_network and not settings.server_share_chats
    assert settings.server_api_key == ""
    dialog = SettingsDialog(settings)
    qtbot.addWidget(dialog)
    page = dialog.server
    assert page.openai_url.text() == "http://127.0.0.1:1234/v1"
    assert page.anthropic_url.text() == "http://127.0.0.1:1234"
    # Off: the addresses are greyed and there is nothing to copy, nothing answers there.
    assert not page.copy_openai.isEnabled() and not page.openai_url.isEnabled()
    page.enabled.setChecked(True)
    assert page.copy_openai.isEnabled() and page.copy_anthropic.isEnabled()
    page.port.setValue(4321)
    assert page.openai_url.text() == "http://127.0.0.1:4321/v1"
    page.copy_openai.click()
    assert QApplication.clipboard().text() == "http://127.0.0.1:4321/v1"
    page.copy_anthropic.click()
    assert QApplication.clipboard().text() == "http://127.0.0.1:4321"


def test_network_access_without_a_key_is_refused_with_a_reason(qtbot) -> None:
    dialog = SettingsDialog(Settings())
    qtbot.addWidget(dialog)
    dialog.show()
    page = dialog.server
    page.enabled.setChecked(True)
    page.allow_network.setChecked(True)
    dialog.tabs.setCurrentIndex(0)
    save = dialog.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Save)
    save.click()
    assert dialog.isVisible() and dialog.tabs.currentWidget() is page
    assert "API key" in page.problem.text() and page.problem.isVisible()
    assert Settings().stored() == {}  # nothing saved
    page.generate.click()
    key = page.api_key.text()
    assert key.startswith("ll-") and len(key) > 20
    save.click()
    assert not dialog.isVisible()
    again = Settings()
    assert again.server_enabled and again.server_allow_network
    assert again.server_api_key == key
    assert not again.server_share_chats


def test_a_privileged_port_stays_as_typed_and_save_says_why_it_is_refused(qtbot) -> None:
    dialog = SettingsDialog(Settings())
    qtbot.addWidget(dialog)
    dialog.show()
    page = dialog.server
    dialog.tabs.setCurrentWidget(page)
    page.port.setFocus()
    page.port.selectAll()
    QTest.keyClicks(page.port, "80")
    dialog.tabs.setCurrentIndex(0)
    save = dialog.findChild(QDialogButtonBox).button(QDialogButtonBox.StandardButton.Save)
    save.click()
    assert dialog.isVisible() and dialog.tabs.currentWidget() is page
    assert page.port.text() == "80"
    assert page.problem.text() == LOW_PORT and page.problem.isVisible()
    assert Settings().stored() == {}  # nothing saved
    page.port.selectAll()
    QTest.keyClicks(page.port, "8080")
    save.click()
    assert not dialog.isVisible()
    assert Settings().server_port == 8080


def test_numbers_keep_their_own_width_and_text_boxes_take_the_row(qtbot) -> None:
    dialog = SettingsDialog(Settings())
    qtbot.addWidget(dialog)
    dialog.tabs.setCurrentIndex(2)  # Memory & storage
    dialog.resize(900, 600)
    dialog.show()
    qtbot.waitExposed(dialog)
    for box in (dialog.budget, dialog.disk_budget):
        assert box.width() <= box.sizeHint().width() + 1
    assert dialog.folders.width() > dialog.budget.width()


def _accessible_name(widget) -> str:
    return QAccessible.queryAccessibleInterface(widget).text(QAccessible.Text.Name)


def test_the_server_pages_key_and_copy_buttons_have_names_of_their_own(qtbot) -> None:
    dialog = SettingsDialog(Settings())
    qtbot.addWidget(dialog)
    page = dialog.server
    assert _accessible_name(page.api_key) == "API key"
    assert _accessible_name(page.copy_openai) == "Copy the address for OpenAI clients"
    assert _accessible_name(page.copy_anthropic) == "Copy the address for Anthropic clients"


def test_tab_in_the_many_line_fields_goes_to_the_next_field(qtbot) -> None:
    """The system prompt and the model folders are fields of a form: Tab moves on (as
    it does from every other field), it does not type a tab into the prompt."""
    from PySide6.QtCore import Qt

    dialog = SettingsDialog(Settings())
    qtbot.addWidget(dialog)
    dialog.show()
    for field in (dialog.system_prompt, dialog.folders):
        dialog.tabs.setCurrentWidget(field.parentWidget())
        field.setFocus()
        qtbot.waitUntil(field.hasFocus)
        before = field.toPlainText()
        QTest.keyClick(field, Qt.Key.Key_Tab)
        assert field.toPlainText() == before and "\t" not in field.toPlainText()
        assert not field.hasFocus()


def test_the_api_key_is_hidden_until_shown_and_a_new_one_is_shown(qtbot) -> None:
    from PySide6.QtWidgets import QLineEdit

    settings = Settings()
    settings.server_api_key = "sk-secret"
    dialog = SettingsDialog(settings)
    qtbot.addWidget(dialog)
    key = dialog.server.api_key
    assert key.echoMode() == QLineEdit.EchoMode.Password  # a screen share shows dots
    dialog.server.show_key.click()
    assert key.echoMode() == QLineEdit.EchoMode.Normal and key.text() == "sk-secret"
    dialog.server.show_key.click()
    assert key.echoMode() == QLineEdit.EchoMode.Password
    dialog.server.generate.click()  # to be copied into the clients next
    assert key.echoMode() == QLineEdit.EchoMode.Normal and key.text() != "sk-secret"


def test_memory_and_storage_rows_stay_together_at_the_top(qtbot) -> None:
    dialog = SettingsDialog(Settings())
    qtbot.addWidget(dialog)
    dialog.show()
    qtbot.waitExposed(dialog)
    dialog.tabs.setCurrentIndex(dialog.tabs.indexOf(dialog.folders.parentWidget()))
    qtbot.waitUntil(dialog.folders.isVisible, timeout=5_000)
    form = dialog.folders.parentWidget().layout()
    rows = [dialog.budget, dialog.disk_budget, dialog.folders]
    # Before, the page's spare height went between the rows (a gap of 58 px each),
    # not below them.
    for upper, lower in pairwise(rows):
        assert lower.y() - upper.geometry().bottom() <= 2 * form.verticalSpacing() + 8
    assert rows[0].y() <= 20
