"""engine.models.info: layer kinds and parameter counts from config and headers."""

from __future__ import annotations

from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from engine.models.info import classify_layers, count_parameters, layer_kinds


def test_cache_lists_count_as_the_attention_they_hold() -> None:
    cache = [
        CacheList(KVCache(), KVCache()),  # MLA plus its indexer (deepseek_v32)
        CacheList(ArraysCache(size=2), KVCache()),  # SSM plus attention (falcon_h1)
        CacheList(RotatingKVCache(max_size=8)),
        ArraysCache(size=2),
        KVCache(),
    ]
    assert classify_layers(cache) == {"full": (0, 1, 4), "sliding": (2,), "other": (3,)}


def test_a_models_own_cache_that_counts_tokens_is_attention() -> None:
    class LayerCache:  # as deepseek_v41 makes: compressed attention state
        offset = 0

    assert classify_layers([LayerCache(), ArraysCache(size=2)])["full"] == (0,)


def _headers(*names: str) -> dict[str, dict]:
    return {name: {"shape": [2, 2], "dtype": "F32", "data_offsets": [0, 16]} for name in names}


def test_layers_without_attention_weights_are_other() -> None:
    headers = _headers(
        "model.layers.0.linear_attn.in_proj_qkvz.weight",
        "model.layers.1.self_attn.k_proj.weight",
        "backbone.layers.2.mixer.in_proj.weight",
        "model.layers.3.self_attn.kv_a_proj_with_mqa.weight",
    )
    kinds = layer_kinds({"num_hidden_layers": 4}, headers)
    assert kinds == {"full": (1, 3), "sliding": (), "other": (0, 2)}


def test_config_patterns_mark_sliding_and_linear_layers() -> None:
    headers = _headers(*(f"model.layers.{i}.self_attn.q_proj.weight" for i in range(4)))
    gemma = {"num_hidden_layers": 4, "sliding_window_pattern": 2, "sliding_window": 16}
    assert layer_kinds(gemma, headers)["sliding"] == (0, 2)
    typed = {"num_hidden_layers": 4, "layer_types": ["sliding_attention", "full_attention"] * 2}
    assert layer_kinds(typed, headers)["full"] == (1, 3)
    hybrid = {"num_hidden_layers": 4, "full_attention_interval": 4}
    assert layer_kinds(hybrid, headers) == {"full": (3,), "sliding": (), "other": (0, 1, 2)}


def test_quantized_weights_count_unpacked_and_scales_do_not_count() -> None:
    headers = {
        "a.weight": {"shape": [8, 4]},  # 4-bit: 8 values per uint32 word
        "a.scales": {"shape": [8, 1]},
        "a.biases": {"shape": [8, 1]},
        "a.bias": {"shape": [8]},
        "norm.weight": {"shape": [32]},
    }
    config = {"quantization": {"group_size": 32, "bits": 4}}
    assert count_parameters(config, headers) == 8 * 32 + 8 + 32
    config["quantization"]["a"] = {"bits": 8, "group_size": 32}
    assert count_parameters(config, headers) == 8 * 16 + 8 + 32
