"""Checkpoints of the cache layers that cannot rewind, so a session never re-reads what it holds.

Paged attention layers trim exactly to any length. mlx-lm's other caches do not:
an ``ArraysCache`` (the conv and recurrent state of a linear-attention layer, as in
qwen3_next) has no past to go back to, and a ``RotatingKVCache`` (a sliding window,
as in gemma3) has overwritten its oldest rows once it wrapped. A :class:`Checkpoint`
copies the state of those layers at one token count; rewinding to ``L`` restores the
newest checkpoint at ``C <= L``, trims the paged layers to ``C`` as well (every layer
must agree on the count) and leaves ``C..L`` for the caller to feed again.

Memory: one checkpoint costs the non-paged layers' state once. For a linear-attention
layer that is its recurrent state (value heads x key dim x value dim, fp32: 48 x 128
x 128 x 4 bytes = 3 MiB) plus a few conv rows, so ~150 MiB for a 27B hybrid's 48
linear layers; for a sliding-window layer it is the window's keys and values (plus a
chunk's rows right after a prefill chunk). A session keeps at most ``MAX_KEPT``
checkpoints, and none for models whose layers are all paged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from engine.cache.paged_cache import PagedKVCache

# Checkpoints kept at message boundaries and prefill ends: regenerate goes back to the
# newest, an edit of the last user message to the one before, and one spare.
MAX_BOUNDARIES = 3
# The most a session keeps at once: those boundaries, the one that ends the longest
# message (a document the chat began with: another chat on it, or an edit of a later
# question, goes back there rather than read it again) and the newest chunk end.
MAX_KEPT = MAX_BOUNDARIES + 2


def copy_state(value: Any) -> Any:
    # mx.array(a) copies the data into a new buffer (a copy.copy would share it and,
    # for the conv state, pin the whole chunk it was sliced from); lists are copied
    # because mlx-lm assigns into them in place (ArraysCache.cache[i] = ...).
    if isinstance(value, mx.array):
        return mx.array(value)
    if isinstance(value, list | tuple):
        return type(value)(copy_state(v) for v in value)
    return value


def _arrays(value: Any) -> list[mx.array]:
    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, list | tuple):
        return [a for v in value for a in _arrays(v)]
    return []


def needs_checkpoints(cache: list[Any]) -> bool:
    """Whether any layer of ``cache`` is not paged, so rewinding it needs checkpoints."""
    return any(not isinstance(layer, PagedKVCache) for layer in cache)


@dataclass(frozen=True)
class Checkpoint:
    """Copied state of a cache's non-paged layers after its first ``tokens`` tokens.

    Attributes:
        tokens: tokens every layer held when the copy was taken.
        states: ``(layer index, copied mlx-lm state)`` of each non-paged layer.
        boundary: taken at a message boundary or a prefill's end (kept longer than
            the chunk ends in between).
        nbytes: bytes the copies take.
    """

    tokens: int
    states: tuple[tuple[int, Any], ...]
    boundary: bool
    nbytes: int


def take(cache: list[Any], tokens: int, *, boundary: bool) -> Checkpoint:
    """Copy the state of ``cache``'s non-paged layers (evaluated now: the layers move on)."""
    states = tuple(
        (index, copy_state(layer.state))
        for index, layer in enumerate(cache)
        if not isinstance(layer, PagedKVCache)
    )
    arrays = _arrays([state for _, state in states])
    mx.eval(arrays)
    return Checkpoint(tokens, states, boundary, sum(a.nbytes for a in arrays))


def _trim_layers_to(layers: list[Any], tokens: int) -> bool:
    """Trim each layer to ``tokens``; False (nothing changed) when one cannot."""
    found = [getattr(layer, "offset", None) for layer in layers]
    offsets = [o for o in found if isinstance(o, int)]
    if len(offsets) < len(found) or any(o < tokens for o in offsets):
        return False
    if any(o > tokens and not layer.is_trimmable() for layer, o in zip(layers, offsets,
                                                                         strict=True)):
        return False
    for layer, offset in zip(layers, offsets, strict=True):
        if offset > tokens:
            # Per layer, not one common count: a failed forward pass may have left
            # the layers at different lengths.
            layer.trim(offset - tokens)
    return all(layer.offset == tokens for layer in layers)


