"""Describe a model folder (``ModelInfo``): the facts the app and cache need.

The facts come from ``config.json`` and the safetensors headers, so
``inspect_model_dir`` learns them without loading weights, building a module or
calling MLX; a loaded model's facts use the layer kinds of mlx-lm's own cache list.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.cache import kvquant, mlx_lm_compat
from engine.cache.modes import MODES, KvMode
from engine.cache.outside import LinearShape, OutsideShape
from engine.errors import EngineError, ModelLoadError
from engine.models.folder import (
    _check_tokenizer_files,  # folder.py's own check, private there
    has_chat_template,
    read_config,
    read_weight_headers,
)

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
        outside: the sliding windows and linear-attention layers as config.json
            gives them (what they reserve beside the pages:
            ``engine.session.session.outside_pages_reserve``; other layers' state, an
            SSM's, is not known before the model loads).
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
    kv_bytes_per_token: dict[KvMode, int | None]
    kv_bytes_full_context: dict[KvMode, int | None]
    outside: OutsideShape = field(default_factory=OutsideShape)

    @property
    def unavailable_modes(self) -> tuple[KvMode, ...]:
        """The modes that cannot store this model's heads (their groups do not
        divide ``head_dim``)."""
        return tuple(mode for mode, size in self.kv_bytes_per_token.items() if size is None)


def inspect_model_dir(path: str | Path) -> ModelInfo:
    """Read a model folder's facts without loading its weights (for pickers).

    Reads ``config.json``, the safetensors headers (parsed as JSON here) and the
    tokenizer config; never builds a model module nor calls MLX, so any thread may
    call it (MLX streams are thread-local: MLX called on a pool thread leaves
    streams behind that make the process abort at exit). Which layers keep a KV
    cache comes from the config's layer pattern and the attention weights each
    layer has; the loader replaces these facts with mlx-lm's own cache list once
    the model is loaded.

    Raises:
        ModelLoadError: the folder cannot be loaded (same checks as ``load_model``).
    """
    folder = Path(path).expanduser()
    config = read_config(folder)
    headers = read_weight_headers(folder)
    check_architecture(config, folder)
    _check_tokenizer_files(folder)
    try:
        kinds = layer_kinds(config, headers)
        return build_model_info(folder, config, kinds, count_parameters(config, headers))
    except (*CONFIG_ERRORS, ValueError) as error:  # a field of the wrong type
        raise invalid_config_error(folder, config, error) from error


# What a model class raises when config.json holds wrong types or zero sizes.
CONFIG_ERRORS = (TypeError, AttributeError, ZeroDivisionError, IndexError)


def invalid_config_error(folder: Path, config: dict[str, Any], error: Exception) -> ModelLoadError:
    """The error for a ``config.json`` that mlx-lm's model class rejects."""
    detail = str(error).splitlines()[0] if str(error) else type(error).__name__
    return ModelLoadError(
        f"The config.json in {folder} does not describe a valid "
        f"{config['model_type']} model ({detail}); download the model again."
    )


def check_architecture(config: dict[str, Any], folder: Path) -> None:
    """Raise ``ModelLoadError`` unless mlx-lm has a module for the config's model_type.

    Looks for the module's file instead of importing it: importing a model module
    imports MLX, and this runs off the worker thread.
    """
    if not mlx_lm_compat.has_architecture(str(config["model_type"])):
        raise ModelLoadError(
            f"mlx-lm does not support the architecture {config['model_type']!r} of "
            f"{folder.name}. Choose another model, or update Longleaf (and with it mlx-lm)."
        )


# A layer's tensor names say whether it has softmax attention: query/key
# projections (separate, fused, or MLA's compressed ones). Linear attention
# (gated delta: linear_attn.in_proj_qkv...) and SSM mixers have none of these.
_LAYER_TENSOR = re.compile(r"(?:^|\.)layers\.(\d+)\.(.+)$")
_ATTENTION_TENSOR = re.compile(
    r"(?:^|\.)(?:k_proj|q_proj|qkv_proj|kv_proj|query_key_value|c_attn|wqkv|Wqkv|"
    r"kv_a_proj_with_mqa|q_a_proj|W_pack|qkvg_proj)\."
)
_NOT_ATTENTION = ("linear_attn.", "mamba.", "conv.")


def layer_kinds(
    config: dict[str, Any], headers: dict[str, dict[str, Any]]
) -> dict[str, tuple[int, ...]]:
    """Sort layers into ``classify_layers``' kinds from config and tensor names only.

    Returns:
        ``{"full": ..., "sliding": ..., "other": ...}`` layer indices.
    """
    with_attention, layers = _attention_layers_from_headers(headers)
    text = _text_config(config)
    count = _layer_count(text) or layers
    kinds: dict[str, list[int]] = {"full": [], "sliding": [], "other": []}
    for index in range(count):
        kind = _declared_kind(text, index)
        if layers and index not in with_attention:
            kind = "other"
        kinds[kind].append(index)
    return {kind: tuple(indices) for kind, indices in kinds.items()}


