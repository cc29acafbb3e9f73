"""``python -m engine serve``: its options, and what it refuses before serving."""

from __future__ import annotations

import io
import json

import pytest

from engine import cli
from engine.errors import EngineError
from engine.format import human_bytes
from tests.engine.tinymodels import make_tiny_model_dir


def test_serve_options_default_to_this_machine() -> None:
    args = cli.build_parser().parse_args(["serve", "--model", "demo"])
    assert (args.host, args.port, args.api_key) == ("127.0.0.1", 1234, None)
    assert args.handler is cli.serve


def test_serving_the_network_needs_an_api_key(capsys) -> None:
    status = cli.main(["serve", "--model", "demo", "--host", "0.0.0.0"], io.StringIO())
    assert status == 1
    assert "--api-key" in capsys.readouterr().err


def test_the_disk_budget_option_takes_the_gb_the_app_shows(capsys) -> None:
    args = cli.build_parser().parse_args(["serve", "--model", "demo", "--kv-disk-budget", "5"])
    assert args.kv_disk_budget == 5 * 2**30  # the app's "5.0 GB", not 5e9 bytes
    assert human_bytes(args.kv_disk_budget) == "5.0 GB"
    assert cli.build_parser().parse_args(["serve", "--model", "demo"]).kv_disk_budget is None
    for bad in ("-1", "nan", "inf", "lots"):
        with pytest.raises(SystemExit) as exited:
            cli.build_parser().parse_args(["serve", "--model", "demo", "--kv-disk-budget", bad])
        assert exited.value.code == 2
        assert "--kv-disk-budget takes a size in GB, 0 or more" in capsys.readouterr().err


def test_pipeline_options_that_cannot_run_are_refused_before_serving(
        tmp_path, monkeypatch, capsys) -> None:
    served = []
    monkeypatch.setattr("engine.server.serve.uvicorn_server", lambda *a, **k: served.append(a))
    assert cli.main(["serve", "--model", "demo", "--split", "10,14"], io.StringIO()) == 1
    assert "--split needs --pipeline N or --hostfile FILE" in capsys.readouterr().err
    assert cli.main(["serve", "--model", "demo", "--pipeline", "0"], io.StringIO()) == 1
    assert "--pipeline takes the number of ranks" in capsys.readouterr().err
    model = make_tiny_model_dir(tmp_path, "qwen3_next")
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps({"backend": "ring", "hosts": [
        {"ssh": host, "ips": [host]} for host in ("mac1.local", "127.0.0.1")]}))
    assert cli.main(["serve", "--model", str(model), "--hostfile", str(hostfile)],
                    io.StringIO()) == 1
    assert "must be this Mac (127.0.0.1)" in capsys.readouterr().err
    assert served == []


def test_a_port_that_cannot_be_served_is_said_before_the_model_loads(
        monkeypatch, capsys) -> None:
    import socket

    loads: list[str] = []
    monkeypatch.setattr("engine.server.bridge.ServerBridge.__init__",
                        lambda self, model, *a, **k: loads.append(model))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli.main(["serve", "--model", "demo", "--port", str(port)], io.StringIO()) == 1
    assert capsys.readouterr().err == (
        f"error: Port {port} is already in use by another program, so the server is off. "
        "Choose another port with --port.\n")
    assert cli.main(["serve", "--model", "demo", "--port", "70000"], io.StringIO()) == 1
    assert "Port 70000 does not exist: ports go from 0 to 65535" in capsys.readouterr().err
    for option in ("--sessions", "--queue-limit"):
        assert cli.main(["serve", "--model", "demo", "--port", "0", option, "0"],
                        io.StringIO()) == 1
        assert f"{option} must be at least 1." in capsys.readouterr().err
    assert loads == []


