"""Raw-attention benchmark of the paged KV cache against mlx-lm's own caches.

Every contender is driven exactly as one attention layer of an mlx-lm model
drives its cache: ``mask = cache.make_mask(n, ...)``, then
``cache.update_and_fetch(keys, values)``, then the attention function the model
would call (mlx-lm's ``scaled_dot_product_attention`` for its caches, the
engine's ``paged_attention`` for paged caches, which is where the adapter
dispatches them), then ``mx.eval`` of the output. Timings are
medians of repeats taken round-robin across contenders, so a burst of load on a
shared machine hits every contender alike and the ratios stay meaningful.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from benchmarks.contenders import (
    GROUP_SIZE,
    Contender,
    contenders,
    held_bytes,
    mlx_needs_presized_buffers,
    mlx_quantized_cache,
)
from engine.cache.kvquant import MODES, bits_for, quantize_rows
from engine.cache.modes import FP16, KvMode

FILL_CHUNK = 4096


def default_dtype_name() -> str:
    """fp32 on the CPU backend (it emulates fp16 math), fp16 on a GPU."""
    return "float32" if mx.default_device() == mx.cpu else "float16"


@dataclass(frozen=True)
class CacheBenchConfig:
    """Sizes and repeat counts of one ``benchmarks cache`` run."""

    contexts: tuple[int, ...] = (4096, 16384, 32768)
    head_dims: tuple[int, ...] = (64, 128, 256)
    modes: tuple[KvMode, ...] = tuple(MODES)
    kv_heads: int = 2
    q_heads: int = 8
    prefill_tokens: int = 16384
    # The engine session's default chunk; also bounds mlx-lm's prefill scratch alike.
    prefill_chunk: int = 512
    # Prefill attention on the CPU backend costs minutes at 16k: fewer heads, at the
    # same GQA ratio, keep a full run near ten minutes; they shrink every
    # contender's work alike.
    prefill_q_heads: int = 4
    prefill_kv_heads: int = 1
    quant_chunk: int = 4096
    decode_repeats: int = 15
    decode_warmup: int = 3
    prefill_repeats: int = 1
    quant_repeats: int = 20
    page_size: int = 256
    dtype: str = field(default_factory=default_dtype_name)


QUICK = CacheBenchConfig(
    contexts=(2048, 4096),
    head_dims=(64, 128),
    prefill_tokens=4096,
    decode_repeats=7,
    decode_warmup=2,
    prefill_repeats=1,
    quant_repeats=7,
)


def _eval_tree(tree: Any) -> None:
    # tree_flatten returns a dict only when handed one to fill; here its list.
    leaves = cast("list[tuple[str, Any]]", tree_flatten(tree))
    arrays = [leaf for _, leaf in leaves if isinstance(leaf, mx.array)]
    if isinstance(tree, mx.array):
        arrays = [tree]
    mx.eval(arrays)


def attention_step(
    contender: Contender,
    cache: Any,
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
) -> mx.array:
    """One attention layer's work for ``queries.shape[2]`` new tokens, evaluated."""
    n = queries.shape[2]
    mask = cache.make_mask(n, return_array=False, window_size=None)
    cached_keys, cached_values = cache.update_and_fetch(keys, values)
    scale = queries.shape[-1] ** -0.5
    # A fresh array object per call, as a model layer makes: mlx-lm's quantized
    # attention scales its queries in place (`queries *= scale`), which would
    # otherwise rescale the shared benchmark input for every later contender.
    out = contender.attend(
        queries[:], cached_keys, cached_values, cache=cache, scale=scale, mask=mask
    )
    mx.eval(out)
    return out


def _random(shape: tuple[int, ...], dtype: mx.Dtype, seed: int) -> mx.array:
    x = mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)
    mx.eval(x)
    return x


def fill_cache(cache: Any, kv_heads: int, head_dim: int, tokens: int, dtype: mx.Dtype) -> None:
    """Write ``tokens`` random rows through ``update_and_fetch`` (no attention)."""
    done = 0
    while done < tokens:
        n = min(FILL_CHUNK, tokens - done)
        keys = _random((1, kv_heads, n, head_dim), dtype, seed=done + 1)
        values = _random((1, kv_heads, n, head_dim), dtype, seed=done + 2)
        _eval_tree(cache.update_and_fetch(keys, values))
        done += n


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _fresh_memory() -> None:
    # Freed arrays sit in MLX's buffer cache; dropping it keeps one contender's
    # buffers out of the next one's peak. (Caches hold no reference cycles, so
    # no gc.collect, which costs ~0.2 s a call with mlx-lm imported.) Arrays whose
    # last reader is still queued are freed when it runs: wait for the stream first,
    # or they leave the baseline later and a peak reads below it (seen: -1.5 MiB).
    mx.synchronize()
    mx.clear_cache()