def _attention_layers_from_headers(headers: dict[str, dict[str, Any]]) -> tuple[set[int], int]:
    """Layers with attention weights, and how many layers the weights name."""
    attention: set[int] = set()
    seen = -1
    for name in headers:
        match = _LAYER_TENSOR.search(name)
        if match is None or "vision" in name or "audio" in name:
            continue
        index, rest = int(match.group(1)), match.group(2)
        seen = max(seen, index)
        if _ATTENTION_TENSOR.search(rest) and not any(n in rest for n in _NOT_ATTENTION):
            attention.add(index)
    return attention, seen + 1


def _layer_count(text: dict[str, Any]) -> int:
    for key in ("num_hidden_layers", "n_layer", "num_layers", "n_layers"):
        value = text.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return 0


def _declared_kind(text: dict[str, Any], index: int) -> str:
    """The kind a config's layer pattern gives layer ``index`` (``full`` by default)."""
    types = text.get("layer_types")
    if isinstance(types, list) and index < len(types):
        name = str(types[index]).lower()
        if "sliding" in name or "local" in name or "chunked" in name:
            return "sliding"
        return "full" if "attention" in name or name in ("full", "global") else "other"
    pattern = text.get("hybrid_override_pattern")
    if isinstance(pattern, str) and index < len(pattern):
        return "full" if pattern[index] == "*" else "other"
    interval = text.get("full_attention_interval")
    if isinstance(interval, int) and interval > 0:
        return "full" if (index + 1) % interval == 0 else "other"
    window = text.get("sliding_window_pattern")
    if isinstance(window, int) and window > 0 and text.get("sliding_window"):
        return "full" if (index + 1) % window == 0 else "sliding"
    return "full"


def count_parameters(config: dict[str, Any], headers: dict[str, dict[str, Any]]) -> int:
    """Parameters the safetensors hold, quantized weights counted unpacked.

    As mlx-lm's ``get_total_parameters`` counts them: a quantized layer's packed
    uint32 ``weight`` holds ``32 / bits`` values per word, and its ``scales`` and
    ``biases`` are not parameters of the model.
    """
    quantized = {name[: -len(".scales")] for name in headers if name.endswith(".scales")}
    total = 0
    for name, entry in headers.items():
        size = math.prod(int(d) for d in entry["shape"])
        module, _, leaf = name.rpartition(".")
        if module in quantized:
            if leaf in ("scales", "biases"):
                continue
            if leaf == "weight":
                size = size * 32 // _bits_of(config, module)
        total += size
    return total


def _bits_of(config: dict[str, Any], module: str) -> int:
    quantization = config.get("quantization") or config.get("quantization_config") or {}
    override = quantization.get(module) if isinstance(quantization, dict) else None
    if isinstance(override, dict) and isinstance(override.get("bits"), int):
        return override["bits"]
    return quantization_bits(config) or 4


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

    def kind(layer: Any) -> str:
        if isinstance(layer, RotatingKVCache | ChunkedKVCache):
            return "sliding"
        if isinstance(layer, KVCache | QuantizedKVCache | ConcatenateKVCache):
            return "full"
        # A CacheList (MLA plus indexer, SSM plus attention) is as long as its longest part.
        inner = {kind(c) for c in getattr(layer, "caches", ())}
        found = next((k for k in ("full", "sliding") if k in inner), None)
        if found:
            return found
        # A model's own cache class that counts tokens (deepseek_v41's compressed
        # LayerCache) holds attention state; SSM state (ArraysCache) has no offset.
        return "full" if isinstance(getattr(layer, "offset", None), int) else "other"

    kinds: dict[str, list[int]] = {"full": [], "sliding": [], "other": []}
    for index, layer in enumerate(cache):
        kinds[kind(layer)].append(index)
    return {kind: tuple(indices) for kind, indices in kinds.items()}


