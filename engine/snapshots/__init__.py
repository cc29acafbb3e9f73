"""KV snapshots on disk: a conversation's cache stored once and reopened.

``save_snapshot``/``load_snapshot`` work on an ``engine.session.session.Session`` from the
engine worker thread; :class:`SnapshotStore` keeps a folder of them under a disk
budget. See ``engine.snapshots.snapshot`` for the format and the reopen rules.
"""

from engine.snapshots.fingerprint import model_fingerprint
from engine.snapshots.layers import can_convert, convert_rows
from engine.snapshots.manifest import (
    FORMAT_VERSION,
    SnapshotInfo,
    delete_snapshot,
    list_snapshots,
    snapshot_info,
)
from engine.snapshots.snapshot import (
    SnapshotError,
    SnapshotRejected,
    load_snapshot,
    save_snapshot,
)
from engine.snapshots.snapshot_store import SnapshotStore, default_budget, default_snapshot_dir

__all__ = [
    "FORMAT_VERSION",
    "SnapshotError",
    "SnapshotInfo",
    "SnapshotRejected",
    "SnapshotStore",
    "can_convert",
    "convert_rows",
    "default_budget",
    "default_snapshot_dir",
    "delete_snapshot",
    "list_snapshots",
    "load_snapshot",
    "model_fingerprint",
    "save_snapshot",
    "snapshot_info",
]