Progress = Callable[[str], None]


def _silent(message: str) -> None:
    del message


def bench_decode(
    config: CacheBenchConfig, entries: list[Contender], progress: Progress = _silent
) -> list[dict[str, Any]]:
    """Decode-step time and bytes held, per context, head_dim and contender."""
    dtype = getattr(mx, config.dtype)
    rows: list[dict[str, Any]] = []
    steps = config.decode_warmup + config.decode_repeats
    for head_dim in config.head_dims:
        queries = _random((1, config.q_heads, 1, head_dim), dtype, seed=101)
        keys = _random((1, config.kv_heads, 1, head_dim), dtype, seed=102)
        values = _random((1, config.kv_heads, 1, head_dim), dtype, seed=103)
        for context in config.contexts:
            progress(f"decode: head_dim {head_dim}, context {context}")
            caches = []
            for entry in entries:
                cache = entry.make_cache(
                    config.kv_heads, head_dim, context + steps + config.page_size
                )
                fill_cache(cache, config.kv_heads, head_dim, context, dtype)
                caches.append(cache)
            held = [held_bytes(entry, cache) for entry, cache in zip(entries, caches, strict=True)]
            times: list[list[float]] = [[] for _ in entries]
            for step in range(steps):
                for i, entry in enumerate(entries):
                    elapsed = _timed(
                        partial(attention_step, entry, caches[i], queries, keys, values)
                    )
                    if step >= config.decode_warmup:
                        times[i].append(elapsed)
            for entry, cache_bytes, samples in zip(entries, held, times, strict=True):
                rows.append(
                    {
                        "head_dim": head_dim,
                        "context": context,
                        "name": entry.name,
                        "kind": entry.kind,
                        "mode": entry.mode,
                        "decode_ms": 1000 * statistics.median(samples),
                        "bytes": cache_bytes,
                    }
                )
            del caches
            _fresh_memory()
    return rows


def _chunks(config: CacheBenchConfig, head_dim: int, dtype: mx.Dtype) -> list[tuple]:
    q_heads, kv_heads = config.prefill_q_heads, config.prefill_kv_heads
    out = []
    for start in range(0, config.prefill_tokens, config.prefill_chunk):
        n = min(config.prefill_chunk, config.prefill_tokens - start)
        out.append(
            (
                _random((1, q_heads, n, head_dim), dtype, seed=3 * start + 1),
                _random((1, kv_heads, n, head_dim), dtype, seed=3 * start + 2),
                _random((1, kv_heads, n, head_dim), dtype, seed=3 * start + 3),
            )
        )
    return out


def _prefill_once(
    entry: Contender, shape: tuple[int, int, int], chunks: list, attend_from: int = 0
) -> tuple[float, int, int]:
    """(seconds, peak bytes above the memory active before, bytes held) of one prefill.

    Chunks before ``attend_from`` only go through ``update_and_fetch`` (no attention);
    the seconds cover the attended chunks only.
    """
    _fresh_memory()
    baseline = mx.get_active_memory()
    mx.reset_peak_memory()
    cache = entry.make_cache(*shape)
    for _, keys, values in chunks[:attend_from]:
        cache.make_mask(keys.shape[2], return_array=False, window_size=None)
        _eval_tree(cache.update_and_fetch(keys, values))
    start = time.perf_counter()
    for queries, keys, values in chunks[attend_from:]:
        attention_step(entry, cache, queries, keys, values)
    elapsed = time.perf_counter() - start
    peak = mx.get_peak_memory() - baseline
    held = held_bytes(entry, cache)
    del cache
    _fresh_memory()
    return elapsed, peak, held


