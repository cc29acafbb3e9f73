"""What each KV storage costs in next-token quality, teacher-forced.

One text (Python's own ``pydoc_data.topics``, sorted by topic) is fed to the demo
model through each cache variant: the first ``context`` tokens as a chunked prefill,
then the next ``tokens`` tokens one at a time, as a decode would. At every one of those
positions the variant's next-token distribution is compared with the engine's fp16
cache (the reference): KL(fp16 ‖ variant), whether the top-1 token is the same, and the
perplexity of the text's real next tokens.

Contexts share the text, so each variant makes one pass: prefill to the first context,
score its ``tokens`` tokens, keep going (prefill) to the next context, score, and so on.
Variants: the engine's paged cache in every mode with and without the Hadamard rotation
of :mod:`engine.cache.rotation`, and mlx-lm's ``QuantizedKVCache`` (group 64) at 8/6/4
bits as the anchor. Compute is fp32 on the CPU.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from benchmarks.report import machine_lines, table
from engine.cache.kvquant import MODES, bits_for, kv_bytes_per_token
from engine.cache.modes import FP16, KvMode, parse_mode
from engine.session.quality_check import divergence, log_probs, summarize

MLX_GROUP_SIZE = 64
_MLX_SCALE_BYTES = 2  # fp16 scale and fp16 bias per group, as on a Mac


@dataclass(frozen=True)
class QualityBenchConfig:
    """Sizes of one ``benchmarks quality`` run."""

    model: str = "demo"
    contexts: tuple[int, ...] = (2048, 6144)
    tokens: int = 64
    modes: tuple[KvMode, ...] = tuple(MODES)
    mlx_bits: tuple[int, ...] = (8, 6, 4)
    chunk: int = 512
    page_size: int = 256


QUICK = QualityBenchConfig(contexts=(256, 512), tokens=16, chunk=128)


@dataclass(frozen=True)
class Variant:
    """One cache under test."""

    name: str
    kind: str  # "engine" or "mlx-lm"
    mode: KvMode
    rotate: bool = False


REFERENCE = Variant("engine fp16", "engine", FP16)


def variants(config: QualityBenchConfig) -> list[Variant]:
    """The reference first, then every engine mode unrotated and rotated, then mlx-lm."""
    found = [REFERENCE]
    for mode in config.modes:
        if mode != FP16:
            found.append(Variant(f"engine {mode}", "engine", mode))
        found.append(Variant(f"engine {mode} rotated", "engine", mode, rotate=True))
    for bits in config.mlx_bits:
        found.append(Variant(f"mlx-lm {bits}-bit g{MLX_GROUP_SIZE}", "mlx-lm",
                             parse_mode(f"q{bits}")))
    return found


def text_ids(tokenizer: Any, count: int) -> list[int]:
    """The first ``count`` token ids of Python's pydoc topics, sorted by topic name."""
    from pydoc_data.topics import topics

    ids: list[int] = []
    for name in sorted(topics):
        ids.extend(tokenizer.encode(topics[name] + "\n\n", add_special_tokens=False))
        if len(ids) >= count:
            return ids[:count]
    raise ValueError(f"pydoc topics hold only {len(ids)} tokens; asked for {count}.")


