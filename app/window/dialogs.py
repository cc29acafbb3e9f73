"""New chat (with the KV mode choice) and Settings dialogs."""

from __future__ import annotations

from dataclasses import fields

from PySide6.QtWidgets import (
    QButtonGroup,
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFormLayout,
    QLabel,
    QMessageBox,
    QPlainTextEdit,
    QRadioButton,
    QSizePolicy,
    QSpinBox,
    QTabWidget,
    QVBoxLayout,
    QWidget,
)

from app.format import GB, human_bytes
from app.memory.panel import budget_bound, fit_place, fit_tokens
from app.settings import Settings
from app.window.macs_settings import OtherMacsPage
from app.window.server_settings import LocalServerPage
from engine import (
    DEFAULT_MODE,
    DEFAULT_READ_SHARE,
    MAX_CHUNK,
    MAX_DEFAULT_BUDGET,
    MAX_PAGE_SIZE,
    MODES,
    FitReport,
    KvMode,
    SamplingParams,
    default_budget,
    parse_mode,
    server_snapshots_dir,
    snapshots_dir,
)

SAMPLING_KEYS = tuple(f.name for f in fields(SamplingParams))
MB = 2**20
# The menu of the reads' share of the time beside other chats' answers.
READ_SHARES = (
    (0.25, "Answers first (reading takes a quarter of the time)"),
    (DEFAULT_READ_SHARE, "Equal turns"),
    (0.75, "Reading first (reading takes three quarters of the time)"),
)


def mode_blurb(mode: KvMode) -> str:
    """The mode's few words from the registry, "(default)" after the default's."""
    label = MODES[mode].label
    return f"{label} (default)" if mode == DEFAULT_MODE else label


def mode_choice_text(mode: KvMode, full_report: FitReport | None) -> str:
    """"q8 — 8-bit … · 12.0 MB at 8,192 tokens · 8,192 tokens fit in free memory".

    A model holds no more than its context however much memory is free, so the
    tokens that fit are capped there ("all 8,192 tokens fit").
    """
    text = f"{mode}  —  {mode_blurb(mode)}"
    if full_report is None:
        return text
    entry = full_report.for_mode(mode)
    if not entry.supported:
        return text + "  ·  not possible for this model's head size"
    context = full_report.max_context
    # The panel's figure: what free memory or the memory limit holds, the smaller.
    tokens = fit_tokens(full_report, mode)
    where = fit_place(budget_bound(full_report, mode), len(full_report.ranks))
    fit = (f"all {context:,} tokens fit in {where}" if tokens >= context
           else f"{tokens:,} tokens fit in {where}")
    return f"{text}  ·  {human_bytes(entry.bytes_needed)} at {context:,} tokens  ·  {fit}"


def default_disk_budget_text() -> str:
    """What "Automatic" means for the stored-KV disk budget on this disk, right now."""
    try:
        # As the app's store counts it: the local server's stored KV too.
        default = f"{human_bytes(default_budget(snapshots_dir(), (server_snapshots_dir(),)))} now"
    except OSError:
        default = "unknown now"
    return (f"Automatic: smaller of {human_bytes(MAX_DEFAULT_BUDGET)} and 10% of free disk, "
            f"stored KV counted as free ({default})")


def read_share_box(share: float) -> QComboBox:
    """How a document read into one chat shares the time with other chats' answers."""
    box = QComboBox()
    for value, text in READ_SHARES:
        box.addItem(f"{text} (default)" if value == DEFAULT_READ_SHARE else text, value)
    index = box.findData(share)
    if index < 0:  # set elsewhere (settings.ini): shown as it is, kept unless changed
        box.addItem(f"Reading takes {share:.0%} of the time", share)
        index = box.count() - 1
    box.setCurrentIndex(index)
    box.setToolTip("While a document is read into one chat and others answer, the engine "
                   "takes turns between them. Answers first keeps the answers near their "
                   "usual pace and reads the document more slowly; reading first does the "
                   "opposite. Nothing changes what is answered, only how fast.")
    return box


