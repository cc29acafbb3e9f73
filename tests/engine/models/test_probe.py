"""engine.models.probe and benchmarks.coverage: one test per family of outcome.

Tiny models come from ``build_tiny`` (a config from each class's
``ModelArgs``, mlx's random initial weights), so the architectures under test are
mlx-lm's own, with their default features on.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

from engine.cache.paged_cache import PagedKVCache
from engine.errors import ModelLoadError
from engine.models import probe
from engine.models.loader import load_model
from engine.models.probe import MAX_REL_DIFF, ProbeResult, make_session_cache, probe_model
from tests.engine.tiny_architectures import (
    TINY_LAYERS,
    TINY_VOCAB,
    build_tiny,
    text_model_types,
    tiny_config,
)
from tests.engine.tinymodels import make_tiny_model_dir


@pytest.fixture(scope="module")
def tiny() -> dict[str, Any]:
    """Tiny models built once for the module, by model_type."""
    return {}


def _model(tiny: dict[str, Any], model_type: str) -> Any:
    if model_type not in tiny:
        tiny[model_type] = build_tiny(model_type)
    return tiny[model_type]


def _loaded(model: Any, result: ProbeResult) -> SimpleNamespace:
    return SimpleNamespace(model=model, probe=result, info=SimpleNamespace(name="tiny"))


def _logits(model: Any, cache: list[Any], tokens: list[int]) -> mx.array:
    return probe._run(model, cache, tokens)


# --- paged -----------------------------------------------------------------


def test_llama_is_paged_within_fp16_rounding(tiny) -> None:
    result = probe_model(_model(tiny, "llama"))
    assert result.verdict == "paged" and result.reason == ""
    assert result.max_rel_diff is not None and 0 < result.max_rel_diff <= MAX_REL_DIFF


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_half_precision_models_are_judged_at_their_precision(dtype) -> None:
    # bf16 activations alone move logits ~1e-2; a float32 bound would send
    # every bf16 model to mlx-lm's cache. Wrong rows still fail (gemma4 below).
    model = build_tiny("qwen3")
    model.set_dtype(dtype)
    result = probe_model(model)
    assert result.verdict == "paged"
    assert result.max_rel_diff <= probe.max_rel_diff_for(model)
    shared = build_tiny("gemma4_text")
    shared.set_dtype(dtype)
    assert probe_model(shared).verdict == "mlx-lm"


def test_paged_session_cache_holds_paged_layers(tiny) -> None:
    model = _model(tiny, "llama")
    chosen = make_session_cache(_loaded(model, probe_model(model)), "q8", page_size=16)
    assert chosen.kind == "paged" and chosen.note == ""
    assert all(isinstance(c, PagedKVCache) for c in chosen.cache)
    assert chosen.cache[0].pool.mode == "q8"


def test_a_wrong_paged_answer_is_caught_by_the_numbers(tiny, monkeypatch) -> None:
    # A paged cache that stores something else than it returns (KV-shared layers
    # read only the returned chunk) must turn the verdict, whatever the name.
    model = _model(tiny, "llama")
    original = PagedKVCache.update_and_fetch

    def store_zero_values(self, keys, values):
        original(self, keys, mx.zeros_like(values))
        return keys, values

    monkeypatch.setattr(PagedKVCache, "update_and_fetch", store_zero_values)
    result = probe_model(model)
    assert result.verdict == "mlx-lm"
    assert result.max_rel_diff is not None and result.max_rel_diff > MAX_REL_DIFF
    assert "differ from mlx-lm's" in result.reason


# --- mlx-lm's own cache ---------------------------------------------------


def test_gemma4_kv_shared_layers_fall_back_to_mlx_lm(tiny) -> None:
    model = _model(tiny, "gemma4_text")
    assert model.args.num_kv_shared_layers > 0
    result = probe_model(model)
    assert result.verdict == "mlx-lm"
    assert result.reason.startswith("KV-shared layers")
    assert result.max_rel_diff is not None and result.max_rel_diff > MAX_REL_DIFF


def test_gemma4_without_kv_sharing_is_paged() -> None:
    from engine.cache.mlx_lm_compat import model_classes

    config = {**tiny_config("gemma4_text"), "num_kv_shared_layers": 0}
    model_class, args_class = model_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    assert probe_model(model).verdict == "paged"


def test_fallback_session_cache_gives_mlx_lms_numbers(tiny) -> None:
    model = _model(tiny, "gemma4_text")
    result = probe_model(model)
    chosen = make_session_cache(_loaded(model, result), "fp16", page_size=16)
    assert chosen.kind == "mlx-lm" and "KV-shared layers" in chosen.note
    assert not any(isinstance(c, PagedKVCache) for c in chosen.cache)
    tokens = probe._probe_tokens(model)
    ours = _logits(model, chosen.cache, tokens)
    reference = _logits(model, make_prompt_cache(model), tokens)
    assert mx.array_equal(ours, reference).item()


def test_mla_keys_and_values_of_different_widths_fall_back(tiny) -> None:
    result = probe_model(_model(tiny, "deepseek_v3"))
    assert result.verdict == "mlx-lm" and result.max_rel_diff is None
    assert result.reason.startswith("keys and values of different widths")


def test_mla_cannot_use_mlx_lms_quantized_cache_either(tiny) -> None:
    # deepseek_v3 reads its cached keys as one array; QuantizedKVCache returns tuples.
    model = _model(tiny, "deepseek_v3")
    result = probe_model(model)
    assert not result.quantized
    chosen = make_session_cache(_loaded(model, result), "q8", page_size=16)
    assert chosen.kind == "mlx-lm" and all(type(c) is KVCache for c in chosen.cache)
    assert "q8 keeps them whole" in chosen.note


def test_fallback_quantizes_with_mlx_lms_cache_where_it_runs(tiny) -> None:
    model = _model(tiny, "llama")
    tokens = probe._probe_tokens(model)
    assert probe._quantized_works(model, tokens)
    result = ProbeResult("mlx-lm", "a reason", None, quantized=True)
    chosen = make_session_cache(_loaded(model, result), "q4", page_size=16)
    assert chosen.kind == "mlx-lm quantized" and "4 bits" in chosen.note
    assert all(isinstance(c, QuantizedKVCache) and c.bits == 4 for c in chosen.cache)
    logits = _logits(model, chosen.cache, tokens)
    reference = _logits(model, make_prompt_cache(model), tokens)
    assert mx.all(mx.isfinite(logits)).item()
    assert 0 < probe.relative_difference(logits, reference) < 0.5


def test_missing_keys_and_values_method_falls_back_with_the_error(tiny) -> None:
    result = probe_model(_model(tiny, "afm7"))
    assert result.verdict == "mlx-lm"
    assert "keys_and_values" in result.reason


def test_fallback_without_a_working_quantized_cache_keeps_kvcache_with_a_note(tiny) -> None:
    model = _model(tiny, "llama")
    result = ProbeResult("mlx-lm", "attention sinks", None, quantized=False)
    chosen = make_session_cache(_loaded(model, result), "q6", page_size=16)
    assert chosen.kind == "mlx-lm"
    assert all(type(c) is KVCache for c in chosen.cache)
    assert "attention sinks" in chosen.note and "q6" in chosen.note


# --- refused and not built ---------------------------------------------------


def test_non_finite_reference_is_refused(tiny) -> None:
    model = build_tiny("llama")
    model.model.embed_tokens.weight = mx.full(model.model.embed_tokens.weight.shape, float("nan"))
    result = probe_model(model)
    assert result.verdict == "refused" and "non-finite" in result.reason
    with pytest.raises(ModelLoadError, match="cannot run"):
        make_session_cache(_loaded(model, result), "fp16", page_size=16)


def test_all_zero_logits_are_refused_not_passed(tiny) -> None:
    # Equal zeros would "match" whatever the paged cache held.
    model = build_tiny("llama")
    embed = model.model.embed_tokens  # tied: also the output head
    embed.weight = mx.zeros_like(embed.weight)
    result = probe_model(model)
    assert result.verdict == "refused" and "all-zero" in result.reason


def test_coverage_skips_tiny_models_whose_logits_ignore_the_context() -> None:
    model = build_tiny("llama")
    assert probe.depends_on_context(model)
    for layer in model.model.layers:  # attention and MLP add nothing: no context flows
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    assert not probe.depends_on_context(model)


def test_coverage_checks_that_pages_reach_the_logits(tiny) -> None:
    model = _model(tiny, "llama")
    assert probe.paged_layers_matter(model)
    assert probe_model(model).verdict == "paged"  # the sabotage is undone
    for layer in model.model.layers:  # attention adds nothing: pages cannot matter
        layer.self_attn.o_proj.weight = mx.zeros_like(layer.self_attn.o_proj.weight)
    assert not probe.paged_layers_matter(model)
    tiny.pop("llama")


def test_zero_initialized_gains_get_random_values() -> None:
    model = build_tiny("talkie")
    assert all(mx.any(v).item() for _, v in tree_flatten(model.parameters()))
    assert probe.depends_on_context(model)


def test_a_model_mlx_lm_cannot_run_is_refused(tiny) -> None:
    model = _model(tiny, "llama")

    class Broken:
        args = model.args
        layers = model.layers

        def __call__(self, inputs, cache=None):
            raise ValueError("shapes do not broadcast")

        def named_modules(self):
            return model.named_modules()

    result = probe_model(Broken())
    assert result.verdict == "refused"
    expected = "mlx-lm's own cache fails on this model: ValueError: shapes do not broadcast"
    assert result.reason == expected


def test_cache_lists_fall_back_to_mlx_lm_with_their_name(tiny) -> None:
    result = probe_model(_model(tiny, "deepseek_v32"))
    assert result.verdict == "mlx-lm" and "CacheList" in result.reason


# --- load_model ----------------------------------------------------------------


def test_load_model_carries_the_probe(tiny_model_root: Path) -> None:
    loaded = load_model(make_tiny_model_dir(tiny_model_root, "gemma3_text"))
    assert loaded.probe is not None and loaded.probe.verdict == "paged"


def test_load_model_refuses_what_cannot_run(tiny_model_root: Path, tmp_path: Path) -> None:
    source = make_tiny_model_dir(tiny_model_root, "llama")
    folder = tmp_path / "nan"
    shutil.copytree(source, folder)
    weights = dict(tree_flatten(mx.load(str(folder / "model.safetensors"))))
    name = "model.embed_tokens.weight"
    weights[name] = mx.full(weights[name].shape, float("nan"))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "llama"
    with pytest.raises(ModelLoadError, match="non-finite logits"):
        load_model(folder)
    assert load_model(folder, probe=False).probe is None


# --- the table -----------------------------------------------------------------


def test_tiny_configs_are_small_and_keep_default_features() -> None:
    config = tiny_config("gemma4_text")
    assert config["num_hidden_layers"] == TINY_LAYERS
    assert config["vocab_size"] == TINY_VOCAB
    assert 0 < config["num_kv_shared_layers"] < config["num_hidden_layers"]
    assert "llama" in text_model_types()
