"""Recommended long-context models, and what any model's KV costs at full context.

The built-in demo model has an 8k context, so the long-context promise needs a
download: these are mlx-community repos whose facts (layers that keep a KV
cache, KV heads, head size, trained context) come from their ``config.json``,
so their KV cost can be shown before a byte is downloaded
(``engine.memory.model_costs.full_context_costs``). Download sizes are approximate
(the Hub's listing has the exact ones when the download starts).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.cache.outside import LinearShape, OutsideShape

GB = 10**9


@dataclass(frozen=True)
class RecommendedModel:
    """A Hub repo worth trying for long context, with the facts that size its KV.

    Attributes:
        repo_id: the mlx-community repo.
        summary: a few words on what it is.
        approx_size_bytes: download size, approximate.
        max_context: trained context, in tokens.
        attention_layers: layers whose KV cache grows with the context.
        kv_heads: KV heads per attention layer.
        head_dim: width of one KV head.
        outside: its layers outside the pages (sliding windows, linear attention).
    """

    repo_id: str
    summary: str
    approx_size_bytes: int
    max_context: int
    attention_layers: int
    kv_heads: int
    head_dim: int
    outside: OutsideShape = field(default_factory=OutsideShape)

    @property
    def name(self) -> str:
        """The repo name without the organisation."""
        return self.repo_id.rpartition("/")[2]


RECOMMENDED_MODELS: tuple[RecommendedModel, ...] = (
    RecommendedModel("mlx-community/Llama-3.2-3B-Instruct-4bit",
                     "Llama 3.2 3B, 4-bit: small and quick, 128k context",
                     int(1.8 * GB), 131_072, 28, 8, 128),
    RecommendedModel("mlx-community/Qwen3-4B-Instruct-2507-4bit",
                     "Qwen3 4B (2507), 4-bit: 256k context on a 16 GB Mac in q4",
                     int(2.3 * GB), 262_144, 36, 8, 128),
    RecommendedModel("mlx-community/Qwen3-30B-A3B-Instruct-2507-4bit",
                     "Qwen3 30B-A3B MoE (2507), 4-bit: 3B active, fast for its size",
                     int(17.2 * GB), 262_144, 48, 4, 128),
    # Hybrid: 36 of its 48 layers are linear attention with a fixed-size state.
    RecommendedModel("mlx-community/Qwen3-Next-80B-A3B-Instruct-4bit",
                     "Qwen3-Next 80B-A3B hybrid, 4-bit: 1 layer in 4 keeps a KV cache",
                     int(44.8 * GB), 262_144, 12, 2, 256,
                     OutsideShape(linear_layers=36, linear=LinearShape(16, 128, 32, 128, 4))),
)