def disk_budget_box(budget_bytes: int | None) -> QDoubleSpinBox:
    """The stored-KV disk budget in GB; 0 shows (and means) the automatic default."""
    box = QDoubleSpinBox(minimum=0.0, maximum=100_000.0, decimals=1, singleStep=1.0,
                         suffix=" GB", value=(budget_bytes or 0) / GB)
    box.setSpecialValueText(default_disk_budget_text())
    box.setToolTip("Chats whose KV cache leaves memory are kept on disk, so reopening them "
                   "reads no document again. Past this budget the least recently used "
                   "are removed; lowering it removes them right away.")
    return box


class NewChatDialog(QDialog):
    """Ask for the KV mode of a new chat, with each mode's projection."""

    def __init__(self, default_mode: KvMode, full_report: FitReport | None,
                 parent: QWidget | None = None,
                 title: str = "New chat") -> None:
        super().__init__(parent)
        self.setWindowTitle(title)
        layout = QVBoxLayout(self)
        intro = QLabel("<b>KV cache mode</b><br>Fixed for the life of the chat. Lower bits hold "
                       "more context in the same memory.")
        intro.setWordWrap(True)
        layout.addWidget(intro)
        self.group = QButtonGroup(self)
        self.buttons: dict[KvMode, QRadioButton] = {}
        for mode in MODES:
            button = QRadioButton(mode_choice_text(mode, full_report))
            supported = full_report is None or full_report.for_mode(mode).supported
            button.setEnabled(supported)
            button.setChecked(mode == default_mode and supported)
            self.group.addButton(button)
            self.buttons[mode] = button
            layout.addWidget(button)
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok
                                   | QDialogButtonBox.StandardButton.Cancel)
        buttons.button(QDialogButtonBox.StandardButton.Ok).setText("Start chat")
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)

    def mode(self) -> KvMode:
        """The chosen mode."""
        return next((m for m, b in self.buttons.items() if b.isChecked()), DEFAULT_MODE)


