"""The snapshot manifest: sealing, reading and listing (no MLX).

The manifest is JSON with its own sha256 (over its canonical form without that
field), so a changed byte anywhere in it, token ids included, is caught before
anything in it is trusted. Listing reads manifests only: the data file's
checksum is checked on reopen.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine import paths
from engine.snapshots import files

FORMAT = "longleaf-kv-snapshot"
# 2: the model fingerprint covers every weight byte (``engine.snapshots.fingerprint``);
# version 1 snapshots cannot be checked against the weights and are set aside.
FORMAT_VERSION = 2
_SELF_HASH = "manifest_sha256"
SET_ASIDE = "set-aside"


@dataclass(frozen=True)
class SnapshotInfo:
    """What the "Stored KV" panel shows of one snapshot (plain values)."""

    name: str
    tokens: int
    mode: str  # as the manifest spells it: a newer version's mode is listed all the same
    page_size: int
    kv_bytes: int
    disk_bytes: int
    created: float
    last_used: float
    model: str
    rotation: str | None = None  # the rows' rotation (engine.cache.rotation); None: as given
    model_digest: str = ""  # the weights' fingerprint it was stored with ("": none recorded)


def canonical(manifest: dict[str, Any]) -> bytes:
    """The manifest's bytes in one fixed form (sorted keys, no spaces)."""
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()


def sealed(manifest: dict[str, Any]) -> bytes:
    """The manifest's bytes with its own sha256 added, as written to disk."""
    digest = hashlib.sha256(canonical(manifest)).hexdigest()
    return canonical({**manifest, _SELF_HASH: digest})


class Corrupt(Exception):
    """A manifest that fails its own checksum or names no data file of its own."""


def read_manifest(path: Path) -> dict[str, Any]:
    """The manifest at ``path`` after checking its own hash.

    Raises:
        Corrupt: its bytes are not a manifest that checks out.
        OSError: the disk would not give them (no verdict on the snapshot: a
            failing or locked disk says nothing about what it holds).
    """
    raw = path.read_bytes()
    try:
        manifest = json.loads(raw)
        claimed = manifest.pop(_SELF_HASH)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise Corrupt(f"unreadable manifest ({error})") from error
    if hashlib.sha256(canonical(manifest)).hexdigest() != claimed:
        raise Corrupt("manifest checksum mismatch")
    data_file = manifest.get("data_file")
    name = path.name[: -len(files.MANIFEST_SUFFIX)]
    if not (isinstance(data_file, str) and data_file.startswith(name + ".")
            and data_file.endswith(files.DATA_SUFFIX) and "/" not in data_file
            and os.sep not in data_file):
        raise Corrupt("manifest names no data file of its own")
    return manifest


def remove_snapshot(directory: Path, name: str) -> None:
    """Delete a snapshot's manifest first (so it is never half-trusted), then its data."""
    manifest = files.manifest_path(directory, name)
    files.remove(manifest)
    files.remove(*data_files(directory, name))


def set_aside(directory: Path, name: str) -> None:
    """Move snapshot ``name`` into the ``set-aside`` folder: kept, never reused.

    A snapshot set aside earlier under the same name is replaced. Set-aside files
    count against the disk budget and are the first to go (``SnapshotStore.evict``).
    """
    aside = paths.private_dir(directory / SET_ASIDE)
    remove_snapshot(aside, name)
    manifest = files.manifest_path(directory, name)
    if manifest.exists():  # first: the folder never holds a manifest without its data
        os.replace(manifest, aside / manifest.name)
    for path in data_files(directory, name):
        os.replace(path, aside / path.name)
    files.fsync_dir(directory)


def data_files(directory: Path, name: str) -> list[Path]:
    """Every data file of snapshot ``name`` (the current one and any orphans)."""
    prefix = f"{name}."
    return [
        p for p in directory.glob(f"{name}.*{files.DATA_SUFFIX}")
        if p.name.startswith(prefix) and p.name.count(".") == name.count(".") + 2
    ]


# -- listing --------------------------------------------------------------------


def snapshot_info(directory: str | Path, name: str) -> SnapshotInfo | None:
    """The stored snapshot ``name``, or None if there is none (or its manifest is bad).

    Reads the manifest only; the data file's checksum is checked on reopen.
    """
    folder = Path(directory)
    path = files.manifest_path(folder, name)
    try:
        manifest = read_manifest(path)
        stat = path.stat()
        data_bytes = (folder / manifest["data_file"]).stat().st_size
        return SnapshotInfo(
            name=name,
            tokens=len(manifest["tokens"]),
            mode=manifest["mode"],
            page_size=int(manifest["page_size"]),
            kv_bytes=int(manifest["kv_bytes"]),
            disk_bytes=data_bytes + stat.st_size,
            created=float(manifest["created"]),
            last_used=stat.st_mtime,
            model=str((manifest.get("model") or {}).get("name", "")),
            rotation=manifest.get("rotation"),
            model_digest=str((manifest.get("model") or {}).get("digest", "")),
        )
    except (Corrupt, OSError, KeyError, TypeError, ValueError):
        return None


def list_snapshots(directory: str | Path) -> list[SnapshotInfo]:
    """Every readable snapshot in ``directory``, most recently used first."""
    folder = Path(directory)
    if not folder.is_dir():
        return []
    found = []
    for path in folder.glob(f"*{files.MANIFEST_SUFFIX}"):
        name = path.name[: -len(files.MANIFEST_SUFFIX)]
        if name.startswith(files.TEMP_MARK):
            continue
        try:
            info = snapshot_info(folder, name)
        except ValueError:  # not a name this module writes
            continue
        if info is not None:
            found.append(info)
    return sorted(found, key=lambda i: i.last_used, reverse=True)


def delete_snapshot(directory: str | Path, name: str) -> bool:
    """Remove snapshot ``name``; returns whether anything was there."""
    folder = Path(directory)
    existed = files.manifest_path(folder, name).exists() or bool(data_files(folder, name))
    if existed:
        remove_snapshot(folder, name)
    return existed
