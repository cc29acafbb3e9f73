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

import os
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

from huggingface_hub import hf_hub_url
from huggingface_hub.utils import build_hf_headers

from engine import disk
from engine.errors import DiskFault, EngineError
from engine.models.download_plan import (
    PARTIAL_DIR,
    hub_endpoint,
    manifest_fields,
    path_inside,
    plan_download,
    start_manifest,
    write_manifest,
)
from engine.models.download_transfer import DownloadProgress, ProgressMeter, fetch_file, verify_file

# Never fill the disk to the last byte: the OS and swap need room too.
DISK_HEADROOM_BYTES = 256 * 1024 * 1024


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
    endpoint = hub_endpoint(endpoint)
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
    start_manifest(plan, revision)
    meter = ProgressMeter(plan, on_progress)
    # Byte offsets must count stored bytes, so never let a server compress a body.
    headers = {**build_hf_headers(token=token), "Accept-Encoding": "identity"}
    for remote in plan.files:
        # Checked again at write time: a link may have appeared since the plan.
        target = path_inside(plan.destination, remote.path, repo_id=repo_id, endpoint=endpoint)
        if remote.path not in plan.files_present:
            url = hf_hub_url(repo_id, remote.path, revision=plan.commit, endpoint=endpoint)
            part = plan.destination / PARTIAL_DIR / remote.path
            try:
                fetch_file(url, headers, part, remote, meter, cancel, endpoint)
            except OSError as error:
                raise _disk_fault(error, repo_id, plan.destination) from error
            verify_file(part, remote)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(part, target)
        meter.file_done(remote.path)
    shutil.rmtree(plan.destination / PARTIAL_DIR, ignore_errors=True)
    write_manifest(plan.destination, {**manifest_fields(plan, revision), "complete": True})
    return plan.destination


def _disk_fault(error: OSError, repo_id: str, destination: Path) -> OSError | DiskFault:
    """The words for a disk that filled up (or turned read-only) under a download,
    which the plan's free-space check could not foresee (another download, another
    app); any other ``OSError`` as it is."""
    cause = disk.cause_of_errno(error.errno)
    if cause is None:
        return error
    return disk.fault(cause, destination, f"The download of {repo_id} stopped",
                      "download it again: it goes on where it stopped")


def _gib(count: int) -> str:
    return f"{count / 1024**3:.2f} GiB"
