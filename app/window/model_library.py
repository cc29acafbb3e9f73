"""The models a user can pick: those on disk and the recommended ones, with their facts.

Each entry says its size, context length and what its KV cache costs at full
context in each mode against this machine's RAM ("262k in q6: 14.8 GB — fits"),
from ``engine.full_context_costs``: arithmetic over the model's facts, no MLX.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil

from app.format import human_bytes, short_tokens
from engine import (
    DEMO,
    RECOMMENDED_MODELS,
    ModeCost,
    RecommendedModel,
    can_split,
    full_context_costs,
    outside_pages_reserve,
)

if TYPE_CHECKING:
    from engine import DiscoveredModel

DEMO_SOURCE = DEMO  # discovery reports the demo model with its path as its source
MIN_USEFUL_CONTEXT = 4096  # tokens: less than this holds no document worth a long-context model


@dataclass(frozen=True)
class ModelEntry:
    """One row of the model library.

    Attributes:
        name: what the user reads (the repo id for Hub models).
        path: the folder to load, or None for a model not downloaded yet.
        repo_id: the Hub repo to download, or None for one found on disk.
        size_bytes: size on disk (approximate for a download).
        max_context: trained context, in tokens.
        costs: each mode's KV bytes at full context and whether it fits in RAM.
        summary: a few words on a recommended model ("" otherwise).
        splittable: whether its layers can be split across Macs (Settings → Use
            other Macs); known only for a model on disk.
    """

    name: str
    path: str | None
    repo_id: str | None
    size_bytes: int
    max_context: int
    costs: tuple[ModeCost, ...]
    summary: str = ""
    splittable: bool = False

    @property
    def key(self) -> str:
        """Its one name in the library: the folder on disk, else the repo to download."""
        key = self.path or self.repo_id
        if key is None:  # installed_entry gives a path, recommended_entry a repo id
            raise ValueError(f"The library entry {self.name!r} has neither folder nor repo.")
        return key

    @property
    def downloaded(self) -> bool:
        """Whether the model is on disk."""
        return self.path is not None

    def size_text(self) -> str:
        """"1.8 GB", or "≈ 1.8 GB" before it is downloaded."""
        return ("" if self.downloaded else "≈ ") + human_bytes(self.size_bytes)

    def split_text(self) -> str:
        """Whether "Use other Macs" can split it, in words ("" before it is downloaded)."""
        if not self.downloaded:
            return ""
        return ("Can be split across Macs (Settings → Use other Macs)" if self.splittable
                else "Runs on one Mac only: its architecture cannot be split across Macs")

    def cost_lines(self) -> list[str]:
        """"262k in q6: 14.8 GB — fits", one line per mode."""
        return [cost_text(cost, self.max_context) for cost in self.costs]


def cost_text(cost: ModeCost, context: int) -> str:
    """"262k in q6: 14.8 GB — fits" (or "— too big for this machine's RAM")."""
    head = f"{short_tokens(context)} in {cost.mode}"
    if cost.kv_bytes is None:
        return f"{head}: not possible for this model's head size"
    verdict = "fits" if cost.fits else "too big for this machine's RAM"
    return f"{head}: {human_bytes(cost.kv_bytes)} — {verdict}"


def fit_advice(entry: ModelEntry, total_ram: int) -> tuple[bool, str]:
    """(whether it fits, what to do): a model's verdict for this machine, in words.

    "Fits: the whole 262k context in q8"; "Too big at its full 262k context here.
    Fits in q4 up to 120k tokens."; or, when not even a useful context fits beside
    its weights, "Too big for this machine's 24 GB of RAM: choose a smaller model."
    """
    whole = short_tokens(entry.max_context)
    best = next((cost for cost in entry.costs if cost.fits), None)  # best quality first
    if best is not None:
        return True, f"Fits: the whole {whole} context in {best.mode}"
    most = max(entry.costs, key=lambda cost: cost.tokens_fit)
    if most.tokens_fit >= MIN_USEFUL_CONTEXT:
        return False, (f"Too big at its full {whole} context here. Fits in {most.mode} up to "
                       f"{short_tokens(most.tokens_fit)} tokens.")
    return False, (f"Too big for this machine's {human_bytes(total_ram)} of RAM: choose a "
                   "smaller model.")


def installed_entry(model: DiscoveredModel, total_ram: int) -> ModelEntry:
    """The entry of an ``engine.discover_models`` model."""
    info = model.info
    costs = full_context_costs(
        attention_layers=info.attention_layers, kv_heads=info.kv_heads,
        head_dim=info.head_dim, max_context=info.max_context,
        weights_bytes=model.weights_bytes, total_ram_bytes=total_ram,
        outside_pages_bytes=outside_pages_reserve(info.outside))
    return ModelEntry(model.name, str(model.path), None, model.size_bytes,
                      info.max_context, costs, splittable=can_split(model.path))


def recommended_entry(model: RecommendedModel, total_ram: int) -> ModelEntry:
    """The entry of an ``engine.RecommendedModel`` not downloaded yet."""
    costs = full_context_costs(
        attention_layers=model.attention_layers, kv_heads=model.kv_heads,
        head_dim=model.head_dim, max_context=model.max_context,
        weights_bytes=model.approx_size_bytes, total_ram_bytes=total_ram,
        outside_pages_bytes=outside_pages_reserve(model.outside))
    return ModelEntry(model.repo_id, None, model.repo_id, model.approx_size_bytes,
                      model.max_context, costs, model.summary)


def library(models: Sequence[DiscoveredModel],
            total_ram: int | None = None) -> tuple[list[ModelEntry], list[ModelEntry]]:
    """(models on disk, recommended ones not on disk yet), each with its facts.

    Args:
        models: ``Discovery.models`` (the demo's converted folder included).
        total_ram: the machine's RAM; None reads it now.
    """
    ram = psutil.virtual_memory().total if total_ram is None else total_ram
    installed = [installed_entry(model, ram) for model in models]
    have = {model.name for model in models}
    wanted = [recommended_entry(model, ram) for model in RECOMMENDED_MODELS
              if model.repo_id not in have]
    return installed, wanted
