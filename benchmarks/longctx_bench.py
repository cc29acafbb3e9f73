"""``python -m benchmarks longctx``: one attention layer at the seed's scale.

Qwen 3.x full-attention shapes (head_dim 256, 4 KV heads; 16 and 24 query
heads) at 32k to 262k tokens. Each contender's cache is filled through
``update_and_fetch`` without attention (that is what makes 262k feasible on a
CPU), then measured at the end of the context:

- bytes held;
- one decode step: time (median of a few) and transient peak (MLX peak memory
  above what was active before the step, the cache included in neither);
- one 512-token prefill chunk: time and transient peak, likewise;
- the paged cache under each attention schedule (``cpu``: the host waits on each
  block of columns; ``gpu``: one lazy graph, :mod:`engine.cache.attention.schedule`),
  with the host synchronizations its attention made per decode step and per
  chunk (``decode_host_syncs``, ``chunk_host_syncs``).

mlx-lm's caches materialize the whole score matrix of a chunk; where that
would not fit this machine next to the other caches, the cell is skipped and
says how much it would have needed.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten

from benchmarks.cache_bench import (
    FILL_CHUNK,
    Progress,
    _random,
    _silent,
    attention_step,
    default_dtype_name,
)
from benchmarks.contenders import Contender, contenders, held_bytes
from engine.cache.attention import schedule
from engine.cache.kvquant import MODES
from engine.cache.modes import Q6, KvMode

GIB = 2**30


def _own_schedule_first() -> tuple[str, ...]:
    own = schedule.backend_schedule()
    return (own, *(name for name in schedule.SCHEDULES if name != own))


@dataclass(frozen=True)
class LongContextConfig:
    """Sizes of one ``benchmarks longctx`` run."""

    contexts: tuple[int, ...] = (32768, 65536, 131072, 262144)
    q_heads: tuple[int, ...] = (16, 24)
    kv_heads: int = 4
    head_dim: int = 256
    modes: tuple[KvMode, ...] = tuple(MODES)
    # Modes also run with Hadamard-rotated rows, for the rotation's cost.
    rotated: tuple[KvMode, ...] = (Q6,)
    chunk: int = 512
    decode_repeats: int = 3
    page_size: int = 256
    # mlx-lm's prefill chunk holds [heads, chunk, context] fp32 scores (and more);
    # cells whose estimate passes this are skipped rather than risk the machine.
    mlx_transient_limit: int = 9 * GIB
    # mlx-lm's QuantizedKVCache attends a chunk through quantized_matmul, which on
    # the CPU backend takes minutes per chunk at these contexts; its decode step is
    # measured either way. The chunk goals compare against KVCache.
    mlx_quantized_prefill: bool = False
    # The decode goals against mlx-lm's QuantizedKVCache cover 32k-128k; past this
    # its cells are left out to keep a CPU run within an hour.
    mlx_quantized_max_context: int = 131072
    # The attention schedules each paged cell runs under; the first is the one the
    # comparisons with mlx-lm read (the backend's own by default).
    schedules: tuple[str, ...] = field(default_factory=_own_schedule_first)
    # mlx-lm's caches as baselines (off: the paged cells only, a shorter run).
    mlx_baselines: bool = True
    dtype: str = field(default_factory=default_dtype_name)


QUICK = LongContextConfig(contexts=(4096, 8192), q_heads=(16,), decode_repeats=2)


def mlx_chunk_estimate(q_heads: int, chunk: int, context: int) -> int:
    """Bytes mlx-lm's unfused attention needs for one chunk: scores and softmax, fp32."""
    return 2 * 4 * q_heads * chunk * context


def stored_arrays(cache: Any) -> list[mx.array]:
    """The arrays a cache keeps its rows in (a paged cache's storage, else its state)."""
    store = getattr(cache, "store", None)
    if store is not None:
        return store.arrays()
    # tree_flatten returns a dict only when handed one to fill; here its list.
    leaves = cast("list[tuple[str, Any]]", tree_flatten(cache.state))
    return [leaf for _, leaf in leaves if isinstance(leaf, mx.array)]


