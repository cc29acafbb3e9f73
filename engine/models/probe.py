"""Check a loaded model's numbers on the paged cache before a user chats with it.

A few dozen tokens go through the model twice: once with mlx-lm's own cache and
once with the paged fp16 cache, in two prefill chunks (the second crossing a page
boundary) and a few single-token decode steps. Equal logits (up to fp16 storage of
the keys and values) mean the paged cache serves this architecture; otherwise the
model runs on mlx-lm's own caches, or is refused when those fail too. Never a
silently wrong answer: every verdict rests on the numbers, not on a list of names.

Only the engine's worker thread may call :func:`probe_model` and
:func:`make_session_cache` (they run the model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Protocol, cast

import mlx.core as mx

from engine.cache.modes import FP16, FULL_PRECISION_BITS, KvMode
from engine.models.info import ModelInfo

PAGED = "paged"
MLX_LM = "mlx-lm"
REFUSED = "refused"

PROBE_PAGE_SIZE = 16
# The first chunk fills one page exactly, the second starts the next page and
# reads the first back; the decode steps then read two pages.
_CHUNKS = (16, 8)
_DECODE_STEPS = 2
# Tokens one probe feeds (its chunks, then its decode steps): the loader sizes
# the probe's memory by it.
PROBE_TOKENS = sum(_CHUNKS) + _DECODE_STEPS
# fp16 storage rounds each key and value by at most 2^-11 relative, which moves the
# logits far less than a cache that reads the wrong rows moves them (tens of percent
# of their largest magnitude); the bound sits well clear of both (the differences:
# docs/coverage.md per architecture, docs/benchmarks.md "Figures behind constants").
# Relative to max |logit|, so it holds at any logit scale.
MAX_REL_DIFF = 2e-2
# A bfloat16 model (on Metal) rounds every activation to 8 mantissa bits on both
# sides, in different orders, which alone comes close to MAX_REL_DIFF; this bound
# keeps that margin while wrong rows still fail.
MAX_REL_DIFF_BF16 = 1e-1
# mlx-lm's QuantizedKVCache, when it is the fallback, groups by 32: it divides the
# most head widths (MLA's 192-wide keys included).
QUANTIZED_GROUP_SIZE = 32
_QUANTIZED_CHECK_BITS = 8


@dataclass(frozen=True)
class ProbeResult:
    """What the load-time probe found.

    Attributes:
        verdict: ``"paged"`` (the paged cache gives mlx-lm's numbers), ``"mlx-lm"``
            (it does not, or raises, while mlx-lm's own cache works) or
            ``"refused"`` (mlx-lm's own cache fails too).
        reason: why, in words a user can read; empty for ``"paged"``.
        max_rel_diff: largest |paged - mlx-lm| logit over max |mlx-lm logit|;
            None when the paged run raised or never ran.
        quantized: whether mlx-lm's QuantizedKVCache (8 bits, group 32) ran the
            probe with finite logits; only checked for the ``"mlx-lm"`` verdict.
        linear_state_bytes: what the linear-attention layers' state of one
            conversation takes (0: none, or the reference run failed): a fixed
            size, counted for a chat before its first token makes it.
    """

    verdict: str
    reason: str
    max_rel_diff: float | None
    quantized: bool = False
    linear_state_bytes: int = 0


@dataclass(frozen=True)
class SessionCache:
    """The cache a session holds, and which kind it is.

    Attributes:
        cache: the per-layer cache list to pass to the model.
        kind: ``"paged"``, ``"mlx-lm"`` (KVCache) or ``"mlx-lm quantized"``.
        note: what the user should know about this choice; empty for paged.
    """

    cache: list[Any]
    kind: str
    note: str


def probe_model(model: Any) -> ProbeResult:
    """Run the paged fp16 cache against mlx-lm's own cache on a short sequence.

    Never raises for a model's failure: a failure is a verdict with its reason.
    """
    from engine.cache.other_layers import linear_state_bytes

    tokens = _probe_tokens(model)
    try:
        # One pass over every token: the cheapest reference (the probe runs at every
        # load); a mismatch is confirmed against the same chunks below.
        reference_cache = _mlx_lm_cache(model)
        reference = _run(model, reference_cache, tokens, (len(tokens),))
    except Exception as error:  # any failure of a foreign model class is a verdict
        return ProbeResult(REFUSED, f"mlx-lm's own cache fails on this model: {_say(error)}", None)
    return replace(_compared(model, tokens, reference),
                   linear_state_bytes=linear_state_bytes(reference_cache))


def _compared(model: Any, tokens: list[int], reference: mx.array) -> ProbeResult:
    """The verdict of the paged cache's logits against mlx-lm's ``reference``."""
    if not _finite(reference):
        return ProbeResult(REFUSED, "mlx-lm's own cache gives non-finite logits", None)
    if not mx.any(reference).item():
        # Nothing to compare: every logit is 0 whatever the cache holds.
        return ProbeResult(REFUSED, "mlx-lm's own cache gives all-zero logits", None)
    suspect = suspected_cause(model)
    try:
        paged_cache = _paged_cache(model)
        if paged_cache is None:
            return _fallback(model, tokens, _no_paged_layer(model), None)
        paged = _run(model, paged_cache, tokens)
    except Exception as error:  # the paged cache raising is what the probe looks for
        return _fallback(model, tokens, _with_cause(_say(error), suspect), None)
    bound = max_rel_diff_for(model)
    diff = relative_difference(paged, reference)
    if diff > bound:
        # Only the chunks differ from the one pass? Then mlx-lm's cache does too.
        diff = min(diff, relative_difference(paged, _run(model, _mlx_lm_cache(model), tokens)))
    if diff <= bound:
        return ProbeResult(PAGED, "", diff)
    detail = f"the paged cache's logits differ from mlx-lm's by {diff:.3g} of their range"
    return _fallback(model, tokens, _with_cause(detail, suspect), diff)


def depends_on_context(model: Any) -> bool:
    """Whether the last logits change with the earlier tokens (else a probe shows nothing)."""
    tokens = _probe_tokens(model)
    other = [(t + 1) % max(tokens) for t in tokens[:-1]] + tokens[-1:]
    logits = [model(mx.array(ids)[None])[0, -1].astype(mx.float32) for ids in (tokens, other)]
    return relative_difference(logits[1], logits[0]) > MAX_REL_DIFF


def paged_layers_matter(model: Any) -> bool:
    """Whether the probe fails once the pages hold zeros.

    Only then does a ``"paged"`` verdict rest on what the cache holds, rather than
    on layers whose output never reaches the logits (used by the coverage table).
    """
    from engine.cache.paged_cache import PagedKVCache

    original = PagedKVCache.update_and_fetch

    def store_zeros(self: PagedKVCache, keys: mx.array, values: mx.array) -> Any:
        original(self, mx.zeros_like(keys), mx.zeros_like(values))
        return keys, values

    # setattr: a method swapped for the probe's run, which mypy would refuse as assignment.
    setattr(PagedKVCache, "update_and_fetch", store_zeros)  # noqa: B010
    try:
        return probe_model(model).verdict != PAGED
    finally:
        setattr(PagedKVCache, "update_and_fetch", original)  # noqa: B010


def max_rel_diff_for(model: Any) -> float:
    """The probe's bound for the model's compute dtype (its first float parameter's)."""
    from mlx.utils import tree_flatten

    # tree_flatten returns a dict only when handed one to fill; here its list.
    parameters = cast("list[tuple[str, Any]]", tree_flatten(model.parameters()))
    dtypes = (v.dtype for _, v in parameters if isinstance(v, mx.array))
    first = next((d for d in dtypes if mx.issubdtype(d, mx.floating)), mx.float32)
    return MAX_REL_DIFF_BF16 if first == mx.bfloat16 else MAX_REL_DIFF


def relative_difference(ours: mx.array, reference: mx.array) -> float:
    """max |ours - reference| over max |reference| (inf for NaN or inf)."""
    peak = float(mx.max(mx.abs(reference)))
    diff = float(mx.max(mx.abs(ours - reference)))
    if math.isnan(diff) or math.isinf(diff):
        return float("inf")
    return diff / max(peak, 1e-6)


def suspected_cause(model: Any) -> str:
    """What in the model's args or modules the paged cache is known not to handle.

    Cheap and only a name for the reason: the probe's numbers decide the verdict.
    """
    args = _text_args(model)
    if (getattr(args, "num_kv_shared_layers", 0) or 0) > 0:
        return "KV-shared layers"
    if getattr(args, "kv_lora_rank", None):
        return "keys and values of different widths (MLA)"
    if any(hasattr(module, "sinks") for _, module in model.named_modules()):
        return "attention sinks"
    return ""


class ProbedModel(Protocol):
    """What :func:`make_session_cache` reads of a loaded model (the loader's
    ``LoadedModel``, which imports this module, so it is not named here)."""

    @property
    def model(self) -> Any: ...

    @property
    def info(self) -> ModelInfo: ...

    @property
    def probe(self) -> ProbeResult | None: ...


def make_session_cache(
    loaded: ProbedModel, mode: KvMode, page_size: int, *, rotate: bool | None = None
) -> SessionCache:
    """The cache a session should hold for ``loaded`` at KV ``mode``.

    The paged cache when the load-time probe said ``"paged"``; otherwise mlx-lm's
    own cache: its QuantizedKVCache at the mode's bits where the probe saw that
    work, else its KVCache, with a note naming the reason.

    Args:
        loaded: a ``LoadedModel`` (its ``probe`` says which cache works; without
            one, the paged cache).
        mode: the KV mode.
        page_size: tokens per page of the paged cache.
        rotate: rotate the paged cache's rows (None: the mode's default).

    Raises:
        UnsupportedModeError: unknown mode, or one that cannot store this model's heads.
        ModelLoadError: the probe refused the model.
    """
    from engine.cache import adapter, kvquant
    from engine.errors import ModelLoadError

    probe = getattr(loaded, "probe", None)  # models loaded without a probe stay paged
    if probe is None or probe.verdict == PAGED:
        cache = adapter.make_cache(loaded.model, mode, page_size=page_size, rotate=rotate)
        return SessionCache(cache, PAGED, "")
    if probe.verdict == REFUSED:
        raise ModelLoadError(f"{loaded.info.name} cannot run here: {probe.reason}.")
    bits = kvquant.bits_for(mode)
    why = f"mlx-lm's own KV cache is in use ({probe.reason})"
    if bits == FULL_PRECISION_BITS:
        return SessionCache(_mlx_lm_cache(loaded.model), MLX_LM, f"{why}.")
    if probe.quantized:
        cache = _quantized(_mlx_lm_cache(loaded.model), bits)
        return SessionCache(cache, f"{MLX_LM} quantized", f"{why}, at {bits} bits.")
    note = f"{why}; it cannot quantize this model's keys and values, so {mode} keeps them whole."
    return SessionCache(_mlx_lm_cache(loaded.model), MLX_LM, note)


# -- the runs ------------------------------------------------------------------


def _probe_tokens(model: Any) -> list[int]:
    vocab = _vocab_size(model)
    count = PROBE_TOKENS
    # Spread over the vocabulary, deterministic, no special meaning.
    return [(7 * i + 3) % vocab for i in range(count)]


def _vocab_size(model: Any) -> int:
    args = _text_args(model)
    size = getattr(args, "vocab_size", None)
    return int(size) if isinstance(size, int) and size > 0 else 32


def _text_args(model: Any) -> Any:
    args = getattr(model, "args", None)
    text = getattr(args, "text_config", None)
    if isinstance(text, dict):
        return _Namespace(text)
    return text if text is not None else args


class _Namespace:
    def __init__(self, values: dict[str, Any]) -> None:
        self.__dict__.update(values)


def _run(
    model: Any, cache: list[Any], tokens: list[int], steps: tuple[int, ...] | None = None
) -> mx.array:
    """Logits of every position, in float32: by default two chunks, then one token at a time."""
    pieces, start = [], 0
    for length in steps or (*_CHUNKS, *([1] * _DECODE_STEPS)):
        ids = mx.array(tokens[start : start + length])[None]
        logits = model(ids, cache=cache).astype(mx.float32)
        mx.eval(logits)
        pieces.append(logits[0])
        start += length
    return mx.concatenate(pieces, axis=0)


def _finite(logits: mx.array) -> bool:
    return bool(mx.all(mx.isfinite(logits)).item())


def _mlx_lm_cache(model: Any) -> list[Any]:
    from mlx_lm.models.cache import make_prompt_cache

    return make_prompt_cache(model)


def _paged_cache(model: Any) -> list[Any] | None:
    from engine.cache.adapter import make_cache
    from engine.cache.paged_cache import PagedKVCache

    cache = make_cache(model, FP16, page_size=PROBE_PAGE_SIZE)
    return cache if any(isinstance(c, PagedKVCache) for c in cache) else None


def _quantized(cache: list[Any], bits: int) -> list[Any]:
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    return [
        QuantizedKVCache(group_size=QUANTIZED_GROUP_SIZE, bits=bits) if type(c) is KVCache else c
        for c in cache
    ]


def _quantized_works(model: Any, tokens: list[int]) -> bool:
    cache = _mlx_lm_cache(model)
    from mlx_lm.models.cache import KVCache

    if not any(type(c) is KVCache for c in cache):
        return False
    try:
        return _finite(_run(model, _quantized(cache, _QUANTIZED_CHECK_BITS), tokens))
    except Exception:  # any failure means: do not offer it
        return False


def _fallback(model: Any, tokens: list[int], reason: str, diff: float | None) -> ProbeResult:
    return ProbeResult(MLX_LM, reason, diff, _quantized_works(model, tokens))


def _no_paged_layer(model: Any) -> str:
    kinds = sorted({type(c).__name__ for c in _mlx_lm_cache(model)})
    return (
        f"mlx-lm keeps this model's context in {', '.join(kinds)}, none of them the "
        "plain KVCache the paged cache replaces"
    )


def _with_cause(detail: str, cause: str) -> str:
    return f"{cause}: {detail}" if cause else detail


def _say(error: Exception) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