class SettingsDialog(QDialog):
    """Edit the user's preferences, one tab per subject; ``apply()`` writes them."""

    def __init__(self, settings: Settings, parent: QWidget | None = None,
                 sampling: SamplingParams | None = None,
                 model_folder: str | None = None) -> None:
        """``sampling`` is what answers use now (the loaded model's own defaults under
        the user's settings); without it, the settings' own values are shown.
        ``model_folder`` is the loaded model's, which "Check hosts" looks for on
        every Mac."""
        super().__init__(parent)
        self.settings = settings
        self._model_sampling = sampling is not None
        self.sampling = sampling or settings.sampling
        self.setWindowTitle("Settings")
        self.setMinimumWidth(520)
        layout = QVBoxLayout(self)
        self.tabs = QTabWidget()
        layout.addWidget(self.tabs)
        self._chats_page(settings)
        self._answers_page(settings)
        self._storage_page(settings)
        self.server = LocalServerPage(settings)
        self.tabs.addTab(self.server, "Local server")
        self.macs = OtherMacsPage(settings, model_folder)
        self.tabs.addTab(self.macs, "Use other Macs")
        buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Save
                                   | QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)
        self.accepted.connect(self.apply)
        # What the widgets show at open (rounded, clamped): a field the user leaves
        # alone reads back the same and is not written.
        self._shown = self.edited()

    def _page(self, title: str) -> QFormLayout:
        page = QWidget()
        self.tabs.addTab(page, title)
        form = QFormLayout(page)
        # Numbers and menus keep their own width, as in a Mac's settings; only text
        # boxes (a prompt, folders) take the row.
        form.setFieldGrowthPolicy(QFormLayout.FieldGrowthPolicy.ExpandingFieldsGrow)
        return form

    def _chats_page(self, settings: Settings) -> None:
        form = self._page("Chats")
        self.mode = QComboBox()
        self.mode.addItems(list(MODES))
        self.mode.setCurrentText(settings.default_mode)
        self.mode.setToolTip("How a new chat stores its keys and values; fixed for the chat's "
                             "life (Reopen in… copies it into another mode).")
        form.addRow("New chats store their memory as", self.mode)
        self.page_size = QSpinBox(minimum=16, maximum=MAX_PAGE_SIZE, singleStep=16,
                                  value=settings.page_size, suffix=" tokens")
        self.page_size.setToolTip("The cache grows by pages of this many tokens (per layer). "
                                  "New chats only.")
        form.addRow("Memory grows in pages of", self.page_size)
        self.rotate = QCheckBox("Rotate keys and values before quantizing (new chats)")
        self.rotate.setToolTip(
            "A Hadamard rotation spreads outlier channels over each row before q8/q6/q4 "
            "store it: same bytes, closer to fp16 (q6's KL to fp16 about 4x lower on the "
            "demo model). The last digits of an answer can then depend on how the text "
            "was split into chunks.")
        # Unset means the engine's default, which rotates every quantized mode.
        self.rotate.setChecked(True if settings.rotate_kv is None else settings.rotate_kv)
        form.addRow("", self.rotate)
        self.chunk = QSpinBox(minimum=16, maximum=MAX_CHUNK, singleStep=64,
                              value=settings.ingest_chunk, suffix=" tokens")
        self.chunk.setToolTip("Longer chunks read a document faster and take more memory "
                              "while they are read; Stop takes effect between chunks.")
        form.addRow("Read documents in chunks of", self.chunk)
        self.read_share = read_share_box(settings.read_share)
        form.addRow("Reading a document beside answers", self.read_share)

    def _answers_page(self, settings: Settings) -> None:
        form = self._page("Answers")
        sampling = self.sampling
        if self._model_sampling:
            note = QLabel("Values you have not changed follow the loaded model's own "
                          "defaults (its generation_config.json).")
            note.setWordWrap(True)
            form.addRow(note)
        self.temperature = QDoubleSpinBox(minimum=0.0, maximum=2.0, singleStep=0.05,
                                          value=sampling.temperature)
        form.addRow("Temperature", self.temperature)
        self.top_p = QDoubleSpinBox(minimum=0.01, maximum=1.0, singleStep=0.05,
                                    value=sampling.top_p)
        form.addRow("Top-p", self.top_p)
        self.top_k = QSpinBox(minimum=0, maximum=1000, value=sampling.top_k)
        form.addRow("Top-k (0 = off)", self.top_k)
        self.min_p = QDoubleSpinBox(minimum=0.0, maximum=1.0, singleStep=0.01,
                                    value=sampling.min_p)
        form.addRow("Min-p", self.min_p)
        self.repetition = QDoubleSpinBox(minimum=0.5, maximum=2.0, singleStep=0.05,
                                         value=sampling.repetition_penalty)
        form.addRow("Repetition penalty", self.repetition)
        self.max_tokens = QSpinBox(minimum=1, maximum=1_000_000, value=sampling.max_tokens)
        form.addRow("Longest answer (tokens)", self.max_tokens)
        self.speculative = QCheckBox("Speculative decoding from the chat's own text")
        self.speculative.setToolTip(
            "Guess the next few tokens from the document and conversation and check them in "
            "one step: the same answer, faster when it quotes or restates the text. "
            "On this Mac only: with other Macs, answers decode one token at a time.")
        self.speculative.setChecked(settings.speculative)
        form.addRow("", self.speculative)
        self.system_prompt = QPlainTextEdit(settings.system_prompt)
        self.system_prompt.setFixedHeight(80)
        self.system_prompt.setSizePolicy(QSizePolicy.Policy.Expanding,
                                         QSizePolicy.Policy.Fixed)  # as the model folders
        # A form: Tab goes to the next field, as in every other field of Settings.
        self.system_prompt.setTabChangesFocus(True)
        form.addRow("System prompt", self.system_prompt)
        # Every chat sends it first, so its cache holds it first: a new one is
        # read in with the whole conversation after it, chat by chat.
        prompt_note = QLabel("Sent first in every chat. After a change, each chat reads "
                             "its whole conversation again with its next message.")
        prompt_note.setWordWrap(True)
        form.addRow("", prompt_note)

    def _storage_page(self, settings: Settings) -> None:
        form = self._page("Memory && storage")
        budget = settings.memory_budget_bytes
        self.budget = QSpinBox()
        self.budget.setRange(0, 1024 * 1024)
        self.budget.setSingleStep(256)
        self.budget.setValue((budget or 0) // MB)
        self.budget.setSuffix(" MB")
        self.budget.setSpecialValueText("Automatic (keep RAM headroom)")
        self.budget.setToolTip("The most memory all open chats' caches may take together.")
        form.addRow("Memory for chats' caches", self.budget)
        self.disk_budget = disk_budget_box(settings.stored_kv_budget_bytes)
        form.addRow("Disk for stored caches", self.disk_budget)
        self.folders = QPlainTextEdit("\n".join(settings.model_folders))
        self.folders.setPlaceholderText("One folder per line")
        self.folders.setFixedHeight(60)
        # A fixed height alone leaves a text box's policy Expanding: the form then
        # spreads the page's spare height between its rows instead of leaving it below.
        self.folders.setSizePolicy(QSizePolicy.Policy.Expanding, QSizePolicy.Policy.Fixed)
        self.folders.setTabChangesFocus(True)
        form.addRow("Model folders", self.folders)

    def accept(self) -> None:
        """Save, unless a value cannot be used: then say why and stay open."""
        if self.server.problem_text():
            self.tabs.setCurrentWidget(self.server)
            return
        if self.macs.problem_text():
            self.tabs.setCurrentWidget(self.macs)
            return
        if not self._failed_macs_accepted():
            self.tabs.setCurrentWidget(self.macs)
            return
        super().accept()

    def _failed_macs_accepted(self) -> bool:
        """True unless a Mac of the hostfile failed its check and the user does not
        want to save it anyway."""
        failed = self.macs.failed_hosts()
        if not failed:
            return True
        answer = QMessageBox.question(
            self, "Use other Macs",
            f"{' and '.join(failed)} failed the host check. Save the hostfile anyway? "
            "A model that can be split then tries every Mac when it loads, and goes on "
            "with this Mac alone if one cannot start.",
            QMessageBox.StandardButton.Save | QMessageBox.StandardButton.Cancel,
            QMessageBox.StandardButton.Cancel)
        return answer == QMessageBox.StandardButton.Save

    def edited(self) -> dict[str, object]:
        """The widgets' values, by the name of the setting each one edits."""
        seed = self.sampling.seed
        return {
            "default_mode": parse_mode(self.mode.currentText()),
            "page_size": self.page_size.value(),
            "rotate_kv": self.rotate.isChecked(),
            "ingest_chunk": self.chunk.value(),
            "read_share": self.read_share.currentData(),
            "memory_budget_bytes": self.budget.value() * MB or None,
            "stored_kv_budget_bytes": round(self.disk_budget.value() * GB) or None,
            "sampling": SamplingParams(
                temperature=self.temperature.value(), top_p=self.top_p.value(),
                top_k=self.top_k.value(), min_p=self.min_p.value(),
                repetition_penalty=self.repetition.value(),
                max_tokens=self.max_tokens.value(), seed=seed),
            "system_prompt": self.system_prompt.toPlainText().strip(),
            "model_folders": [f.strip() for f in self.folders.toPlainText().splitlines()
                              if f.strip()],
            "speculative": self.speculative.isChecked(),
            **self.server.values(),
            **self.macs.values(),
        }

    def apply(self) -> None:
        """Write the fields the user changed (and only those) to the settings."""
        s = self.settings
        for name, value in self.edited().items():
            shown = self._shown[name]
            if value == shown:
                continue
            if name == "sampling":  # one key per spin box: the untouched ones stay as stored
                s.set_sampling({key: getattr(value, key) for key in SAMPLING_KEYS
                                if getattr(value, key) != getattr(shown, key)})
                continue
            setattr(s, name, value)
        s.sync()