def fill(cache: Any, kv_heads: int, head_dim: int, tokens: int, dtype: mx.Dtype) -> None:
    """Write ``tokens`` random rows through ``update_and_fetch``, storage evaluated.

    Evaluating what ``update_and_fetch`` returns is not enough for a paged cache:
    it returns the new rows, so the page writes would stay pending and the first
    measured step would pay for quantizing the whole context.
    """
    for done in range(0, tokens, FILL_CHUNK):
        n = min(FILL_CHUNK, tokens - done)
        keys = _random((1, kv_heads, n, head_dim), dtype, seed=done + 1)
        values = _random((1, kv_heads, n, head_dim), dtype, seed=done + 2)
        cache.update_and_fetch(keys, values)
        mx.eval(stored_arrays(cache))


def _reserve(entry: Contender, cache: Any, tokens: int) -> None:
    # A paged cache's storage grows before the step (pages that stay, and a copy
    # this bench does not count as the step's transient; mlx-lm's caches regrow
    # inside their step, which is one).
    if entry.kind.startswith("paged"):
        cache.pool.ensure(cache.offset + tokens)


def _measure(fn: Callable[[], Any]) -> tuple[float, int]:
    """(seconds, MLX peak above the memory active before) of one call."""
    mx.synchronize()  # frees still queued behind pending work would move the baseline
    mx.clear_cache()
    baseline = mx.get_active_memory()
    mx.reset_peak_memory()
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return seconds, mx.get_peak_memory() - baseline


def _decode(entry: Contender, cache: Any, q_heads: int, config: LongContextConfig) -> dict:
    dtype = getattr(mx, config.dtype)
    shape_q = (1, q_heads, 1, config.head_dim)
    shape_kv = (1, config.kv_heads, 1, config.head_dim)
    samples, syncs = [], []
    _reserve(entry, cache, config.decode_repeats + 1)
    for step in range(config.decode_repeats + 1):  # the first compiles and warms up
        queries = _random(shape_q, dtype, 11 + step)
        keys, values = _random(shape_kv, dtype, 21 + step), _random(shape_kv, dtype, 31 + step)
        before = schedule.host_syncs()
        samples.append(_measure(partial(attention_step, entry, cache, queries, keys, values)))
        syncs.append(schedule.host_syncs() - before)
    timed = samples[1:]
    return {
        "decode_ms": 1000 * statistics.median(s for s, _ in timed),
        "decode_peak": max(p for _, p in timed),
        "decode_host_syncs": max(syncs[1:]),
    }


def _prefill_chunk(entry: Contender, cache: Any, q_heads: int, config: LongContextConfig) -> dict:
    dtype = getattr(mx, config.dtype)
    queries = _random((1, q_heads, config.chunk, config.head_dim), dtype, 41)
    shape_kv = (1, config.kv_heads, config.chunk, config.head_dim)
    keys, values = _random(shape_kv, dtype, 42), _random(shape_kv, dtype, 43)
    _reserve(entry, cache, config.chunk)
    before = schedule.host_syncs()
    seconds, peak = _measure(partial(attention_step, entry, cache, queries, keys, values))
    return {"prefill_s": seconds, "prefill_peak": peak,
            "chunk_host_syncs": schedule.host_syncs() - before}


def _row(entry: Contender, context: int, q_heads: int) -> dict[str, Any]:
    return {"name": entry.name, "kind": entry.kind, "mode": entry.mode,
            "context": context, "q_heads": q_heads}


def _is_paged(entry: Contender) -> bool:
    return entry.kind.startswith("paged")


def _measure_cell(
    entry: Contender, cache: Any, q_heads: int, context: int, config: LongContextConfig
) -> dict[str, Any]:
    """One decode step and one prefill chunk of ``entry`` (the cache left as found)."""
    row = _decode(entry, cache, q_heads, config)
    cache.trim(config.decode_repeats + 1)
    estimate = mlx_chunk_estimate(q_heads, config.chunk, context)
    if entry.kind == "mlx-quant" and not config.mlx_quantized_prefill:
        row.update(prefill_s=None, prefill_peak=None)
    elif not _is_paged(entry) and estimate > config.mlx_transient_limit:
        row.update(prefill_s=None, prefill_peak=None, skipped_estimate=estimate)
    else:
        row.update(_prefill_chunk(entry, cache, q_heads, config))
        cache.trim(config.chunk)
    return row


