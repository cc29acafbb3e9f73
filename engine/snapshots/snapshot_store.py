"""A folder of KV snapshots under a disk budget, evicting the least recently used.

"Used" means written or reopened: both set the manifest's modification time,
which survives restarts without a separate index file to keep consistent.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine import paths
from engine.errors import EngineError
from engine.format import GB, human_bytes
from engine.session.prompt_ids import common_prefix
from engine.snapshots import files
from engine.snapshots.manifest import (
    FORMAT_VERSION,
    SET_ASIDE,
    Corrupt,
    SnapshotInfo,
    data_files,
    delete_snapshot,
    list_snapshots,
    read_manifest,
    snapshot_info,
)
from engine.snapshots.snapshot import SnapshotError, load_snapshot, save_snapshot

if TYPE_CHECKING:
    from engine.session.session import Session

MAX_DEFAULT_BUDGET = 20 * GB
FREE_DISK_SHARE = 0.10


@dataclass(frozen=True)
class Saved:
    """A snapshot written: its manifest, and the snapshots evicted to make room."""

    manifest: Path
    evicted: tuple[str, ...]


def default_snapshot_dir() -> Path:
    """``<data dir>/kv-snapshots``, owner-only."""
    return paths.snapshots_dir()


def default_budget(directory: str | Path, counted_with: Iterable[str | Path] = ()) -> int:
    """The smaller of 20 GB and 10% of the space on ``directory``'s disk that is free
    or already holds stored KV (``directory``'s and ``counted_with``'s): counted as
    free alone, the stored KV itself shrank the budget at every start, and a plain
    restart evicted the oldest chats' KV."""
    folder = paths.private_dir(directory)
    free = shutil.disk_usage(folder).free
    stored = sum(_stored_bytes(Path(other)) for other in (folder, *counted_with))
    return int(min(MAX_DEFAULT_BUDGET, (free + stored) * FREE_DISK_SHARE))


def _stored_bytes(folder: Path) -> int:
    try:
        return sum(p.stat().st_size for p in _folder_files(folder))
    except OSError:  # a folder not made yet, or going away: nothing of it counts
        return 0


