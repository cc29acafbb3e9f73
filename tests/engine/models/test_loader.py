"""engine.models.loader: loading through mlx-lm, the facts it reports, and broken folders."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from engine.cache import kvquant
from engine.errors import ModelLoadError
from engine.models.info import ModelInfo, inspect_model_dir
from engine.models.loader import load_model
from tests.engine.tinymodels import ARCHS, make_tiny_model_dir, tiny_config


@pytest.fixture
def tiny_root(tiny_model_root: Path) -> Path:
    """The session's shared tiny-model folder (tests copy before damaging)."""
    return tiny_model_root


def _tiny(root: Path, arch: str, **overrides) -> Path:
    return make_tiny_model_dir(root, arch, **overrides)


def _copy(folder: Path, tmp_path: Path) -> Path:
    copy = tmp_path / folder.name
    shutil.copytree(folder, copy)
    return copy


@pytest.mark.parametrize("arch", ARCHS)
def test_inspect_matches_load_for_every_arch(tiny_root: Path, arch: str) -> None:
    folder = _tiny(tiny_root, arch)
    loaded = load_model(folder)
    assert inspect_model_dir(folder) == loaded.info
    assert loaded.info.architecture == arch


@pytest.mark.parametrize("arch", ARCHS)
def test_kv_shape_matches_what_the_model_writes(tiny_root: Path, arch: str) -> None:
    from mlx_lm.models.cache import make_prompt_cache

    loaded = load_model(_tiny(tiny_root, arch))
    cache = make_prompt_cache(loaded.model)
    logits = loaded.model(mx.array([[1, 2, 3]]), cache=cache)
    assert logits.shape[-1] == tiny_config(arch)["vocab_size"]
    info = loaded.info
    for index in info.attention_layer_indices:
        keys = cache[index].state[0]
        assert keys.shape[1] == info.kv_heads
        assert keys.shape[-1] == info.head_dim


def test_llama_facts_come_from_config_and_weights(tiny_root: Path) -> None:
    from mlx_lm.utils import get_total_parameters

    folder = _tiny(tiny_root, "llama")
    config = json.loads((folder / "config.json").read_text())
    loaded = load_model(folder)
    info = loaded.info
    assert isinstance(info, ModelInfo)
    assert info.name == folder.name and Path(info.path) == folder
    assert info.num_layers == config["num_hidden_layers"]
    assert info.attention_layer_indices == tuple(range(config["num_hidden_layers"]))
    assert info.attention_layers == config["num_hidden_layers"]
    assert info.other_layer_indices == () and info.sliding_window_layer_indices == ()
    assert info.kv_heads == config["num_key_value_heads"]
    assert info.head_dim == config["head_dim"]
    assert info.num_parameters == get_total_parameters(loaded.model)
    assert info.num_parameters == sum(v.size for _, v in tree_flatten(loaded.model.parameters()))
    assert info.quantization_bits is None
    assert info.has_chat_template is True
    assert ("q6" in info.unavailable_modes) is (info.head_dim % 4 != 0)


def test_kv_projection_uses_kvquant_for_each_mode(tiny_root: Path) -> None:
    info = load_model(_tiny(tiny_root, "llama")).info
    assert set(info.kv_bytes_per_token) == set(kvquant.MODES)
    for mode in kvquant.MODES:
        args = (info.attention_layers, info.kv_heads, info.head_dim)
        assert info.kv_bytes_per_token[mode] == kvquant.project_kv_bytes(*args, 1, mode)
        expected = kvquant.project_kv_bytes(*args, info.max_context, mode)
        assert info.kv_bytes_full_context[mode] == expected
    assert info.kv_bytes_per_token["q4"] < info.kv_bytes_per_token["q8"]
    assert info.kv_bytes_per_token["q8"] < info.kv_bytes_per_token["fp16"]


def test_q6_unsupported_head_dim_reports_none(tmp_path: Path) -> None:
    # head_dim 18 = 2 * 9: not a multiple of 4, so q6 cannot pack it.
    folder = make_tiny_model_dir(
        tmp_path, "llama", hidden_size=72, num_attention_heads=4, num_key_value_heads=2,
        head_dim=18,
    )
    info = inspect_model_dir(folder)
    assert info.head_dim == 18
    assert info.unavailable_modes == ("q6",)
    assert info.kv_bytes_per_token["q6"] is None
    assert info.kv_bytes_full_context["q6"] is None
    assert info.kv_bytes_per_token["fp16"] == kvquant.project_kv_bytes(
        info.attention_layers, 2, 18, 1, "fp16"
    )


def test_hybrid_model_separates_attention_from_linear_layers(tiny_root: Path) -> None:
    from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache

    loaded = load_model(_tiny(tiny_root, "qwen3_next"))
    cache = make_prompt_cache(loaded.model)
    info = loaded.info
    assert info.other_layer_indices, "qwen3_next has linear-attention layers"
    assert info.attention_layer_indices
    assert all(isinstance(cache[i], KVCache) for i in info.attention_layer_indices)
    assert all(isinstance(cache[i], ArraysCache) for i in info.other_layer_indices)
    assert info.attention_layers == len(info.attention_layer_indices)
    assert info.num_layers == len(cache)


def test_sliding_window_layers_are_flagged_and_not_paged(tiny_root: Path) -> None:
    from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache

    loaded = load_model(_tiny(tiny_root, "gemma3_text"))
    cache = make_prompt_cache(loaded.model)
    info = loaded.info
    sliding = tuple(i for i, c in enumerate(cache) if isinstance(c, RotatingKVCache))
    assert sliding and info.sliding_window_layer_indices == sliding
    assert set(sliding) < set(info.attention_layer_indices)
    assert info.attention_layers == len(cache) - len(sliding)


