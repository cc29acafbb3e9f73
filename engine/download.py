"""Download an MLX model from the Hugging Face Hub, resumable and cancellable.

huggingface_hub lists the repo and talks HTTP (its session, headers and error
types). The byte transfer itself is ours: since huggingface_hub 2.x every
``hf_hub_download`` writes to a fresh temporary file and deletes it on failure,
so a cancelled or dropped 5 GB shard would start over. Here partial files are
kept next to the model and continued with an HTTP ``Range`` request.

A model lands in ``models_dir()/<org>--<name>/``; partial files live under
``.longleaf-partial/`` inside it until complete and verified, and a manifest
records whether the folder is whole, so discovery never offers half a model.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx2
from huggingface_hub import HfApi, constants, hf_hub_url
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import (
    build_hf_headers,
    filter_repo_objects,
    get_session,
    hf_raise_for_status,
)

from engine.discovery import MANIFEST_NAME, layout_problem, read_manifest
from engine.errors import Cancelled, EngineError
from engine.paths import models_dir

# Same files mlx_lm.utils fetches for a model (a test keeps them in sync).
ALLOW_PATTERNS = (
    "*.json",
    "model*.safetensors",
    "*.py",
    "tokenizer.model",
    "*.tiktoken",
    "tiktoken.model",
    "*.txt",
    "*.jsonl",
    "*.jinja",
)
PARTIAL_DIR = ".longleaf-partial"
# Seconds to wait before each retry when a request fails without any new bytes.
RETRY_DELAYS = (1.0, 2.0, 4.0)
# Never fill the disk to the last byte: the OS and swap need room too.
DISK_HEADROOM_BYTES = 256 * 1024 * 1024
PROGRESS_INTERVAL_S = 0.1
RATE_WINDOW_S = 5.0
_TIMEOUT = httpx2.Timeout(30.0, connect=10.0)


class InsufficientDiskSpace(EngineError):
    """The model does not fit on the disk that would hold it.

    Attributes:
        bytes_needed: bytes still to download, plus a safety margin.
        bytes_free: bytes free on that disk now.
    """

    def __init__(self, message: str, *, bytes_needed: int, bytes_free: int) -> None:
        super().__init__(message)
        self.bytes_needed = bytes_needed
        self.bytes_free = bytes_free


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


@dataclass(frozen=True)
class DownloadProgress:
    """Progress of a whole-model download; ``bytes_*`` count across all files."""

    repo_id: str
    filename: str
    files_done: int
    files_total: int
    bytes_done: int
    bytes_total: int
    bytes_per_second: float
    eta_seconds: float | None


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
        EngineError: the repo is missing, private, gated, unreachable, or holds
            nothing mlx-lm can load.
    """
    endpoint = _endpoint(endpoint)
    api = HfApi(endpoint=endpoint, token=token)
    try:
        info = api.model_info(repo_id, revision=revision, files_metadata=True)
    except Exception as error:
        raise _hub_error(error, repo_id, endpoint, revision) from error
    names = [sibling.rfilename for sibling in info.siblings or ()]
    if (problem := layout_problem(names)) is not None:
        raise EngineError(f"{repo_id} cannot be used: {problem}")
    wanted = set(filter_repo_objects(names, allow_patterns=list(ALLOW_PATTERNS)))
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
    destination = destination_for(repo_id, models_root)
    present = _files_present(destination, files, info.sha)
    partial = 0 if _manifest_commit(destination) != info.sha else sum(
        _size(destination / PARTIAL_DIR / f.path) for f in files if f.path not in present
    )
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


