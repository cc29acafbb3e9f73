"""Sampling settings for one generation, and the mlx-lm sampler built from them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from engine.errors import EngineError

Sampler = Callable[[mx.array], mx.array]
LogitsProcessor = Callable[[mx.array, mx.array], mx.array]

# mlx-lm's default window for the repetition penalty; long enough to stop loops,
# short enough not to punish every common word in a long answer.
REPETITION_CONTEXT = 64


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token.

    Attributes:
        temperature: 0 picks the most likely token (greedy).
        top_p: nucleus mass to keep; 1.0 disables it.
        top_k: keep only the k most likely tokens; 0 disables it.
        min_p: drop tokens below this fraction of the top token's probability.
        repetition_penalty: > 1 discourages repeating recent tokens; 1.0 disables it.
        max_tokens: most tokens to generate.
        seed: random seed for reproducible sampling, or None.
    """

    temperature: float = 0.7
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int = 512
    seed: int | None = None

    def __post_init__(self) -> None:
        problems = []
        if self.temperature < 0:
            problems.append(f"temperature must be >= 0 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            problems.append(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            problems.append(f"top_k must be >= 0 (got {self.top_k})")
        if not 0 <= self.min_p < 1:
            problems.append(f"min_p must be in [0, 1) (got {self.min_p})")
        if self.repetition_penalty <= 0:
            problems.append(
                f"repetition_penalty must be > 0 (got {self.repetition_penalty})"
            )
        if self.max_tokens < 1:
            problems.append(f"max_tokens must be >= 1 (got {self.max_tokens})")
        if problems:
            raise EngineError("Invalid sampling settings: " + "; ".join(problems) + ".")


def build_sampler(params: SamplingParams) -> Sampler:
    """Return mlx-lm's sampler for these settings (greedy at temperature 0)."""
    return make_sampler(
        temp=params.temperature,
        top_p=params.top_p if params.top_p < 1.0 else 0.0,
        min_p=params.min_p,
        top_k=params.top_k,
    )


def build_logits_processors(params: SamplingParams) -> list[LogitsProcessor]:
    """Return mlx-lm's logits processors for these settings (may be empty)."""
    if params.repetition_penalty == 1.0:
        return []
    return make_logits_processors(
        repetition_penalty=params.repetition_penalty,
        repetition_context_size=REPETITION_CONTEXT,
    )


def seed_sampling(params: SamplingParams) -> None:
    """Seed MLX's random state when the settings ask for reproducible sampling."""
    if params.seed is not None:
        mx.random.seed(params.seed)
