"""The one typed wrapper over QSettings.

Settings live in an INI file in the user's config folder (platformdirs'
``user_config_dir``), not among the data: ``LONGLEAF_CONFIG_HOME`` overrides it,
and a redirected ``LONGLEAF_HOME`` (every test sets one) takes the settings
along into its ``config`` folder, so tests never touch the real user's settings.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from urllib.parse import quote

import platformdirs
from PySide6.QtCore import QSettings, QStandardPaths

from engine import (
    DEFAULT_MODE,
    MODES,
    KvMode,
    SamplingParams,
    data_dir,
    prefill_rate,
    private_dir,
    private_file,
)

# Best quality first, the order every list of modes in the app uses.
# Small models loop on a phrase without it (the demo model repeated "finally…"
# for minutes at 1.0); 1.1 over the engine's 64-token window stops that without
# punishing every common word.
DEFAULT_REPETITION_PENALTY = 1.1
DEFAULT_SYSTEM_PROMPT = "You are Longleaf, a helpful assistant. Answer clearly and concisely."
SETTINGS_FILE = "settings.ini"
# The sampling keys a model's generation_config.json may give a default for.
MODEL_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
DEFAULT_SERVER_PORT = 1234  # LM Studio's, so tools set up for it find Longleaf too
log = logging.getLogger(__name__)


def _config_path() -> Path:
    """Where the settings folder is (nothing is created)."""
    override = os.environ.get("LONGLEAF_CONFIG_HOME")
    if override:
        return Path(override)
    home = os.environ.get("LONGLEAF_HOME")
    if home:
        return Path(home) / "config"
    return Path(platformdirs.user_config_dir("Longleaf", False))


def config_dir() -> Path:
    """The user-only folder that holds the settings file, created if missing.

    Raises:
        OSError: it cannot be made (a read-only or full disk).
    """
    if not os.environ.get("LONGLEAF_CONFIG_HOME") and os.environ.get("LONGLEAF_HOME"):
        return private_dir(data_dir() / "config")  # the data folder made user-only first
    return private_dir(_config_path())


def default_settings_path() -> Path:
    """``settings.ini`` in ``config_dir()``, moved there from the data folder once.

    A settings folder that cannot be made still gives its path: the settings
    read nothing there and keep changes for this run only.
    """
    try:
        path = config_dir() / SETTINGS_FILE
    except OSError as error:
        log.warning("settings are kept for this run only: %s", error)
        return _config_path() / SETTINGS_FILE
    try:
        older = data_dir() / SETTINGS_FILE  # where versions before 0.1.1 kept it
        if not path.exists() and older.is_file() and older != path:
            shutil.move(older, path)
    except OSError as error:  # an unusable data folder: the window says so; settings go on
        log.warning("settings were not looked for in the data folder: %s", error)
    return path


def _timings_key(model_id: str) -> str:
    # A model id is a folder path: quoted, its slashes make no INI groups.
    return f"prefill_timings/{quote(model_id, safe='')}"


def parse_split(text: str) -> tuple[int, ...] | None:
    """"10,14" -> (10, 14): layers per machine, the first machine first; "" -> None.

    Raises:
        ValueError: not whole numbers of at least one layer separated by commas
            (its message says what is expected).
    """
    parts = [part.strip() for part in text.split(",")] if text.strip() else []
    if not parts:
        return None
    if not all(part.isdigit() and int(part) > 0 for part in parts) or len(parts) < 2:
        raise ValueError(f"The layer split {text.strip()!r} is not one whole number of "
                         "layers (at least 1) per Mac, separated by commas, this Mac "
                         "first: for example 10,14. Leave it empty for an even split.")
    return tuple(int(part) for part in parts)


def documents_dir() -> str:
    """The user's Documents folder (their home when the platform names none)."""
    folder = QStandardPaths.writableLocation(
        QStandardPaths.StandardLocation.DocumentsLocation)
    return folder if folder and Path(folder).is_dir() else str(Path.home())


