"""Tiny instances of every mlx-lm text architecture, built from its own ``ModelArgs``.

A config comes from each class's ``ModelArgs`` fields (widths shrunk, 4 query and
2 KV heads so GQA is exercised) and the weights are mlx's random initial ones, so
the architectures under test are mlx-lm's own with their default features on. The
probe's tests and ``python -m benchmarks.coverage`` build their models here.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path
from typing import Any, cast

TINY_LAYERS = 4
TINY_VOCAB = 128

# Sizes by field name; every other large int that names a width is shrunk by
# _shrink. Heads: 4 query, 2 KV, so GQA is exercised.
_NAMED: dict[str, Any] = {
    "hidden_size": 64, "d_model": 64, "n_embd": 64, "dim": 64, "model_dim": 64,
    "embed_dim": 64, "intermediate_size": 128, "ffn_hidden_size": 128, "ffn_dim": 128,
    "n_inner": 128, "hidden_dim": 128, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32, "expert_intermediate_size": 32,
    "num_hidden_layers": TINY_LAYERS, "n_layer": TINY_LAYERS, "n_layers": TINY_LAYERS,
    "num_layers": TINY_LAYERS, "num_attention_heads": 4, "n_head": 4, "n_heads": 4,
    "num_heads": 4, "num_key_value_heads": 2, "n_kv_heads": 2, "num_kv_heads": 2,
    "multi_query_group_num": 2, "head_dim": 32, "global_head_dim": 64,
    "vocab_size": TINY_VOCAB, "vocab_size_per_layer_input": TINY_VOCAB,
    "hidden_size_per_layer_input": 16, "sliding_window": 16, "sliding_window_pattern": 2,
    "num_experts": 4, "n_routed_experts": 4, "num_local_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "top_k_experts": 2, "moe_topk": 2, "n_shared_experts": 1,
    "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    "kv_lora_rank": 64, "q_lora_rank": 32, "qk_rope_head_dim": 32, "qk_nope_head_dim": 32,
    "v_head_dim": 32, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "layer_norm_eps": 1e-5,
    "norm_eps": 1e-5, "layer_norm_epsilon": 1e-5, "linear_num_value_heads": 4,
    "linear_num_key_heads": 2, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "state_size": 8, "ssm_state_size": 8, "conv_kernel": 4, "time_step_rank": 4,
    # Learned position tables must cover the probe's tokens (MLX does not bounds-check).
    "max_position_embeddings": 4096, "n_positions": 4096, "n_ctx": 4096, "max_seq_len": 4096,
    "seq_length": 4096, "max_sequence_length": 4096, "context_length": 4096,
}
_WIDTH_WORDS = ("size", "dim", "rank", "hidden", "intermediate", "embed", "ffn", "width", "vocab")


def models_dir() -> Path:
    """mlx-lm's ``models`` package folder."""
    import mlx_lm.models

    return Path(mlx_lm.models.__file__).parent


def text_model_types() -> list[str]:
    """Every mlx-lm module that defines both ``Model`` and ``ModelArgs``."""
    found = []
    for path in sorted(models_dir().glob("*.py")):
        source = path.read_text(encoding="utf-8")
        has_model = re.search(r"^class Model\(", source, re.M)
        if has_model and re.search(r"^class ModelArgs", source, re.M):
            found.append(path.stem)
    return found


def tiny_config(model_type: str) -> dict[str, Any]:
    """A small config for ``model_type`` built from its ``ModelArgs`` fields.

    Raises:
        ImportError: mlx-lm has no such module.
    """
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    return _fill(module.ModelArgs, model_type)


