"""A quality receipt for one chat: its KV mode against fp16 on its own text.

The last ``WINDOW_TOKENS`` (or fewer) tokens of the chat's context are read as a
standalone window, teacher-forced, through two fresh caches built the way sessions
build them: fp16 (the reference) and the chat's mode with its rotation setting. Each
chunk goes through both caches and the two next-token distributions are compared at
once (KL(fp16 ‖ mode), same top-1 token); only per-position scores are kept, so memory
stays bounded by one chunk's logits whatever the vocabulary. The session's own cache
is never touched. Only the engine's worker thread may call :func:`check_quality`.

:func:`log_probs`, :func:`divergence` and :func:`summarize` are the teacher-forced
math that ``benchmarks.quality_bench`` uses as well.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from engine.cache import adapter
from engine.cache.modes import REFERENCE, KvMode
from engine.errors import Cancelled, EngineError
from engine.events import QualityReceipt
from engine.models.loader import LoadedModel
from engine.models.probe import MLX_LM, make_session_cache

WINDOW_TOKENS = 1024  # both caches of a window this size fit next to any model we load
CHUNK_TOKENS = 128  # the most tokens per step
# What one step's logits may take: per cache the logits, their float32 copy and
# log-probs, and the comparison's temporaries, about six float32 rows per token.
# A 248k vocabulary then steps 45 tokens at a time, a 49k one 128.
LOGITS_BUDGET_BYTES = 256 * 2**20
_LOGIT_COPIES = 6
PAGE_SIZE = 256

Progress = Callable[[int, int], None]  # (tokens done, tokens in the window)


def log_probs(logits: mx.array) -> mx.array:
    """Log-softmax over the last axis, in float32, evaluated."""
    logits = logits.astype(mx.float32)
    out = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(out)
    return out


def divergence(reference: mx.array, variant: mx.array) -> tuple[np.ndarray, np.ndarray]:
    """Per position: KL(reference ‖ variant) and whether both pick the same top-1 token.

    Both are log-probabilities ``[positions, vocab]``; only the two small vectors come
    back to NumPy.
    """
    kl = mx.sum(mx.exp(reference) * (reference - variant), axis=-1)
    kl = mx.maximum(kl, 0.0)  # rounding can make an identical pair read -1e-9
    same = mx.argmax(reference, axis=-1) == mx.argmax(variant, axis=-1)
    mx.eval(kl, same)
    return np.array(kl, dtype=np.float64), np.array(same, dtype=bool)


def surprisal(log_prob: mx.array, targets: list[int]) -> np.ndarray:
    """Per position: -log p of the token that came next in the text (``targets``, one
    per position from the first; positions past them are left out)."""
    if not targets:
        return np.zeros(0)
    picked = mx.take_along_axis(log_prob[:len(targets)], mx.array(targets)[:, None], axis=-1)
    return -np.array(picked[:, 0], dtype=np.float64)


def perplexity(nll: np.ndarray) -> float | None:
    """exp of the mean surprisal; None with no position to score."""
    return float(np.exp(nll.mean())) if nll.size else None


def summarize(kl: np.ndarray, same: np.ndarray) -> dict[str, float]:
    """Mean and 99th percentile of the KL, and the share of positions with the same top-1."""
    return {
        "kl_mean": float(kl.mean()),
        "kl_p99": float(np.percentile(kl, 99)),
        "top1": float(same.mean()),
    }


def check_quality(
    loaded: LoadedModel,
    context_ids: list[int],
    mode: KvMode,
    *,
    rotate: bool,
    window: int | None = None,
    chunk: int | None = None,
    page_size: int = PAGE_SIZE,
    cancel: threading.Event | None = None,
    progress: Progress | None = None,
    clock: Callable[[], float] = time.time,
) -> QualityReceipt:
    """Compare ``mode`` with fp16 over the last ``window`` tokens of ``context_ids``.

    Args:
        loaded: the ``LoadedModel`` the chat runs on.
        context_ids: the chat's whole context, as token ids.
        mode: the chat's KV mode.
        rotate: whether the chat's cache stores its rows rotated.
        window: the most tokens read (the last ones); None: ``WINDOW_TOKENS``.
        chunk: tokens fed per step, progress and cancel checked between them; None:
            one token first, then what :func:`chunk_for_vocabulary` allows for the
            vocabulary its logits show.
        page_size: tokens per page of both caches (the session's).
        cancel: set to stop between two chunks (raises ``Cancelled``).
        progress: called after every chunk with (tokens done, tokens in the window).
        clock: when the receipt was made, in seconds since the epoch.

    Raises:
        EngineError: the context is empty, the window or chunk is under one token, or
            the mode stores keys and values whole on this model.
        Cancelled: ``cancel`` was set; nothing is kept.
        UnsupportedModeError: the mode cannot store this model's heads.
    """
    window = WINDOW_TOKENS if window is None else window
    if window < 1 or (chunk is not None and chunk < 1):
        raise EngineError("The quality check needs a window and a chunk of at least 1 token.")
    if not context_ids:
        raise EngineError("Nothing to check yet: the chat has no text. Send a message first.")
    ids = list(context_ids[-window:])
    caches = [_fresh_cache(loaded, REFERENCE, False, page_size),
              _fresh_cache(loaded, mode, rotate, page_size, checked=True)]
    # What the mode's cache really stores (mlx-lm's own cache, where the probe chose it,
    # has no rotation whatever the setting says).
    rotated = adapter.rotation_format(caches[1]) is not None
    kls, sames = [], []
    surprises: tuple[list[np.ndarray], list[np.ndarray]] = ([], [])
    try:
        start, size = 0, 1 if chunk is None else chunk
        while start < len(ids):
            if cancel is not None and cancel.is_set():
                raise Cancelled(f"Quality check cancelled after {start:,} of {len(ids):,} "
                                "tokens; nothing was stored.")
            piece = ids[start : start + size]
            reference, variant = (_forward(loaded.model, cache, piece) for cache in caches)
            if chunk is None:
                size = chunk_for_vocabulary(reference.shape[-1])
            kl, same = divergence(reference, variant)
            # The chat's own next tokens; the window's last has none inside it.
            targets = ids[start + 1 : start + len(piece) + 1]
            for kept, log_prob in zip(surprises, (reference, variant), strict=True):
                kept.append(surprisal(log_prob, targets))
            del reference, variant  # one chunk's logits at a time
            kls.append(kl)
            sames.append(same)
            start += len(piece)
            if progress is not None:
                progress(start, len(ids))
        if cancel is not None and cancel.is_set():
            # Stop pressed during the last chunk: the user asked for no receipt.
            raise Cancelled(f"Quality check cancelled after {start:,} of {len(ids):,} "
                            "tokens; nothing was stored.")
    finally:
        caches.clear()
        mx.clear_cache()  # hand both caches' pages back, not just to MLX's buffer cache
    return QualityReceipt(
        mode=mode, rotated=rotated, window_tokens=len(ids), context_tokens=len(context_ids),
        positions=len(ids), model=loaded.info.name,
        measured_at=clock(), **summarize(np.concatenate(kls), np.concatenate(sames)),
        reference_perplexity=perplexity(np.concatenate(surprises[0])),
        perplexity=perplexity(np.concatenate(surprises[1])),
    )


def chunk_for_vocabulary(vocab: int, budget: int | None = None) -> int:
    """Tokens per step whose logits over ``vocab`` fit ``budget`` (None: the default)."""
    budget = LOGITS_BUDGET_BYTES if budget is None else budget
    return max(1, min(CHUNK_TOKENS, budget // (4 * _LOGIT_COPIES * vocab)))


def _fresh_cache(loaded: LoadedModel, mode: KvMode, rotate: bool, page_size: int,
                 *, checked: bool = False) -> list[Any]:
    """A new cache as a session in ``mode`` holds it; ``checked``: the one measured,
    refused where the mode stores keys and values whole (mlx-lm's unquantized
    cache): its verdict would be fp16's, for a mode that saves nothing."""
    chosen = make_session_cache(loaded, mode, page_size, rotate=rotate)
    if checked and mode != REFERENCE and chosen.kind == MLX_LM:
        raise EngineError(f"Nothing to check: {chosen.note} On this model {mode} answers as "
                          "fp16 does and takes fp16's memory.")
    return chosen.cache


def _forward(model: Any, cache: list[Any], ids: list[int]) -> mx.array:
    """The log-probs of every position of ``ids``, fed after what ``cache`` holds."""
    logits = model(mx.array(ids)[None], cache=cache)
    mx.eval(adapter.eval_targets(cache))
    return log_probs(logits[0])
