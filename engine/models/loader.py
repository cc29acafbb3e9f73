"""Load mlx-lm model folders through mlx-lm's own loader.

Every architecture mlx-lm knows works unchanged. Before handing a folder to it,
the folder is checked the cheap way (``engine.models.folder``) so a broken
download gives a message a user can act on; the facts it reports are a
``engine.models.info.ModelInfo``.
"""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import mlx.core as mx

from engine.errors import ModelLoadError
from engine.models import DEMO
from engine.models.folder import check_model_dir
from engine.models.info import (
    CONFIG_ERRORS,
    ModelInfo,
    build_model_info,
    classify_layers,
    count_parameters,
    invalid_config_error,
    quantization_bits,
    require_attention,
)
from engine.models.probe import PROBE_TOKENS, REFUSED, ProbeResult, probe_model


@dataclass(frozen=True)
class LoadedModel:
    """A loaded model: mlx-lm's module, its ``TokenizerWrapper`` and its facts.

    Only the engine's worker thread may touch ``model`` and ``tokenizer``.
    ``probe`` says which KV cache gives this model's numbers (None: not probed).
    ``fingerprint`` is the weights' fingerprint taken at load
    (``engine.snapshots.fingerprint``; None: not taken), which stored KV must match;
    ``code`` likewise the code's (MLX's version, mlx-lm's module for the model).
    """

    model: Any
    tokenizer: Any
    info: ModelInfo
    config: dict[str, Any]
    probe: ProbeResult | None = None
    fingerprint: dict[str, Any] | None = None
    code: dict[str, str] | None = None


def resolve_model_path(path: str | Path) -> Path:
    """Map ``"demo"`` to the converted demo model; expand anything else."""
    if str(path) == DEMO:
        from engine.models.demo import ensure_demo_model

        return ensure_demo_model()
    return Path(path).expanduser()


def load_model(
    path: str | Path, *, compute_dtype: mx.Dtype | None = None, probe: bool = True,
    pipeline: mx.distributed.Group | None = None,
    split: Sequence[int] | None = None,
) -> LoadedModel:
    """Load a model folder (or ``"demo"``) through mlx-lm's loader.

    Args:
        path: an mlx-lm model folder, or ``"demo"`` for the bundled SmolLM2.
        compute_dtype: dtype for the model's float parameters. By default half
            precision becomes float32 on the CPU backend, which emulates float16
            very slowly, and is kept as stored on Metal.
        probe: run ``engine.models.probe.probe_model`` (paged cache against
            mlx-lm's own) and keep its result in ``LoadedModel.probe``.
        pipeline: an ``mx.distributed`` group: keep only this rank's layers
            (mlx-lm's ``pipeline`` split: rank 0 holds the last layers); every
            rank must load the same model in the same order.
        split: layers per rank, rank 0 first (None: mlx-lm's even split).

    Returns:
        The model, tokenizer, ``ModelInfo`` and probe result.

    Raises:
        ModelLoadError: the folder is missing, incomplete, corrupt or of an
            architecture mlx-lm does not support, or neither the paged cache nor
            mlx-lm's own cache runs the model (the probe's reason).
    """
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model as mlx_load_model
    from mlx_lm.utils import load_tokenizer

    folder = resolve_model_path(path)
    config, _, _ = check_model_dir(folder)
    try:
        with unpatterned(folder) as readable:
            model, config = mlx_load_model(readable)
    except CONFIG_ERRORS as error:
        # Raised while building the model from config.json, before any weight.
        raise invalid_config_error(folder, config, error) from error
    except (ValueError, RuntimeError, KeyError, OSError) as error:
        raise ModelLoadError(
            f"mlx-lm could not load the weights in {folder}: {_summarized(error)}. The "
            "files may be incomplete or from a different model; download the model again."
        ) from error
    try:
        tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
    except Exception as error:  # transformers raises many unrelated types here
        raise ModelLoadError(
            f"The tokenizer files in {folder} cannot be read ({error}); download the "
            "model again or copy its tokenizer files into the folder."
        ) from error
    model = _set_compute_dtype(model, compute_dtype)
    stage_group = pipeline if pipeline is not None and pipeline.size() > 1 else None
    stage = stage_group is not None
    if stage_group is not None:
        # A rank may hold only layers without a KV cache; the whole model may not.
        require_attention(folder, config, classify_layers(make_prompt_cache(model)))
        _split(model, stage_group, folder, config, split)
    kinds = classify_layers(make_prompt_cache(model))
    # Counted by the same rule as inspect_model_dir's headers, so both agree.
    # tree_flatten returns a dict only when handed one to fill; here its list.
    parameters = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    shapes = {name: {"shape": a.shape} for name, a in parameters}
    info = build_model_info(folder, config, kinds, count_parameters(config, shapes),
                            stage=stage)
    result = _probe(model, info) if probe else None
    return LoadedModel(model=model, tokenizer=tokenizer, info=info, config=config, probe=result)


