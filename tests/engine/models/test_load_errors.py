"""Load errors a user can read: summarized lists, impossible sizes refused up front."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.errors import ModelLoadError
from engine.models.folder import MAX_DIMENSION, read_config
from engine.models.loader import load_model
from tests.engine.tinymodels import make_tiny_model_dir


def _edit_config(folder: Path, **values: object) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(values)
    (folder / "config.json").write_text(json.dumps(config))


def test_thousands_of_missing_parameters_give_a_short_message(tmp_path: Path) -> None:
    folder = make_tiny_model_dir(tmp_path, "llama")
    layers = json.loads((folder / "config.json").read_text())["num_hidden_layers"]
    _edit_config(folder, num_hidden_layers=2000)  # the weights hold only the first few
    with pytest.raises(ModelLoadError) as refused:
        load_model(str(folder), probe=False)
    message = str(refused.value)
    missing = (2000 - layers) * 9  # every layer of a llama has 9 parameters
    assert f"Missing {missing} parameters" in message
    assert f"and {missing - 3:,} more" in message
    assert message.count("model.layers.") == 3  # the first few names, so one knows what
    assert len(message) < 1000


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "num_hidden_layers"])
def test_a_size_past_what_mlx_can_index_is_refused_with_the_reason(tmp_path: Path,
                                                                   key: str) -> None:
    folder = make_tiny_model_dir(tmp_path, "llama")
    _edit_config(folder, **{key: 2**31})
    for attempt in (lambda: read_config(folder), lambda: load_model(str(folder), probe=False)):
        with pytest.raises(ModelLoadError, match=rf"{key} is 2,147,483,648.*{MAX_DIMENSION:,}"):
            attempt()


def test_the_largest_size_mlx_can_index_is_not_refused_by_the_check(tmp_path: Path) -> None:
    folder = make_tiny_model_dir(tmp_path, "llama")
    _edit_config(folder, vocab_size=MAX_DIMENSION, max_position_embeddings=2**40)
    assert read_config(folder)["vocab_size"] == MAX_DIMENSION


@pytest.mark.parametrize("nested", [False, True])
def test_weights_quantized_in_a_way_mlx_lm_cannot_load_are_refused_saying_so(
        tmp_path: Path, nested: bool) -> None:
    """A bitsandbytes repo (common in Hugging Face caches) read as an unquantized model
    and then failed with "download the model again", which gives the same files."""
    from engine.models.discovery import SkippedModel, inspect_candidate

    folder = make_tiny_model_dir(tmp_path, "llama")
    section = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    _edit_config(folder, **({"text_config": {"quantization_config": section}} if nested
                            else {"quantization_config": section}))
    said = "quantized with bitsandbytes, which mlx-lm cannot load"
    for attempt in (lambda: read_config(folder), lambda: load_model(str(folder), probe=False)):
        with pytest.raises(ModelLoadError, match=said):
            attempt()
    skipped = inspect_candidate("bnb", folder)
    assert isinstance(skipped, SkippedModel) and said in skipped.reason
    # A method mlx-lm turns into its own (gptq, awq, ...) is left to it.
    _edit_config(folder, quantization_config={"quant_method": "gptq", "bits": 4},
                 text_config={})
    assert read_config(folder)
