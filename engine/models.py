"""Load mlx-lm model folders and describe them: the facts the app and cache need.

Loading goes through mlx-lm's own loader, so every architecture mlx-lm knows
works unchanged. Before handing a folder to it, the folder is checked the cheap
way (config, safetensors headers, tokenizer files) so a broken download gives a
message a user can act on instead of a stack trace from deep inside MLX.
"""

from __future__ import annotations

import contextlib
import glob
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

from engine import kvquant
from engine.errors import EngineError, ModelLoadError

DEMO = "demo"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json")
CONTEXT_KEYS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")
# Without any context key in the config, assume a conservative window.
FALLBACK_CONTEXT = 4096
_MAX_HEADER_BYTES = 100 * 2**20


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


@dataclass(frozen=True)
class LoadedModel:
    """A loaded model: mlx-lm's module, its ``TokenizerWrapper`` and its facts.

    Only the engine's worker thread may touch ``model`` and ``tokenizer``.
    """

    model: Any
    tokenizer: Any
    info: ModelInfo
    config: dict[str, Any]


def resolve_model_path(path: str | Path) -> Path:
    """Map ``"demo"`` to the converted demo model; expand anything else."""
    if str(path) == DEMO:
        from engine.demo_model import ensure_demo_model

        return ensure_demo_model()
    return Path(path).expanduser()


def load_model(path: str | Path, *, compute_dtype: mx.Dtype | None = None) -> LoadedModel:
    """Load a model folder (or ``"demo"``) through mlx-lm's loader.

    Args:
        path: an mlx-lm model folder, or ``"demo"`` for the bundled SmolLM2.
        compute_dtype: dtype for the model's float parameters. By default half
            precision becomes float32 on the CPU backend, which emulates float16
            very slowly, and is kept as stored on Metal.

    Returns:
        The model, tokenizer and ``ModelInfo``.

    Raises:
        ModelLoadError: the folder is missing, incomplete, corrupt or of an
            architecture mlx-lm does not support.
    """
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import get_total_parameters, load_tokenizer
    from mlx_lm.utils import load_model as mlx_load_model

    folder = resolve_model_path(path)
    config, _, _ = check_model_dir(folder)
    try:
        model, config = mlx_load_model(folder)
    except _CONFIG_ERRORS as error:
        # Raised while building the model from config.json, before any weight.
        raise _invalid_config(folder, config, error) from error
    except (ValueError, RuntimeError, KeyError, OSError) as error:
        raise ModelLoadError(
            f"mlx-lm could not load the weights in {folder}: {error}. The files may be "
            "incomplete or from a different model; download the model again."
        ) from error
    try:
        tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
    except Exception as error:  # transformers raises many unrelated types here
        raise ModelLoadError(
            f"The tokenizer files in {folder} cannot be read ({error}); download the "
            "model again or copy its tokenizer files into the folder."
        ) from error
    model = _set_compute_dtype(model, compute_dtype)
    kinds = classify_layers(make_prompt_cache(model))
    info = _model_info(folder, config, kinds, get_total_parameters(model))
    return LoadedModel(model=model, tokenizer=tokenizer, info=info, config=config)


def _set_compute_dtype(model: Any, dtype: mx.Dtype | None) -> Any:
    if dtype is None:
        if mx.default_device().type == mx.gpu and mx.metal.is_available():
            return model
        dtype = mx.float32
        model = _dequantize_for_cpu(model)
    model.set_dtype(dtype)  # float parameters only; packed weights stay as they are
    return model


def _dequantize_for_cpu(model: Any) -> Any:
    """Unpack quantized weights to float on the CPU backend when RAM allows.

    MLX's CPU quantized matmul is a plain loop, ~12x slower than the BLAS sgemm
    a float layer gets (measured on the demo: 25.6 s vs 2.1 s for a 64-token
    forward); Metal has fused kernels, so there the weights stay packed.
    """
    import psutil
    from mlx_lm.utils import dequantize_model, get_total_parameters

    if not any(hasattr(m, "scales") for _, m in model.named_modules()):
        return model
    float_bytes = get_total_parameters(model) * 4
    if float_bytes > psutil.virtual_memory().available // 2:
        return model
    return dequantize_model(model)


def check_model_dir(folder: Path) -> tuple[dict[str, Any], dict[str, dict[str, Any]], Any]:
    """Check a folder the cheap way before any weights are read.

    Returns:
        ``(config, safetensors headers, (model class, args class))``.

    Raises:
        ModelLoadError: missing folder/config/weights/tokenizer, invalid JSON,
            truncated safetensors, or an architecture mlx-lm does not know.
    """
    config = read_config(folder)
    headers = read_weight_headers(folder)
    classes = _model_classes(config, folder)
    _check_tokenizer_files(folder)
    return config, headers, classes


_HALF_DTYPES = frozenset({"F16", "BF16"})


def estimate_load_bytes(folder: Path) -> tuple[int, bool]:
    """Memory the loaded weights will take, from the safetensors headers alone.

    The tensors' data sizes, with float16/bfloat16 tensors counted twice on the
    CPU backend (they are computed in float32 there). Quantized weights that the
    CPU backend unpacks to float are not counted twice: the loader unpacks them
    only when that fits in half of the available memory.

    Returns:
        ``(bytes, quantized)``: the estimate and whether the weights are quantized.

    Raises:
        ModelLoadError: the folder fails ``check_model_dir``.
    """
    config, headers, _ = check_model_dir(folder)
    widen = not (mx.default_device().type == mx.gpu and mx.metal.is_available())
    total = 0
    for entry in headers.values():
        start, end = entry["data_offsets"]
        size = int(end) - int(start)
        total += 2 * size if widen and entry.get("dtype") in _HALF_DTYPES else size
    return total, quantization_bits(config) is not None


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
    except (ValueError, KeyError, *_CONFIG_ERRORS) as error:
        raise _invalid_config(folder, config, error) from error
    return _model_info(folder, config, kinds, get_total_parameters(model))


