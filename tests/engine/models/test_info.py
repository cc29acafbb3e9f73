"""engine.models.info: layer kinds and parameter counts from config and headers."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache

from engine.cache import kvquant
from engine.models.info import _attention_shape, classify_layers, count_parameters, layer_kinds


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
        "model.layers.4.self_attn.W_pack.weight",  # baichuan_m1's fused projection
        "model.layers.5.self_attn.qkvg_proj.weight",  # muse_spark's
    )
    kinds = layer_kinds({"num_hidden_layers": 6}, headers)
    assert kinds == {"full": (1, 3, 4, 5), "sliding": (), "other": (0, 2)}


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


# A rope scaling the tiny configs leave out and these attentions read.
_YARN = {"type": "yarn", "factor": 1.0, "original_max_position_embeddings": 4096,
         "mscale": 1.0, "mscale_all_dim": 0, "beta_fast": 32, "beta_slow": 1}


def _mla_and_wide_heads() -> list[str]:
    """mlx-lm's text architectures whose full layers cache other widths than
    ``head_dim``: MLA (kv_lora_rank) and Gemma 4's wider global heads."""
    from tests.engine.tiny_architectures import text_model_types, tiny_config

    found = []
    for model_type in text_model_types():
        try:
            config = tiny_config(model_type)
        except (ImportError, SystemExit):  # a module needing a package not installed
            continue
        if config.get("kv_lora_rank") or config.get("global_head_dim"):
            found.append(model_type)
    return found


@pytest.mark.parametrize("model_type", ["deepseek_v2", "deepseek_v3", "glm4_moe_lite",
                                        "minicpm3", "gemma4_text", "deepseek_v32"])
def test_the_kv_bytes_a_config_projects_are_what_mlx_lms_cache_holds(model_type: str) -> None:
    """The dialog's and the fit check's figure for a model mlx-lm's cache serves (MLA
    keeps keys and values of other widths, or one compressed head), per token."""
    assert model_type in _mla_and_wide_heads()
    config, real, full = _cache_per_token(model_type)
    kv_heads, head_dim = _attention_shape(config)
    assert kvquant.project_kv_bytes(full, kv_heads, head_dim, 1, "fp16") == real


def _cache_per_token(model_type: str) -> tuple[dict, int, int]:
    """(tiny config, fp16 bytes a token takes in its full layers' mlx-lm caches,
    those layers)."""
    from mlx_lm.models.cache import make_prompt_cache

    from engine.cache.mlx_lm_compat import model_classes
    from tests.engine import tiny_architectures

    config = tiny_architectures.tiny_config(model_type)
    if config.get("rope_scaling") is None and model_type in ("deepseek_v2", "minicpm3"):
        config["rope_scaling"] = _YARN
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    cache = make_prompt_cache(model)
    full = classify_layers(cache)["full"]
    model(mx.array([[3] * 8]), cache=cache)
    # Sparse-attention MLA keeps a CacheList: the latent's cache and its indexer's.
    parts = [part for index in full
             for part in getattr(cache[index], "caches", (cache[index],))]
    widths = sum(part.keys.shape[1] * (part.keys.shape[-1] + part.values.shape[-1])
                 for part in parts)
    return config, widths * 2, len(full)


def test_every_architecture_of_other_widths_projects_what_its_cache_holds() -> None:
    """Beyond the named ones: a new MLA module of mlx-lm caching the latent (or not)
    must be listed (or not) in ``LATENT_KV``. Those whose tiny model does not build
    or whose cache is not plain keys and values (an indexer beside it) are left out."""
    wrong, checked = {}, []
    for model_type in _mla_and_wide_heads():
        try:
            config, real, full = _cache_per_token(model_type)
        except (AttributeError, TypeError, ValueError, KeyError):
            continue
        checked.append(model_type)
        projected = kvquant.project_kv_bytes(full, *_attention_shape(config), 1, "fp16")
        if projected != real:
            wrong[model_type] = (projected, real)
    assert len(checked) >= 5 and not wrong, (checked, wrong)
