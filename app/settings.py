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
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Generic, TypeVar, overload
from urllib.parse import quote

import platformdirs
from PySide6.QtCore import QSettings, QStandardPaths

from engine import (
    DEFAULT_MODE,
    DEFAULT_READ_SHARE,
    MODES,
    EngineError,
    KvMode,
    SamplingParams,
    check_read_share,
    data_dir,
    prefill_rate,
    private_dir,
    private_file,
)

# Small models (the demo model among them) loop on a phrase without a penalty; this
# one, over the engine's 64-token window, stops that without punishing every common word.
DEFAULT_REPETITION_PENALTY = 1.1
DEFAULT_SYSTEM_PROMPT = "You are Longleaf, a helpful assistant. Answer clearly and concisely."
SETTINGS_FILE = "settings.ini"
# The sampling keys a model's generation_config.json may give a default for.
MODEL_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# The sampling values Settings stores (each a key of its own).
STORED_SAMPLING_KEYS = (*MODEL_SAMPLING_KEYS, "max_tokens", "seed")
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
        older = data_dir() / SETTINGS_FILE  # where an older Longleaf's file may still be
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


T = TypeVar("T")


def _same(value: Any) -> Any:
    return value


def _convert(value: Any, kind: type) -> Any:
    """A stored value as ``kind`` (INI files hold text; QSettings gives some types back).

    Raises:
        TypeError, ValueError: it is not a ``kind``.
    """
    if kind is bool:
        return value if isinstance(value, bool) else str(value).lower() == "true"
    if kind is list:  # QSettings reads a one-item list back as its item
        return ([value] if value else []) if isinstance(value, str) else list(value)
    if kind is str and isinstance(value, list):
        # A comma in a value typed into the file without quotes makes QSettings
        # read a list of its pieces, trimmed: the text comes back with each comma
        # followed by one space (the spacing typed around it is not kept).
        return ", ".join(str(item) for item in value)
    return kind(value)


class Setting(Generic[T]):
    """One row of the settings table: a stored key and how its value reads and writes.

    A class attribute of :class:`Settings`, where it is the property of the same name:
    reading converts the stored value to ``kind`` and passes it through ``read``;
    writing stores ``write(value)`` under ``key`` (None removes the key).

    Args:
        key: the QSettings key, ``group/name`` in settings.ini (users' files keep it).
        default: the stored value a missing or unreadable key stands for.
        kind: the type the stored value is read as; the default's type when not given.
        read: the validator: the stored value as the setting's value; a ValueError
            means it is not valid and ``default`` is read instead.
        write: the value stored for a given one (refusing an invalid one with a
            ValueError); None removes the key.
    """

    def __init__(self, key: str, default: object, *, kind: type | None = None,
                 read: Callable[[Any], T] = _same, write: Callable[[T], object] = _same) -> None:
        self.key, self.default, self.read, self.write = key, default, read, write
        self.kind = kind or type(default)
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, settings: None, owner: type) -> Setting[T]: ...

    @overload
    def __get__(self, settings: Settings, owner: type) -> T: ...

    def __get__(self, settings: Settings | None, owner: type) -> Setting[T] | T:
        if settings is None:
            return self
        stored = settings._get(self.key, self.default, self.kind)
        try:
            return self.read(stored)
        except ValueError:
            return self.read(self.default)

    def __set__(self, settings: Settings, value: T) -> None:
        settings._set(self.key, self.write(value))


def _known_mode(mode: KvMode) -> KvMode:
    if mode not in MODES:
        raise ValueError(f"unknown KV mode {mode!r}; choose one of {', '.join(MODES)}")
    return mode


def _at_least_16(tokens: int) -> int:
    return max(16, tokens)


def _time_share(share: float) -> float:
    try:
        return check_read_share(share)
    except EngineError as error:
        raise ValueError(str(error)) from None


def _positive_or_none(value: int) -> int | None:
    return value if value > 0 else None


def _port(port: int) -> int:
    if not 1 <= port <= 65535:
        raise ValueError(f"{port} is not a TCP port")
    return port


def _names(text: str) -> tuple[str, ...]:
    return tuple(name.strip() for name in text.split(",") if name.strip())


def _stripped_or_none(text: str) -> str | None:
    return str(text).strip() or None


def _existing_folder(folder: str) -> str:
    return folder if folder and Path(folder).is_dir() else documents_dir()


