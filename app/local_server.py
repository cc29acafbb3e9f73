"""The local server in the app: started, restarted and stopped as its settings say.

The server (``engine.server.inprocess``) runs on the app's own engine worker, so
a chat answer and an API request answer together in its batch; it takes its
requests' events from the bridge before the window sees them, and serves the
model the window has loaded. Nothing of Qt reaches it: its status comes back
through a queued signal.
"""

from __future__ import annotations

from PySide6.QtCore import QObject, Qt, Signal, Slot

from app.engine_bridge import EngineBridge
from app.model_state import ModelState
from app.settings import Settings
from app.window.server_settings import NEEDS_KEY, server_host
from engine import (
    ApiSession,
    EngineError,
    LocalServer,
    ServerStatus,
    ServerUnavailable,
    host_names,
)

JOIN_TIMEOUT_S = 10.0


def status_text(status: ServerStatus) -> str:
    """The status line: "Local server on http://127.0.0.1:1234", "…answering…", or ""."""
    if status.state == "failed":
        return status.message
    if status.state == "answering":
        waiting = status.in_flight - 1
        more = f" ({waiting} more waiting)" if waiting > 0 else ""
        return f"Local server: answering a request…{more}"
    if status.state == "waiting":
        requests = "a request waits" if status.in_flight == 1 else \
            f"{status.in_flight} requests wait"
        return f"Local server: {requests} for the engine…"
    if status.state == "loading":
        return f"Local server on {status.url}: {status.message or 'waiting for the model'}"
    if status.state == "ready":
        return f"Local server on {status.url}"
    return ""


class LocalServerHost(QObject):
    """Owns the app's local server and follows the settings.

    Args:
        bridge: the app's engine bridge (its worker is the server's).
        settings: where the server's settings are read.
        model_state: the model the window has loaded, served as it changes.

    Signals:
        statusChanged(ServerStatus): on the GUI thread, whenever it changes.
        errorRaised(str): the server cannot run (port in use): for the banner.
    """

    statusChanged = Signal(object)
    errorRaised = Signal(str)
    _relay = Signal()

    def __init__(self, bridge: EngineBridge, settings: Settings, model_state: ModelState,
                 parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.bridge, self.settings, self.model_state = bridge, settings, model_state
        self.server: LocalServer | None = None
        self.status = ServerStatus("off")
        # host, port, key, KV mode, allowed host names
        self._config: tuple[str, int, str, tuple[str, ...]] | None = None
        self._shared = False  # the worker keeps API sessions and chats apart until told
        self._retired: list[LocalServer] = []  # stopped, still owed their requests' endings
        self._relay.connect(self._refresh, Qt.ConnectionType.QueuedConnection)
        model_state.stateChanged.connect(self._on_model_state)

    def apply(self) -> None:
        """Follow the settings: start, restart (port, network, key or host names
        changed) or stop; a new default KV mode applies to the running server."""
        s = self.settings
        if s.server_share_chats != self._shared:
            self._shared = s.server_share_chats
            self.bridge.worker.share_chats_with_api(self._shared)
        config = ((server_host(s.server_allow_network), s.server_port, s.server_api_key,
                   s.server_allowed_hosts) if s.server_enabled else None)
        if config == self._config and self.server is not None and self.server.running:
            self.server.set_default_mode(s.default_mode)
            return
        self.stop()
        self._config = config
        if config is None:
            return
        host, port, key, names = config
        if host != server_host(False) and not key:
            self._failed(ServerStatus("failed", message=NEEDS_KEY))
            return
        try:
            allowed = host_names(names)
        except EngineError as error:
            self._failed(ServerStatus("failed", message=str(error)))
            return
        server = LocalServer(self.bridge.worker, host=host, port=port, api_key=key or None,
                             kv_mode=s.default_mode, on_status=lambda _status: self._relay.emit(),
                             allowed_hosts=allowed)
        self.bridge.add_claim(server.claim)
        try:
            server.start()
        except ServerUnavailable as error:
            self.bridge.remove_claim(server.claim)
            self._failed(ServerStatus("failed", server.url, 0, str(error)))
            return
        self.server = server
        info = self.model_state.info
        if self.model_state.ready and info is not None:
            server.model_loaded(self.model_state.path, info)
        self._refresh()

    def worker_replaced(self) -> None:
        """The bridge runs a new worker (another machine set): the server moves to it."""
        self._shared = False  # a new worker keeps API sessions and chats apart until told
        self.stop()
        self.apply()

    def _failed(self, status: ServerStatus) -> None:
        self._set(status)
        self.errorRaised.emit(status.message)

    def request_stop(self) -> None:
        """Ask the running server to end (the app is quitting); returns at once."""
        if self.server is not None:
            self.server.request_stop()

    def stop(self, timeout: float = JOIN_TIMEOUT_S) -> bool:
        """Stop the server and wait for its thread; True once none runs."""
        server, self.server = self.server, None
        done = True
        if server is not None:
            server.request_stop()
            done = server.join(timeout)
            self._retired.append(server)
        # A stopped server's requests still end on the worker: its claim takes them
        # until they have, so no API event reaches the window.
        for old in [s for s in self._retired if s.bridge.idle]:
            self.bridge.remove_claim(old.claim)
            self._retired.remove(old)
        self._set(ServerStatus("off"))
        return done

    def sessions(self) -> tuple[ApiSession, ...]:
        """The API sessions the server holds now."""
        return self.server.bridge.sessions() if self.server is not None else ()

    @property
    def running(self) -> bool:
        """Whether the server is listening."""
        return self.server is not None and self.server.running

    def _on_model_state(self, _text: str, ready: bool) -> None:
        if self.server is None:
            return
        info = self.model_state.info
        if ready and info is not None:
            self.server.model_loaded(self.model_state.path, info)
        else:
            self.server.model_changing()

    @Slot()
    def _refresh(self) -> None:
        if self.server is not None:
            self._set(self.server.status())

    def _set(self, status: ServerStatus) -> None:
        if status != self.status:
            self.status = status
            self.statusChanged.emit(status)