def bytes_per_token(variant: Variant, head_dim: int) -> int:
    """K+V bytes one token takes per KV head, by format arithmetic.

    mlx-lm's cache is counted with fp16 scale and bias per group (what it stores for an
    fp16 model on a Mac); on this CPU the model runs in fp32 and so do its scales.
    """
    if variant.kind == "engine":
        return kv_bytes_per_token(head_dim, variant.mode)
    bits = bits_for(variant.mode)
    return 2 * (head_dim * bits // 8 + 2 * _MLX_SCALE_BYTES * head_dim // MLX_GROUP_SIZE)


def make_variant_cache(model: Any, variant: Variant, capacity: int, page_size: int) -> list[Any]:
    """A fresh prompt cache for ``variant`` (mlx-lm's pre-sized where it needs it)."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    from benchmarks.contenders import mlx_quantized_cache
    from engine.cache.adapter import layer_attention_shape, make_cache

    if variant.kind == "engine":
        return make_cache(model, variant.mode, page_size=page_size, rotate=variant.rotate)
    make = mlx_quantized_cache(bits_for(variant.mode), mx.float32)
    cache = make_prompt_cache(model)
    for index, layer_cache in enumerate(cache):
        if type(layer_cache) is KVCache:
            kv_heads, head_dim = layer_attention_shape(model, index)
            if kv_heads is None or head_dim is None:
                raise ValueError(f"Layer {index} has a KVCache but no readable attention shape.")
            cache[index] = make(kv_heads, head_dim, capacity)
    return cache


class _Feeder:
    """Feeds one text through one cache, keeping only the logits asked for."""

    def __init__(self, model: Any, cache: list[Any], ids: list[int], chunk: int) -> None:
        self.model, self.cache, self.ids, self.chunk = model, cache, ids, chunk
        self.position = 0
        self.prefill_seconds = 0.0

    def _forward(self, ids: list[int]) -> mx.array:
        from engine.cache.adapter import eval_targets

        logits = self.model(mx.array(ids)[None], cache=self.cache)
        mx.eval(eval_targets(self.cache))
        return logits

    def prefill_to(self, end: int) -> mx.array:
        """Feed ids up to ``end``; the log-probs of the last position (for ids[end])."""
        started = time.perf_counter()
        logits = None
        while self.position < end:
            step = min(self.chunk, end - self.position)
            logits = self._forward(self.ids[self.position : self.position + step])
            self.position += step
        if logits is None:
            raise ValueError(f"Already fed to {self.position}; nothing to prefill to {end}.")
        last = log_probs(logits[0, -1])
        self.prefill_seconds += time.perf_counter() - started
        return last

    def step(self) -> mx.array:
        """Feed one id; the log-probs for the next."""
        logits = self._forward([self.ids[self.position]])
        self.position += 1
        return log_probs(logits[0, -1])


def run_variant(
    model: Any, variant: Variant, ids: list[int], config: QualityBenchConfig
) -> dict[int, np.ndarray]:
    """Log-probs ``[tokens, vocab]`` at each context: ``{context: array}``.

    Row ``i`` of a context's array is the distribution the variant gives for
    ``ids[context + i]``.
    """
    capacity = len(ids) + config.page_size
    cache = make_variant_cache(model, variant, capacity, config.page_size)
    feeder = _Feeder(model, cache, ids, config.chunk)
    out: dict[int, np.ndarray] = {}
    for context in sorted(config.contexts):
        rows = [feeder.prefill_to(context)]
        rows.extend(feeder.step() for _ in range(config.tokens - 1))
        out[context] = np.array(mx.stack(rows))
    return out


def compare(reference: np.ndarray, variant: np.ndarray, targets: list[int]) -> dict[str, float]:
    """KL(reference ‖ variant) per position (mean, p99), top-1 agreement and perplexity."""
    kl, same = divergence(mx.array(reference), mx.array(variant))
    nll = -variant[np.arange(len(targets)), targets].astype(np.float64)
    return {**summarize(kl, same), "ppl": float(np.exp(nll.mean()))}


def run_quality_bench(
    config: QualityBenchConfig,
    progress: Callable[[str], None] = print,
    partial_results: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every variant at every context against engine fp16; plain-value results.

    ``partial_results`` gets the results so far after each variant, so a long run
    that is stopped still leaves its finished variants behind.
    """
    from engine.models.loader import load_model

    loaded = load_model(config.model)
    info = loaded.info
    ids = text_ids(loaded.tokenizer, max(config.contexts) + config.tokens)
    rows: list[dict[str, Any]] = []
    results = {
        "config": dataclasses.asdict(config),
        "model": {"name": info.name, "head_dim": info.head_dim, "kv_heads": info.kv_heads},
        "rows": rows,
    }
    reference: dict[int, np.ndarray] = {}
    for variant in variants(config):
        progress(f"quality: {variant.name}")
        started = time.perf_counter()
        scores = run_variant(loaded.model, variant, ids, config)
        seconds = time.perf_counter() - started
        if variant == REFERENCE:
            reference = scores
        for context, scored in scores.items():
            targets = ids[context : context + config.tokens]
            rows.append(
                {
                    "variant": variant.name,
                    "kind": variant.kind,
                    "mode": variant.mode,
                    "rotated": variant.rotate,
                    "context": context,
                    "bytes_per_token": bytes_per_token(variant, info.head_dim),
                    "seconds": seconds,
                    **compare(reference[context], scored, targets),
                }
            )
        if partial_results is not None:
            partial_results(results)
    return results


def _row(results: dict[str, Any], variant: str, context: int) -> dict[str, Any] | None:
    return next(
        (r for r in results["rows"] if r["variant"] == variant and r["context"] == context), None
    )


def verdicts(results: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(goal, context, verdict with the numbers) for each quality goal."""
    goals = (
        ("rotated q6 mean KL ≤ 0.5× mlx-lm 6-bit", "engine q6 rotated", "mlx-lm 6-bit g64", 0.5),
        ("rotated q4 mean KL ≤ 0.4× unrotated q4", "engine q4 rotated", "engine q4", 0.4),
        ("rotated q8 mean KL ≤ mlx-lm 8-bit", "engine q8 rotated", "mlx-lm 8-bit g64", 1.0),
    )
    out = []
    for context in results["config"]["contexts"]:
        for goal, ours, theirs, bound in goals:
            a, b = _row(results, ours, context), _row(results, theirs, context)
            if a is None or b is None:
                continue
            ratio = a["kl_mean"] / b["kl_mean"] if b["kl_mean"] > 0 else float("inf")
            met = a["kl_mean"] <= bound * b["kl_mean"]
            numbers = f"{a['kl_mean']:.2e} vs {b['kl_mean']:.2e} ({ratio:.2f}×)"
            out.append((goal, str(context), f"**{'met' if met else 'not met'}**: {numbers}"))
    return out


def render_quality_report(
    results: dict[str, Any], info: dict[str, Any], command: str, load_after: str
) -> str:
    """The Markdown body of the quality benchmark's section."""
    config = results["config"]
    cells = [
        (
            row["context"],
            row["variant"],
            row["bytes_per_token"],
            f"{row['kl_mean']:.2e}",
            f"{row['kl_p99']:.2e}",
            f"{row['top1']:.3f}",
            f"{row['ppl']:.2f}",
        )
        for row in sorted(results["rows"], key=lambda r: r["context"])
    ]
    lines = [
        "## Next-token quality per KV storage, teacher-forced (`python -m benchmarks quality`)",
        "",
        f"Command: `{command}`",
        "",
        *machine_lines(info, load_after),
        "",
        f"Model: {results['model']['name']} (head_dim {results['model']['head_dim']}), fp32 "
        "compute. Text: Python's `pydoc_data.topics`, topics in sorted order. Each variant "
        f"prefills the first N tokens in chunks of {config['chunk']}, then feeds the next "
        f"{config['tokens']} tokens one at a time; at each of those {config['tokens']} "
        "positions its next-token distribution is compared with the engine's fp16 cache: "
        "KL(fp16 ‖ variant) in nats (mean and 99th percentile over the positions), the "
        "share of positions with the same top-1 token, and the perplexity of the text's "
        "real next tokens. Bytes per token per KV head are K+V by format arithmetic "
        "(mlx-lm's with fp16 scale and bias per group of 64, as on a Mac). \"rotated\": "
        "rows stored after the Hadamard rotation `hadamard-v1+signs`.",
        "",
        *table(
            ("context", "variant", "bytes/token/KV head", "mean KL", "p99 KL", "top-1", "ppl"),
            cells,
        ),
        "",
        "### Goals",
        "",
        *table(("goal", "context", "verdict"), verdicts(results)),
    ]
    return "\n".join(lines) + "\n"
