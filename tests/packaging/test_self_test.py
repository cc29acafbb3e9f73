"""``--self-test`` run in-process on a tiny model (the bundle test runs it frozen)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from app.self_test import main, run_self_test
from engine.memory.fit import MODES
from tests.engine.tinymodels import make_tiny_model_dir


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("self-test"), "llama")


def test_generates_in_every_kv_mode(tiny_llama: Path) -> None:
    out = io.StringIO()

    assert run_self_test(str(tiny_llama), max_tokens=3, out=out) == 0

    lines = out.getvalue().splitlines()
    assert lines[:2] == ["self-test: Qt platform offscreen", "self-test: icon and stylesheet found"]
    for mode in MODES:
        [line] = [line for line in lines if line.startswith(f"self-test: {mode}: ")]
        tokens = int(line.split(": ")[2].split()[0])
        assert 1 <= tokens <= 3, line
    assert lines[-1].startswith("self-test: OK")


def test_reports_a_model_that_cannot_load(tmp_path: Path) -> None:
    out = io.StringIO()

    assert run_self_test(str(tmp_path / "no-such-model"), out=out) == 1

    assert "FAILED loading" in out.getvalue()
    assert "does not exist" in out.getvalue()


def test_command_line_flags(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--self-test", "--model", str(tiny_llama), "--max-tokens", "2"]) == 0
    assert "self-test: q6: " in capsys.readouterr().out


def test_reports_missing_resources(tiny_llama: Path, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("app.style.resources_dir", lambda: tmp_path)
    out = io.StringIO()

    assert run_self_test(str(tiny_llama), out=out) == 1

    assert f"FAILED: longleaf.png, longleaf.qss not in {tmp_path}" in out.getvalue()
