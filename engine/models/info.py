"""Describe a model folder (``ModelInfo``): the facts the app and cache need.

The facts come from ``config.json``, the safetensors headers and the layer
kinds of mlx-lm's own cache list, so ``inspect_model_dir`` learns them without
loading any weights.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine.cache import kvquant
from engine.errors import EngineError, ModelLoadError
from engine.models.folder import check_model_dir, has_chat_template

CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")
# Without any context key in the config, assume a conservative window.
FALLBACK_CONTEXT = 4096


@dataclass(frozen=True)
class ModelInfo:
    """Facts about a model folder, as plain values safe to pass between threads.

    Attributes:
        name: display name (the folder name, or the Hub repo id for cached models).
        path: the model folder.
        architecture: mlx-lm's ``model_type`` (e.g. "llama", "qwen3_next").
        num_parameters: parameter count (quantized weights counted unpacked).
        quantization_bits: weight bits of a quantized model, None when unquantized.
        num_layers: number of decoder layers.
        attention_layers: layers whose KV cache grows with the context (the ones
            the paged cache stores); sliding-window layers are not counted.
        attention_layer_indices: every layer with a KV cache, sliding ones included.
        sliding_window_layer_indices: attention layers with a bounded window.
        other_layer_indices: layers without a KV cache (linear attention, SSM).
        kv_heads: KV heads per attention layer.
        head_dim: width of one KV head.
        max_context: longest context the model was trained for, in tokens.
        has_chat_template: whether the tokenizer carries a chat template.
        kv_bytes_per_token: per KV mode, bytes one token of context takes over
            all ``attention_layers`` (None: the mode cannot store this head_dim).
        kv_bytes_full_context: per KV mode, bytes of a ``max_context`` cache.
        q6_supported: whether q6 storage applies (head_dim divisible by 4).
    """

    name: str
    path: str
    architecture: str
    num_parameters: int
    quantization_bits: int | None
    num_layers: int
    attention_layers: int
    attention_layer_indices: tuple[int, ...]
    sliding_window_layer_indices: tuple[int, ...]
    other_layer_indices: tuple[int, ...]
    kv_heads: int
    head_dim: int
    max_context: int
    has_chat_template: bool
    kv_bytes_per_token: dict[str, int | None]
    kv_bytes_full_context: dict[str, int | None]
    q6_supported: bool


def inspect_model_dir(path: str | Path) -> ModelInfo:
    """Read a model folder's facts without loading its weights (for pickers).

    Reads ``config.json``, the safetensors headers and the tokenizer config, and
    builds mlx-lm's model class without evaluating it to learn which layers
    keep a KV cache.

    Raises:
        ModelLoadError: the folder cannot be loaded (same checks as ``load_model``).
    """
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import get_total_parameters

    folder = Path(path).expanduser()
    config, headers, (model_class, args_class) = check_model_dir(folder)
    try:
        # Parameters stay lazy: nothing is allocated, only the module tree is built.
        model = model_class(args_class.from_dict(config))
        _sanitize_lazily(model, headers)
        kinds = classify_layers(make_prompt_cache(model))
    except (ValueError, KeyError, *CONFIG_ERRORS) as error:
        raise invalid_config_error(folder, config, error) from error
    return build_model_info(folder, config, kinds, get_total_parameters(model))


# What a model class raises when config.json holds wrong types or zero sizes.
CONFIG_ERRORS = (TypeError, AttributeError, ZeroDivisionError, IndexError)


def invalid_config_error(folder: Path, config: dict[str, Any], error: Exception) -> ModelLoadError:
    """The error for a ``config.json`` that mlx-lm's model class rejects."""
    detail = str(error).splitlines()[0] if str(error) else type(error).__name__
    return ModelLoadError(
        f"The config.json in {folder} does not describe a valid "
        f"{config['model_type']} model ({detail}); download the model again."
    )


_HEADER_DTYPES = {
    "F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16, "U32": mx.uint32,
    "I32": mx.int32, "U8": mx.uint8, "I8": mx.int8, "I64": mx.int64, "BOOL": mx.bool_,
}


