"""Sampling follows the loaded model's generation_config.json where Settings set nothing."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

from app.settings import DEFAULT_REPETITION_PENALTY, Settings
from engine import SamplingParams
from tests.app.conftest import close_window, open_window

MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "min_p": 0.05,
                  "repetition_penalty": 1.05}


def test_a_key_set_in_settings_wins_over_the_models_default() -> None:
    settings = Settings()
    assert settings.sampling_for(MODEL_DEFAULTS) == replace(settings.sampling, **MODEL_DEFAULTS)
    assert settings.sampling_for({}) == settings.sampling
    assert settings.sampling.repetition_penalty == DEFAULT_REPETITION_PENALTY  # no file: ours
    # Saving one edited key (as Settings' Save does) writes that key alone.
    settings.sampling = replace(settings.sampling, top_k=5)
    assert set(settings.stored()) == {"sampling/top_k"}
    chosen = settings.sampling_for(MODEL_DEFAULTS)
    assert chosen.top_k == 5
    assert chosen.temperature == 0.6 and chosen.repetition_penalty == 1.05
    # A key set to the app's own default stays the user's choice too.
    settings.sampling = replace(settings.sampling, temperature=0.0)
    assert settings.sampling_for(MODEL_DEFAULTS).temperature == 0.0


def test_answers_use_the_loaded_models_own_defaults(qtbot, tiny_llama, tmp_path: Path) -> None:
    folder = tmp_path / "model"
    shutil.copytree(tiny_llama, folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, **MODEL_DEFAULTS}), encoding="utf-8")
    # Its settings set temperature 0 and repetition penalty 1.0 (and max_tokens, seed).
    window = open_window(qtbot, folder)
    try:
        c = window.controller
        assert set(c.settings.stored()) >= {"sampling/temperature",
                                            "sampling/repetition_penalty"}
        sampling = c.sampling()
        # Set in Settings: the user's values; the rest from the model.
        assert (sampling.temperature, sampling.repetition_penalty) == (0.0, 1.0)
        assert (sampling.top_p, sampling.top_k, sampling.min_p) == (0.95, 20, 0.05)
        sent: list[SamplingParams] = []
        chat = c.bridge.chat

        def spy(session_id, messages, params, handler):
            sent.append(params)
            return chat(session_id, messages, params, handler)

        c.bridge.chat = spy
        c.new_session("q8")
        with qtbot.waitSignal(c.answerFinished, timeout=120_000):
            c.send("hello")
        assert sent == [sampling]
    finally:
        close_window(window)
