"""The recommended long-context models."""

from __future__ import annotations

from engine.models.catalog import RECOMMENDED_MODELS


def test_recommended_models_are_long_context_mlx_community_repos() -> None:
    repos = [m.repo_id for m in RECOMMENDED_MODELS]
    assert len(set(repos)) == len(repos) >= 3
    for model in RECOMMENDED_MODELS:
        assert model.repo_id.startswith("mlx-community/")
        assert model.max_context >= 131_072
        assert model.approx_size_bytes > 10**9
        assert model.attention_layers and model.kv_heads and model.head_dim % 4 == 0
