"""The layers a session keeps outside the pages, as a model's config.json gives them.

Plain values and arithmetic only (no MLX): a model described before it loads, on
any thread, sizes what its sliding windows and linear-attention state will take
(``engine.cache.other_layers`` bounds them once it has loaded).
"""

from __future__ import annotations

from dataclasses import dataclass

MAC_VALUE_BYTES = 2  # a Mac's GPU computes in 16 bits: what its windows and states keep


@dataclass(frozen=True)
class LinearShape:
    """A gated-delta linear-attention layer's shape (Qwen3-Next's ``linear_*``
    config fields): what its state holds does not grow with the context."""

    key_heads: int
    key_dim: int
    value_heads: int
    value_dim: int
    conv_kernel: int

    def state_bytes(self, value_bytes: int) -> int:
        """One conversation's state of one layer, as mlx-lm makes it: the
        convolution's last inputs in the activations' dtype (``value_bytes``) and the
        recurrent state in float32."""
        conv_width = 2 * self.key_heads * self.key_dim + self.value_heads * self.value_dim
        return ((self.conv_kernel - 1) * conv_width * value_bytes
                + self.value_heads * self.value_dim * self.key_dim * 4)


@dataclass(frozen=True)
class OutsideShape:
    """The layers outside the pages as a model's config.json gives them (plain
    values: a model not loaded, or not downloaded)."""

    sliding_layers: int = 0
    window: int = 0  # tokens a sliding window holds
    kv_heads: int = 0  # of a window's layer
    head_dim: int = 0
    linear_layers: int = 0
    linear: LinearShape | None = None

    def bound_bytes(self, chunk: int, value_bytes: int) -> int:
        """What one conversation's windows (each its tokens plus a prefill chunk of
        ``chunk``) and linear states hold at most, as ``other_layers.other_layers``
        bounds them."""
        rows = self.window + chunk - 1 if self.window > 0 else 0
        windows = self.sliding_layers * rows * 2 * self.kv_heads * self.head_dim * value_bytes
        states = (self.linear_layers * self.linear.state_bytes(value_bytes)
                  if self.linear is not None else 0)
        return windows + states
