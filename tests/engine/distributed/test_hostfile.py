"""``generate|serve --hostfile FILE``: MLX's own hostfile and launcher."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest

from engine import cli
from engine.distributed.launch import REPORT_DIR, launch_command
from tests.engine.distributed.test_cli_pipeline import _generate, _json
from tests.engine.distributed.test_pipeline_cache import LAUNCH
from tests.engine.tinymodels import make_tiny_model_dir


def _hostfile(tmp_path: Path, hosts: list[str]) -> Path:
    path = tmp_path / "hosts.json"
    path.write_text(json.dumps({"backend": "ring", "hosts": [
        {"ssh": host, "ips": [host]} for host in hosts]}), encoding="utf-8")
    return path


def test_the_hostfile_goes_to_mlx_launch_and_not_to_the_ranks(tmp_path: Path) -> None:
    hosts = _hostfile(tmp_path, ["10.0.0.1", "10.0.0.2"])
    argv = ["generate", "--model", "m", "--hostfile", str(hosts), "--prompt", "hi"]
    command = launch_command(["mlx.launch"], argv, 2, 7, "/tmp/reports", hosts)
    assert command[:5] == ["mlx.launch", "--hostfile", str(hosts), "--env",
                           f"{REPORT_DIR}=/tmp/reports"]
    assert command[5:] == [sys.executable, "-m", "engine", "generate", "--model", "m",
                           "--prompt", "hi", "--seed", "7"]


@pytest.mark.parametrize("content", ["not json", json.dumps({"hosts": [{"ssh": "a"}]})])
def test_an_unusable_hostfile_is_refused_with_the_format(tmp_path: Path, content: str) -> None:
    path = tmp_path / "hosts.json"
    path.write_text(content, encoding="utf-8")
    err = io.StringIO()
    sys_err, sys.stderr = sys.stderr, err
    try:
        status = cli.main(["generate", "--model", "m", "--prompt", "x", "--hostfile", str(path)])
    finally:
        sys.stderr = sys_err
    assert status == 1
    assert "MLX hostfile is JSON" in err.getvalue() or "at least 2" in err.getvalue()


def test_serve_refuses_an_unusable_hostfile_before_serving(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    served = []
    monkeypatch.setattr("engine.server.serve.uvicorn_server", lambda *a, **k: served.append(a))
    model = make_tiny_model_dir(tmp_path, "qwen3_next")
    path = tmp_path / "hosts.json"
    path.write_text("not json", encoding="utf-8")
    assert cli.main(["serve", "--model", str(model), "--hostfile", str(path)]) == 1
    assert "MLX hostfile is JSON" in capsys.readouterr().err
    assert served == []


@pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")
def test_a_hostfile_of_this_machine_twice_runs_as_two_ranks(tmp_path: Path) -> None:
    model = make_tiny_model_dir(tmp_path, "qwen3_next")
    hosts = _hostfile(tmp_path, ["127.0.0.1", "127.0.0.1"])
    one = _json(_generate(model, "--temp", "0"))
    two = _json(_generate(model, "--temp", "0", "--hostfile", str(hosts)))
    assert two["tokens"] == one["tokens"]
    assert [r["rank"] for r in two["ranks"]] == [0, 1]
    assert sum(r["kv_bytes"] for r in two["ranks"]) == one["kv_bytes"]
