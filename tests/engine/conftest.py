"""Fixtures for engine tests: tiny mlx-lm model folders, built once per session."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.engine.tinymodels import ARCHS, make_tiny_model_dir


@pytest.fixture(scope="session")
def tiny_model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One folder holding every tiny model the session builds."""
    return tmp_path_factory.mktemp("tiny-models")


@pytest.fixture(scope="session", params=ARCHS)
def tiny_model_dir(request: pytest.FixtureRequest, tiny_model_root: Path) -> Path:
    """A tiny model folder; runs a test once per arch unless parametrized.

    Pick archs with ``@pytest.mark.parametrize("tiny_model_dir", ["gemma3_text"],
    indirect=True)``. Tests must not write into the folder: it is shared.
    """
    return make_tiny_model_dir(tiny_model_root, request.param)


@pytest.fixture
def tiny_model(tiny_model_dir: Path) -> tuple[Any, Any]:
    """A freshly loaded ``(model, tokenizer)`` from ``tiny_model_dir``."""
    from mlx_lm.utils import load

    return load(str(tiny_model_dir))


@pytest.fixture(scope="session")
def demo_model(demo_home: Path) -> tuple[Any, Any]:
    """SmolLM2-135M (the app's demo model) and its tokenizer, dequantized to float32.

    The CPU backend emulates float16, so the model computes in float32 here.
    """
    import mlx.core as mx
    from mlx_lm.utils import dequantize_model, load

    from engine.models.demo import ensure_demo_model

    patch = pytest.MonkeyPatch()
    patch.setenv("LONGLEAF_HOME", str(demo_home))
    try:
        model, tokenizer = load(str(ensure_demo_model()))  # converted already
    finally:
        patch.undo()
    model = dequantize_model(model)
    model.set_dtype(mx.float32)
    return model, tokenizer


@pytest.fixture
def always_draft(monkeypatch: pytest.MonkeyPatch) -> None:
    """Verify every speculative proposal, whatever it earns (rows free, no margin),
    so every verification path runs on random-weight models, whose drafts the
    drafter would rightly skip."""
    from engine.session import speculative

    monkeypatch.setattr(speculative, "ROW_COST", dict.fromkeys(speculative.ROW_COST, 0.0))
    monkeypatch.setattr(speculative, "GAIN_MARGIN", 0.0)
