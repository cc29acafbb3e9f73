"""Check an mlx-lm model folder the cheap way, before any weights are read.

Config, safetensors headers and tokenizer files are read directly, so a broken
download gives a message a user can act on instead of a stack trace from deep
inside MLX.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from engine.errors import ModelLoadError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tiktoken.model", "vocab.json")
_MAX_HEADER_BYTES = 100 * 2**20
# MLX indexes arrays with 32-bit integers: no dimension can be larger.
MAX_DIMENSION = 2**31 - 1


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


def read_config(folder: Path) -> dict[str, Any]:
    """Read ``config.json``, raising ``ModelLoadError`` with the fix when it can't."""
    if not folder.is_dir():
        what = "is a file, not a folder" if folder.is_file() else "does not exist"
        raise ModelLoadError(
            f"Model folder {folder} {what}; choose a folder that contains "
            "config.json, *.safetensors and tokenizer files."
        )
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(
            f"{folder} has no config.json, so it is not an mlx-lm model folder. "
            "Choose the folder that holds config.json and the .safetensors weights."
        )
    try:
        text = config_path.read_text(encoding="utf-8")
        if text.startswith("\ufeff"):
            raise ModelLoadError(
                f"{config_path} starts with a byte order mark (an editor added it), which "
                "mlx-lm cannot read: save it again as UTF-8 without BOM."
            )
        config = json.loads(text)
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
    _check_sizes(config, config_path)
    _check_quantization(config, config_path)
    return config


def _check_sizes(config: dict[str, Any], config_path: Path) -> None:
    """Refuse a size no MLX array can have, before a model class tries to build it."""
    sections = [config] + [v for k, v in config.items() if k.endswith("_config")
                           and isinstance(v, dict)]
    for section in sections:
        for key, value in section.items():
            is_size = key.endswith("_size") or key.startswith("num_") or key == "head_dim"
            if (is_size and isinstance(value, int) and not isinstance(value, bool)
                    and value > MAX_DIMENSION):
                raise ModelLoadError(
                    f"{config_path} says {key} is {value:,}, more than MLX can hold in one "
                    f"array dimension ({MAX_DIMENSION:,}); the file is damaged or not a real "
                    "model. Download the model again."
                )


# The quantization_config methods mlx-lm's loader turns into its own (``load_model``);
# others (bitsandbytes, hqq, ...) fall through it and their weights match no layer.
MLX_LM_QUANT_METHODS = ("awq", "bitnet", "compressed-tensors", "fp8", "gptq", "modelopt",
                        "mxfp4", "mxfp8")


def _check_quantization(config: dict[str, Any], config_path: Path) -> None:
    """Refuse weights quantized in a way mlx-lm cannot load, naming the way out."""
    if config.get("quantization") is not None:
        return  # MLX's own quantization, which mlx-lm reads before anything else
    text = config.get("text_config")
    section = config.get("quantization_config") or (
        text.get("quantization_config") if isinstance(text, dict) else None)
    if not isinstance(section, dict):
        return
    method = section.get("quant_method")
    if isinstance(method, str) and method not in MLX_LM_QUANT_METHODS:
        raise ModelLoadError(
            f"{config_path.parent.name} is quantized with {method}, which mlx-lm cannot "
            "load. Get the model's MLX version (for example from mlx-community), or "
            "convert the original weights with mlx_lm.convert."
        )


def _model_classes(config: dict[str, Any], folder: Path) -> tuple[Any, Any]:
    from engine.cache import mlx_lm_compat

    try:
        return mlx_lm_compat.model_classes(config)
    except ValueError as error:
        raise ModelLoadError(
            f"mlx-lm does not support the architecture {config['model_type']!r} of "
            f"{folder.name}. Choose another model, or update Longleaf (and with it mlx-lm)."
        ) from error


def read_weight_headers(folder: Path) -> dict[str, dict[str, Any]]:
    """Read every ``model*.safetensors`` header, checking the data is all there.

    Returns:
        Tensor name -> ``{"dtype", "shape", "data_offsets"}`` over all shards.

    Raises:
        ModelLoadError: no weights, or a file that is truncated or not safetensors.
    """
    # Path.glob: a folder named "Models [MLX]" is a name, not a pattern.
    files = sorted(str(file) for file in folder.glob("model*.safetensors"))
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
    if not isinstance(weight_map, dict):
        return
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
    if any(folder.glob("*.tiktoken")):
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