def download_model(
    repo_id: str,
    *,
    revision: str = "main",
    on_progress: Callable[[DownloadProgress], None] | None = None,
    cancel: threading.Event | None = None,
    token: str | bool | None = None,
    endpoint: str | None = None,
    models_root: Path | None = None,
) -> Path:
    """Download a model repo into Longleaf's models folder and return that folder.

    Runs on the calling thread; ``on_progress`` is called from it. Calling it
    again after a cancel, crash or dropped connection resumes where it stopped.

    Raises:
        Cancelled: ``cancel`` was set; partial files are kept for resuming.
        InsufficientDiskSpace: the rest of the model does not fit on disk.
        EngineError: repo missing/private/gated, network failure, corrupt file.
    """
    endpoint = _endpoint(endpoint)
    plan = plan_download(
        repo_id, revision=revision, token=token, endpoint=endpoint, models_root=models_root
    )
    needed = plan.bytes_needed + DISK_HEADROOM_BYTES
    if needed > plan.bytes_free:
        raise InsufficientDiskSpace(
            f"{repo_id} needs {_gib(plan.bytes_needed)} more on disk (plus "
            f"{_gib(DISK_HEADROOM_BYTES)} to spare) but only {_gib(plan.bytes_free)} is free "
            f"at {plan.destination.parent}. Free some space and try again.",
            bytes_needed=needed,
            bytes_free=plan.bytes_free,
        )
    _start_manifest(plan, revision)
    meter = _Meter(plan, on_progress)
    # Byte offsets must count stored bytes, so never let a server compress a body.
    headers = {**build_hf_headers(token=token), "Accept-Encoding": "identity"}
    for remote in plan.files:
        target = plan.destination / remote.path
        if remote.path not in plan.files_present:
            url = hf_hub_url(repo_id, remote.path, revision=plan.commit, endpoint=endpoint)
            part = plan.destination / PARTIAL_DIR / remote.path
            _fetch(url, headers, part, remote, meter, cancel, endpoint)
            _verify(part, remote)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(part, target)
        meter.file_done(remote.path)
    shutil.rmtree(plan.destination / PARTIAL_DIR, ignore_errors=True)
    _write_manifest(plan.destination, {**_manifest(plan, revision), "complete": True})
    return plan.destination


def _fetch(
    url: str,
    headers: dict[str, str],
    part: Path,
    remote: RemoteFile,
    meter: _Meter,
    cancel: threading.Event | None,
    endpoint: str,
) -> None:
    """Fetch one file into ``part``, continuing whatever bytes it already has."""
    part.parent.mkdir(parents=True, exist_ok=True)
    part.touch()  # an empty file is complete as soon as it exists
    failures = 0
    while True:
        if cancel is not None and cancel.is_set():
            raise Cancelled("Download cancelled; start it again to resume.")
        have = part.stat().st_size if part.exists() else 0
        if have > remote.size:
            part.unlink()
            continue
        if have == remote.size:
            return
        request_headers = {**headers, "Range": f"bytes={have}-"} if have else headers
        try:
            with get_session().stream(
                "GET", url, headers=request_headers, timeout=_TIMEOUT
            ) as response:
                _raise_for_status(response)
                if have and response.status_code != 206:
                    meter.add(remote.path, -have)  # server ignored Range: start over
                    have = 0
                with part.open("ab" if have else "wb") as sink:
                    for piece in response.iter_bytes():
                        sink.write(piece)
                        meter.add(remote.path, len(piece))
                        failures = 0
                        if cancel is not None and cancel.is_set():
                            raise Cancelled(
                                f"Download of {remote.path} cancelled; start it again to resume."
                            )
        except (httpx2.TransportError, _ServerBusy) as error:
            if failures >= len(RETRY_DELAYS):
                raise EngineError(
                    f"Lost the connection to {_host(endpoint)} while downloading "
                    f"{remote.path} ({error}). The partial file is kept: check your "
                    "connection and download again to resume."
                ) from error
            delay = RETRY_DELAYS[failures]
            failures += 1
            if cancel is not None and cancel.wait(delay):
                raise Cancelled("Download cancelled; start it again to resume.") from error
        except HfHubHTTPError as error:
            raise _hub_error(error, meter.repo_id, endpoint) from error


class _ServerBusy(Exception):
    """A 5xx answer: the Hub is overloaded or restarting, worth a retry."""


def _raise_for_status(response: httpx2.Response) -> None:
    if response.status_code >= 500:
        raise _ServerBusy(f"HTTP {response.status_code}")
    hf_raise_for_status(response)