class SnapshotStore:
    """Snapshots in one folder, kept within a byte budget.

    Args:
        directory: the folder (created owner-only).
        budget_bytes: most bytes all snapshots may take on disk; None for
            :func:`default_budget`, computed now.
        counted_with: other snapshot folders whose bytes count against this
            budget too (never evicted from here), so that two stores of one
            user (the app's and the server's) stay within one stored-KV budget.
        evictable: which snapshots this store may delete to make room (None: any):
            a guest in another's folder (the CLI in the app's) evicts its own only.
    """

    def __init__(self, directory: str | Path | None = None, budget_bytes: int | None = None,
                 *, counted_with: Iterable[str | Path] = (),
                 evictable: Callable[[str], bool] | None = None):
        self.directory = paths.private_dir(directory or default_snapshot_dir())
        self.counted_with = tuple(Path(p) for p in counted_with)
        self.budget_bytes = self._default_budget() if budget_bytes is None else budget_bytes
        self.evictable = evictable
        self.sweep()

    def set_budget(self, budget_bytes: int | None) -> list[str]:
        """Apply a new budget (None: :func:`default_budget`, computed now).

        Returns:
            The snapshots evicted, least recently used first, to fit a lower budget.
        """
        if budget_bytes is not None and budget_bytes < 0:
            raise EngineError("The stored-KV disk budget cannot be negative.")
        self.budget_bytes = self._default_budget() if budget_bytes is None else budget_bytes
        return self.evict()

    def _default_budget(self) -> int:
        return default_budget(self.directory, self.counted_with)

    # -- reading and writing --------------------------------------------------

    def save(self, session: Session, name: str, *, spare: Collection[str] = ()) -> Saved:
        """Store ``session`` as ``name``, first evicting older snapshots to make room
        (those named in ``spare`` only once no other is left to go).

        Raises:
            SnapshotError: the snapshot alone is larger than the budget (nothing
                is written), or the session holds nothing.
        """
        evicted: list[str] = []

        def make_room(size: int) -> None:
            evicted.extend(self._make_room(size, name, spare))

        manifest = save_snapshot(session, self.directory, name, before_write=make_room)
        return Saved(manifest, tuple(evicted))

    def load(
        self, session: Session, name: str, prompt_ids: Sequence[int], *, keep_last: bool = True
    ) -> int:
        """``load_snapshot`` from this folder; a reopen counts as a use."""
        return load_snapshot(session, self.directory, name, prompt_ids, keep_last=keep_last)

    def by_shared_prefix(
        self, prompt_ids: Sequence[int], *, model_digest: str, at_least: int,
        allow: Callable[[str], bool] | None = None,
    ) -> list[tuple[str, int]]:
        """The snapshots of model ``model_digest`` (those ``allow`` accepts by name,
        when given) that start with at least ``at_least`` tokens of ``prompt_ids``,
        each with the tokens it shares, the most first."""
        found: list[tuple[str, int]] = []
        for path in self.directory.glob(f"*{files.MANIFEST_SUFFIX}"):
            name = path.name[: -len(files.MANIFEST_SUFFIX)]
            if name.startswith(files.TEMP_MARK) or (allow is not None and not allow(name)):
                continue
            try:
                manifest = read_manifest(path)
                if manifest.get("version") != FORMAT_VERSION or (
                        manifest.get("model") or {}).get("digest") != model_digest:
                    continue  # other weights (or unchecked ones) serve no other chat
                shared = common_prefix(manifest["tokens"], prompt_ids)
            except (Corrupt, OSError, KeyError, TypeError):
                continue  # its own reopen removes it; here it just serves no one
            if shared >= at_least:
                found.append((name, shared))
        return sorted(found, key=lambda item: -item[1])

    def info(self, name: str) -> SnapshotInfo | None:
        return snapshot_info(self.directory, name)

    def per_snapshot(self) -> list[SnapshotInfo]:
        """Every snapshot, most recently used first (for the "Stored KV" panel)."""
        return list_snapshots(self.directory)

    def total_bytes(self) -> int:
        """Bytes of every file in the folder, leftovers of interrupted writes and
        snapshots set aside included."""
        return sum(p.stat().st_size for p in self._files())

    def counted_bytes(self) -> int:
        """What counts against the budget: this folder and the ``counted_with`` ones."""
        return self.total_bytes() + sum(_stored_bytes(folder) for folder in self.counted_with)

    def _files(self) -> list[Path]:
        return _folder_files(self.directory)

    def _drop_set_aside(self, incoming: int) -> None:
        """Delete set-aside files this store may evict, oldest first, until
        ``incoming`` more bytes fit."""
        aside = self.directory / SET_ASIDE
        if not aside.is_dir():
            return
        ours = [p for p in aside.iterdir() if p.is_file() and (
            self.evictable is None or self.evictable(files.snapshot_name(p.name)))]
        for path in sorted(ours, key=lambda p: p.stat().st_mtime):
            if self.counted_bytes() + incoming <= self.budget_bytes:
                return
            path.unlink(missing_ok=True)

    # -- removing ----------------------------------------------------------------

    def delete(self, name: str) -> bool:
        """Remove snapshot ``name``, with the pipeline ranks' parts of it on this machine
        and its copy set aside (its ids are the chat's text: a deleted chat leaves none)."""
        for folder in files.rank_folders(self.directory):
            delete_snapshot(folder, name)
        aside = self.directory / SET_ASIDE
        if aside.is_dir():
            delete_snapshot(aside, name)
        return delete_snapshot(self.directory, name)

    def clear(self) -> None:
        """Remove every snapshot and leftover file in the folder."""
        for info in self.per_snapshot():
            self.delete(info.name)
        self.sweep()
        for path in self.directory.iterdir():
            if (path.is_file() and path.name.endswith((files.DATA_SUFFIX, files.MANIFEST_SUFFIX))
                    and files.left_by_dead_writer(path.name)):
                path.unlink(missing_ok=True)
        shutil.rmtree(self.directory / SET_ASIDE, ignore_errors=True)
        for folder in files.rank_folders(self.directory):  # parts no rank 0 manifest names
            shutil.rmtree(folder, ignore_errors=True)

    def evict(self, incoming: int = 0, keep: Iterable[str] = (),
              spare: Collection[str] = ()) -> list[str]:
        """Delete least-recently-used snapshots until ``incoming`` more bytes fit;
        those named in ``spare`` go last (the only copy of an open chat's KV).

        Returns:
            The names deleted, in the order they went.
        """
        self._drop_set_aside(incoming)  # kept only while nothing else needs the room
        keep = set(keep)
        removed: list[str] = []
        oldest_first = [i for i in reversed(self.per_snapshot()) if i.name not in keep
                        and (self.evictable is None or self.evictable(i.name))]
        candidates = sorted(oldest_first, key=lambda info: info.name in spare)  # stable
        while candidates and self.counted_bytes() + incoming > self.budget_bytes:
            victim = candidates.pop(0)
            self.delete(victim.name)
            removed.append(victim.name)
        return removed

    def sweep(self) -> None:
        """Remove what interrupted writes left: temp files, data no manifest names,
        manifests that fail their own checksum (with their data).

        Temp and data files another live process is writing (the CLI, a second
        app, a server on the same folder) are left alone: their names record the
        writer's process id (``files.left_by_dead_writer``).
        """
        named: set[str] = set()
        for path in self.directory.glob(f"*{files.MANIFEST_SUFFIX}"):
            if path.name.startswith(files.TEMP_MARK):
                continue
            try:
                named.add(read_manifest(path)["data_file"])
            except OSError:
                # Unread is no verdict: keep it, and the data it may name.
                named.update(p.name for p in data_files(self.directory,
                                                        path.name[: -len(files.MANIFEST_SUFFIX)]))
            except Corrupt:
                name = path.name[: -len(files.MANIFEST_SUFFIX)]
                for leftover in (path, *data_files(self.directory, name)):
                    files.discard(leftover)  # a read-only disk keeps it: never reused
        for path in self.directory.iterdir():
            stale = path.name.startswith(files.TEMP_MARK) or (
                path.name.endswith(files.DATA_SUFFIX) and path.name not in named
            )
            if path.is_file() and stale and files.left_by_dead_writer(path.name):
                files.discard(path)

    def _make_room(self, size: int, name: str, spare: Collection[str]) -> list[str]:
        if size > self.budget_bytes:
            raise SnapshotError(
                f"This conversation's KV ({human_bytes(size)}) is larger than the stored-KV "
                f"disk budget ({human_bytes(self.budget_bytes)}); it was not stored."
            )
        # The snapshot being replaced frees its bytes once the new one commits;
        # count them as freed now so a same-size rewrite evicts nothing.
        replaced = self.info(name)
        freed = replaced.disk_bytes if replaced else 0
        return self.evict(max(0, size - freed), keep={name}, spare=spare)


def _folder_files(directory: Path) -> list[Path]:
    """The files of a snapshot folder: the snapshots set aside and the parts a
    pipeline's other ranks on this machine store (``files.rank_folders``) included."""
    if not directory.is_dir():
        return []
    inner = [directory / SET_ASIDE, *files.rank_folders(directory)]
    found = [p for p in directory.iterdir() if p.is_file()]
    return found + [p for folder in inner if folder.is_dir()
                    for p in folder.iterdir() if p.is_file()]
