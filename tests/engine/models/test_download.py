"""Downloads against a real HTTP server on 127.0.0.1 that speaks the Hub's layout.

The server implements the two endpoints huggingface_hub 2.x and engine.models.download
use: ``GET /api/models/{repo}/revision/{rev}?blobs=true`` (repo listing with
sizes and hashes) and ``GET /{repo}/resolve/{rev}/{file}`` (bytes, with Range).
Nothing in huggingface_hub is mocked; HF_ENDPOINT points at the server.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from engine.errors import Cancelled, EngineError
from engine.models import download_plan, download_transfer
from engine.models.discovery import read_manifest
from engine.models.download import InsufficientDiskSpace, download_model
from engine.models.download_plan import destination_for, plan_download
from engine.models.download_transfer import DownloadProgress

PIECE = 16 * 1024


@dataclass
class FakeRepo:
    commit: str
    files: dict[str, bytes]
    lfs: frozenset[str] = frozenset()
    gated: bool = False
    private: bool = False
    declared_sizes: dict[str, int] = field(default_factory=dict)
    served_bytes: dict[str, bytes] = field(default_factory=dict)


class FakeHub:
    """A threaded HTTP server holding a few repos, with fault injection."""

    def __init__(self) -> None:
        self.repos: dict[str, FakeRepo] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.encodings: list[str | None] = []
        self.drop_once: dict[str, int] = {}  # file -> drop the connection after N bytes
        self.refuse_files = False  # hang up before answering any file request
        self.down_after_drop = False  # set refuse_files when a drop_once fires
        self.pause_at: dict[str, int] = {}  # file -> call on_pause after N bytes, then wait
        self.on_pause: Callable[[], None] = lambda: None
        self.release = threading.Event()
        self.ignore_range = False  # answer every GET with the whole file, as some proxies do
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, name="fake-hub"
        )

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=10)

    def file_gets(self, name: str) -> list[str | None]:
        """Range headers of every GET for a file (None = whole file)."""
        return [r for (m, p, r) in self.requests if m == "GET" and p.endswith("/" + name)]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                hub.requests.append(("GET", urlsplit(self.path).path, self.headers.get("Range")))
                hub.encodings.append(self.headers.get("Accept-Encoding"))
                path = unquote(urlsplit(self.path).path)
                if path.startswith("/api/models/"):
                    self._listing(path.removeprefix("/api/models/"))
                elif "/resolve/" in path:
                    self._file(path)
                else:
                    self._error(404, "RepoNotFound")

            def _listing(self, rest: str) -> None:
                repo_id, _, revision = rest.partition("/revision/")
                repo = hub.repos.get(repo_id)
                if repo is None:
                    return self._error(404, "RepoNotFound")
                if repo.private:
                    # The Hub hides private repos from anonymous callers behind a 401.
                    return self._error(401, "RepoNotFound", "Invalid username or password.")
                if revision not in ("main", repo.commit):
                    return self._error(404, "RevisionNotFound")
                siblings = []
                for name, data in repo.files.items():
                    size = repo.declared_sizes.get(name, len(data))
                    sibling = {"rfilename": name, "size": size, "blobId": _git_blob_id(data)}
                    if name in repo.lfs:
                        sibling["lfs"] = {
                            "sha256": hashlib.sha256(data).hexdigest(),
                            "size": size,
                            "pointerSize": 134,
                        }
                    siblings.append(sibling)
                body = json.dumps(
                    {
                        "_id": "0" * 24,
                        "id": repo_id,
                        "sha": repo.commit,
                        "private": False,
                        "gated": "manual" if repo.gated else False,
                        "siblings": siblings,
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _file(self, path: str) -> None:
                repo_part, _, rest = path.lstrip("/").partition("/resolve/")
                revision, _, name = rest.partition("/")
                repo = hub.repos.get(repo_part)
                if repo is None:
                    return self._error(404, "RepoNotFound")
                if repo.gated:
                    return self._error(403, "GatedRepo", "Access to this model is restricted.")
                if hub.refuse_files:
                    self.close_connection = True
                    return
                if revision != repo.commit or name not in repo.files:
                    return self._error(404, "EntryNotFound")
                data = repo.served_bytes.get(name, repo.files[name])
                start = 0
                if (wanted := self.headers.get("Range")) is not None and not hub.ignore_range:
                    start = int(wanted.removeprefix("bytes=").split("-")[0])
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
                self.send_header("Content-Length", str(len(data) - start))
                self.send_header("Accept-Ranges", "bytes")
                self.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                self.send_header("X-Repo-Commit", repo.commit)
                self.end_headers()
                self._body(name, data, start)

            def _body(self, name: str, data: bytes, start: int) -> None:
                drop_at = hub.drop_once.pop(name, None)
                pause_at = hub.pause_at.pop(name, None)
                try:
                    for offset in range(start, len(data), PIECE):
                        if drop_at is not None and offset >= drop_at:
                            hub.refuse_files = hub.down_after_drop
                            self.wfile.flush()
                            self.connection.shutdown(socket.SHUT_RDWR)
                            self.close_connection = True
                            return
                        if pause_at is not None and offset >= pause_at:
                            pause_at = None
                            hub.on_pause()
                            # One more piece after the pause so the client sees the cancel.
                            self.wfile.write(data[offset : offset + PIECE])
                            self.wfile.flush()
                            hub.release.wait(timeout=10)
                            continue
                        self.wfile.write(data[offset : offset + PIECE])
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True

            def _error(self, status: int, code: str, message: str = "") -> None:
                self.send_response(status)
                self.send_header("X-Error-Code", code)
                if message:
                    self.send_header("X-Error-Message", message)
                self.send_header("Content-Length", "0")
                self.end_headers()

        return Handler


def _git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _tiny_repo(weights_size: int = 300 * 1024) -> FakeRepo:
    weights = os.urandom(weights_size)
    return FakeRepo(
        commit="a" * 40,
        files={
            "config.json": json.dumps({"model_type": "llama", "hidden_size": 8}).encode(),
            "model.safetensors": weights,
            "tokenizer.json": b'{"version": "1.0"}',
            "tokenizer_config.json": b'{"eos_token": "</s>"}',
            "README.md": b"# tiny\n",
            ".gitattributes": b"*.safetensors filter=lfs\n",
        },
        lfs=frozenset({"model.safetensors"}),
    )


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    with FakeHub() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
        yield server


def _assert_model_on_disk(folder: Path, repo: FakeRepo) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).read_bytes() == repo.files[name], name
    assert not (folder / "README.md").exists()  # mlx-lm's patterns skip it
    assert not (folder / download_plan.PARTIAL_DIR).exists()
    assert read_manifest(folder)["complete"] is True


def test_downloads_model_files_with_progress(hub: FakeHub) -> None:
    repo = hub.repos["mlx-community/tiny"] = _tiny_repo()
    events: list[DownloadProgress] = []

    folder = download_model("mlx-community/tiny", on_progress=events.append)

    assert folder == destination_for("mlx-community/tiny")
    _assert_model_on_disk(folder, repo)
    total = sum(len(repo.files[n]) for n in read_manifest(folder)["files"])
    assert events[-1].bytes_done == events[-1].bytes_total == total
    assert events[-1].files_done == events[-1].files_total == 4
    assert events[-1].eta_seconds == 0.0
    done = [e.bytes_done for e in events]
    assert done == sorted(done)
    assert all(e.bytes_per_second >= 0 for e in events)
    assert any(e.bytes_per_second > 0 for e in events)


def test_empty_files_and_subfolders_are_downloaded(hub: FakeHub) -> None:
    repo = hub.repos["mlx-community/tiny"] = _tiny_repo()
    repo.files["generation_config.json"] = b""
    repo.files["chat/template.jinja"] = b"{{ messages }}"

    folder = download_model("mlx-community/tiny")

    assert (folder / "generation_config.json").read_bytes() == b""
    assert (folder / "chat" / "template.jinja").read_bytes() == b"{{ messages }}"


def test_second_download_fetches_nothing(hub: FakeHub) -> None:
    hub.repos["mlx-community/tiny"] = _tiny_repo()
    download_model("mlx-community/tiny")
    gets_before = len(hub.file_gets("model.safetensors"))

    plan = plan_download("mlx-community/tiny")
    download_model("mlx-community/tiny")

    assert plan.bytes_needed == 0
    assert len(hub.file_gets("model.safetensors")) == gets_before == 1


def test_dropped_connection_is_resumed_with_range(hub: FakeHub) -> None:
    repo = hub.repos["mlx-community/tiny"] = _tiny_repo()
    hub.drop_once["model.safetensors"] = 5 * PIECE

    folder = download_model("mlx-community/tiny")

    _assert_model_on_disk(folder, repo)
    assert hub.encodings[-1] == "identity"  # Range offsets count stored bytes
    ranges = hub.file_gets("model.safetensors")
    assert ranges[0] is None
    assert len(ranges) == 2
    resumed_at = int(ranges[1].removeprefix("bytes=").rstrip("-"))
    assert 0 < resumed_at <= 5 * PIECE


def test_outage_keeps_partial_file_and_next_call_resumes(
    hub: FakeHub, monkeypatch: pytest.MonkeyPatch
) -> None:
    repo = hub.repos["mlx-community/tiny"] = _tiny_repo()
    monkeypatch.setattr(download_transfer, "RETRY_DELAYS", (0.0, 0.0))
    # The first GET drops mid-body; every retry then finds the server hanging up.
    hub.drop_once["model.safetensors"] = 6 * PIECE
    hub.down_after_drop = True
    with pytest.raises(EngineError, match="Lost the connection") as failure:
        download_model("mlx-community/tiny")
    assert not isinstance(failure.value, Cancelled)
    part = destination_for("mlx-community/tiny") / download_plan.PARTIAL_DIR / "model.safetensors"
    kept = part.stat().st_size
    assert 0 < kept < len(repo.files["model.safetensors"])
    assert part.read_bytes() == repo.files["model.safetensors"][:kept]
    assert read_manifest(part.parent.parent)["complete"] is False

    hub.refuse_files = False
    folder = download_model("mlx-community/tiny")

    _assert_model_on_disk(folder, repo)
    assert hub.file_gets("model.safetensors")[-1] == f"bytes={kept}-"


def test_a_body_longer_than_listed_stops_the_download_with_a_reason(hub: FakeHub) -> None:
    repo = hub.repos["mlx-community/tiny"] = _tiny_repo()
    listed = len(repo.files["model.safetensors"]) - 1000
    repo.declared_sizes["model.safetensors"] = listed
    progress: list[DownloadProgress] = []
    with pytest.raises(EngineError, match=r"sent more of model\.safetensors than the"):
        download_model("mlx-community/tiny", on_progress=progress.append)
    assert len(hub.file_gets("model.safetensors")) == 1
    part = destination_for("mlx-community/tiny") / download_plan.PARTIAL_DIR / "model.safetensors"
    assert part.stat().st_size <= listed
    assert all(p.bytes_done <= p.bytes_total for p in progress)


@pytest.mark.parametrize("ignore_range", [False, True])
def test_a_body_cut_short_again_and_again_ends_the_download(
        hub: FakeHub, monkeypatch: pytest.MonkeyPatch, ignore_range: bool) -> None:
    """The server ends the file early without an error, every time: resumed (or, a
    server ignoring Range, sent whole again), then given up after the retries."""
    repo = hub.repos["mlx-community/tiny"] = _tiny_repo()
    weights = repo.files["model.safetensors"]
    repo.served_bytes["model.safetensors"] = weights[: len(weights) // 2]
    hub.ignore_range = ignore_range
    monkeypatch.setattr(download_transfer, "RETRY_DELAYS", (0.0, 0.0))
    with pytest.raises(EngineError, match=f"it sent {len(weights) // 2:,} of {len(weights):,}"):
        download_model("mlx-community/tiny")
    assert len(hub.file_gets("model.safetensors")) == 4  # the first try and three more


def test_cancel_then_resume(hub: FakeHub) -> None:
    repo = hub.repos["mlx-community/tiny"] = _tiny_repo()
    cancel = threading.Event()
    hub.pause_at["model.safetensors"] = 8 * PIECE
    hub.on_pause = cancel.set
    events: list[DownloadProgress] = []

    with pytest.raises(Cancelled):
        download_model("mlx-community/tiny", cancel=cancel, on_progress=events.append)
    hub.release.set()
    part = destination_for("mlx-community/tiny") / download_plan.PARTIAL_DIR / "model.safetensors"
    kept = part.stat().st_size
    # The client stops at the first piece it reads after the cancel, wherever that is.
    assert 0 < kept < len(repo.files["model.safetensors"])
    assert part.read_bytes() == repo.files["model.safetensors"][:kept]
    assert events[-1].bytes_done < events[-1].bytes_total
    plan = plan_download("mlx-community/tiny")
    unfinished = ("model.safetensors", "tokenizer.json", "tokenizer_config.json")
    assert plan.files_present == {"config.json"}
    assert plan.bytes_needed == sum(len(repo.files[n]) for n in unfinished) - kept

    resumed: list[DownloadProgress] = []
    folder = download_model("mlx-community/tiny", on_progress=resumed.append)

    _assert_model_on_disk(folder, repo)
    assert hub.file_gets("model.safetensors")[-1] == f"bytes={kept}-"
    assert resumed[-1].bytes_done == resumed[-1].bytes_total


@pytest.mark.parametrize("weights_changed", [False, True])
def test_a_paused_download_resumes_its_shard_after_a_commit_that_left_it_alone(
        hub: FakeHub, weights_changed: bool) -> None:
    """A commit between a pause and its resume (a README or config edit) keeps the
    partial shard whose content the listing says is the same; a changed one restarts."""
    repo = hub.repos["mlx-community/tiny"] = _tiny_repo()
    cancel = threading.Event()
    hub.pause_at["model.safetensors"] = 8 * PIECE
    hub.on_pause = cancel.set
    with pytest.raises(Cancelled):
        download_model("mlx-community/tiny", cancel=cancel)
    hub.release.set()
    part = destination_for("mlx-community/tiny") / download_plan.PARTIAL_DIR / "model.safetensors"
    kept = part.stat().st_size
    repo.commit = "e" * 40
    repo.files["config.json"] = b'{"model_type": "llama", "hidden_size": 16}'
    if weights_changed:
        repo.files["model.safetensors"] = os.urandom(len(repo.files["model.safetensors"]))

    plan = plan_download("mlx-community/tiny")
    folder = download_model("mlx-community/tiny")

    _assert_model_on_disk(folder, repo)
    resumed_at = hub.file_gets("model.safetensors")[-1]
    assert resumed_at == (None if weights_changed else f"bytes={kept}-")
    assert plan.bytes_present == (0 if weights_changed else kept)


def test_missing_or_private_repo_is_a_clear_error(hub: FakeHub) -> None:
    hidden = hub.repos["someone/private"] = _tiny_repo()
    hidden.private = True
    for repo_id in ("someone/nothing-here", "someone/private"):
        with pytest.raises(EngineError, match=rf"No model named {repo_id}.*private.*token"):
            download_model(repo_id)
        assert not destination_for(repo_id).exists()
    assert hub.file_gets("model.safetensors") == []


def test_unknown_revision_is_a_clear_error(hub: FakeHub) -> None:
    hub.repos["mlx-community/tiny"] = _tiny_repo()
    with pytest.raises(EngineError, match="no branch, tag or commit named v9"):
        download_model("mlx-community/tiny", revision="v9")


def test_gated_repo_is_a_clear_error(hub: FakeHub) -> None:
    repo = _tiny_repo()
    repo.gated = True
    hub.repos["meta-llama/gated"] = repo
    with pytest.raises(EngineError, match=r"gated.*license.*token"):
        download_model("meta-llama/gated")
    assert not (destination_for("meta-llama/gated") / "model.safetensors").exists()


def test_unreachable_hub_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    with pytest.raises(EngineError, match=r"Cannot reach 127\.0\.0\.1"):
        download_model("mlx-community/tiny")


def test_refuses_when_disk_is_too_small(hub: FakeHub) -> None:
    repo = hub.repos["mlx-community/huge"] = _tiny_repo()
    repo.declared_sizes["model.safetensors"] = 1 << 60  # an exabyte fits nowhere

    with pytest.raises(InsufficientDiskSpace, match="Free some space") as refusal:
        download_model("mlx-community/huge")

    assert refusal.value.bytes_needed > refusal.value.bytes_free > 0
    assert hub.file_gets("model.safetensors") == []


def test_refuses_repos_mlx_cannot_load(hub: FakeHub) -> None:
    hub.repos["someone/gguf-only"] = FakeRepo(
        commit="b" * 40, files={"model-Q4_K_M.gguf": b"GGUF", "README.md": b"hi"}
    )
    hub.repos["someone/pytorch"] = FakeRepo(
        commit="c" * 40, files={"config.json": b"{}", "pytorch_model.bin": b"pt"}
    )
    with pytest.raises(EngineError, match="GGUF"):
        download_model("someone/gguf-only")
    with pytest.raises(EngineError, match=r"mlx_lm\.convert"):
        download_model("someone/pytorch")
    assert not any("/resolve/" in path for (_, path, _) in hub.requests)


def test_corrupt_file_is_deleted_not_kept(hub: FakeHub) -> None:
    repo = hub.repos["mlx-community/tiny"] = _tiny_repo()
    good = repo.files["model.safetensors"]
    repo.served_bytes["model.safetensors"] = bytes(len(good))

    with pytest.raises(EngineError, match="corrupt"):
        download_model("mlx-community/tiny")

    folder = destination_for("mlx-community/tiny")
    assert not (folder / "model.safetensors").exists()
    assert not (folder / download_plan.PARTIAL_DIR / "model.safetensors").exists()


def test_allow_patterns_match_mlx_lm_without_python_code() -> None:
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    # *.py is custom code for trust_remote_code, which Longleaf never passes.
    assert tuple(p for p in DEFAULT_ALLOW_PATTERNS if p != "*.py") == download_plan.ALLOW_PATTERNS


def test_python_files_in_a_repo_are_not_downloaded(hub: FakeHub) -> None:
    repo = hub.repos["mlx-community/tiny"] = _tiny_repo()
    repo.files["modeling_tiny.py"] = b"import os; os.system('echo hi')\n"

    folder = download_model("mlx-community/tiny")

    _assert_model_on_disk(folder, repo)
    assert not (folder / "modeling_tiny.py").exists()
    assert hub.file_gets("modeling_tiny.py") == []


def _files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("../evil.json", "it has a '.' or '..' part"),
        ("/abs.json", "it is an absolute path"),
        ("a/../../b.json", "it has a '.' or '..' part"),
        ("C:/Windows/evil.json", "it starts with a drive letter"),
        ("sub\\..\\..\\evil.json", "it contains a backslash"),
        ("sub//evil.json", "it has an empty part"),
        (".longleaf-download.json", "Longleaf keeps that name for its own bookkeeping"),
        (".longleaf-partial/config.json", "Longleaf keeps that name for its own bookkeeping"),
    ],
)
def test_hostile_file_names_refuse_the_download_and_write_nothing(
    hub: FakeHub, isolated_user_dirs: Path, name: str, why: str
) -> None:
    repo = hub.repos["mirror/hostile"] = _tiny_repo()
    repo.files[name] = b'{"pwned": true}'
    before = _files_under(isolated_user_dirs)

    with pytest.raises(EngineError) as refusal:
        download_model("mirror/hostile")

    assert str(refusal.value) == (
        f"mirror/hostile on 127.0.0.1:{hub.server.server_address[1]} lists a file named "
        f"{name!r}, which is not a plain path inside the model folder ({why}), so Longleaf "
        "refused the download. The Hugging Face Hub never lists such names: check "
        "HF_ENDPOINT and any proxy between you and the Hub."
    )
    assert _files_under(isolated_user_dirs) == before
    assert not Path("/abs.json").exists()
    assert not any("/resolve/" in path for (_, path, _) in hub.requests)


def test_a_link_in_the_model_folder_cannot_carry_a_file_outside(
    hub: FakeHub, tmp_path_factory: pytest.TempPathFactory
) -> None:
    repo = hub.repos["mlx-community/tiny"] = _tiny_repo()
    folder = download_model("mlx-community/tiny")
    outside = tmp_path_factory.mktemp("outside")
    (folder / "chat").symlink_to(outside, target_is_directory=True)
    repo.files["chat/template.jinja"] = b"{{ messages }}"
    repo.commit = "f" * 40

    with pytest.raises(EngineError, match=r"'chat/template\.jinja'.*a link in .* leads it to"):
        download_model("mlx-community/tiny")

    assert list(outside.iterdir()) == []
    assert hub.file_gets("template.jinja") == []


def test_new_commit_replaces_changed_files_and_drops_stale_ones(hub: FakeHub) -> None:
    repo = hub.repos["mlx-community/tiny"] = _tiny_repo()
    download_model("mlx-community/tiny")
    weights = repo.files.pop("model.safetensors")
    half = len(weights) // 2
    resharded = {
        "model-00001-of-00002.safetensors": weights[:half],
        "model-00002-of-00002.safetensors": weights[half:],
        "model.safetensors.index.json": b'{"weight_map": {}}',
    }
    repo.files.update(resharded)
    repo.files["config.json"] = b'{"model_type": "llama", "hidden_size": 16}'
    repo.lfs = frozenset(name for name in resharded if name.endswith(".safetensors"))
    repo.commit = "d" * 40
    config_gets = len(hub.file_gets("config.json"))

    plan = plan_download("mlx-community/tiny")
    folder = download_model("mlx-community/tiny")

    # Unchanged tokenizer files are kept (their hashes still match); config is refetched.
    assert plan.files_present == {"tokenizer.json", "tokenizer_config.json"}
    assert len(hub.file_gets("tokenizer.json")) == 1
    assert len(hub.file_gets("config.json")) == config_gets + 1
    for name, data in repo.files.items():
        if name not in ("README.md", ".gitattributes"):
            assert (folder / name).read_bytes() == data, name
    assert not (folder / "model.safetensors").exists()
    assert read_manifest(folder)["commit"] == "d" * 40


def test_downloaded_model_is_discovered_by_its_repo_id(
    hub: FakeHub, tmp_path_factory: pytest.TempPathFactory
) -> None:
    from engine.models.discovery import discover_models
    from tests.engine.tinymodels import make_tiny_model_dir

    tiny = make_tiny_model_dir(tmp_path_factory.mktemp("served"), "llama")
    files = {p.name: p.read_bytes() for p in tiny.iterdir() if p.is_file()}
    hub.repos["mlx-community/tiny-real"] = FakeRepo(
        commit="e" * 40, files=files, lfs=frozenset({"model.safetensors"})
    )

    folder = download_model("mlx-community/tiny-real")
    found = discover_models(include_hf_cache=False, include_lmstudio=False)

    [model] = found.models
    assert (model.name, model.source, model.path) == ("mlx-community/tiny-real", "longleaf", folder)
    assert model.info.architecture == "llama"
    assert model.size_bytes >= sum(len(data) for data in files.values())


def test_a_disk_that_fills_up_during_the_download_says_so_and_keeps_what_came(
        hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another app (or another download) took the space after the check passed."""
    import errno

    from engine.errors import DiskFault
    from engine.models import download

    hub.repos["mlx-community/tiny"] = _tiny_repo()
    real_fetch = download.fetch_file

    def full_after_a_piece(url, headers, part, remote, *rest):
        if remote.path != "model.safetensors":
            return real_fetch(url, headers, part, remote, *rest)
        part.parent.mkdir(parents=True, exist_ok=True)
        part.write_bytes(b"\0" * PIECE)
        raise OSError(errno.ENOSPC, "No space left on device", str(part))

    monkeypatch.setattr(download, "fetch_file", full_after_a_piece)
    with pytest.raises(DiskFault, match=r"The download of mlx-community/tiny stopped: the "
                                        r"disk holding .* is full\. Free some space") as full:
        download_model("mlx-community/tiny")
    assert full.value.cause == "full" and "goes on where it stopped" in str(full.value)
    folder = destination_for("mlx-community/tiny")
    assert read_manifest(folder)["complete"] is False
    assert (folder / download_plan.PARTIAL_DIR / "model.safetensors").stat().st_size == PIECE