# What a model class raises when config.json holds wrong types or zero sizes.
_CONFIG_ERRORS = (TypeError, AttributeError, ZeroDivisionError, IndexError)


def _invalid_config(folder: Path, config: dict[str, Any], error: Exception) -> ModelLoadError:
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


def read_config(folder: Path) -> dict[str, Any]:
    """Read ``config.json``, raising ``ModelLoadError`` with the fix when it can't."""
    if not folder.is_dir():
        raise ModelLoadError(
            f"Model folder {folder} does not exist; choose a folder that contains "
            "config.json, *.safetensors and tokenizer files."
        )
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(
            f"{folder} has no config.json, so it is not an mlx-lm model folder. "
            "Choose the folder that holds config.json and the .safetensors weights."
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (ValueError, OSError) as error:
        raise ModelLoadError(
            f"{config_path} is not valid JSON ({error}); the download may be "
            "incomplete. Download the model again."
        ) from error
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelLoadError(
            f"{config_path} has no model_type, so the architecture is unknown. "
            "Download the model again or pick an mlx-lm model."
        )
    return config


def _model_classes(config: dict[str, Any], folder: Path) -> tuple[Any, Any]:
    from mlx_lm.utils import _get_classes

    try:
        return _get_classes(config)
    except ValueError as error:
        raise ModelLoadError(
            f"mlx-lm does not support the architecture {config['model_type']!r} of "
            f"{folder.name}. Update mlx-lm (pip install -U mlx-lm) or choose another model."
        ) from error


def read_weight_headers(folder: Path) -> dict[str, dict[str, Any]]:
    """Read every ``model*.safetensors`` header, checking the data is all there.

    Returns:
        Tensor name -> ``{"dtype", "shape", "data_offsets"}`` over all shards.

    Raises:
        ModelLoadError: no weights, or a file that is truncated or not safetensors.
    """
    files = sorted(glob.glob(str(folder / "model*.safetensors")))
    if not files:
        raise ModelLoadError(
            f"{folder} has no model*.safetensors weights. mlx-lm needs safetensors; "
            "download the MLX version of the model or convert it with mlx_lm.convert."
        )
    _check_shards(folder)
    tensors: dict[str, dict[str, Any]] = {}
    for file in files:
        tensors.update(_safetensors_header(Path(file)))
    return tensors


def _check_shards(folder: Path) -> None:
    """Name the shards a sharded model's index lists but the folder lacks."""
    index = folder / "model.safetensors.index.json"
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8")).get("weight_map", {})
    except (OSError, ValueError, AttributeError):
        return  # no index (single file) or an unreadable one: the headers decide
    missing = sorted({str(f) for f in weight_map.values() if not (folder / str(f)).is_file()})
    if missing:
        raise ModelLoadError(
            f"{folder} is missing {len(missing)} weight file(s) listed in "
            f"model.safetensors.index.json ({', '.join(missing[:3])}"
            f"{', ...' if len(missing) > 3 else ''}); the download is incomplete. "
            "Download the model again."
        )


def _safetensors_header(file: Path) -> dict[str, dict[str, Any]]:
    corrupt = f"{file.name} in {file.parent} is corrupt or truncated; download the model again"
    try:
        size = file.stat().st_size
        with file.open("rb") as handle:
            (header_bytes,) = struct.unpack("<Q", handle.read(8))
            if header_bytes > min(size - 8, _MAX_HEADER_BYTES):
                raise ModelLoadError(f"{corrupt} (bad header length).")
            header = json.loads(handle.read(header_bytes))
    except (struct.error, ValueError) as error:
        raise ModelLoadError(f"{corrupt} ({error}).") from error
    except OSError as error:
        raise ModelLoadError(
            f"{file.name} in {file.parent} cannot be read ({error.strerror or error}); "
            "check that it is a file you may read, or download the model again."
        ) from error
    if not isinstance(header, dict):
        raise ModelLoadError(f"{corrupt} (the header is not a tensor table).")
    header.pop("__metadata__", None)
    data_bytes = size - 8 - header_bytes
    for name, entry in header.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not isinstance(offsets, list) or len(offsets) != 2 or "shape" not in entry:
            raise ModelLoadError(f"{corrupt} (tensor {name} has no valid shape and offsets).")
        if not 0 <= offsets[0] <= offsets[1] <= data_bytes:
            raise ModelLoadError(f"{corrupt} (tensor {name} lies past the end of the file).")
    return header


def _check_tokenizer_files(folder: Path) -> None:
    if any((folder / name).is_file() for name in TOKENIZER_FILES):
        return
    if glob.glob(str(folder / "*.tiktoken")):
        return
    raise ModelLoadError(
        f"{folder} has no tokenizer (tokenizer.json or tokenizer.model). Copy the "
        "tokenizer files from the original model into this folder, or download it again."
    )


def has_chat_template(folder: Path) -> bool:
    """Whether the folder's tokenizer files carry a chat template."""
    if (folder / "chat_template.jinja").is_file() or (folder / "chat_template.json").is_file():
        return True
    try:
        tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text("utf-8"))
    except (OSError, ValueError):
        return False
    return bool(isinstance(tokenizer_config, dict) and tokenizer_config.get("chat_template"))


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


def _model_info(
    folder: Path, config: dict[str, Any], kinds: dict[str, tuple[int, ...]], parameters: int
) -> ModelInfo:
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
