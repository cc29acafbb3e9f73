"""Save a session's KV cache to disk and reopen it: the snapshot format.

A snapshot is ``NAME.json`` (the manifest: token ids, mode, page size, format
version, rotation, model fingerprint, per-layer records, the session's
checkpoints, byte counts, the data file's sha256 and the manifest's own sha256)
plus ``NAME.<nonce>.safetensors`` (the pages exactly as held, every other
layer's arrays and the checkpoints' arrays). The manifest is written last and is
the commit point (see ``engine.snapshots.files``).

Reopen restores the longest stored prefix of the new prompt. Paged layers trim
to any length; linear-attention and wrapped sliding-window layers cannot, so
when the prompt leaves the stored ids before their end, those layers come from
the newest stored checkpoint (``engine.session.checkpoints``: taken at message
boundaries and prefill ends) at or before that point, and the paged layers are
cut there too. With no such checkpoint the snapshot is not used.

Reopen trusts nothing it has not checked: the manifest's own hash and shape,
the format version, the model fingerprint (every weight byte), the data file's
size and sha256, each layer's dtypes and shapes against the manifest, and after
restoring, that the cache holds the tokens it claims. A snapshot of other
weights or of an older format (which cannot be checked against the weights) is
set aside (moved into ``set-aside/``, never tried again); one of a newer format
is refused and kept; a corrupt, incomplete or inconsistent one, or one whose
restore fails in any way, is removed. Either way the caller gets a
:class:`SnapshotRejected` whose message is one line for the user, and the
session holds nothing from it.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import mlx.core as mx

from engine import disk, paths
from engine.cache import adapter
from engine.cache.modes import parse_mode
from engine.cache.rotation import rotation_for
from engine.errors import EngineError, KvBudgetExceeded
from engine.session.prompt_ids import common_prefix
from engine.snapshots import files, tensors
from engine.snapshots.fingerprint import session_code, session_fingerprint, session_model_dir
from engine.snapshots.layers import (
    LayerMismatch,
    can_convert,
    capture,
    capture_checkpoints,
    checkpoint_states,
    restore,
    rotation_id,
)
from engine.snapshots.manifest import (
    FORMAT,
    FORMAT_VERSION,
    Corrupt,
    data_files,
    read_manifest,
    remove_snapshot,
    sealed,
    set_aside,
)

if TYPE_CHECKING:
    from engine.cache.modes import KvMode

log = logging.getLogger(__name__)


class SnapshotSession(Protocol):
    """What saving and loading a snapshot reads and sets of a session.

    ``engine.session.session.Session`` is one; a stand-in around a bare cache
    (no model loaded, as the snapshot benchmark builds) is another. Its model
    folder is found by ``session_model_dir``; its ``checkpoints``, where it has
    them, are stored and restored too.
    """

    tokens: list[int]

    @property
    def cache(self) -> list[Any]: ...

    @property
    def mode(self) -> KvMode: ...

    @property
    def page_size(self) -> int: ...

    def reset(self) -> None:
        """Drop every held token and page (a failed load leaves the session empty)."""


class SnapshotError(EngineError):
    """A snapshot could not be written."""


class SnapshotRejected(EngineError):
    """A stored snapshot was not used; the message is a one-line notice for the user.

    Attributes:
        reason: "model" (another model), "format" (another format version or a
            rotation this version does not know), "corrupt" (incomplete or
            damaged), "mode" (a higher precision than stored needs a re-read),
            "diverged" (the conversation differs inside the snapshot before any
            stored checkpoint and this model's layers cannot rewind),
            "code" (computed by another MLX or mlx-lm model code), "budget" (the
            pages do not fit the KV budget), "unreadable" (the disk failed to read it
            now; kept) or "changed" (stored again while it was read; kept).
        removed: whether the snapshot's files were deleted.
        set_aside: whether they were moved into the ``set-aside`` folder.
    """

    def __init__(
        self, message: str, *, reason: str, removed: bool = False, set_aside: bool = False
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.removed = removed
        self.set_aside = set_aside


# -- save ----------------------------------------------------------------------


def _kv_bytes(records: list[dict]) -> int:
    return sum(r["bytes"] for r in records)


def save_snapshot(
    session: SnapshotSession,
    directory: str | Path,
    name: str,
    *,
    before_write: Callable[[int], None] | None = None,
) -> Path:
    """Store the session's cache and held token ids as snapshot ``name``.

    Call from the engine worker thread (it evaluates MLX arrays). Replaces an
    earlier snapshot of the same name atomically: a crash at any point leaves
    either the old snapshot or the new one, never a mix.

    Args:
        session: the session to store (:class:`SnapshotSession`: cache, tokens, mode,
            page size and the folder of its model, see ``session_model_dir``).
        directory: the snapshot folder (created owner-only if missing).
        name: the snapshot's name, e.g. the chat's id.
        before_write: called with the bytes about to be written, before any
            file is touched (a disk budget evicts or refuses here).

    Returns:
        The manifest's path.

    Raises:
        SnapshotError: the session holds nothing, or its cache and ids disagree.
        EngineError: the model folder cannot be fingerprinted.
    """
    folder = paths.private_dir(directory)
    manifest_path = files.manifest_path(folder, name)
    tokens = [int(t) for t in session.tokens]
    if not tokens:
        raise SnapshotError("There is no KV cache to store: the session holds no tokens.")
    if adapter.cache_tokens(session.cache) != len(tokens):
        raise SnapshotError("The session's cache and token ids disagree; not storing it.")
    model_dir = session_model_dir(session)
    fingerprint = session_fingerprint(session)
    # Checkpoints first: a reopen that rewinds to one needs them before the layers.
    arrays: dict[str, mx.array] = {}
    held_checkpoints = getattr(getattr(session, "checkpoints", None), "kept", None) or []
    checkpoints = capture_checkpoints(
        [c for c in held_checkpoints if 0 < c.tokens <= len(tokens)], arrays
    )
    layer_arrays, records = capture(session.cache)
    arrays.update(layer_arrays)
    del layer_arrays  # the writer empties ``arrays``; no other reference may keep a page
    if before_write is not None:
        before_write(sum(a.nbytes for a in arrays.values()) + 16 * len(tokens))
    data_path = folder / files.new_data_name(name)
    try:
        data_sha256 = _write_data(data_path, arrays)
    except OSError as error:
        raise _not_stored(error, folder) from error
    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "name": name,
        "created": time.time(),
        "data_file": data_path.name,
        "data_bytes": data_path.stat().st_size,
        "data_sha256": data_sha256,
        "kv_bytes": _kv_bytes(records),
        "mode": session.mode,
        "page_size": int(session.page_size),
        "rotation": rotation_id(session.cache),
        "model": {"name": model_dir.name, **fingerprint},
        "code": session_code(session),
        "tokens": tokens,
        "layers": records,
        "checkpoints": checkpoints,
    }
    previous = data_files(folder, name)
    try:
        files.write_bytes_atomic(manifest_path, sealed(manifest), label="manifest")
    except BaseException as error:
        # Nothing names the new data now: it goes at once, not at the next start.
        files.discard(data_path)
        if isinstance(error, OSError):
            raise _not_stored(error, folder) from error
        raise
    try:
        files.remove(*[p for p in previous if p != data_path])
    except OSError as error:  # the new snapshot is in force; the sweep takes the rest
        log.info("an earlier data file of %s stays until the next sweep: %s", name, error)
    return manifest_path


def _not_stored(error: OSError, folder: Path) -> SnapshotError:
    """The error a write into ``folder`` that failed with ``error`` raises, in words."""
    fault = disk.fault_of(error, retry="it is stored again when the chat next closes",
                          folder=folder)
    detail = str(fault) if fault is not None else f"{error.strerror or error}."
    return SnapshotError(f"This conversation's KV was not stored. {detail}")


def _write_data(path: Path, arrays: dict[str, mx.array]) -> str:
    """Stream ``arrays`` into ``path`` atomically; the sha256 of the bytes written."""
    temp = files.temp_path(path)
    files.checkpoint("data:start")
    try:
        metadata = {"format": FORMAT, "version": str(FORMAT_VERSION)}
        digest = tensors.write_file(temp, arrays, metadata, files.FILE_MODE)
        files.checkpoint("data:written")
        files.commit(temp, path)
    except BaseException:
        files.discard(temp)
        raise
    files.checkpoint("data:committed")
    return digest


# -- reopen ---------------------------------------------------------------------


def _reject_corrupt(directory: Path, name: str, why: str,
                    data_file: str | None = None) -> SnapshotRejected:
    """Remove snapshot ``name``, found damaged (``why``), and say so; but where its
    manifest now names another data file than ``data_file``, the one read, another
    process saved the chat again meanwhile: that snapshot is whole, and stays."""
    if data_file is not None and _named_data_file(directory, name) not in (None, data_file):
        return SnapshotRejected(
            f"Stored KV for {name!r} was stored again while it was read; the conversation "
            "is read again this time.",
            reason="changed",
        )
    try:
        remove_snapshot(directory, name)
    except OSError as error:  # a read-only disk: it stays, and is not used this time
        return SnapshotRejected(
            f"Stored KV for {name!r} could not be read ({why}); it could not be removed "
            f"either ({error.strerror or error}), and the conversation is read again.",
            reason="corrupt",
        )
    return SnapshotRejected(
        f"Stored KV for {name!r} was incomplete or damaged ({why}); it was removed and "
        "the conversation is read again.",
        reason="corrupt",
        removed=True,
    )


def _named_data_file(directory: Path, name: str) -> str | None:
    """The data file snapshot ``name``'s manifest names now; None when it names none
    or cannot be read."""
    try:
        named = read_manifest(files.manifest_path(directory, name)).get("data_file")
    except (OSError, Corrupt, ValueError, AttributeError):
        return None
    return named if isinstance(named, str) else None


def _unreadable(name: str, error: OSError) -> SnapshotRejected:
    """A read of snapshot ``name`` the disk failed (an external or network disk's
    passing error): no damage to the snapshot, which is kept for the next reopen."""
    return SnapshotRejected(
        f"Stored KV for {name!r} could not be read now ({error.strerror or error}); it is "
        "kept, and the conversation is read again this time.",
        reason="unreadable",
    )


def _set_aside(directory: Path, name: str, message: str, reason: str) -> SnapshotRejected:
    try:
        set_aside(directory, name)
    except OSError as error:  # a read-only disk: it stays where it is, unused
        log.warning("snapshot %s not set aside: %s", name, error)
        return SnapshotRejected(message.replace(" was set aside", " was not used"),
                                reason=reason)
    return SnapshotRejected(message, reason=reason, set_aside=True)


def _check_compatible(
    manifest: dict[str, Any], session: SnapshotSession, name: str, directory: Path
) -> None:
    version = manifest.get("version")
    if manifest.get("format") != FORMAT or not isinstance(version, int):
        raise _reject_corrupt(directory, name, "not a Longleaf KV snapshot")
    if version < FORMAT_VERSION:
        raise _set_aside(
            directory, name,
            "Stored KV from an earlier version of Longleaf cannot be checked against this "
            "model's weights, so it was set aside; the conversation is read again.",
            "format",
        )
    if version > FORMAT_VERSION:
        raise SnapshotRejected(
            f"Stored KV for {name!r} has format version {version}, newer than this "
            f"version's {FORMAT_VERSION}; it is kept, and the conversation is read again.",
            reason="format",
        )
    stored_model = manifest.get("model") or {}
    try:
        digest = session_fingerprint(session)["digest"]
    except EngineError as error:
        raise _uncheckable(name, "this model", error) from error
    stored_split = (stored_model.get("pipeline") or {}).get("split")
    split = (session_fingerprint(session).get("pipeline") or {}).get("split")
    if stored_split != split:
        raise SnapshotRejected(
            f"Stored KV for {name!r} holds the model's layers split as "
            f"{_split_words(stored_split)}; this run has {_split_words(split)}. It is kept "
            "for that split, and the conversation is read again.",
            reason="split",
        )
    if stored_model.get("digest") != digest:
        same_name = stored_model.get("name") == session_model_dir(session).name
        raise _set_aside(
            directory, name,
            "Stored KV from a different version of this model was set aside; the "
            "conversation is read again." if same_name else
            f"Stored KV for {name!r} was made by another model "
            f"({stored_model.get('name', 'unknown')}) and was set aside; the conversation "
            "is read again.",
            "model",
        )
    if manifest.get("code") != _code(session, name):
        raise _set_aside(
            directory, name,
            f"Stored KV for {name!r} was computed by another version of MLX or of "
            "mlx-lm's code for this model, which may compute other values, so it was set "
            "aside; the conversation is read again.",
            "code",
        )
    try:
        rotation_for(manifest.get("rotation"), 4, 0)  # raises for a rotation unknown here
    except EngineError:
        raise SnapshotRejected(
            f"Stored KV for {name!r} uses row rotation {manifest.get('rotation')!r}, which "
            "this version cannot read; the conversation is read again.",
            reason="format",
        ) from None
    stored_mode = parse_mode(manifest["mode"])
    if stored_mode != session.mode and not adapter.converts_modes(session.cache):
        raise SnapshotRejected(
            f"Stored KV for {name!r} is {stored_mode}; this chat runs {session.mode} on "
            "mlx-lm's own cache, which cannot convert it, so the conversation is read again.",
            reason="mode",
        )
    if not can_convert(stored_mode, session.mode):
        raise SnapshotRejected(
            f"Stored KV for {name!r} is {stored_mode}; {session.mode} is a higher "
            "precision and needs the conversation read again.",
            reason="mode",
        )


def _code(session: SnapshotSession, name: str) -> dict[str, str]:
    """``session_code`` of ``session``, or why stored KV cannot be checked against it."""
    try:
        return session_code(session)
    except EngineError as error:
        raise _uncheckable(name, "this model's code", error) from error


def _uncheckable(name: str, against: str, error: EngineError) -> SnapshotRejected:
    # This model's files, not the snapshot, are the problem: the snapshot stays.
    return SnapshotRejected(
        f"Stored KV for {name!r} cannot be checked against {against} ({error}); it is "
        "kept, and the conversation is read again.",
        reason="model",
    )


def _split_words(split: list[list[int]] | None) -> str:
    """A pipeline split in words: "layers 0-2 on rank 1, layer 3 on rank 0"."""
    if not split:
        return "all layers on one machine"
    spans = sorted(enumerate(split), key=lambda item: item[1][0])
    return ", ".join((f"layer {start}" if end - start == 1 else f"layers {start}-{end - 1}")
                     + f" on rank {rank}" for rank, (start, end) in spans)


def _check_shape(manifest: dict[str, Any]) -> None:
    """Raise ValueError unless the manifest's records agree with its token list."""
    tokens = manifest["tokens"]
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens) or not tokens:
        raise ValueError("its token ids are not a list of integers")
    parse_mode(manifest["mode"])  # raises for a mode this version lacks
    page_size = manifest["page_size"]
    if type(page_size) is not int or page_size <= 0:
        raise ValueError(f"page size {page_size!r}")
    for record in manifest["layers"]:
        if record["kind"] == "paged":
            # Saved only when the cache held exactly the listed tokens.
            if record["offset"] != len(tokens):
                raise ValueError(f"layer {record['index']} holds {record['offset']} of "
                                 f"{len(tokens)} tokens")
            if record["pages"] != -(-record["offset"] // page_size):
                raise ValueError(f"layer {record['index']} lists {record['pages']} pages")
        elif record["kind"] != "state":
            raise ValueError(f"layer kind {record['kind']!r}")


def _check_restored(session: SnapshotSession, tokens: int, rotation: str | None) -> None:
    """Raise LayerMismatch unless every layer holds ``tokens`` tokens, in the rotation
    the session had before the restore."""
    held = adapter.cache_tokens(session.cache)
    offsets = {c.offset for c in session.cache
               if isinstance(getattr(c, "offset", None), int)}
    if held != tokens or offsets - {tokens}:
        raise LayerMismatch(f"the cache holds {sorted(offsets)} tokens, not {tokens}")
    if rotation_id(session.cache) != rotation:
        raise LayerMismatch("the restore changed the cache's row rotation")


def _reusable(
    manifest: dict[str, Any], prompt_ids: Sequence[int], keep_last: bool, name: str
) -> tuple[int, int | None]:
    """Stored tokens to restore (0: none), and the stored checkpoint to take the
    non-paged layers from (None: their final state)."""
    stored = manifest["tokens"]
    keep = common_prefix(stored, prompt_ids)
    if keep_last:
        keep = min(keep, len(prompt_ids) - 1)
    rigid = any(r["kind"] == "state" and not r["trimmable"] for r in manifest["layers"])
    if keep <= 0 or keep == len(stored) or not rigid:
        return max(keep, 0), None
    # Linear-attention state cannot rewind: go back to the newest checkpoint the
    # session had taken (message boundaries, prefill ends) at or before the cut.
    checkpoints = manifest.get("checkpoints") or []
    usable = [n for n, c in enumerate(checkpoints) if c["tokens"] <= keep]
    if not usable:
        raise SnapshotRejected(
            f"Stored KV for {name!r} matches the conversation for {keep:,} of its "
            f"{len(stored):,} tokens, and this model's linear-attention or sliding-window "
            "layers cannot rewind that far; the conversation is read again.",
            reason="diverged",
        )
    number = max(usable, key=lambda n: checkpoints[n]["tokens"])
    return checkpoints[number]["tokens"], number


def _restore_checkpoints(
    session: SnapshotSession, manifest: dict[str, Any], arrays: tensors.StoredArrays, tokens: int
) -> None:
    """Give the session back the stored checkpoints it can still rewind to."""
    store = getattr(session, "checkpoints", None)
    records = manifest.get("checkpoints") or []
    if store is None or not records:
        return
    from engine.session.checkpoints import Checkpoint

    for number, record in enumerate(records):
        if record["tokens"] <= tokens:
            states = checkpoint_states(records, number, arrays)
            store.add(Checkpoint(record["tokens"], states, record["boundary"], record["bytes"]))


def _open_data(folder: Path, name: str, manifest: dict[str, Any]) -> tensors.StreamedTensors:
    """The data file, opened to be read and checked in one pass (see ``finish``)."""
    data_file = manifest["data_file"]
    data = folder / data_file
    try:
        size = data.stat().st_size
    except FileNotFoundError:
        raise _reject_corrupt(folder, name, "its data file is missing", data_file) from None
    except OSError as error:
        raise _unreadable(name, error) from error
    if size != manifest.get("data_bytes"):
        raise _reject_corrupt(folder, name, "its data file is truncated", data_file)
    try:
        return tensors.StreamedTensors(data, size)
    except tensors.BadTensors as error:
        raise _reject_corrupt(folder, name, f"unreadable data: {error}", data_file) from error
    except OSError as error:
        raise _unreadable(name, error) from error


def _finish_checked(arrays: tensors.StreamedTensors, manifest: dict[str, Any]) -> None:
    if arrays.finish() != manifest.get("data_sha256"):
        raise tensors.BadTensors("checksum mismatch")


def load_snapshot(
    session: SnapshotSession,
    directory: str | Path,
    name: str,
    prompt_ids: Sequence[int],
    *,
    keep_last: bool = True,
) -> int:
    """Restore the longest prefix of snapshot ``name`` that ``prompt_ids`` starts with.

    Afterwards the session holds that prefix (cache and ``session.tokens``) and
    its next ``chat``/``ingest`` on ``prompt_ids`` ingests only the rest. Pages
    stored in a higher-precision mode than the session's are converted (fp16 to
    q8/q6/q4, q8 to q6/q4, q6 to q4) without any forward pass, and so are pages
    stored in another row rotation than the session's (``engine.cache.rotation``).
    Call from the engine worker thread.

    When the session already holds at least as long a prefix, nothing is read.

    Args:
        session: the session to fill (:class:`SnapshotSession`, normally fresh).
        directory: the snapshot folder.
        name: the snapshot's name.
        prompt_ids: the token ids the session will be asked to continue from.
        keep_last: leave the prompt's last token unfed, as ``Session.chat`` does;
            pass False before ``Session.ingest``.

    Returns:
        The number of prompt tokens the session now holds (0: read everything).

    Raises:
        SnapshotRejected: the snapshot exists but cannot be used; its message is
            the one-line notice to show. Corrupt snapshots are removed first.
    """
    folder = Path(directory)
    held = common_prefix(session.tokens, prompt_ids)
    if keep_last:
        held = min(held, max(len(prompt_ids) - 1, 0))
    manifest_path = files.manifest_path(folder, name)
    if not manifest_path.exists():
        if data_files(folder, name):
            raise _reject_corrupt(folder, name, "its manifest is missing")
        return held
    try:
        manifest = read_manifest(manifest_path)
        _check_compatible(manifest, session, name, folder)
        _check_shape(manifest)
        stored_tokens = len(manifest["tokens"])
        keep, checkpoint = _reusable(manifest, prompt_ids, keep_last, name)
    except SnapshotRejected:
        raise
    except (Corrupt, KeyError, TypeError, ValueError, IndexError, AttributeError,
            EngineError) as error:
        raise _reject_corrupt(folder, name, str(error)) from None
    if keep <= held:
        return held
    rotation = rotation_id(session.cache)
    # Restored while it is read and hashed, one layer's arrays at a time; nothing
    # of it is kept unless the whole file's checksum then matches.
    arrays = _open_data(folder, name, manifest)
    try:
        states = None
        if checkpoint is not None:
            states = checkpoint_states(manifest["checkpoints"], checkpoint, arrays)
        restore(
            session.cache, manifest["layers"], arrays, tokens=keep, total=stored_tokens,
            stored_mode=parse_mode(manifest["mode"]),
            stored_page_size=int(manifest["page_size"]),
            stored_rotation=manifest.get("rotation"), checkpoint=states,
        )
        _finish_checked(arrays, manifest)
        _check_restored(session, keep, rotation)
        session.tokens = [int(t) for t in manifest["tokens"][:keep]]
        _restore_checkpoints(session, manifest, arrays, keep)
        mx.eval(adapter.eval_targets(session.cache))
    except KvBudgetExceeded as error:
        session.reset()
        raise SnapshotRejected(
            f"Stored KV for {name!r} does not fit the KV budget ({error})", reason="budget"
        ) from error
    except tensors.BadTensors as error:
        session.reset()
        raise _reject_corrupt(folder, name, str(error), manifest["data_file"]) from error
    except OSError as error:
        session.reset()
        raise _unreadable(name, error) from error
    except Exception as error:
        # Whatever a restore raises (a record that lies about its data, a state an
        # mlx-lm cache class refuses) means this snapshot cannot be trusted: it goes,
        # and the conversation is read again rather than a send failing on it.
        session.reset()
        raise _reject_corrupt(folder, name, f"layers do not fit: {error}") from error
    finally:
        arrays.close()
    _touch(manifest_path)
    return keep


def _touch(manifest_path: Path) -> None:
    """Mark the snapshot used now, for least-recently-used eviction.

    A disk that takes no write (read-only) keeps the old time: the snapshot is
    restored all the same, it only looks older to the eviction.
    """
    try:
        os.utime(manifest_path)
    except OSError as error:
        log.info("last use of %s not recorded: %s", manifest_path.name, error)