@contextlib.contextmanager
def unpatterned(folder: Path) -> Iterator[Path]:
    """``folder``, or a link to it whose path holds no glob pattern characters, while
    the block runs: mlx-lm finds a model's weights with ``glob.glob`` on the
    folder's path, which reads "Models [MLX]" as a pattern and finds nothing."""
    if not any(char in str(folder) for char in "*?["):
        yield folder
        return
    with tempfile.TemporaryDirectory(prefix="longleaf-model-") as links:
        link = Path(links) / "model"
        link.symlink_to(folder.resolve(), target_is_directory=True)
        yield link


def _summarized(error: Exception, shown: int = 3) -> str:
    """A load error cut to its first line and the first ``shown`` names it lists.

    MLX lists every missing or unexpected parameter, one per line; a folder that
    lacks thousands of them would otherwise give a message of megabytes.
    """
    first, *rest = str(error).splitlines() or [type(error).__name__]
    names = [line.strip().rstrip(",.") for line in rest if line.strip()]
    if not names:
        return first if len(first) <= 500 else first[:499] + "…"
    more = f" and {len(names) - shown:,} more" if len(names) > shown else ""
    return f"{first.rstrip(': ')} ({', '.join(names[:shown])}{more})"


def _split(model: Any, group: mx.distributed.Group, folder: Path, config: dict[str, Any],
           split: Sequence[int] | None) -> None:
    inner: Any = getattr(model, "model", None)  # mlx-lm's inner model, untyped
    if not callable(getattr(inner, "pipeline", None)):
        from engine.models.split import no_split_message

        raise ModelLoadError(no_split_message(folder.name, config.get("model_type", "unknown")))
    try:
        inner.pipeline(group, None if split is None else list(split))
    except ValueError as error:  # more ranks than layers
        raise ModelLoadError(f"{folder.name} cannot be split that way: {error}.") from error


def _probe(model: Any, info: ModelInfo) -> ProbeResult:
    # The weights (unpacked or cast above) are materialized here rather than by the
    # probe's first forward, so the probe's cost is its own.
    mx.eval(model.parameters())
    with _stage_alone(model):
        result = probe_model(model)
    if result.verdict == REFUSED:
        raise ModelLoadError(f"{info.name} ({info.architecture}) cannot run: {result.reason}.")
    return result


@contextlib.contextmanager
def _stage_alone(model: Any) -> Iterator[None]:
    """A pipeline rank's layers run as a model of their own, with no messages.

    Each rank probes its own layers' caches: a probe that ran the split forward
    would wait on the other ranks, whose probes may run other passes (a rank
    with no paged layer skips the paged run).
    """
    inner: Any = getattr(model, "model", None)  # mlx-lm's inner model, untyped
    size = getattr(inner, "pipeline_size", 1)
    if size == 1:
        yield
        return
    rank = inner.pipeline_rank
    inner.pipeline_rank, inner.pipeline_size = 0, 1
    try:
        yield
    finally:
        inner.pipeline_rank, inner.pipeline_size = rank, size


def _set_compute_dtype(model: Any, dtype: mx.Dtype | None) -> Any:
    if dtype is None:
        if not _computes_on_cpu():
            return model
        dtype = mx.float32
        model = _dequantize_for_cpu(model)
    model.set_dtype(dtype)  # float parameters only; packed weights stay as they are
    return model


def _dequantize_for_cpu(model: Any) -> Any:
    """Unpack quantized weights to float on the CPU backend when RAM allows.

    MLX's CPU quantized matmul is a plain loop, many times slower than the BLAS
    sgemm a float layer gets (docs/benchmarks.md, "Figures behind constants");
    Metal has fused kernels, so there the weights stay packed.
    """
    from mlx_lm.utils import dequantize_model, get_total_parameters

    if not any(hasattr(m, "scales") for _, m in model.named_modules()):
        return model
    if not _unpacks_on_cpu(get_total_parameters(model) * _FLOAT32_BYTES):
        return model
    return dequantize_model(model)