class Settings:
    """Typed access to the user's preferences.

    Every setting is one :class:`Setting` row below (its key, default, validator);
    ``table()`` lists them. ``sampling`` is the one composite: a ``sampling/`` key per
    :class:`SamplingParams` value, each written only when it differs.

    Args:
        path: the INI file; defaults to ``default_settings_path()``.
    """

    default_mode = Setting[KvMode](
        "engine/default_mode", DEFAULT_MODE,
        read=lambda name: MODES.find(name) or DEFAULT_MODE, write=_known_mode)
    """KV mode a new chat starts with."""
    page_size = Setting[int]("engine/page_size", 256, read=_at_least_16, write=int)
    """Tokens per KV page."""
    rotate_kv = Setting[bool | None]("engine/rotate_kv", None, kind=bool)
    """Store q8/q6/q4 rows after a Hadamard rotation (new chats); None: the engine's default."""
    ingest_chunk = Setting[int]("engine/ingest_chunk", 512, read=_at_least_16, write=int)
    """Tokens prefilled per chunk."""
    read_share = Setting[float]("engine/read_share", DEFAULT_READ_SHARE, read=_time_share,
                                write=_time_share)
    """The engine's share of the time a document being read takes while other chats
    answer (the rest goes to their answers)."""
    memory_budget_bytes = Setting[int | None](
        "engine/memory_budget_bytes", 0, read=_positive_or_none,
        write=lambda value: int(value or 0))
    """KV byte budget, or None to let the engine keep its RAM headroom."""
    stored_kv_budget_bytes = Setting[int | None](
        "engine/stored_kv_budget_bytes", 0, read=_positive_or_none,
        write=lambda value: int(value or 0) or None)
    """Disk bytes all stored KV snapshots may take, or None for the engine's
    default (the smaller of 20 GB and 10% of free disk, its stored KV counted as free)."""
    system_prompt = Setting[str]("chat/system_prompt", DEFAULT_SYSTEM_PROMPT)
    """System message sent first in every chat (a change makes each chat read its
    conversation again: its cache holds the old one first)."""
    speculative = Setting[bool]("engine/speculative", SamplingParams().speculative == "lookup",
                                write=bool)
    """Draft answer tokens from the chat's own text and verify them in one pass."""
    server_enabled = Setting[bool]("server/enabled", False, write=bool)
    """Run the local OpenAI/Anthropic-compatible server while the app runs."""
    server_port = Setting[int]("server/port", DEFAULT_SERVER_PORT, read=_port, write=int)
    """The local server's TCP port."""
    server_allow_network = Setting[bool]("server/allow_network", False, write=bool)
    """Listen on every network interface, not only this computer's (needs an API key)."""
    server_api_key = Setting[str]("server/api_key", "", write=_stripped_or_none)
    """The key clients must send ("" for none: only allowed on this computer)."""
    server_allowed_hosts = Setting[tuple[str, ...]](
        "server/allowed_hosts", "", read=_names, write=lambda names: ",".join(names) or None)
    """Names besides this computer's that the keyless server answers requests for
    (``server/allowed_hosts`` in settings.ini, comma-separated; no widget)."""
    server_share_chats = Setting[bool]("server/share_chats", False, write=bool)
    """Let API requests reuse the KV of the app's own chats (off: API only)."""
    pipeline_enabled = Setting[bool]("pipeline/enabled", False, write=bool)
    """Split models that can be split across the Macs of ``pipeline_hostfile``."""
    pipeline_hostfile = Setting[str]("pipeline/hostfile", "", write=_stripped_or_none)
    """The MLX hostfile (JSON) naming the Macs, this one first ("" for none)."""
    pipeline_split = Setting[tuple[int, ...] | None](
        "pipeline/split", "", read=parse_split,  # edited by hand into nonsense: the even split
        write=lambda split: ",".join(map(str, split)) if split else None)
    """Layers per Mac, this one first; None: mlx-lm's even split."""
    model_folders = Setting[list[str]](
        "models/folders", [], read=lambda folders: [str(f) for f in folders],
        write=lambda folders: list(dict.fromkeys(folders)))
    """Extra folders the user asked Longleaf to search for models."""
    last_model = Setting[str]("models/last", "demo")
    """The model loaded last time ("demo" for the embedded one)."""
    last_folder = Setting[str]("files/last_folder", "", read=_existing_folder,
                               write=lambda folder: str(folder) or None)
    """The folder the last file dialog was left in (Documents at first, and when it is gone)."""
    memory_panel_visible = Setting[bool]("window/memory_panel", True, write=bool)
    """Whether the memory panel is expanded."""
    window_geometry = Setting[bytes | None]("window/geometry", None, kind=bytes)
    """Saved window geometry."""

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

    def _get(self, key: str, default: Any, kind: type) -> Any:
        value = self._qs.value(key, default)
        if value is None:
            return default
        try:
            return _convert(value, kind)
        except (TypeError, ValueError):
            return default

    def _set(self, key: str, value: object) -> None:
        # QSettings writes None and empty lists as "@Invalid()": drop the key instead.
        if value is None or (isinstance(value, list | tuple) and not value):
            self._qs.remove(key)
        else:
            self._qs.setValue(key, value)

    def sync(self) -> bool:
        """Write pending changes to disk; False when the file could not be written
        (a full or read-only disk): they hold for this run only."""
        self._qs.sync()
        return self._qs.status() == QSettings.Status.NoError

    def stored(self) -> dict[str, object]:
        """Every key the file holds now, with its raw value (what a user set)."""
        return {key: self._qs.value(key) for key in self._qs.allKeys()}

    @classmethod
    def table(cls) -> tuple[Setting[Any], ...]:
        """Every row of the settings table, in the order declared."""
        return tuple(attr for attr in vars(cls).values() if isinstance(attr, Setting))

    @classmethod
    def fields(cls) -> tuple[str, ...]:
        """The names of every setting: each row of ``table()``, and ``sampling``."""
        return (*(row.name for row in cls.table()), "sampling")

    @property
    def sampling(self) -> SamplingParams:
        """Default sampling parameters."""
        base = SamplingParams(repetition_penalty=DEFAULT_REPETITION_PENALTY)
        seed = self._get("sampling/seed", -1, int)
        values = {key: self._get(f"sampling/{key}", getattr(base, key), kind)
                  for key, kind in (("temperature", float), ("top_p", float), ("top_k", int),
                                    ("min_p", float), ("repetition_penalty", float),
                                    ("max_tokens", int))}
        for key, value in values.items():
            # A hand-edited file may hold anything: a value no answer could use is
            # dropped from it, so the default (or the model's own) applies, rather
            # than raised at every send.
            try:
                SamplingParams(**{key: value})
            except EngineError as error:
                log.warning("settings: sampling/%s removed: %s", key, error)
                self._qs.remove(f"sampling/{key}")
                values[key] = getattr(base, key)
        return SamplingParams(**values, seed=None if seed < 0 else seed,
                              speculative="lookup" if self.speculative else "off")

    @sampling.setter
    def sampling(self, params: SamplingParams) -> None:
        # Only the values that differ are written: a key left unset keeps following
        # the default (and, later, a model's own generation defaults).
        current = self.sampling
        for key in STORED_SAMPLING_KEYS:
            if key != "seed" and getattr(params, key) != getattr(current, key):
                self._set(f"sampling/{key}", getattr(params, key))
        if params.seed != current.seed:
            self._set("sampling/seed", -1 if params.seed is None else params.seed)

    def set_sampling(self, changed: Mapping[str, object]) -> None:
        """Store the sampling values the user set (``SamplingParams`` keys): each is
        kept as given, also where it equals the app's default, so it wins over a
        model's own (the setter above keeps following the defaults instead)."""
        for key, value in changed.items():
            if key == "seed":
                self._set("sampling/seed", -1 if value is None else value)
            elif key in STORED_SAMPLING_KEYS:
                self._set(f"sampling/{key}", value)

    def sampling_for(self, model_defaults: Mapping[str, float | int]) -> SamplingParams:
        """``sampling`` with the model's own defaults (its generation_config.json) for
        every key the user has not set here; a key set in Settings wins."""
        own = self.sampling  # first: it drops a stored value no answer could use
        stored = {key for key in MODEL_SAMPLING_KEYS if self._qs.contains(f"sampling/{key}")}
        # The keys are SamplingParams fields of mixed types; the filter above is the check.
        taken: dict[str, Any] = {key: value for key, value in model_defaults.items()
                                 if key in MODEL_SAMPLING_KEYS and key not in stored}
        return replace(own, **taken)

    def prefill_timings(self, model_id: str) -> tuple[prefill_rate.ChunkTiming, ...]:
        """The prefill chunks timed with ``model_id`` on this machine, oldest first."""
        return prefill_rate.loads(self._get(_timings_key(model_id), "", str))

    def set_prefill_timings(self, model_id: str,
                            timings: tuple[prefill_rate.ChunkTiming, ...]) -> None:
        """Keep ``model_id``'s chunk timings (a measurement: not one of ``fields()``)."""
        self._set(_timings_key(model_id), prefill_rate.dumps(timings) if timings else None)
