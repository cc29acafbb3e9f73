"""The model the engine runs: which one, whether it is ready, and the load in flight.

A new load keeps the previous model in mind until it has loaded: when the
engine refuses the new folder (broken, too big for free memory) before letting
go of the old model, the chat goes on with the old one.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Signal

from app.engine_bridge import EngineBridge
from app.settings import Settings
from engine import EngineError, Event, Failed, ModelInfo, ModelLoaded, generation_defaults


def model_name(info: ModelInfo | None, fallback: str = "") -> str:
    """A short display name for a model's facts (``fallback`` without them)."""
    for attr in ("name", "model_id", "path"):
        value = getattr(info, attr, None)
        if value:
            return str(value).rstrip("/").rsplit("/", 1)[-1]
    return fallback


class ModelState(QObject):
    """Loads models through the bridge and follows their ``ModelLoaded`` and ``Failed``.

    ``path`` is the folder (or "demo") loaded or loading, ``info`` its
    ``ModelInfo`` once loaded, ``ready`` whether chats can use it now.
    """

    stateChanged = Signal(str, bool)  # description, ready
    errorRaised = Signal(str)

    def __init__(self, bridge: EngineBridge, settings: Settings,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.bridge, self.settings = bridge, settings
        self.info: ModelInfo | None = None
        self.path = ""
        self.ready = False
        self._request: int | None = None  # the newest load: the one that decides
        self._previous: tuple[str, ModelInfo | None] | None = None  # kept while a load runs
        self._paths: dict[int, str] = {}  # every load in flight -> its folder
        self._defaults: tuple[str, dict[str, float | int]] = ("", {})

    @property
    def loading(self) -> bool:
        """True while a model load is in flight."""
        return bool(self._paths)

    def load(self, path: str) -> None:
        """Ask the engine to load a model folder or "demo"."""
        if self.ready:
            self._previous = (self.path, self.info)
        self.ready = False
        self.path = path
        self._request = self.bridge.load_model(path, self._handle)
        self._paths[self._request] = path  # loading, for whoever hears the state below
        self.stateChanged.emit(f"Loading {model_name(None, path) or path}…", False)

    def drop(self, description: str) -> None:
        """The engine no longer has the model (its machines are gone): not ready until
        the next load; ``description`` says so."""
        self.ready = False
        self._previous = None
        self.stateChanged.emit(description, False)

    def generation_defaults(self) -> dict[str, float | int]:
        """The loaded model's own sampling defaults (its generation_config.json)."""
        folder = getattr(self.info, "path", None) if self.ready else None
        if not folder:
            return {}
        if self._defaults[0] != folder:  # read once per model, not once per answer
            self._defaults = (folder, generation_defaults(folder))
        return self._defaults[1]

    def _handle(self, event: Event) -> None:
        if isinstance(event, ModelLoaded):
            self.on_loaded(event)
        elif isinstance(event, Failed):
            self.on_failed(event)

    def on_loaded(self, event: ModelLoaded) -> None:
        """A load finished: ready, unless a newer load is queued behind it."""
        path = self._paths.pop(event.request_id, self.path)
        if event.request_id != self._request:
            # A newer load is queued behind this one and decides; this model is
            # what the engine falls back on if that one fails.
            self._previous = (path, event.info)
            return
        self._previous = None
        self.info = event.info
        self.ready = True
        self.settings.last_model = self.path
        self.stateChanged.emit(model_name(event.info, self.path), True)

    def on_failed(self, event: Failed) -> None:
        """A load failed: say why, and keep the previous model if the engine still has it."""
        self._paths.pop(event.request_id, None)
        if event.request_id != self._request:
            self.errorRaised.emit(event.message)
            return
        previous = self._previous
        if previous is not None and self._engine_has_model():
            # The engine refused the new folder before letting go of the old
            # model (a broken folder, too little memory): keep using it.
            self.path, self.info = previous
            self.ready = True
            name = model_name(self.info, self.path)
            self.errorRaised.emit(f"{event.message} Still using {name}.")
            self.stateChanged.emit(name, True)
            return
        self.errorRaised.emit(event.message)
        self.ready = False
        self.stateChanged.emit(f"No model ({model_name(None, self.path)})", False)

    def _engine_has_model(self) -> bool:
        try:
            self.bridge.fit_check(None, 1)  # thread-safe; refuses when nothing is loaded
        except EngineError:
            return False
        return True
