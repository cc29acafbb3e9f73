"""Longleaf's MLX engine: paged, quantized KV cache, models, sessions.

This package never imports Qt; the app talks to it through plain Python
values (see ``engine.events``). The names below are the small public API the
app uses; each is imported on first use, so ``import engine`` stays cheap and
does not load MLX until something needs it.

- Models: ``DEMO`` (the path that names the built-in demo model), ``discover_models``,
  ``inspect_model_dir`` (describe without loading, a ``ModelInfo``; the CLI's),
  ``download_model`` (from the Hub, resumable), ``RECOMMENDED_MODELS`` and
  ``full_context_costs`` (what a model's KV takes at full context, per mode).
- The worker: ``EngineWorker`` (load a model, open a session with a KV mode,
  ingest, chat, cancel, stats), driven from any thread through events; over other
  Macs, ``RemoteWorker`` with the same surface (``Worker``), where ``can_split``.
- Events: ``Event`` (any of them), ``TokenChunk``, ``IngestProgress``, ``StatsSample``
  (with a pipeline's ``RankShare`` per machine), ``LayerPages``, ``Finished``,
  ``Failed``, ``ModelLoaded``, ``SessionOpened``, ``GenerationStats``, ``Notice``,
  ``AnswerWaiting``, ``WaitEnded``, ``StoredKv``, ``PipelineLost``,
  ``QualityProgress``, ``QualityChecked`` (with its ``QualityReceipt``).
- Errors: ``EngineError`` and the subclasses the app catches; the others
  (``MemoryShort``, ``MachineShort``, ``TemplateRefused``) reach it as a
  ``Failed.error_type``.
- Values: ``SamplingParams``, ``MODES``, ``DEFAULT_READ_SHARE`` (and
  ``check_read_share``), ``read_document`` (and the
  ``file_patterns`` it reads), ``data_dir``,
  ``private_file``, ``private_dir`` (create a user-only file or folder).
- What else the app uses: the local API server it hosts (``LocalServer``,
  ``ApiSession``, ``ServerStatus``), other Macs (``read_hostfile``,
  ``check_hosts``, ``fits_here``), read-time estimates (``prefill_rate``,
  ``ChunkTiming``, ``PrefillRate``), stored KV (``SnapshotStore``,
  ``SnapshotInfo``, ``MAX_DEFAULT_BUDGET``), ``disk`` (a failed write in words)
  and ``human_bytes`` with its ``GB``. ``__all__`` is the complete list;
  ``tests/app/test_engine_facade.py`` holds the app to it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from engine.paths import use_private_temp_dir

# Before anything imports MLX: its CPU backend compiles kernels into $TMPDIR and
# loads whatever libraries it finds there, so that folder must be the user's own.
# Every Longleaf process (app, CLI, bench, server, the ranks and children they
# start, which inherit TMPDIR) imports this package first.
use_private_temp_dir()

_PUBLIC = {
    "EngineWorker": "engine.runtime.worker",
    "RemoteWorker": "engine.distributed.remote",
    "can_split": "engine.models.split",
    "DEMO": "engine.models",
    "MAX_PORT": "engine.server.listen",
    **{name: "engine.models.discovery" for name in (
        "discover_models", "DiscoveredModel", "Discovery", "SkippedModel")},
    **{name: "engine.models.info" for name in ("inspect_model_dir", "ModelInfo")},
    "download_model": "engine.models.download",
    "DownloadProgress": "engine.models.download_transfer",
    "RECOMMENDED_MODELS": "engine.models.catalog",
    "RecommendedModel": "engine.models.catalog",
    "ModeCost": "engine.memory.model_costs",
    "full_context_costs": "engine.memory.model_costs",
    **{name: "engine.documents.reader" for name in ("read_document", "file_patterns")},
    "SamplingParams": "engine.session.sampling",
    "DEFAULT_READ_SHARE": "engine.session.batch",
    "WAITED_BEHIND": "engine.session.batch",
    **{name: "engine.session.session" for name in (
        "MAX_CHUNK", "MAX_PAGE_SIZE", "outside_pages_reserve")},
    "check_read_share": "engine.session.batch",
    **{name: "engine.cache.modes" for name in (
        "MODES", "DEFAULT_MODE", "REFERENCE", "KvMode", "parse_mode")},
    "Worker": "engine.runtime.interface",
    "data_dir": "engine.paths",
    "private_file": "engine.paths",
    "private_dir": "engine.paths",
    "SnapshotStore": "engine.snapshots.snapshot_store",
    "default_budget": "engine.snapshots.snapshot_store",
    "snapshot_info": "engine.snapshots.manifest",
    "snapshots_dir": "engine.paths",
    "server_snapshots_dir": "engine.paths",
    "fits_here": "engine.distributed.fallback",
    "read_hostfile": "engine.distributed.launch",
    **{name: "engine.distributed.hosts" for name in ("check_hosts", "HostCheck",
                                                    "rank_zero_problem")},
    "ChunkTiming": "engine.memory.prefill_rate",
    "PrefillRate": "engine.memory.prefill_rate",
    "FitReport": "engine.memory.fit",
    "system_readings": "engine.memory.stats",
    "generation_defaults": "engine.models.generation_defaults",
    "HubUnreachable": "engine.models.download_plan",
    "API_SESSION_PREFIX": "engine.runtime.held_sessions",
    "TurnOverhead": "engine.session.prompt_ids",
    "SnapshotInfo": "engine.snapshots.manifest",
    "MAX_DEFAULT_BUDGET": "engine.snapshots.snapshot_store",
    "GB": "engine.format",
    "human_bytes": "engine.format",
    "host_names": "engine.server.app",
    "ApiSession": "engine.server.inprocess",
    "LocalServer": "engine.server.inprocess",
    "ServerStatus": "engine.server.inprocess",
    "ServerUnavailable": "engine.server.listen",
    **{name: "engine.events" for name in (
        "Event", "TokenChunk", "IngestProgress", "StatsSample", "LayerPages", "GenerationStats",
        "Finished", "Failed", "ModelLoaded", "SessionOpened", "Notice", "AnswerWaiting", "StoredKv",
        "QualityReceipt", "QualityProgress", "QualityChecked", "PipelineLost", "RankShare",
        "WaitEnded", "renumbered", "request_id_of")},
    **{name: "engine.errors" for name in (
        "EngineError", "UnsupportedModeError", "KvBudgetExceeded", "ContextTooLong",
        "ModelLoadError", "DocumentError", "DocumentTooLong", "Cancelled", "InsufficientMemory",
        "MemoryPressure", "DiskFault", "EngineStopped")},
}

# Modules the app uses as a whole: their names are short only inside them.
_MODULES = {"disk": "engine.disk", "prefill_rate": "engine.memory.prefill_rate"}

__all__ = [
    "API_SESSION_PREFIX",
    "DEFAULT_MODE",
    "DEFAULT_READ_SHARE",
    "DEMO",
    "GB",
    "MAX_CHUNK",
    "MAX_DEFAULT_BUDGET",
    "MAX_PAGE_SIZE",
    "MAX_PORT",
    "MODES",
    "RECOMMENDED_MODELS",
    "REFERENCE",
    "WAITED_BEHIND",
    "AnswerWaiting",
    "ApiSession",
    "Cancelled",
    "ChunkTiming",
    "ContextTooLong",
    "DiscoveredModel",
    "Discovery",
    "DiskFault",
    "DocumentError",
    "DocumentTooLong",
    "DownloadProgress",
    "EngineError",
    "EngineStopped",
    "EngineWorker",
    "Event",
    "Failed",
    "Finished",
    "FitReport",
    "GenerationStats",
    "HostCheck",
    "HubUnreachable",
    "IngestProgress",
    "InsufficientMemory",
    "KvBudgetExceeded",
    "KvMode",
    "LayerPages",
    "LocalServer",
    "MemoryPressure",
    "ModeCost",
    "ModelInfo",
    "ModelLoadError",
    "ModelLoaded",
    "Notice",
    "PipelineLost",
    "PrefillRate",
    "QualityChecked",
    "QualityProgress",
    "QualityReceipt",
    "RankShare",
    "RecommendedModel",
    "RemoteWorker",
    "SamplingParams",
    "ServerStatus",
    "ServerUnavailable",
    "SessionOpened",
    "SkippedModel",
    "SnapshotInfo",
    "SnapshotStore",
    "StatsSample",
    "StoredKv",
    "TokenChunk",
    "TurnOverhead",
    "UnsupportedModeError",
    "WaitEnded",
    "Worker",
    "can_split",
    "check_hosts",
    "check_read_share",
    "data_dir",
    "default_budget",
    "discover_models",
    "disk",
    "download_model",
    "file_patterns",
    "fits_here",
    "full_context_costs",
    "generation_defaults",
    "host_names",
    "human_bytes",
    "inspect_model_dir",
    "outside_pages_reserve",
    "parse_mode",
    "prefill_rate",
    "private_dir",
    "private_file",
    "rank_zero_problem",
    "read_document",
    "read_hostfile",
    "renumbered",
    "request_id_of",
    "server_snapshots_dir",
    "snapshot_info",
    "snapshots_dir",
    "system_readings",
]


def __getattr__(name: str) -> Any:
    if name in _MODULES:
        value = importlib.import_module(_MODULES[name])
        globals()[name] = value
        return value
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:
    from engine import disk
    from engine.cache.modes import DEFAULT_MODE, MODES, REFERENCE, KvMode, parse_mode
    from engine.distributed.fallback import fits_here
    from engine.distributed.hosts import HostCheck, check_hosts, rank_zero_problem
    from engine.distributed.launch import read_hostfile
    from engine.distributed.remote import RemoteWorker
    from engine.documents.reader import file_patterns, read_document
    from engine.errors import (
        Cancelled,
        ContextTooLong,
        DiskFault,
        DocumentError,
        DocumentTooLong,
        EngineError,
        EngineStopped,
        InsufficientMemory,
        KvBudgetExceeded,
        MemoryPressure,
        ModelLoadError,
        UnsupportedModeError,
    )
    from engine.events import (
        AnswerWaiting,
        Event,
        Failed,
        Finished,
        GenerationStats,
        IngestProgress,
        LayerPages,
        ModelLoaded,
        Notice,
        PipelineLost,
        QualityChecked,
        QualityProgress,
        QualityReceipt,
        RankShare,
        SessionOpened,
        StatsSample,
        StoredKv,
        TokenChunk,
        WaitEnded,
        renumbered,
        request_id_of,
    )
    from engine.format import GB, human_bytes
    from engine.memory import prefill_rate
    from engine.memory.fit import FitReport
    from engine.memory.model_costs import ModeCost, full_context_costs
    from engine.memory.prefill_rate import ChunkTiming, PrefillRate
    from engine.memory.stats import system_readings
    from engine.models import DEMO
    from engine.models.catalog import RECOMMENDED_MODELS, RecommendedModel
    from engine.models.discovery import DiscoveredModel, Discovery, SkippedModel, discover_models
    from engine.models.download import download_model
    from engine.models.download_plan import HubUnreachable
    from engine.models.download_transfer import DownloadProgress
    from engine.models.generation_defaults import generation_defaults
    from engine.models.info import ModelInfo, inspect_model_dir
    from engine.models.split import can_split
    from engine.paths import (
        data_dir,
        private_dir,
        private_file,
        server_snapshots_dir,
        snapshots_dir,
    )
    from engine.runtime.held_sessions import API_SESSION_PREFIX
    from engine.runtime.interface import Worker
    from engine.runtime.worker import EngineWorker
    from engine.server.app import host_names
    from engine.server.inprocess import ApiSession, LocalServer, ServerStatus
    from engine.server.listen import MAX_PORT, ServerUnavailable
    from engine.session.batch import DEFAULT_READ_SHARE, WAITED_BEHIND, check_read_share
    from engine.session.prompt_ids import TurnOverhead
    from engine.session.sampling import SamplingParams
    from engine.session.session import MAX_CHUNK, MAX_PAGE_SIZE, outside_pages_reserve
    from engine.snapshots.manifest import SnapshotInfo, snapshot_info
    from engine.snapshots.snapshot_store import MAX_DEFAULT_BUDGET, SnapshotStore, default_budget
