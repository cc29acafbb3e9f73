"""``generate --pipeline 2 --speculative lookup`` is refused, with what to do instead;
left to the default, a pipeline decodes plainly."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from engine.cli import main
from tests.engine.tinymodels import make_tiny_model_dir


def test_speculative_decoding_over_a_pipeline_is_refused_before_any_rank_starts(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    launched = []
    monkeypatch.setattr("engine.cli.launch", lambda *a, **k: launched.append(a) or 0)
    # A model mlx-lm can split (the demo's llama is refused before this check).
    model = str(make_tiny_model_dir(tmp_path, "qwen3_next"))
    assert main(["generate", "--model", model, "--prompt", "hi", "--pipeline", "2",
                 "--speculative", "lookup"], out=io.StringIO()) == 1
    assert "not available over a pipeline yet: run with --speculative off" \
        in capsys.readouterr().err
    assert launched == []
    assert main(["generate", "--model", model, "--prompt", "hi", "--pipeline", "2",
                 "--speculative", "off"], out=io.StringIO()) == 0
    assert main(["generate", "--model", model, "--prompt", "hi", "--pipeline", "2"],
                out=io.StringIO()) == 0
    assert len(launched) == 2
