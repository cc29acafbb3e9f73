"""Plan a model download: list the Hub repo, see what is on disk, keep the manifest.

The plan says which files the model needs, which are already whole for this
commit, and how many bytes partial files under ``.longleaf-partial/`` hold,
before any weight byte moves. The manifest in the folder records whether the
folder is whole, so discovery never offers half a model.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx2
from huggingface_hub import HfApi, constants
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import filter_repo_objects

from engine.errors import EngineError
from engine.models.discovery import MANIFEST_NAME, layout_problem, read_manifest
from engine.paths import models_dir

# The files mlx_lm.utils fetches for a model (a test keeps them in sync), less
# "*.py": that is custom code for trust_remote_code, which Longleaf never passes
# to mlx-lm or transformers, so it would be downloaded and never run.
ALLOW_PATTERNS = (
    "*.json",
    "model*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
)
PARTIAL_DIR = ".longleaf-partial"
_DRIVE = re.compile(r"^[A-Za-z]:")


@dataclass(frozen=True)
class RemoteFile:
    """One file of the repo that the model needs."""

    path: str
    size: int
    sha256: str | None
    git_blob_id: str | None


@dataclass(frozen=True)
class DownloadPlan:
    """What a download would fetch, known before any weight byte moves."""

    repo_id: str
    commit: str
    destination: Path
    files: tuple[RemoteFile, ...]
    files_present: frozenset[str]
    total_bytes: int
    bytes_present: int
    bytes_free: int

    @property
    def bytes_needed(self) -> int:
        """Bytes still to fetch: neither in finished files nor in partial ones."""
        return self.total_bytes - self.bytes_present


def destination_for(repo_id: str, models_root: Path | None = None) -> Path:
    """Return the folder a repo downloads into."""
    return (models_root or models_dir()) / repo_id.replace("/", "--")


def plan_download(
    repo_id: str,
    *,
    revision: str = "main",
    token: str | bool | None = None,
    endpoint: str | None = None,
    models_root: Path | None = None,
) -> DownloadPlan:
    """List the repo and work out what is left to fetch and whether it fits.

    Raises:
        EngineError: the repo is missing, private, gated, unreachable, holds
            nothing mlx-lm can load, or lists a file that would land outside the
            model folder.
    """
    endpoint = hub_endpoint(endpoint)
    api = HfApi(endpoint=endpoint, token=token)
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
    except Exception as error:
        raise hub_error(error, repo_id, endpoint, revision) from error
    names = [sibling.rfilename for sibling in info.siblings or ()]
    if (problem := layout_problem(names)) is not None:
        raise EngineError(f"{repo_id} cannot be used: {problem}")
    wanted = set(filter_repo_objects(names, allow_patterns=list(ALLOW_PATTERNS)))
    destination = destination_for(repo_id, models_root)
    for name in sorted(wanted):
        path_inside(destination, name, repo_id=repo_id, endpoint=endpoint)
    files = tuple(
        RemoteFile(
            path=s.rfilename,
            size=s.size if s.size is not None else -1,
            sha256=s.lfs.sha256 if s.lfs else None,
            git_blob_id=None if s.lfs else s.blob_id,
        )
        for s in info.siblings or ()
        if s.rfilename in wanted
    )
    if any(f.size < 0 for f in files):
        raise EngineError(
            f"{endpoint} did not report file sizes for {repo_id}, so the download "
            "cannot be checked against free disk space. Try again later."
        )
    if info.sha is None:
        raise EngineError(
            f"{endpoint} did not say which commit of {repo_id} it would send, so a "
            "download could not be resumed safely. Try again later."
        )
    present = _files_present(destination, files, info.sha)
    going_on = continued(read_manifest(destination), info.sha, files)
    partial = sum(_size(destination / PARTIAL_DIR / f.path) for f in files
                  if f.path not in present and f.path in going_on)
    return DownloadPlan(
        repo_id=repo_id,
        commit=info.sha,
        destination=destination,
        files=files,
        files_present=present,
        total_bytes=sum(f.size for f in files),
        bytes_present=partial + sum(f.size for f in files if f.path in present),
        bytes_free=shutil.disk_usage(_existing_ancestor(destination)).free,
    )


def unsafe_name(name: str) -> str | None:
    """Why a listed file name is not a plain relative path in a model folder, or None."""
    if not name:
        return "it is empty"
    if any(ord(char) < 32 for char in name):
        return "it contains control characters"
    if "\\" in name:
        return "it contains a backslash"
    if name.startswith("/"):
        return "it is an absolute path"
    if _DRIVE.match(name):
        return "it starts with a drive letter"
    parts = name.split("/")
    if "" in parts:
        return "it has an empty part"
    if ".." in parts or "." in parts:
        return "it has a '.' or '..' part"
    if parts[0] == PARTIAL_DIR or parts[0].startswith(MANIFEST_NAME):
        return "Longleaf keeps that name for its own bookkeeping"
    return None


def path_inside(root: Path, name: str, *, repo_id: str, endpoint: str) -> Path:
    """Return ``root / name``, checked (with its partial copy) to stay inside ``root``.

    Raises:
        EngineError: the name is not a plain relative path, or a link already in
            the folder would carry the file (or its partial copy) outside it.
    """
    why = unsafe_name(name)
    if why is None:
        for path in (root / name, root / PARTIAL_DIR / name):
            if not _stays_inside(root, path):
                why = f"a link in {root} leads it to {path.resolve()}"
                break
    if why is not None:
        raise EngineError(
            f"{repo_id} on {host_name(endpoint)} lists a file named {name!r}, which is not a "
            f"plain path inside the model folder ({why}), so Longleaf refused the download. "
            "The Hugging Face Hub never lists such names: check HF_ENDPOINT and any proxy "
            "between you and the Hub."
        )
    return root / name


def _stays_inside(root: Path, path: Path) -> bool:
    """Whether writing ``path`` writes inside ``root``, following the links there now."""
    # resolve() follows the links that exist and keeps the rest as written.
    return not path.is_symlink() and path.parent.resolve().is_relative_to(root.resolve())


class HubUnreachable(EngineError):
    """The Hub could not be reached at all (no network, DNS, refused connection).

    Attributes:
        host: the Hub's host name, for a message in fewer words than this one's.
    """

    def __init__(self, message: str, host: str) -> None:
        super().__init__(message)
        self.host = host


def hub_error(
    error: Exception, repo_id: str, endpoint: str, revision: str = "main"
) -> EngineError:
    """Translate huggingface_hub/httpx failures into messages a user can act on."""
    host = host_name(endpoint)
    if isinstance(error, GatedRepoError):
        return EngineError(
            f"{repo_id} is gated: accept its license on {endpoint}/{repo_id} while "
            "logged in, then add a Hugging Face access token (HF_TOKEN or `hf auth login`)."
        )
    if isinstance(error, RepositoryNotFoundError):
        return EngineError(
            f"No model named {repo_id} on {host}. Check the id (owner/name); if the "
            "repo is private, add a Hugging Face access token that can read it."
        )
    if isinstance(error, RevisionNotFoundError):
        return EngineError(f"{repo_id} has no branch, tag or commit named {revision}.")
    if isinstance(error, RemoteEntryNotFoundError):
        return EngineError(f"A file of {repo_id} vanished from {host}; try again later.")
    if isinstance(error, HFValidationError):
        return EngineError(f"{repo_id!r} is not a Hugging Face repo id (owner/name).")
    if isinstance(error, OfflineModeIsEnabled):
        return EngineError("Downloads are off because HF_HUB_OFFLINE is set.")
    if isinstance(error, HfHubHTTPError):
        status = error.response.status_code if error.response is not None else "?"
        return EngineError(
            f"{host} refused the download of {repo_id} (HTTP {status}). Try again later."
        )
    if isinstance(error, (httpx2.TransportError, OSError)):
        return HubUnreachable(
            f"Cannot reach {host} ({error}). Check your internet connection and try again.",
            host,
        )
    return EngineError(f"Downloading {repo_id} failed: {error}")


def matches_hash(path: Path, remote: RemoteFile) -> bool:
    """Whether a file's sha256 (LFS) or git blob id matches the repo's listing."""
    if remote.sha256:
        digest = hashlib.sha256()
        expected = remote.sha256
    elif remote.git_blob_id:
        digest = hashlib.sha1(f"blob {remote.size}\0".encode(), usedforsecurity=False)
        expected = remote.git_blob_id
    else:
        return True
    with path.open("rb") as source:
        while block := source.read(1 << 20):
            digest.update(block)
    return digest.hexdigest() == expected


def continued(old: dict | None, commit: str, files: tuple[RemoteFile, ...]) -> frozenset[str]:
    """The files whose partial bytes a download of ``commit`` may continue: all of them
    for the commit the folder's manifest ``old`` names, else those whose content (the
    listing's hash) that manifest recorded unchanged: a README edit between a pause and
    its resume must not send a 20 GB shard back to its first byte."""
    if old is None:
        return frozenset()
    if old.get("commit") == commit:
        return frozenset(f.path for f in files)
    hashes = old.get("hashes")
    if not isinstance(hashes, dict):  # a manifest from before hashes were kept
        return frozenset()
    return frozenset(f.path for f in files
                     if _content_id(f) is not None and hashes.get(f.path) == _content_id(f))


def _content_id(remote: RemoteFile) -> str | None:
    return remote.sha256 or remote.git_blob_id


def start_manifest(plan: DownloadPlan, revision: str) -> None:
    """Mark the folder incomplete, dropping another commit's partial and stale files."""
    old = read_manifest(plan.destination)
    if old is not None and old.get("commit") != plan.commit:
        # Partial bytes of another commit's files must not be continued (unless their
        # content is the same), and its files the new commit dropped (e.g. re-sharded
        # weights) must not be loaded.
        _drop_partials(plan.destination / PARTIAL_DIR,
                       continued(old, plan.commit, plan.files))
        for stale in set(old.get("files", {})) - {f.path for f in plan.files}:
            # The old manifest is a file on disk; never let it name a path outside.
            path = plan.destination / stale
            if unsafe_name(stale) is None and _stays_inside(plan.destination, path):
                path.unlink(missing_ok=True)
    plan.destination.mkdir(parents=True, exist_ok=True)
    write_manifest(plan.destination, {**manifest_fields(plan, revision), "complete": False})


