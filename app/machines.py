"""Which engine runs the model: a thread of this Mac, or a pipeline over other Macs.

With "Use other Macs" on (Settings) a model that can be split runs on a
``RemoteWorker``: its pipeline group (this Mac first, as rank 0, then the
hostfile's other Macs) runs as child processes with the same requests and
events as the in-process ``EngineWorker``. Every other model, and every model
with the setting off, runs in-process as before. When the group is lost, the
bridge goes back to the in-process engine (the controller then reloads the model
here if it fits).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

from PySide6.QtCore import QObject

from app.engine_bridge import EngineBridge, WorkerFactory
from app.settings import Settings
from engine import Event, Worker

LOCAL = "this Mac"


def can_split_model(path: str) -> bool:
    """Whether the model at ``path`` (a folder, or "demo") can be split across Macs."""
    from engine import can_split

    return path != "demo" and can_split(path)


class Machines(QObject):
    """Chooses the bridge's worker for each model load, and falls back to this Mac.

    ``where`` is what runs now: ``LOCAL``, or the hostfile of a pipeline;
    ``pipeline`` that pipeline's (hostfile, split), None on this Mac alone.

    Args:
        bridge: the app's engine bridge; its own worker factory is the in-process one.
        settings: "Use other Macs" (``pipeline_enabled``, ``pipeline_hostfile``,
            ``pipeline_split``).
        remote_worker: builds a pipeline worker (``RemoteWorker``'s signature);
            None: ``engine.distributed.remote.RemoteWorker``.
    """

    def __init__(self, bridge: EngineBridge, settings: Settings,
                 parent: QObject | None = None,
                 remote_worker: Callable[..., Worker] | None = None) -> None:
        super().__init__(parent)
        self.bridge, self.settings = bridge, settings
        self.remote_worker = remote_worker
        self.where = LOCAL
        self.pipeline: tuple[str, tuple[int, ...] | None] | None = None  # hostfile, split
        # The Use other Macs settings (and hostfile's bytes) the model was last loaded
        # under; a pipeline lost since ran with them all the same.
        self.applied: tuple[str, tuple[int, ...] | None, str] | None = None

    def wanted(self, path: str) -> tuple[str, tuple[int, ...] | None] | None:
        """The pipeline (hostfile, split) that should run ``path``; None: this Mac alone."""
        s = self.settings
        if not (s.pipeline_enabled and s.pipeline_hostfile) or not can_split_model(path):
            return None
        return s.pipeline_hostfile, s.pipeline_split

    def changed_since_load(self, path: str) -> bool:
        """Whether the Use other Macs settings for ``path``, or the hostfile's contents,
        differ from those its last load was made under (a pipeline lost since and
        run here is no change)."""
        return self._settings_key(path) != self.applied

    def _settings_key(self, path: str) -> tuple[str, tuple[int, ...] | None, str] | None:
        pipeline = self.wanted(path)
        if pipeline is None:
            return None
        try:  # a host taken out of the file in place is a change too
            digest = hashlib.sha256(Path(pipeline[0]).read_bytes()).hexdigest()
        except OSError as error:
            digest = f"unreadable: {error.strerror or error}"
        return (*pipeline, digest)

    def prepare(self, path: str) -> bool:
        """Make the bridge's worker the one that should load ``path``; True if it changed.

        Raises:
            EngineError: the hostfile cannot be read (its message).
        """
        self.applied = self._settings_key(path)
        pipeline = self.wanted(path)
        if pipeline == self.pipeline:
            return False
        if pipeline is None:
            self.bridge.replace_worker()
        else:
            self.bridge.replace_worker(self._factory(*pipeline))
        self.pipeline = pipeline
        self.where = LOCAL if pipeline is None else pipeline[0]
        return True

    def fall_back(self) -> bool:
        """Back to the in-process engine after the pipeline was lost; False if none ran."""
        if self.pipeline is None:
            return False
        self.bridge.replace_worker()
        self.pipeline = None
        self.where = LOCAL
        return True

    def _factory(self, hostfile: str, split: tuple[int, ...] | None) -> WorkerFactory:
        from engine import read_hostfile

        ranks = len(read_hostfile(Path(hostfile)))
        from engine import RemoteWorker

        remote_worker = self.remote_worker or RemoteWorker

        def build(on_event: Callable[[Event], None], budget_bytes: int | None,
                  chunk_size: int, read_share: float) -> Worker:
            return remote_worker(on_event, budget_bytes, chunk_size, ranks=ranks,
                                 hostfile=Path(hostfile), split=split, read_share=read_share)

        return build