class Settings:
    """Typed access to the user's preferences.

    Args:
        path: the INI file; defaults to ``default_settings_path()``.
    """

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_settings_path()
        try:
            # Created user-only first: QSettings keeps an existing file's mode.
            private_file(self.path)
        except OSError as error:
            # A read-only or full disk: QSettings reads what is there and keeps
            # changes in memory (its own writes fail quietly).
            log.warning("settings are kept for this run only: %s", error)
        self._qs = QSettings(str(self.path), QSettings.Format.IniFormat)

    def _get(self, key: str, default, kind: type):
        value = self._qs.value(key, default)
        if value is None:
            return default
        try:
            if kind is bool:
                return value if isinstance(value, bool) else str(value).lower() == "true"
            return kind(value)
        except (TypeError, ValueError):
            return default

    def _set(self, key: str, value) -> None:
        # QSettings writes None and empty lists as "@Invalid()": drop the key instead.
        if value is None or (isinstance(value, list | tuple) and not value):
            self._qs.remove(key)
        else:
            self._qs.setValue(key, value)

    def sync(self) -> None:
        """Write pending changes to disk."""
        self._qs.sync()

    def stored(self) -> dict[str, object]:
        """Every key the file holds now, with its raw value (what a user set)."""
        return {key: self._qs.value(key) for key in self._qs.allKeys()}

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The names of every setting (each property that can be written)."""
        return tuple(name for name, attr in vars(cls).items()
                     if isinstance(attr, property) and attr.fset is not None)

    @property
    def default_mode(self) -> KvMode:
        """KV mode a new chat starts with."""
        return MODES.find(self._get("engine/default_mode", DEFAULT_MODE, str)) or DEFAULT_MODE

    @default_mode.setter
    def default_mode(self, mode: KvMode) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown KV mode {mode!r}; choose one of {', '.join(MODES)}")
        self._set("engine/default_mode", mode)

    @property
    def page_size(self) -> int:
        """Tokens per KV page."""
        return max(16, self._get("engine/page_size", 256, int))

    @page_size.setter
    def page_size(self, value: int) -> None:
        self._set("engine/page_size", int(value))

    @property
    def rotate_kv(self) -> bool | None:
        """Store q8/q6/q4 rows after a Hadamard rotation (new chats); None: the engine's default."""
        value = self._qs.value("engine/rotate_kv", None)
        return None if value is None else self._get("engine/rotate_kv", False, bool)

    @rotate_kv.setter
    def rotate_kv(self, value: bool | None) -> None:
        self._set("engine/rotate_kv", value)

    @property
    def ingest_chunk(self) -> int:
        """Tokens prefilled per chunk."""
        return max(16, self._get("engine/ingest_chunk", 512, int))

    @ingest_chunk.setter
    def ingest_chunk(self, value: int) -> None:
        self._set("engine/ingest_chunk", int(value))

    @property
    def memory_budget_bytes(self) -> int | None:
        """KV byte budget, or None to let the engine keep its RAM headroom."""
        value = self._get("engine/memory_budget_bytes", 0, int)
        return value if value > 0 else None

    @memory_budget_bytes.setter
    def memory_budget_bytes(self, value: int | None) -> None:
        self._set("engine/memory_budget_bytes", int(value or 0))

    @property
    def stored_kv_budget_bytes(self) -> int | None:
        """Disk bytes all stored KV snapshots may take, or None for the engine's
        default (the smaller of 20 GB and 10% of free disk)."""
        value = self._get("engine/stored_kv_budget_bytes", 0, int)
        return value if value > 0 else None

    @stored_kv_budget_bytes.setter
    def stored_kv_budget_bytes(self, value: int | None) -> None:
        self._set("engine/stored_kv_budget_bytes", int(value or 0) or None)

    @property
    def system_prompt(self) -> str:
        """System message sent first in every new chat."""
        return self._get("chat/system_prompt", DEFAULT_SYSTEM_PROMPT, str)

    @system_prompt.setter
    def system_prompt(self, text: str) -> None:
        self._set("chat/system_prompt", text)

    @property
    def sampling(self) -> SamplingParams:
        """Default sampling parameters."""
        base = SamplingParams(repetition_penalty=DEFAULT_REPETITION_PENALTY)
        seed = self._get("sampling/seed", -1, int)
        return SamplingParams(
            temperature=self._get("sampling/temperature", base.temperature, float),
            top_p=self._get("sampling/top_p", base.top_p, float),
            top_k=self._get("sampling/top_k", base.top_k, int),
            min_p=self._get("sampling/min_p", base.min_p, float),
            repetition_penalty=self._get(
                "sampling/repetition_penalty", base.repetition_penalty, float
            ),
            max_tokens=self._get("sampling/max_tokens", base.max_tokens, int),
            seed=None if seed < 0 else seed,
            speculative="lookup" if self.speculative else "off",
        )

    def sampling_for(self, model_defaults: Mapping[str, float | int]) -> SamplingParams:
        """``sampling`` with the model's own defaults (its generation_config.json) for
        every key the user has not set here; a key set in Settings wins."""
        stored = {key for key in MODEL_SAMPLING_KEYS if self._qs.contains(f"sampling/{key}")}
        taken = {key: value for key, value in model_defaults.items()
                 if key in MODEL_SAMPLING_KEYS and key not in stored}
        return replace(self.sampling, **taken)

    @sampling.setter
    def sampling(self, params: SamplingParams) -> None:
        # Only the values that differ are written: a key left unset keeps following
        # the default (and, later, a model's own generation defaults).
        current = self.sampling
        for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                    "max_tokens"):
            if getattr(params, key) != getattr(current, key):
                self._set(f"sampling/{key}", getattr(params, key))
        if params.seed != current.seed:
            self._set("sampling/seed", -1 if params.seed is None else params.seed)

    @property
    def speculative(self) -> bool:
        """Draft answer tokens from the chat's own text and verify them in one pass."""
        return self._get("engine/speculative", SamplingParams().speculative == "lookup", bool)

    @speculative.setter
    def speculative(self, value: bool) -> None:
        self._set("engine/speculative", bool(value))

    def prefill_timings(self, model_id: str) -> tuple[prefill_rate.ChunkTiming, ...]:
        """The prefill chunks timed with ``model_id`` on this machine, oldest first."""
        return prefill_rate.loads(self._get(_timings_key(model_id), "", str))

    def set_prefill_timings(self, model_id: str,
                            timings: tuple[prefill_rate.ChunkTiming, ...]) -> None:
        """Keep ``model_id``'s chunk timings (a measurement: not one of ``fields()``)."""
        self._set(_timings_key(model_id), prefill_rate.dumps(timings) if timings else None)

    @property
    def server_enabled(self) -> bool:
        """Run the local OpenAI/Anthropic-compatible server while the app runs."""
        return self._get("server/enabled", False, bool)

    @server_enabled.setter
    def server_enabled(self, value: bool) -> None:
        self._set("server/enabled", bool(value))

    @property
    def server_port(self) -> int:
        """The local server's TCP port."""
        port = self._get("server/port", DEFAULT_SERVER_PORT, int)
        return port if 1 <= port <= 65535 else DEFAULT_SERVER_PORT

    @server_port.setter
    def server_port(self, value: int) -> None:
        self._set("server/port", int(value))

    @property
    def server_allow_network(self) -> bool:
        """Listen on every network interface, not only this computer's (needs an API key)."""
        return self._get("server/allow_network", False, bool)

    @server_allow_network.setter
    def server_allow_network(self, value: bool) -> None:
        self._set("server/allow_network", bool(value))

    @property
    def server_api_key(self) -> str:
        """The key clients must send ("" for none: only allowed on this computer)."""
        return self._get("server/api_key", "", str)

    @server_api_key.setter
    def server_api_key(self, key: str) -> None:
        self._set("server/api_key", key.strip() or None)

    @property
    def server_allowed_hosts(self) -> tuple[str, ...]:
        """Names besides this computer's that the keyless server answers requests for
        (``server/allowed_hosts`` in settings.ini, comma-separated; no widget)."""
        text = self._get("server/allowed_hosts", "", str)
        return tuple(name.strip() for name in text.split(",") if name.strip())

    @server_allowed_hosts.setter
    def server_allowed_hosts(self, names: tuple[str, ...]) -> None:
        self._set("server/allowed_hosts", ",".join(names) or None)

    @property
    def server_share_chats(self) -> bool:
        """Let API requests reuse the KV of the app's own chats (off: API only)."""
        return self._get("server/share_chats", False, bool)

    @server_share_chats.setter
    def server_share_chats(self, value: bool) -> None:
        self._set("server/share_chats", bool(value))

    @property
    def pipeline_enabled(self) -> bool:
        """Split models that can be split across the Macs of ``pipeline_hostfile``."""
        return self._get("pipeline/enabled", False, bool)

    @pipeline_enabled.setter
    def pipeline_enabled(self, value: bool) -> None:
        self._set("pipeline/enabled", bool(value))

    @property
    def pipeline_hostfile(self) -> str:
        """The MLX hostfile (JSON) naming the Macs, this one first ("" for none)."""
        return self._get("pipeline/hostfile", "", str)

    @pipeline_hostfile.setter
    def pipeline_hostfile(self, path: str) -> None:
        self._set("pipeline/hostfile", str(path).strip() or None)

    @property
    def pipeline_split(self) -> tuple[int, ...] | None:
        """Layers per Mac, this one first; None: mlx-lm's even split."""
        try:
            return parse_split(self._get("pipeline/split", "", str))
        except ValueError:  # edited by hand into something unusable: the even split
            return None

    @pipeline_split.setter
    def pipeline_split(self, split: tuple[int, ...] | None) -> None:
        self._set("pipeline/split", ",".join(map(str, split)) if split else None)

    @property
    def model_folders(self) -> list[str]:
        """Extra folders the user asked Longleaf to search for models."""
        value = self._qs.value("models/folders", [])
        if isinstance(value, str):
            value = [value] if value else []
        return [str(v) for v in value or []]

    @model_folders.setter
    def model_folders(self, folders: list[str]) -> None:
        self._set("models/folders", list(dict.fromkeys(folders)))

    @property
    def last_model(self) -> str:
        """The model loaded last time ("demo" for the embedded one)."""
        return self._get("models/last", "demo", str)

    @last_model.setter
    def last_model(self, model: str) -> None:
        self._set("models/last", model)

    @property
    def last_folder(self) -> str:
        """The folder the last file dialog was left in (Documents at first)."""
        folder = self._get("files/last_folder", "", str)
        return folder if folder and Path(folder).is_dir() else documents_dir()

    @last_folder.setter
    def last_folder(self, folder: str) -> None:
        self._set("files/last_folder", str(folder) or None)

    @property
    def memory_panel_visible(self) -> bool:
        """Whether the memory panel is expanded."""
        return self._get("window/memory_panel", True, bool)

    @memory_panel_visible.setter
    def memory_panel_visible(self, visible: bool) -> None:
        self._set("window/memory_panel", bool(visible))

    @property
    def window_geometry(self) -> bytes | None:
        """Saved window geometry."""
        value = self._qs.value("window/geometry")
        return bytes(value) if value is not None else None

    @window_geometry.setter
    def window_geometry(self, value: bytes) -> None:
        self._set("window/geometry", value)