def bench_prefill(
    config: CacheBenchConfig, entries: list[Contender], progress: Progress = _silent
) -> list[dict[str, Any]]:
    """Chunked prefill of ``prefill_tokens`` tokens: time and peak memory.

    The paged cache and mlx-lm's KVCache run the whole prefill (timed, round-robin).
    Every contender, mlx-lm's QuantizedKVCache included, also runs a memory pass:
    all chunks but the last go through ``update_and_fetch`` alone and only the last
    chunk runs attention. Attention scratch grows with the context, so the last
    chunk sets a chunked prefill's peak; the pass measures that peak without
    attending every chunk, which for mlx-lm's quantized cache on the CPU backend
    would take many minutes per contender.
    """
    dtype = getattr(mx, config.dtype)
    rows: list[dict[str, Any]] = []
    timed = [e for e in entries if e.kind != "mlx-quant"]
    for head_dim in config.head_dims:
        progress(f"prefill: head_dim {head_dim}, {config.prefill_tokens} tokens")
        chunks = _chunks(config, head_dim, dtype)
        shape = (config.prefill_kv_heads, head_dim, config.prefill_tokens + config.page_size)
        for entry in entries:  # compile kernels and warm allocators, untimed
            _prefill_once(entry, shape, chunks[:2])
        samples: dict[str, list[tuple]] = {e.name: [] for e in timed}
        for _ in range(config.prefill_repeats):
            for entry in timed:
                samples[entry.name].append(_prefill_once(entry, shape, chunks))
        progress(f"prefill memory pass: head_dim {head_dim}")
        for entry in entries:
            last_s, last_peak, held = _prefill_once(entry, shape, chunks, len(chunks) - 1)
            runs = samples.get(entry.name, [])
            rows.append(
                {
                    "head_dim": head_dim,
                    "tokens": config.prefill_tokens,
                    "name": entry.name,
                    "kind": entry.kind,
                    "mode": entry.mode,
                    "prefill_s": statistics.median(r[0] for r in runs) if runs else None,
                    "full_peak_bytes": max(r[1] for r in runs) if runs else None,
                    "peak_bytes": last_peak,
                    "last_chunk_s": last_s,
                    "bytes": held,
                }
            )
        del chunks
        _fresh_memory()
    return rows


def _median_time(fn: Callable[[], Any], repeats: int) -> float:
    fn()
    return statistics.median(_timed(fn) for _ in range(repeats))


def _quantize_ours(keys: mx.array, values: mx.array, bits: int) -> None:
    mx.eval(quantize_rows(keys, bits), quantize_rows(values, bits))


def _quantize_mlx(keys: mx.array, values: mx.array, bits: int) -> None:
    mx.eval(
        mx.quantize(keys, group_size=GROUP_SIZE, bits=bits),
        mx.quantize(values, group_size=GROUP_SIZE, bits=bits),
    )


def bench_quantize(config: CacheBenchConfig) -> list[dict[str, Any]]:
    """quantize_rows for K and V of one new token and of one chunk, per mode."""
    dtype = getattr(mx, config.dtype)
    rows: list[dict[str, Any]] = []
    for head_dim in config.head_dims:
        for tokens in (1, config.quant_chunk):
            keys = _random((1, config.kv_heads, tokens, head_dim), dtype, seed=7)
            values = _random((1, config.kv_heads, tokens, head_dim), dtype, seed=8)
            for mode in config.modes:
                bits = bits_for(mode)
                if bits == 16:
                    continue
                ours = _median_time(
                    partial(_quantize_ours, keys, values, bits), config.quant_repeats
                )
                theirs = _median_time(
                    partial(_quantize_mlx, keys, values, bits), config.quant_repeats
                )
                rows.append(
                    {
                        "head_dim": head_dim,
                        "tokens": tokens,
                        "mode": mode,
                        "quantize_ms": 1000 * ours,
                        "mlx_quantize_ms": 1000 * theirs,
                    }
                )
    return rows


def reference_bytes(config: CacheBenchConfig) -> list[dict[str, Any]]:
    """nbytes of mlx-lm caches holding fp16 K/V, as a model in fp16 would fill them.

    On the CPU backend the benchmark computes in fp32, so the mlx-lm caches timed
    above hold fp32 values and fp32 scales/biases; these fp16 caches are the fair
    comparison for storage (the layout mlx-lm uses with fp16/bf16 models).
    """
    rows = []
    for head_dim in config.head_dims:
        for context in config.contexts:
            for mode in (FP16, *[m for m in config.modes if m != FP16]):
                bits = bits_for(mode)
                if bits == 16:
                    cache: Any = KVCache()
                else:
                    make = mlx_quantized_cache(bits, mx.float16)
                    cache = make(config.kv_heads, head_dim, context)
                fill_cache(cache, config.kv_heads, head_dim, context, mx.float16)
                rows.append(
                    {"head_dim": head_dim, "context": context, "mode": mode, "bytes": cache.nbytes}
                )
                del cache
    _fresh_memory()
    return rows


def run_cache_bench(
    config: CacheBenchConfig, progress: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run every part of the cache benchmark and return plain-value results."""
    entries = contenders(config.modes, config.page_size, getattr(mx, config.dtype))
    decode = bench_decode(config, entries, progress)
    prefill = bench_prefill(config, entries, progress)
    progress("quantize+pack")
    quantize = bench_quantize(config)
    progress("reference bytes (fp16 mlx-lm caches)")
    reference = reference_bytes(config)
    workaround = [d for d in config.head_dims if mlx_needs_presized_buffers(d, 6)]
    return {
        "config": dataclasses.asdict(config),
        "decode": decode,
        "prefill": prefill,
        "quantize": quantize,
        "reference_bytes": reference,
        "mlx_6bit_workaround_head_dims": workaround if "q6" in config.modes else [],
    }