def _drop_partials(partial_dir: Path, keep: frozenset[str]) -> None:
    """Delete the partial files under ``partial_dir`` but those named in ``keep``."""
    if not partial_dir.is_dir():
        return
    for path in sorted(partial_dir.rglob("*"), reverse=True):  # files before folders
        name = path.relative_to(partial_dir).as_posix()
        if path.is_dir():
            with contextlib.suppress(OSError):
                path.rmdir()  # emptied, unless a kept file is in it
        elif name not in keep:
            path.unlink(missing_ok=True)


def manifest_fields(plan: DownloadPlan, revision: str) -> dict:
    """The manifest entries that describe a plan (all but ``complete``)."""
    return {
        "repo_id": plan.repo_id,
        "revision": revision,
        "commit": plan.commit,
        "files": {f.path: f.size for f in plan.files},
        "hashes": {f.path: _content_id(f) for f in plan.files},
    }


def write_manifest(folder: Path, manifest: dict) -> None:
    """Replace the folder's manifest atomically."""
    temporary = folder / (MANIFEST_NAME + ".tmp")
    temporary.write_text(json.dumps(manifest, indent=1))
    os.replace(temporary, folder / MANIFEST_NAME)


def _files_present(
    destination: Path, files: tuple[RemoteFile, ...], commit: str
) -> frozenset[str]:
    """Return the files already downloaded for this commit.

    Files left by a download of another commit count only if their hash still
    matches (tokenizer files rarely change between commits).
    """
    same_commit = _manifest_commit(destination) == commit
    return frozenset(
        f.path
        for f in files
        if (target := destination / f.path).is_file()
        and _size(target) == f.size
        and (same_commit or matches_hash(target, f))
    )


def _manifest_commit(folder: Path) -> str | None:
    manifest = read_manifest(folder)
    return manifest.get("commit") if manifest else None


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _existing_ancestor(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def hub_endpoint(endpoint: str | None) -> str:
    """The Hub base URL: the given one, else HF_ENDPOINT, else huggingface_hub's default."""
    # constants.ENDPOINT is frozen at import; read the variable now so a changed
    # HF_ENDPOINT (a mirror, or a test server) takes effect.
    return (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def host_name(endpoint: str) -> str:
    """The host part of an endpoint URL, for messages."""
    return urlsplit(endpoint).netloc or endpoint