def _verify(part: Path, remote: RemoteFile) -> None:
    """Check a finished file against the repo's hash; a bad one is deleted."""
    if not _matches_hash(part, remote):
        part.unlink()
        raise EngineError(
            f"{remote.path} arrived corrupt (its checksum does not match the Hub's) and "
            "was deleted. Download again."
        )


def _matches_hash(path: Path, remote: RemoteFile) -> bool:
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


class _Meter:
    """Turns byte counts into throttled DownloadProgress events."""

    def __init__(
        self, plan: DownloadPlan, on_progress: Callable[[DownloadProgress], None] | None
    ) -> None:
        self.repo_id = plan.repo_id
        self._plan = plan
        self._callback = on_progress
        self._done = plan.bytes_present
        self._files_done = 0
        self._samples: deque[tuple[float, int]] = deque([(time.monotonic(), self._done)])
        self._last_emit = 0.0

    def add(self, filename: str, count: int) -> None:
        self._done += count
        now = time.monotonic()
        self._samples.append((now, self._done))
        while len(self._samples) > 2 and now - self._samples[0][0] > RATE_WINDOW_S:
            self._samples.popleft()
        if now - self._last_emit >= PROGRESS_INTERVAL_S:
            self._emit(filename, now)

    def file_done(self, filename: str) -> None:
        self._files_done += 1
        self._emit(filename, time.monotonic())

    def _emit(self, filename: str, now: float) -> None:
        self._last_emit = now
        if self._callback is None:
            return
        (start, start_bytes) = self._samples[0]
        rate = (self._done - start_bytes) / (now - start) if now > start else 0.0
        remaining = self._plan.total_bytes - self._done
        eta = remaining / rate if rate > 0 else (0.0 if remaining == 0 else None)
        self._callback(
            DownloadProgress(
                repo_id=self.repo_id,
                filename=filename,
                files_done=self._files_done,
                files_total=len(self._plan.files),
                bytes_done=self._done,
                bytes_total=self._plan.total_bytes,
                bytes_per_second=max(rate, 0.0),
                eta_seconds=eta,
            )
        )


def _hub_error(
    error: Exception, repo_id: str, endpoint: str, revision: str = "main"
) -> EngineError:
    """Translate huggingface_hub/httpx failures into messages a user can act on."""
    host = _host(endpoint)
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
        return EngineError(
            f"Cannot reach {host} ({error}). Check your internet connection and try again."
        )
    return EngineError(f"Downloading {repo_id} failed: {error}")


def _start_manifest(plan: DownloadPlan, revision: str) -> None:
    old = read_manifest(plan.destination)
    if old is not None and old.get("commit") != plan.commit:
        # Partial bytes of another commit's files must not be continued, and its
        # files the new commit dropped (e.g. re-sharded weights) must not be loaded.
        shutil.rmtree(plan.destination / PARTIAL_DIR, ignore_errors=True)
        for stale in set(old.get("files", {})) - {f.path for f in plan.files}:
            (plan.destination / stale).unlink(missing_ok=True)
    plan.destination.mkdir(parents=True, exist_ok=True)
    _write_manifest(plan.destination, {**_manifest(plan, revision), "complete": False})


def _manifest(plan: DownloadPlan, revision: str) -> dict:
    return {
        "repo_id": plan.repo_id,
        "revision": revision,
        "commit": plan.commit,
        "files": {f.path: f.size for f in plan.files},
    }


def _write_manifest(folder: Path, manifest: dict) -> None:
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
        and (same_commit or _matches_hash(target, f))
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


def _endpoint(endpoint: str | None) -> str:
    # constants.ENDPOINT is frozen at import; read the variable now so a changed
    # HF_ENDPOINT (a mirror, or a test server) takes effect.
    return (endpoint or os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _host(endpoint: str) -> str:
    return urlsplit(endpoint).netloc or endpoint


def _gib(count: int) -> str:
    return f"{count / 1024**3:.2f} GiB"
