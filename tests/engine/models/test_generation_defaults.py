"""A model's own sampling defaults from its generation_config.json."""

from __future__ import annotations

import json
from pathlib import Path

from engine.models.generation_defaults import generation_defaults


def _folder(tmp_path: Path, config) -> Path:
    text = config if isinstance(config, str) else json.dumps(config)
    (tmp_path / "generation_config.json").write_text(text, encoding="utf-8")
    return tmp_path


def test_the_five_sampling_keys_are_taken_and_the_rest_ignored(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"do_sample": True, "temperature": 0.6, "top_p": 0.95,
                                "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05,
                                "max_new_tokens": 9000, "eos_token_id": [1, 2]})
    assert generation_defaults(folder) == {"temperature": 0.6, "top_p": 0.95, "top_k": 20,
                                           "min_p": 0.05, "repetition_penalty": 1.05}
    assert isinstance(generation_defaults(folder)["top_k"], int)


def test_do_sample_false_means_greedy(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"do_sample": False, "temperature": 0.9, "top_p": 0.8})
    assert generation_defaults(folder) == {"temperature": 0.0, "top_p": 0.8}


def test_values_out_of_range_or_of_the_wrong_type_give_no_default(tmp_path: Path) -> None:
    folder = _folder(tmp_path, {"temperature": -1, "top_p": 0, "top_k": 2.5, "min_p": 1.0,
                                "repetition_penalty": "1.1"})
    assert generation_defaults(folder) == {}


def test_values_that_are_not_finite_numbers_give_no_default(tmp_path: Path) -> None:
    # json reads these; SamplingParams refuses them, so each send would fail.
    folder = _folder(tmp_path, '{"temperature": Infinity, "repetition_penalty": NaN, '
                               '"top_p": 0.9, "top_k": 1' + "0" * 400 + '}')
    assert generation_defaults(folder) == {"top_p": 0.9}


def test_a_missing_or_broken_file_gives_none(tmp_path: Path) -> None:
    assert generation_defaults(tmp_path) == {}
    assert generation_defaults(_folder(tmp_path, "{not json")) == {}
    assert generation_defaults(_folder(tmp_path, "[0.7]")) == {}


def test_a_file_saved_with_a_byte_order_mark_is_read(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text('{"temperature": 0.6}',
                                                     encoding="utf-8-sig")
    assert generation_defaults(tmp_path) == {"temperature": 0.6}