def _sanitize_lazily(model: Any, headers: dict[str, dict[str, Any]]) -> None:
    # Some models drop modules in sanitize() depending on which weights exist
    # (an untied lm_head, say); run it on lazy zeros so the count matches a load.
    if not hasattr(model, "sanitize"):
        return
    weights = {
        name: mx.zeros(entry["shape"], _HEADER_DTYPES.get(entry.get("dtype"), mx.float32))
        for name, entry in headers.items()
    }
    # On failure the module tree stays as built, which is all the facts need.
    with contextlib.suppress(ValueError, KeyError, TypeError, IndexError):
        model.sanitize(weights)


def classify_layers(cache: list[Any]) -> dict[str, tuple[int, ...]]:
    """Sort layers by the cache mlx-lm makes for them.

    Returns:
        ``{"full": ..., "sliding": ..., "other": ...}`` layer indices: full-context
        attention, bounded-window attention, and layers without a KV cache.
    """
    from mlx_lm.models.cache import (
        ChunkedKVCache,
        ConcatenateKVCache,
        KVCache,
        QuantizedKVCache,
        RotatingKVCache,
    )

    kinds: dict[str, list[int]] = {"full": [], "sliding": [], "other": []}
    for index, layer in enumerate(cache):
        if isinstance(layer, RotatingKVCache | ChunkedKVCache):
            kinds["sliding"].append(index)
        elif isinstance(layer, KVCache | QuantizedKVCache | ConcatenateKVCache):
            kinds["full"].append(index)
        else:
            kinds["other"].append(index)
    return {kind: tuple(indices) for kind, indices in kinds.items()}


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    # Multimodal configs nest the language model's facts under text_config.
    nested = config.get("text_config")
    return {**nested, **config} if isinstance(nested, dict) else config


def _attention_shape(config: dict[str, Any]) -> tuple[int, int]:
    text = _text_config(config)
    heads = text.get("num_attention_heads") or text.get("n_head") or 0
    kv_heads = text.get("num_key_value_heads") or text.get("n_kv_heads") or heads
    head_dim = text.get("head_dim")
    if not head_dim and heads:
        head_dim = text.get("hidden_size", 0) // heads
    return int(kv_heads), int(head_dim or 0)


def max_context(config: dict[str, Any]) -> int:
    """The trained context length from a config, or ``FALLBACK_CONTEXT``."""
    text = _text_config(config)
    for key in CONTEXT_KEYS:
        value = text.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return FALLBACK_CONTEXT


def quantization_bits(config: dict[str, Any]) -> int | None:
    """Weight bits of a quantized model's config, None when unquantized."""
    quantization = config.get("quantization") or config.get("quantization_config")
    if isinstance(quantization, dict) and isinstance(quantization.get("bits"), int):
        return quantization["bits"]
    return None


def build_model_info(
    folder: Path, config: dict[str, Any], kinds: dict[str, tuple[int, ...]], parameters: int
) -> ModelInfo:
    """Assemble a folder's ``ModelInfo`` from its config and ``classify_layers`` kinds.

    Raises:
        ModelLoadError: the model has no attention layer, so no KV cache to page.
    """
    attention = tuple(sorted(kinds["full"] + kinds["sliding"]))
    if not attention:
        raise ModelLoadError(
            f"{folder.name} ({config['model_type']}) has no attention layers, so it keeps "
            "no KV cache for Longleaf to page. Choose a transformer model instead."
        )
    kv_heads, head_dim = _attention_shape(config)
    context = max_context(config)
    full_layers = len(kinds["full"])
    per_token: dict[str, int | None] = {}
    full_context: dict[str, int | None] = {}
    for mode in kvquant.MODES:
        try:
            per_token[mode] = kvquant.project_kv_bytes(full_layers, kv_heads, head_dim, 1, mode)
            full_context[mode] = kvquant.project_kv_bytes(
                full_layers, kv_heads, head_dim, context, mode
            )
        except EngineError:
            per_token[mode] = full_context[mode] = None
    return ModelInfo(
        name=folder.name,
        path=str(folder),
        architecture=str(config["model_type"]),
        num_parameters=int(parameters),
        quantization_bits=quantization_bits(config),
        num_layers=len(attention) + len(kinds["other"]),
        attention_layers=full_layers,
        attention_layer_indices=attention,
        sliding_window_layer_indices=kinds["sliding"],
        other_layer_indices=kinds["other"],
        kv_heads=kv_heads,
        head_dim=head_dim,
        max_context=context,
        has_chat_template=has_chat_template(folder),
        kv_bytes_per_token=per_token,
        kv_bytes_full_context=full_context,
        q6_supported=head_dim % 4 == 0,
    )
