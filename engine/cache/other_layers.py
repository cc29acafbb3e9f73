"""The layers a session keeps outside the pages, and the most they can hold.

Sliding-window layers keep mlx-lm's ``RotatingKVCache``: at most its window plus
one prefill chunk of tokens (mlx-lm keeps ``max_size + chunk - 1`` rows after a
chunk). Linear-attention layers keep an ``ArraysCache`` whose arrays have a fixed
size once the first token made them. Both are bounded, so the KV budget reserves
their bound next to the pages instead of finding out when they grow.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache, RotatingKVCache

SLIDING = "sliding windows"
LINEAR = "linear attention"


@dataclass(frozen=True)
class OtherLayers:
    """What the layers that are not paged may hold.

    Attributes:
        bound_bytes: the most they hold (a linear-attention state not made yet
            counts what the model's probe measured, else 0 until the first token
            makes it).
        kinds: what they are, e.g. "sliding windows, linear attention" ("" if none).
        checkpoint_copies: how many checkpoints of them the session may keep
            (``engine.session.checkpoints``): each copies them whole.
    """

    bound_bytes: int = 0
    kinds: str = ""
    checkpoint_copies: int = 0

    @property
    def reserve_bytes(self) -> int:
        """What the KV budget and free RAM keep for them: their bound, and as much
        again for each checkpoint the session may keep."""
        return self.bound_bytes * (1 + self.checkpoint_copies)


def other_layers(
    cache: list[Any], kv_heads: int, head_dim: int, value_bytes: int, chunk: int, *,
    linear_bytes: int = 0, checkpoint_copies: int = 0,
) -> OtherLayers:
    """The bound of every layer of ``cache`` that is not paged (no MLX evaluation).

    Args:
        cache: a session's per-layer caches.
        kv_heads: KV heads of a window's layer (used before its first token).
        head_dim: values per head (likewise).
        value_bytes: bytes of one key or value (likewise).
        chunk: the largest prefill chunk.
        linear_bytes: what the linear-attention layers' state of one conversation
            takes, as the model's probe measured it (0: unknown); counted before
            the first token makes it.
        checkpoint_copies: the checkpoints the session may keep of these layers.
    """
    windows, kinds = 0, []
    for layer in cache:
        if isinstance(layer, RotatingKVCache):
            windows += (layer.max_size + chunk - 1) * _row_bytes(layer, kv_heads, head_dim,
                                                                 value_bytes)
            kind = SLIDING
        elif isinstance(layer, ArraysCache):
            kind = LINEAR
        else:
            continue  # paged, or mlx-lm's own full cache (no paged layer): not bounded
        if kind not in kinds:
            kinds.append(kind)
    linear = max(linear_state_bytes(cache), linear_bytes) if LINEAR in kinds else 0
    return OtherLayers(windows + linear, ", ".join(kinds), checkpoint_copies)


def linear_state_bytes(cache: list[Any]) -> int:
    """Bytes the linear-attention layers of ``cache`` hold (0 before the first token)."""
    total = 0
    for layer in cache:
        if isinstance(layer, ArraysCache):
            # mlx-lm leaves ArraysCache.cache unannotated (read as a list of None);
            # it holds the layer's state arrays.
            states = cast("list[mx.array | None]", layer.cache)
            total += sum(int(a.nbytes) for a in states if a is not None)
    return total


def _row_bytes(layer: Any, kv_heads: int, head_dim: int, value_bytes: int) -> int:
    """Bytes of one token's keys and values in a rotating window."""
    if layer.keys is None:
        return 2 * kv_heads * head_dim * value_bytes
    keys, values = layer.keys, layer.values
    return (keys.shape[1] * keys.shape[3] * keys.itemsize
            + values.shape[1] * values.shape[3] * values.itemsize)
