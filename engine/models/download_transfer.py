"""Move one file's bytes from the Hub, resuming with an HTTP ``Range`` request.

Since huggingface_hub 2.x every ``hf_hub_download`` writes to a fresh temporary
file and deletes it on failure, so a cancelled or dropped 5 GB shard would
start over. Here the partial file is kept and continued, retried on dropped
connections and busy servers, checked against the Hub's hash, and counted into
throttled ``DownloadProgress`` events.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx2
from huggingface_hub.errors import HfHubHTTPError
from huggingface_hub.utils import get_session, hf_raise_for_status

from engine.errors import Cancelled, EngineError
from engine.models.download_plan import DownloadPlan, RemoteFile, host_name, hub_error, matches_hash

# Seconds to wait before each retry when a request fails without any new bytes.
RETRY_DELAYS = (1.0, 2.0, 4.0)
PROGRESS_INTERVAL_S = 0.1
RATE_WINDOW_S = 5.0
_TIMEOUT = httpx2.Timeout(30.0, connect=10.0)


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


def fetch_file(
    url: str,
    headers: dict[str, str],
    part: Path,
    remote: RemoteFile,
    meter: ProgressMeter,
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
        start = have
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
                        if have + len(piece) > remote.size:
                            raise _too_long(endpoint, remote)
                        sink.write(piece)
                        have += len(piece)
                        meter.add(remote.path, len(piece))
                        if cancel is not None and cancel.is_set():
                            raise Cancelled(
                                f"Download of {remote.path} cancelled; start it again to resume."
                            )
            if have <= start:
                # An answer that ended cleanly without new bytes (a body cut short,
                # or the whole file sent again in place of the rest) is retried as
                # a dropped connection is, never for ever.
                failures = _wait_to_retry(failures, cancel, _lost(
                    endpoint, remote, f"it sent {have:,} of {remote.size:,} bytes"))
            else:
                failures = 0
        except (httpx2.TransportError, _ServerBusy) as error:
            failures = _wait_to_retry(failures if have <= start else 0, cancel,
                                      _lost(endpoint, remote, str(error)))
        except HfHubHTTPError as error:
            raise hub_error(error, meter.repo_id, endpoint) from error


def _wait_to_retry(failures: int, cancel: threading.Event | None, error: EngineError) -> int:
    """Wait before retry number ``failures + 1``; raises ``error`` once retries ran out."""
    if failures >= len(RETRY_DELAYS):
        raise error
    if cancel is not None and cancel.wait(RETRY_DELAYS[failures]):
        raise Cancelled("Download cancelled; start it again to resume.")
    return failures + 1


def _lost(endpoint: str, remote: RemoteFile, why: str) -> EngineError:
    return EngineError(
        f"Lost the connection to {host_name(endpoint)} while downloading {remote.path} "
        f"({why}). The partial file is kept: check your connection and download again "
        "to resume."
    )


def _too_long(endpoint: str, remote: RemoteFile) -> EngineError:
    return EngineError(
        f"{host_name(endpoint)} sent more of {remote.path} than the {remote.size:,} bytes "
        "its file list gives, so the download stopped (a proxy or mirror may be changing "
        "the files). Try again later, or from another network."
    )


class _ServerBusy(Exception):
    """A 5xx answer: the Hub is overloaded or restarting, worth a retry."""


def _raise_for_status(response: httpx2.Response) -> None:
    if response.status_code >= 500:
        raise _ServerBusy(f"HTTP {response.status_code}")
    hf_raise_for_status(response)


def verify_file(part: Path, remote: RemoteFile) -> None:
    """Check a finished file against the repo's hash; a bad one is deleted."""
    if not matches_hash(part, remote):
        part.unlink()
        raise EngineError(
            f"{remote.path} arrived corrupt (its checksum does not match the Hub's) and "
            "was deleted. Download again."
        )


class ProgressMeter:
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
