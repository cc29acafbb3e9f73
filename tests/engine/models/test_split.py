"""can_split: which models mlx-lm splits into pipeline stages, from config.json alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.models.split import can_split
from tests.engine.tinymodels import make_tiny_model_dir


def test_only_architectures_with_mlx_lm_pipeline_support_can_be_split(tmp_path: Path) -> None:
    assert can_split(make_tiny_model_dir(tmp_path, "qwen3_next"))
    assert not can_split(make_tiny_model_dir(tmp_path, "llama"))
    assert not can_split(make_tiny_model_dir(tmp_path, "gemma3_text"))


def test_a_folder_that_is_no_model_cannot_be_split(tmp_path: Path) -> None:
    assert not can_split(tmp_path / "missing")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text('{"model_type": "no_such_arch"}')
    assert not can_split(tmp_path / "odd")


@pytest.mark.parametrize(("model_type", "splits"), [
    ("qwen2", True), ("qwen3_5", True), ("qwen3_5_moe", True), ("llama", False)])
def test_the_architecture_alone_decides_without_weights(
        tmp_path: Path, model_type: str, splits: bool) -> None:
    """qwen3_5_moe's Model is qwen3_5's: the mixin is found through its bases."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    assert can_split(tmp_path) is splits