def bench_context(
    config: LongContextConfig, context: int, progress: Progress = _silent
) -> list[dict[str, Any]]:
    """Every contender at one context length, for each query-head count."""
    dtype = getattr(mx, config.dtype)
    rows: list[dict[str, Any]] = []
    for entry in contenders(config.modes, config.page_size, dtype, config.rotated):
        if entry.kind == "mlx-quant" and context > config.mlx_quantized_max_context:
            continue
        if not (config.mlx_baselines or _is_paged(entry)):
            continue
        progress(f"longctx {context}: fill {entry.name}")
        capacity = context + config.chunk + 8 * config.page_size
        cache = entry.make_cache(config.kv_heads, config.head_dim, capacity)
        fill(cache, config.kv_heads, config.head_dim, context, dtype)
        held = held_bytes(entry, cache)
        for q_heads in config.q_heads:
            for name in config.schedules if _is_paged(entry) else (None,):
                row = {**_row(entry, context, q_heads), "bytes": held, "schedule": name}
                progress(f"longctx {context}: {entry.name}, {q_heads} query heads"
                         + (f", {name} schedule" if name else ""))
                with schedule.forced(name) if name else contextlib.nullcontext():
                    row.update(_measure_cell(entry, cache, q_heads, context, config))
                rows.append(row)
        del cache
        mx.clear_cache()
    return rows


def run_layer_bench(
    config: LongContextConfig,
    progress: Progress = _silent,
    partial_results: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """The per-layer measurements at every context length.

    ``partial_results`` gets the results so far after each context, so a long
    run that is stopped still leaves its finished contexts behind.
    """
    started = time.monotonic()
    results: dict[str, Any] = {"config": config, "rows": []}
    for context in config.contexts:
        results["rows"] += bench_context(config, context, progress)
        results["wall_seconds"] = time.monotonic() - started
        if partial_results is not None:
            partial_results(results)
    return results


@dataclass(frozen=True)
class HybridIngestConfig:
    """The end-to-end part: a tiny random hybrid model read to ``tokens`` in ``mode``."""

    tokens: int = 65536
    mode: KvMode = Q6
    context: int = 131072  # max_position_embeddings of the tiny model (>= 65,536)
    chunk: int = 512


HYBRID_QUICK = HybridIngestConfig(tokens=4096, context=8192)


def _tiny_hybrid_dir(root: Path, context: int) -> Path:
    try:
        from tests.engine.tinymodels import make_tiny_model_dir
    except ImportError as error:  # an installed wheel has no tests/
        raise SystemExit("benchmarks longctx needs the checkout's tests/ package") from error
    return make_tiny_model_dir(root, "qwen3_next", max_position_embeddings=context)


def _document(tokenizer: Any, tokens: int) -> str:
    """Text of about ``tokens`` tokens (the tiny tokenizer's own corpus, repeated)."""
    from tests.engine.tinymodels import CORPUS

    per_copy = max(1, len(tokenizer.encode(CORPUS)))
    return CORPUS * (tokens // per_copy + 1)


def run_hybrid_ingest(config: HybridIngestConfig, progress: Progress = _silent) -> dict[str, Any]:
    """Ingest a long document into a tiny qwen3_next; predicted vs measured peak."""
    import resource
    import tempfile
    import threading

    from engine.models.loader import load_model
    from engine.session.session import Session

    with tempfile.TemporaryDirectory() as root:
        loaded = load_model(_tiny_hybrid_dir(Path(root), config.context))
        session = Session("longctx", loaded, config.mode, chunk_size=config.chunk)
        text = _document(loaded.tokenizer, config.tokens)
        ids = loaded.tokenizer.encode(text)[: config.tokens]
        text = loaded.tokenizer.decode(ids)
        messages = [{"role": "user", "content": text}]
        total = len(session.render(messages, add_generation_prompt=False))
        # The fit check's arithmetic (pages for every token, one chunk's scratch and
        # activations) for the chunk this run reads with, at the context it reaches.
        kv_bytes = session.fit_report(total).for_mode(config.mode).bytes_needed
        predicted = session.prefill_facts.peak_bytes(kv_bytes, config.chunk, total)
        progress(f"hybrid ingest: {total} tokens in {config.mode}, predicted peak {predicted}")
        mx.clear_cache()
        mx.reset_peak_memory()
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        started = time.perf_counter()
        stats = session.ingest(messages, request_id=1, cancel=threading.Event(),
                               emit=lambda event: None, tick=lambda: None)
        seconds = time.perf_counter() - started
        measured = mx.get_peak_memory()
        rss_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        held = session.stats().bytes_used
        session.close()
    return {
        "config": config, "tokens": total, "seconds": seconds,
        "prefill_tps": stats.prefill_tps, "predicted_peak": predicted,
        "measured_peak": measured, "kv_bytes": held,
        "rss_peak": rss_peak, "rss_peak_before": rss_before,
    }