def _fill(args_class: Any, model_type: str) -> dict[str, Any]:
    config: dict[str, Any] = {"model_type": model_type}
    for field in dataclasses.fields(args_class):
        value = _tiny_value(field, model_type)
        if value is not dataclasses.MISSING:
            config[field.name] = value
    config["model_type"] = model_type
    return config


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _tiny_value(field: dataclasses.Field, model_type: str) -> Any:
    name, default = field.name, _default(field)
    if name == "text_config":
        return _tiny_text_config(model_type, default)
    if name == "num_kv_shared_layers":
        # Kept on when the class turns it on: that is the case the probe must catch.
        on = default is dataclasses.MISSING or (isinstance(default, int) and default > 0)
        return TINY_LAYERS // 2 if on else default
    unset = default is dataclasses.MISSING or default is None
    if name in _NAMED and (unset or type(default) is int):
        return _NAMED[name]
    if name == "layer_types" and (default is dataclasses.MISSING or default == []):
        return ["sliding_attention", "full_attention"] * (TINY_LAYERS // 2)
    if default is dataclasses.MISSING:
        if "layers" in name and str(field.type) in ("int", "<class 'int'>"):
            return TINY_LAYERS // 2  # some layers of a kind (KV reuse, dense), not all
        return _required(name, str(field.type))
    return _shrink(name, default)


def _shrink(name: str, default: Any) -> Any:
    if isinstance(default, bool) or not isinstance(default, int | list):
        return default
    if isinstance(default, list):
        # Per-layer lists sized for the real depth: keep the first layers' entries.
        return default[:TINY_LAYERS] if len(default) > TINY_LAYERS else default
    if "window" in name and default > 16:
        return 16
    if ("rotary" in name or "rope" in name) and "dim" in name and default > 16:
        return 16  # a rotary width may not exceed the tiny head width
    if default > 256 and any(word in name for word in _WIDTH_WORDS):
        return TINY_VOCAB if "vocab" in name else 64
    return default


def _required(name: str, annotation: str) -> Any:
    outer = annotation.lower().removeprefix("typing.").removeprefix("optional[")
    if outer.startswith(("list", "tuple")):
        return []
    if outer.startswith("dict"):
        return {}
    if "bool" in annotation:
        return False
    if "int" in annotation:
        return 4
    if "float" in annotation:
        return 1e-5 if "eps" in name else 10000.0 if "theta" in name else 1.0
    if "str" in annotation:
        return ""
    return {}


def _tiny_text_config(model_type: str, default: Any) -> Any:
    """A multimodal wrapper's ``text_config``: its language model's tiny config."""
    inner = _inner_text_type(model_type)
    if inner:
        return tiny_config(inner)
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    text_class = getattr(module, "TextConfig", None) or getattr(module, "TextArgs", None)
    if text_class is not None and dataclasses.is_dataclass(text_class):
        return _fill(text_class, model_type)
    return default


def _inner_text_type(model_type: str) -> str | None:
    """The language-model module a multimodal wrapper imports (``from . import qwen3``)."""
    source = (models_dir() / f"{model_type}.py").read_text(encoding="utf-8")
    names = re.findall(r"from \.(\w+) import", source) + re.findall(r"from \. import (\w+)", source)
    known = set(text_model_types())
    return next((n for n in names if n in known and n != model_type), None)


def build_tiny(model_type: str) -> Any:
    """The tiny model for ``model_type`` with mlx's random initial weights, in float32."""
    import mlx.core as mx

    from engine.cache.mlx_lm_compat import model_classes

    config = tiny_config(model_type)
    model_class, args_class = model_classes(config)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(mx.float32)
    _randomize_zeros(model)
    mx.eval(model.parameters())
    return model


def _randomize_zeros(model: Any) -> None:
    """Give all-zero parameters (gains, biases) small random values.

    A zero-initialized output gain makes every logit 0 whatever the cache holds,
    and a probe of such a model would pass without checking anything.
    """
    import mlx.core as mx
    from mlx.utils import tree_flatten, tree_unflatten

    parameters = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    updates = [
        (name, mx.random.normal(value.shape) * 0.02)
        for name, value in parameters
        if mx.issubdtype(value.dtype, mx.floating) and not mx.any(value).item()
    ]
    if updates:
        model.update(tree_unflatten(updates))