# MLA models whose attention caches the compressed latent (kv_lora_rank wide) and
# the rope key shared by the heads (qk_rope_head_dim wide) as one head, not every
# head's expanded keys and values (deepseek_v2, minicpm3): mlx-lm's modules, checked
# against their caches by tests/engine/models/test_info.py.
LATENT_KV = frozenset({
    "deepseek_v3", "glm4_moe_lite", "kimi_k25", "kimi_vl", "kimi_k3", "kimi_linear",
    "bailing_moe_v3", "bailing_hybrid", "longcat_flash", "longcat_flash_ngram", "mistral4",
    "deepseek_v32", "glm_moe_dsa",
})
# Sparse-attention MLA (deepseek_v32 and glm_moe_dsa, built on it): beside the
# latent, each layer's indexer caches its keys, index_head_dim wide, passed to
# mlx-lm's KVCache as both keys and values.
INDEXED_KV = frozenset({"deepseek_v32", "glm_moe_dsa"})


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    # Multimodal configs nest the language model's facts under text_config.
    nested = config.get("text_config")
    return {**nested, **config} if isinstance(nested, dict) else config


def _attention_shape(config: dict[str, Any]) -> tuple[int, int]:
    """(KV heads, values per head) of a full-attention layer's cache; where keys and
    values differ in width (MLA), their mean, so the bytes come out right.

    Raises:
        TypeError: a width or count in the config is not a whole number.
    """
    text = _text_config(config)
    heads = _whole(text, "num_attention_heads", "n_head")
    kv_heads = _whole(text, "num_key_value_heads", "n_kv_heads") or heads
    head_dim = _whole(text, "head_dim")
    if not head_dim and heads:
        head_dim = _whole(text, "hidden_size") // heads
    rank, rope = _whole(text, "kv_lora_rank"), _whole(text, "qk_rope_head_dim")
    if rank and str(config.get("model_type")) in LATENT_KV:
        indexer = 2 * _whole(text, "index_head_dim") if config.get("model_type") in INDEXED_KV \
            else 0
        return 1, -(-(rank + rope + indexer) // 2)
    if rank:  # every head's keys (compressed part and rope part) and values
        values = _whole(text, "v_head_dim") or head_dim
        return heads, -(-(_whole(text, "qk_nope_head_dim") + rope + values) // 2)
    if _whole(text, "global_head_dim"):  # Gemma 4: its full layers' heads are wider
        if text.get("attention_k_eq_v") and _whole(text, "num_global_key_value_heads"):
            kv_heads = _whole(text, "num_global_key_value_heads")
        return kv_heads, _whole(text, "global_head_dim")
    return kv_heads, head_dim


def _whole(text: dict[str, Any], *keys: str) -> int:
    """The first of ``keys`` the config sets (0: none).

    Raises:
        TypeError: it is not a whole number ("8", 8.0).
    """
    value = next((text[key] for key in keys if text.get(key) is not None), 0)
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{keys[0]} is {value!r}, not a whole number")
    return value


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


def require_attention(folder: Path, config: dict[str, Any],
                      kinds: dict[str, tuple[int, ...]]) -> None:
    """Refuse a model whose ``classify_layers`` kinds hold no attention layer.

    Raises:
        ModelLoadError: the model has no attention layer, so no KV cache to page.
    """
    if not kinds["full"] and not kinds["sliding"]:
        raise ModelLoadError(
            f"{folder.name} ({config['model_type']}) has no attention layers, so it keeps "
            "no KV cache for Longleaf to page. Choose a transformer model instead."
        )


def build_model_info(
    folder: Path, config: dict[str, Any], kinds: dict[str, tuple[int, ...]], parameters: int,
    *, stage: bool = False,
) -> ModelInfo:
    """Assemble a folder's ``ModelInfo`` from its config and ``classify_layers`` kinds.

    With ``stage`` the kinds are one pipeline rank's layers, which may hold no
    attention layer (other ranks' do; the whole model was checked before the split).

    Raises:
        ModelLoadError: the model has no attention layer, so no KV cache to page.
    """
    if not stage:
        require_attention(folder, config, kinds)
    attention = tuple(sorted(kinds["full"] + kinds["sliding"]))
    kv_heads, head_dim = _attention_shape(config)
    context = max_context(config)
    text = _text_config(config)
    full_layers = len(kinds["full"])
    per_token: dict[KvMode, int | None] = {}
    full_context: dict[KvMode, int | None] = {}
    for mode in MODES:
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
        outside=OutsideShape(
            sliding_layers=len(kinds["sliding"]), window=_whole(text, "sliding_window"),
            kv_heads=kv_heads, head_dim=head_dim,
            linear_layers=len(kinds["other"]), linear=_linear_shape(text)),
    )


def _linear_shape(text: dict[str, Any]) -> LinearShape | None:
    """A gated-delta linear-attention layer's shape, where the config gives one."""
    sizes = [_whole(text, key) for key in (
        "linear_num_key_heads", "linear_key_head_dim", "linear_num_value_heads",
        "linear_value_head_dim", "linear_conv_kernel_dim")]
    return LinearShape(*sizes) if all(sizes) else None