def test_cpu_computes_in_float32_even_for_float16_weights(tmp_path: Path) -> None:
    folder = make_tiny_model_dir(tmp_path, "llama", dtype="float16")
    loaded = load_model(folder, compute_dtype=mx.float32)
    dtypes = {v.dtype for _, v in tree_flatten(loaded.model.parameters())}
    assert dtypes == {mx.float32}
    kept = load_model(folder, compute_dtype=mx.float16)
    assert {v.dtype for _, v in tree_flatten(kept.model.parameters())} == {mx.float16}


def test_quantized_model_reports_bits_and_unpacked_parameters(tiny_root, tmp_path) -> None:
    from mlx_lm.utils import load, quantize_model, save_config, save_model

    source = _tiny(tiny_root, "llama")
    model, _ = load(str(source))
    config = json.loads((source / "config.json").read_text())
    model, config = quantize_model(model, config, group_size=32, bits=4)
    target = tmp_path / "quantized"
    save_model(target, model)
    save_config(config, target / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, target / name)
    info = load_model(target).info
    assert info.quantization_bits == 4
    assert info.num_parameters == load_model(source).info.num_parameters
    assert inspect_model_dir(target) == info


def _mamba_dir(tmp_path: Path) -> Path:
    from engine.cache.mlx_lm_compat import model_classes

    config = {
        "model_type": "mamba", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
        "state_size": 8, "num_hidden_layers": 2, "conv_kernel": 4, "use_bias": False,
        "use_conv_bias": True, "time_step_rank": 4,
    }
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    folder = tmp_path / "mamba"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    shutil.copy(_source_tokenizer(tmp_path), folder / "tokenizer.json")
    return folder


def _source_tokenizer(tmp_path: Path) -> Path:
    return make_tiny_model_dir(tmp_path / "src", "llama") / "tokenizer.json"


def _break(kind: str, folder: Path) -> tuple[Path, str]:
    """Damage a copy of a tiny model; return the folder and a phrase the error must hold."""
    weights = folder / "model.safetensors"
    if kind == "missing folder":
        return folder / "nope", "does not exist"
    if kind == "missing config":
        (folder / "config.json").unlink()
        return folder, "no config.json"
    if kind == "invalid json":
        (folder / "config.json").write_text('{"model_type": "llama", ')
        return folder, "not valid JSON"
    if kind == "no model_type":
        (folder / "config.json").write_text('{"hidden_size": 8}')
        return folder, "no model_type"
    if kind == "missing weights":
        weights.unlink()
        return folder, r"no model\*\.safetensors"
    if kind == "truncated weights":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
        return folder, "corrupt or truncated"
    if kind == "garbage weights":
        weights.write_bytes(b"\xff" * 64)
        return folder, "corrupt or truncated"
    if kind == "header not a table":
        header = b"[1, 2, 3]"
        weights.write_bytes(len(header).to_bytes(8, "little") + header)
        return folder, "not a tensor table"
    if kind == "unknown architecture":
        config = json.loads((folder / "config.json").read_text())
        config["model_type"] = "no_such_arch"
        (folder / "config.json").write_text(json.dumps(config))
        return folder, "does not support the architecture 'no_such_arch'"
    if kind == "missing tokenizer":
        (folder / "tokenizer.json").unlink()
        return folder, "has no tokenizer"
    raise AssertionError(kind)


BROKEN = (
    "missing folder", "missing config", "invalid json", "no model_type", "missing weights",
    "truncated weights", "garbage weights", "header not a table", "unknown architecture",
    "missing tokenizer",
)


@pytest.mark.parametrize("kind", BROKEN)
@pytest.mark.parametrize("reader", [load_model, inspect_model_dir], ids=["load", "inspect"])
def test_broken_folders_raise_model_load_error(tiny_root, tmp_path, kind, reader) -> None:
    folder, phrase = _break(kind, _copy(_tiny(tiny_root, "llama"), tmp_path))
    with pytest.raises(ModelLoadError, match=phrase):
        reader(folder)


@pytest.mark.parametrize("reader", [load_model, inspect_model_dir], ids=["load", "inspect"])
def test_model_without_attention_layers_is_refused(tmp_path: Path, reader) -> None:
    with pytest.raises(ModelLoadError, match="no attention layers"):
        reader(_mamba_dir(tmp_path))


def test_weights_of_another_model_fail_with_model_load_error(tiny_root, tmp_path) -> None:
    folder = _copy(_tiny(tiny_root, "llama"), tmp_path)
    config = json.loads((folder / "config.json").read_text())
    config["num_hidden_layers"] += 1  # the weights now lack a layer
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="download the model again"):
        load_model(folder)


def test_a_folder_whose_name_reads_as_a_glob_pattern_is_seen_and_loads(
        tiny_root: Path, tmp_path: Path) -> None:
    """"My Models [MLX]": a name, not a pattern matching one letter of M, L or X."""
    folder = tmp_path / "My Models [MLX]" / "tiny llama"
    shutil.copytree(_tiny(tiny_root, "llama"), folder)
    assert inspect_model_dir(folder).architecture == "llama"
    loaded = load_model(folder)
    assert loaded.info.path == str(folder) and loaded.info.attention_layers > 0