class CheckpointStore:
    """The few checkpoints one session keeps, newest last.

    The newest ``max_boundaries`` boundary checkpoints, the boundary that ends the
    longest message (the most tokens since the boundary before it; the oldest of
    equals) and the newest chunk end.
    """

    def __init__(self, max_boundaries: int = MAX_BOUNDARIES) -> None:
        self.max_boundaries = max_boundaries
        self.kept: list[Checkpoint] = []
        self._spans: dict[int, int] = {}  # a kept boundary's tokens: the message it ends

    @property
    def nbytes(self) -> int:
        """Bytes all kept checkpoints take."""
        return sum(c.nbytes for c in self.kept)

    def newest(self) -> Checkpoint | None:
        """The checkpoint with the most tokens, or None."""
        return self.kept[-1] if self.kept else None

    def add(self, checkpoint: Checkpoint) -> None:
        """Keep ``checkpoint`` (replacing one at the same count), dropping the oldest."""
        if checkpoint.boundary:
            # The newest boundary is always kept: the one before this message.
            before = max((t for t in self._spans if t < checkpoint.tokens), default=0)
            self._spans[checkpoint.tokens] = checkpoint.tokens - before
        others = [c for c in self.kept if c.tokens != checkpoint.tokens]
        kept = sorted([*others, checkpoint], key=lambda c: c.tokens)
        boundaries = [c for c in kept if c.boundary]
        newest = boundaries[-self.max_boundaries:]
        longest = max(boundaries, key=lambda c: self._spans.get(c.tokens, 0), default=None)
        pinned = [] if longest is None or longest.tokens in {c.tokens for c in newest} \
            else [longest]
        chunk_ends = [c for c in kept if not c.boundary][-1:]
        self.kept = sorted([*pinned, *newest, *chunk_ends], key=lambda c: c.tokens)
        self._forget_spans()

    def drop_after(self, tokens: int) -> None:
        """Forget checkpoints past ``tokens``: the ids they followed are gone."""
        self.kept = [c for c in self.kept if c.tokens <= tokens]
        self._forget_spans()

    def _forget_spans(self) -> None:
        held = {c.tokens for c in self.kept if c.boundary}
        self._spans = {tokens: span for tokens, span in self._spans.items() if tokens in held}

    def at_most(self, tokens: int) -> Checkpoint | None:
        """The newest checkpoint at ``tokens`` or fewer."""
        return next((c for c in reversed(self.kept) if c.tokens <= tokens), None)

    def clear(self) -> None:
        """Forget every checkpoint."""
        self.kept = []
        self._spans = {}


def rewind(cache: list[Any], tokens: int, store: CheckpointStore, *,
           exact: bool = True) -> int | None:
    """Bring every layer of ``cache`` back to at most ``tokens`` tokens.

    Layers that can trim are trimmed exactly to ``tokens`` (unless ``exact`` is
    False: another rank's layers cannot, so this one goes where they go).
    Otherwise the newest checkpoint at ``C <= tokens`` is restored into the
    non-paged layers and the paged layers are trimmed to ``C``.

    Returns:
        The tokens every layer now holds (``tokens``, or a checkpoint's ``C``), or
        None when no checkpoint reaches back that far (the cache is unchanged
        unless a paged layer was already shorter; reset it then).
    """
    if exact and _trim_layers_to(cache, tokens):
        store.drop_after(tokens)
        return tokens
    checkpoint = store.at_most(tokens)
    if checkpoint is None:
        return None
    restored = {index for index, _ in checkpoint.states}
    paged = [layer for index, layer in enumerate(cache) if index not in restored]
    if not _trim_layers_to(paged, checkpoint.tokens):
        return None
    for index, state in checkpoint.states:
        # A fresh copy: the checkpoint must survive the in-place updates that follow.
        cache[index].state = copy_state(state)
    store.drop_after(checkpoint.tokens)
    return checkpoint.tokens