def test_ctrl_c_stops_the_server_cleanly_with_its_sessions_stored(tmp_path) -> None:
    import os
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx

    model = make_tiny_model_dir(tmp_path, "llama")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {**os.environ, "LONGLEAF_HOME": str(tmp_path / "home")}
    server = subprocess.Popen(
        [sys.executable, "-m", "engine", "serve", "--model", str(model), "--port", str(port)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        reply = httpx.post(url + "/v1/chat/completions", timeout=120, json={
            "model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
        assert reply.status_code == 200
        server.send_signal(signal.SIGINT)
        out, err = server.communicate(timeout=120)
    finally:
        if server.poll() is None:
            server.kill()
    assert server.returncode == 0, err  # was -2, after a CancelledError traceback
    assert "Traceback" not in err and "stopped" in out
    assert list((tmp_path / "home" / "server-kv-snapshots").glob("*.json"))


def test_the_reads_share_and_disk_budget_reach_the_engine(monkeypatch, capsys) -> None:
    assert cli.build_parser().parse_args(["serve", "--model", "demo"]).read_share == 0.5
    made: list[dict] = []

    class Worker:  # stands in for the engine: it records what the server built it with
        def __init__(self, on_event, **options) -> None:
            made.append(options)
            raise EngineError("recorded")

    monkeypatch.setattr("engine.server.bridge.EngineWorker", Worker)
    assert cli.main(["serve", "--model", "demo", "--port", "0", "--read-share", "0.25"],
                    io.StringIO()) == 1
    assert made[-1]["read_share"] == 0.25 and "recorded" in capsys.readouterr().err
    assert cli.main(["serve", "--model", "demo", "--port", "0", "--kv-disk-budget", "2.5"],
                    io.StringIO()) == 1
    assert made[-1]["snapshots"].budget_bytes == int(2.5 * 2**30)
    for bad in ("0", "1.5", "nan", "half"):
        with pytest.raises(SystemExit) as exited:
            cli.build_parser().parse_args(["serve", "--model", "demo", "--read-share", bad])
        assert exited.value.code == 2
        assert "--read-share takes a number above 0 and at most 1" in capsys.readouterr().err


def test_a_model_folder_that_is_not_there_is_said_before_serving(
        tmp_path, monkeypatch, capsys) -> None:
    served = []
    monkeypatch.setattr("engine.server.serve.uvicorn_server", lambda *a, **k: served.append(a))
    missing = tmp_path / "no-such-model"
    assert cli.main(["serve", "--model", str(missing), "--port", "0"], io.StringIO()) == 1
    assert str(missing) in capsys.readouterr().err and served == []


def test_a_model_that_fails_to_load_stops_the_server_with_its_reason(
        tmp_path, monkeypatch, capsys) -> None:
    from engine.errors import ModelLoadError
    from engine.models import loader

    def corrupt(*args, **kwargs):
        raise ModelLoadError("The weights of tiny-llama are damaged.")

    monkeypatch.setenv("LONGLEAF_HOME", str(tmp_path / "home"))
    monkeypatch.setattr(loader, "load_model", corrupt)  # found only while loading
    model = make_tiny_model_dir(tmp_path, "llama")
    out = io.StringIO()
    assert cli.main(["serve", "--model", str(model), "--port", "0"], out) == 1
    assert capsys.readouterr().err == (
        "error: The model did not load: The weights of tiny-llama are damaged.\n")
    assert "stopped" not in out.getvalue()


def test_a_stop_after_the_pipeline_was_lost_does_not_say_its_sessions_are_stored(
        monkeypatch) -> None:
    lost = "The pipeline run failed on rank 1 (mac2.local): its process was killed."

    class LosingServer:  # serves until stopped, the group lost meanwhile
        def __init__(self, bridge, *args, **kwargs) -> None:
            self.bridge = bridge

        def run(self, sockets) -> None:
            self.bridge.load_error = lost

    monkeypatch.setattr("engine.server.serve.uvicorn_server", LosingServer)
    out = io.StringIO()
    assert cli.main(["serve", "--model", "demo", "--port", "0"], out) == 0
    said = out.getvalue()
    # Before, "its sessions are stored", though they lived on the lost ranks.
    assert "its sessions are stored" not in said
    assert "the pipeline's sessions were lost with it" in said and lost in said