_HALF_DTYPES = frozenset({"F16", "BF16"})
_FLOAT32_BYTES = 4
# mlx-lm's KVCache grows in steps of this many tokens (``KVCache.step``).
_KV_STEP = 256


def _computes_on_cpu() -> bool:
    """Whether the weights are computed on the CPU backend (unpacked or widened)."""
    return not (mx.default_device().type == mx.gpu and mx.metal.is_available())


def _unpacks_on_cpu(float_bytes: int) -> bool:
    """Whether ``_dequantize_for_cpu`` unpacks weights taking ``float_bytes`` as float32."""
    import psutil

    return float_bytes <= psutil.virtual_memory().available // 2


def _probe_bytes(config: dict[str, Any], value_bytes: int) -> int:
    """What the load-time probe holds above the weights.

    Its tokens' float32 logits a few times over (mlx-lm's run, the paged run and
    their comparison), the widest MLP activation twice, and per layer mlx-lm's
    cache of one ``_KV_STEP``, keys and values.
    """
    text = config.get("text_config") or config
    tokens = PROBE_TOKENS
    heads = _count(text, "num_attention_heads") or 1
    kv_heads = _count(text, "num_key_value_heads") or heads
    head_dim = _count(text, "head_dim") or _count(text, "hidden_size") // heads
    activations = tokens * _FLOAT32_BYTES * (
        5 * _count(text, "vocab_size") + 2 * _count(text, "intermediate_size"))
    caches = _count(text, "num_hidden_layers") * 2 * _KV_STEP * kv_heads * head_dim
    return activations + caches * value_bytes


def _count(config: dict[str, Any], key: str) -> int:
    # An estimate only: a value of the wrong type counts 0 here, and the load
    # itself refuses the config with a message naming the field.
    value = config.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def estimate_load_bytes(folder: Path) -> tuple[int, bool]:
    """Peak memory of loading the folder (``load_model``), from the safetensors
    headers and config alone.

    On Metal the weights stay as stored. On the CPU backend every float weight
    ends as float32; quantized weights are first unpacked (when that fits in half
    of the available memory, as the loader decides), and while that runs the
    packed weights and the largest unpacked tensor are held besides. Then the
    load-time probe runs a few tokens (``_probe_bytes``). The peak is the larger
    of the conversion's and the probe's.

    Returns:
        ``(bytes, quantized)``: the estimate and whether the weights are quantized.

    Raises:
        ModelLoadError: the folder fails ``check_model_dir``.
    """
    config, headers, _ = check_model_dir(folder)
    quantized = quantization_bits(config) is not None
    stored = sum(int(e["data_offsets"][1]) - int(e["data_offsets"][0]) for e in headers.values())
    if not _computes_on_cpu():
        return stored + _probe_bytes(config, 2), quantized
    float_bytes = count_parameters(config, headers) * _FLOAT32_BYTES
    if quantized and _unpacks_on_cpu(float_bytes):
        largest = max(_unpacked_elements(config, headers, name) for name in headers)
        converting = float_bytes + stored + largest * _FLOAT32_BYTES
        return max(converting, float_bytes + _probe_bytes(config, _FLOAT32_BYTES)), quantized
    # Packed (quantized, too large to unpack) or float: half tensors are cast to float32.
    final = sum(_final_bytes(e) for e in headers.values())
    largest = max(_final_bytes(e) for e in headers.values())
    converting = final + (largest if final != stored else 0)
    return max(converting, final + _probe_bytes(config, _FLOAT32_BYTES)), quantized


def _final_bytes(entry: dict[str, Any]) -> int:
    size = int(entry["data_offsets"][1]) - int(entry["data_offsets"][0])
    return 2 * size if entry.get("dtype") in _HALF_DTYPES else size


def _unpacked_elements(config: dict[str, Any], headers: dict[str, Any], name: str) -> int:
    """Elements of tensor ``name`` once unpacked (0 for a quantized layer's scales)."""
    scales = f"{name.rpartition('.')[0]}.scales"
    if name.endswith((".scales", ".biases")):
        return 0
    own = {name: headers[name], **({scales: headers[scales]} if scales in headers else {})}
    return count_parameters(config, own)
