"""The typed QSettings wrapper writes only under the redirected data dir."""

from __future__ import annotations

import pytest

from app.settings import Settings
from engine.paths import data_dir
from engine.sampling import SamplingParams


def test_defaults() -> None:
    s = Settings()
    assert s.path.parent == data_dir()
    assert (s.default_mode, s.page_size, s.ingest_chunk) == ("q8", 256, 512)
    assert s.memory_budget_bytes is None
    assert s.sampling == SamplingParams()
    assert s.last_model == "demo"
    assert s.model_folders == []


def test_round_trip_through_the_file() -> None:
    s = Settings()
    s.default_mode = "q6"
    s.page_size = 128
    s.ingest_chunk = 1024
    s.memory_budget_bytes = 2 * 2**30
    s.sampling = SamplingParams(temperature=0.2, top_k=40, max_tokens=99, seed=7)
    s.system_prompt = "Be brief."
    s.model_folders = ["/models/a", "/models/b", "/models/a"]
    s.last_model = "/models/b"
    s.sync()
    again = Settings()
    assert (again.default_mode, again.page_size, again.ingest_chunk) == ("q6", 128, 1024)
    assert again.memory_budget_bytes == 2 * 2**30
    assert again.sampling == SamplingParams(temperature=0.2, top_k=40, max_tokens=99, seed=7)
    assert again.system_prompt == "Be brief."
    assert again.model_folders == ["/models/a", "/models/b"]
    assert again.last_model == "/models/b"
    assert s.path.read_text().count("default_mode=q6") == 1


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="q8, q6, q4, fp16"):
        Settings().default_mode = "q6_k"
