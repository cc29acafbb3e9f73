"""``python -m benchmarks kernels``: one attention layer's graph on a GPU's terms.

For one layer of the seed's shape (4 KV heads, head_dim 256, 16 query heads,
256-token pages) at each context, the graph of one decode step and of one
512-token prefill chunk is traced (:mod:`benchmarks.graph_count`) for the
paged cache in every mode (the attention forced onto the GPU schedule, rows
rotated as each mode's default, fp16 queries as on Metal) and for mlx-lm's
``KVCache`` with its fused SDPA and ``QuantizedKVCache`` at 8/6/4 bits with
its own attention. Each row gives the graph's primitives, the Metal kernels
they dispatch, the bytes read and written against the KV bytes the step must
read (the stored rows in the seed's format), and the host time Python takes to
build the graph (median of repeats; the graph is never evaluated, so the
numbers are the same on any backend but the host time).

The caches hold zeros: a graph's shape does not depend on what the rows hold.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.base import scaled_dot_product_attention as mlx_lm_attention
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from benchmarks import graph_count, report
from benchmarks.cache_bench import Progress, _silent
from engine.cache import kvquant
from engine.cache.adapter import attend, rotates_by_default
from engine.cache.attention import schedule
from engine.cache.modes import FP16, MODES, KvMode
from engine.cache.paged_cache import PagedKVCache
from engine.cache.pages import PagePool
from engine.cache.rotation import HadamardRotation

MLX_GROUP_SIZE = 64  # mlx-lm's QuantizedKVCache default
_FILL = 8192
# What the cost model prices a kernel launch at, and the bandwidth it reads at: an
# assumption (no Apple GPU was measured here), the M4 Max's published bandwidth.
KERNEL_US = 2.75
PESSIMISTIC_KERNEL_US = (5.0, 10.0)
BANDWIDTH = 546e9
SEED_LAYERS = 16


@dataclass(frozen=True)
class KernelsConfig:
    """Sizes of one ``benchmarks kernels`` run."""

    contexts: tuple[int, ...] = (32768, 131072, 262144)
    modes: tuple[KvMode, ...] = tuple(MODES)
    kv_heads: int = 4
    q_heads: int = 16
    head_dim: int = 256
    page_size: int = 256
    chunk: int = 512
    host_repeats: int = 15
    chunks: bool = True


QUICK = KernelsConfig(contexts=(4096, 16384), host_repeats=5)


@dataclass(frozen=True)
class Layer:
    """One contender: how to make its cache at a context and build one step's graph."""

    name: str
    kind: str  # "longleaf", "mlx-fp16" or "mlx-quant"
    mode: KvMode
    make: Callable[[KernelsConfig, int], Any]
    step: Callable[[Any, mx.array, mx.array, mx.array], mx.array]


def _paged_make(mode: KvMode) -> Callable[[KernelsConfig, int], Any]:
    def make(config: KernelsConfig, context: int) -> Any:
        cache = PagedKVCache(PagePool(mode, config.page_size), config.kv_heads, config.head_dim)
        if rotates_by_default(mode):
            cache.rotation = HadamardRotation(config.head_dim)
        for done in range(0, context, _FILL):
            rows = mx.zeros((1, config.kv_heads, min(_FILL, context - done), config.head_dim))
            cache.update_and_fetch(rows, rows)
            mx.eval(storage(cache))
        return cache

    return make


def _paged_step(cache: Any, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
    mask = cache.make_mask(q.shape[2], return_array=False, window_size=None)
    keys, values = cache.update_and_fetch(k, v)
    return attend(q, keys, values, cache, scale=q.shape[-1] ** -0.5, mask=mask)


def _mlx_fp16_make(config: KernelsConfig, context: int) -> Any:
    cache = KVCache()
    room = _room(context, config.chunk)
    shape = (1, config.kv_heads, room, config.head_dim)
    cache.keys, cache.values = mx.zeros(shape, mx.float16), mx.zeros(shape, mx.float16)
    cache.offset = context
    mx.eval(cache.keys, cache.values)
    return cache


def _mlx_quant_make(bits: int) -> Callable[[KernelsConfig, int], Any]:
    def make(config: KernelsConfig, context: int) -> Any:
        cache = QuantizedKVCache(group_size=MLX_GROUP_SIZE, bits=bits)
        room = _room(context, config.chunk)
        heads, dim = config.kv_heads, config.head_dim

        def buffers() -> tuple[mx.array, ...]:
            groups = (1, heads, room, dim // MLX_GROUP_SIZE)
            return (mx.zeros((1, heads, room, dim * bits // 32), mx.uint32),
                    mx.zeros(groups, mx.float16), mx.zeros(groups, mx.float16))

        # mlx-lm leaves these unannotated and starts them at None, so its
        # inferred type is None alone.
        cache.keys, cache.values = buffers(), buffers()  # type: ignore[assignment]
        cache.offset = context
        mx.eval(cache.keys, cache.values)
        return cache

    return make


def _room(context: int, chunk: int) -> int:
    """A buffer with room for the largest step, so no step regrows it."""
    return -(-(context + chunk) // 256) * 256


def _mlx_step(cache: Any, q: mx.array, k: mx.array, v: mx.array) -> mx.array:
    mask = cache.make_mask(q.shape[2], return_array=False, window_size=None)
    keys, values = cache.update_and_fetch(k, v)
    return mlx_lm_attention(q[:], keys, values, cache=cache, scale=q.shape[-1] ** -0.5,
                            mask=mask)


def layers(modes: tuple[KvMode, ...]) -> list[Layer]:
    """mlx-lm's caches first (the baselines), then Longleaf's in each mode."""
    entries = [Layer("mlx-lm KVCache + fused SDPA", "mlx-fp16", FP16, _mlx_fp16_make,
                     _mlx_step)]
    for mode in modes:
        if mode != FP16:
            bits = kvquant.bits_for(mode)
            entries.append(Layer(f"mlx-lm QuantizedKVCache {bits}-bit", "mlx-quant", mode,
                                 _mlx_quant_make(bits), _mlx_step))
    entries += [Layer(f"Longleaf {mode}", "longleaf", mode, _paged_make(mode), _paged_step)
                for mode in modes]
    return entries


def storage(cache: Any) -> list[mx.array]:
    """The arrays a cache keeps its rows in."""
    store = getattr(cache, "store", None)
    if store is not None:
        return store.arrays()
    parts = [cache.keys, cache.values]
    return [a for part in parts for a in (part if isinstance(part, tuple) else (part,))]


def replace_storage(cache: Any, arrays: list[mx.array]) -> None:
    """Point a cache at other arrays of the same shapes (:func:`storage`'s order)."""
    store = getattr(cache, "store", None)
    if store is not None:
        store.replace_arrays(arrays)
        return
    for name in ("keys", "values"):
        part = getattr(cache, name)
        if isinstance(part, tuple):
            setattr(cache, name, tuple(arrays[: len(part)]))
            arrays = arrays[len(part):]
        else:
            setattr(cache, name, arrays.pop(0))


def _arrays_in(value: Any) -> list[mx.array]:
    """Every array inside ``value``'s containers."""
    if isinstance(value, mx.array):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [a for v in value for a in _arrays_in(v)]
    return []


def _copied(value: Any) -> Any:
    """Containers copied all the way down, so a step that writes into them (or
    memoizes arrays made inside a trace in them) leaves these alone."""
    if isinstance(value, list):
        return [_copied(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_copied(v) for v in value)
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value


def _saved(obj: Any) -> dict[str, Any]:
    return {k: _copied(v) for k, v in vars(obj).items()}


def _restore(obj: Any, saved: dict[str, Any]) -> None:
    vars(obj).clear()
    vars(obj).update(_saved_copy(saved))


def _saved_copy(saved: dict[str, Any]) -> dict[str, Any]:
    return {k: _copied(v) for k, v in saved.items()}


class _Undo:
    """Puts a cache (and its page store) back as it was before a graph was built."""

    def __init__(self, cache: Any, memos: bool = True) -> None:
        # What a step memoizes (cast rotations) is put back too: an array made
        # inside a trace must not outlive it.
        parts = ("store", "rotation") if memos else ("store",)
        self.objects = [cache, *(getattr(cache, p) for p in parts if getattr(cache, p, None))]
        self.saved = [_saved(o) for o in self.objects]

    def __call__(self) -> None:
        for obj, saved in zip(self.objects, self.saved, strict=True):
            _restore(obj, saved)


def _inputs(config: KernelsConfig, tokens: int) -> tuple[mx.array, mx.array, mx.array]:
    q = mx.zeros((1, config.q_heads, tokens, config.head_dim), mx.float16)
    kv = mx.zeros((1, config.kv_heads, tokens, config.head_dim), mx.float16)
    mx.eval(q, kv)
    return q, kv, kv


def measure(layer: Layer, cache: Any, config: KernelsConfig, tokens: int,
            host_repeats: int) -> dict[str, Any]:
    """One step of ``tokens`` new tokens: its graph's tally and its host build time."""
    q, k, v = _inputs(config, tokens)
    if isinstance(cache, PagedKVCache):
        cache.pool.ensure(cache.offset + tokens)  # pages allocated, not part of the step
    if tokens == 1:
        # One step built first: what a step memoizes on its first call (a
        # rotation's cast matrices) is then made and evaluated outside the trace,
        # as in every later step. (A chunk comes after the decode step.)
        rows = _Undo(cache, memos=False)
        layer.step(cache, q, k, v)
        mx.eval(_arrays_in(vars(getattr(cache, "rotation", None) or rows)))
        rows()
    undo = _Undo(cache)
    held = storage(cache)
    try:
        # The storage goes in as the trace's inputs (a write into a captured
        # constant would spoil the cache's own arrays) and comes out as its
        # outputs (a write nothing reads later is still work).
        nodes, fused = graph_count.trace(
            lambda q, k, v, *arrays: _traced_step(layer, cache, q, k, v, arrays),
            q, k, v, *held)
    finally:
        undo()
    counted = graph_count.tally(nodes, fused)
    seconds = []
    for _ in range(host_repeats):
        start = time.perf_counter()
        layer.step(cache, q, k, v)
        seconds.append(time.perf_counter() - start)
        undo()
    return {
        "primitives": counted.primitives,
        "kernels": counted.kernels,
        "read": counted.read,
        "written": counted.written,
        "by_primitive": dict(counted.by_primitive.most_common()),
        "unknown": sorted(counted.unknown),
        "host_ms": 1000 * statistics.median(seconds) if seconds else None,
    }


def _traced_step(layer: Layer, cache: Any, q: mx.array, k: mx.array, v: mx.array,
                 arrays: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
    replace_storage(cache, list(arrays))
    return (layer.step(cache, q, k, v), *storage(cache))


def held_bytes(config: KernelsConfig, layer: Layer, tokens: int) -> int:
    """Bytes a cache holds for ``tokens`` tokens, in its own format: what a step over
    them must read. Longleaf: codes with MLX scales and biases per group of 128;
    mlx-lm's quantized cache: codes with float16 scales and biases per group of 64."""
    if layer.kind == "mlx-quant":
        bits = kvquant.bits_for(layer.mode)
        row = config.head_dim * bits // 8 + 2 * 2 * config.head_dim // MLX_GROUP_SIZE
        return config.kv_heads * tokens * 2 * row
    return config.kv_heads * tokens * kvquant.kv_bytes_per_token(config.head_dim, layer.mode)


def format_bytes(config: KernelsConfig, mode: KvMode, tokens: int) -> int:
    """The same rows in the seed's row format (one float16 scale per row)."""
    return config.kv_heads * tokens * kvquant.row_format_bytes(config.head_dim, mode)


def run_kernels_bench(config: KernelsConfig, progress: Progress = _silent,
                      partial_results: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Every contender's decode step and prefill chunk at every context."""
    rows: list[dict[str, Any]] = []
    with schedule.forced(schedule.GPU):
        for context in config.contexts:
            for layer in layers(config.modes):
                progress(f"kernels: {layer.name} at {report.fmt_tokens(context)}")
                cache = layer.make(config, context)
                row = {"name": layer.name, "kind": layer.kind, "mode": layer.mode,
                       "context": context, "kv_bytes": held_bytes(config, layer, context),
                       "format_bytes": format_bytes(config, layer.mode, context)}
                row["decode"] = measure(layer, cache, config, 1, config.host_repeats)
                if config.chunks:
                    row["chunk"] = measure(layer, cache, config, config.chunk, 0)
                rows.append(row)
                del cache
                mx.clear_cache()
                if partial_results is not None:
                    partial_results({"config": _plain(config), "rows": rows})
    return {"config": _plain(config), "rows": rows}


def _plain(config: KernelsConfig) -> dict[str, Any]:
    return {k: v for k, v in vars(config).items()}


# -- the report ----------------------------------------------------------------------


def attention_ms(kernels: int, traffic: int, kernel_us: float = KERNEL_US,
                 layers: int = SEED_LAYERS) -> float:
    """The cost model: per token, ``layers`` × (kernels × launch cost + bytes / bandwidth)."""
    return layers * (kernels * kernel_us * 1e-6 + traffic / BANDWIDTH) * 1000


@dataclass
class _Verdicts:
    lines: list[str] = field(default_factory=list)

    def goal(self, text: str, met: bool, detail: str) -> None:
        self.lines.append(f"- {text}: **{'met' if met else 'NOT met'}** ({detail})")


def render_kernels_report(results: dict[str, Any], info: dict[str, Any], command: str,
                          load_after: str | None = None) -> str:
    """The Markdown section: tables per step, the cost model, verdicts per goal."""
    rows = results["rows"]
    lines = [f"`{command}`", "", *report.machine_lines(info, load_after), ""]
    for step, title in (("decode", "One decode step"), ("chunk", "One 512-token prefill chunk")):
        if not any(step in r for r in rows):
            continue
        lines += [f"### {title}, one layer (attention + cache write)", ""]
        lines += report.table(
            ["context", "contender", "primitives", "Metal kernels", "read + written",
             "÷ KV bytes held", "÷ seed-format bytes", "host build"],
            [(report.fmt_tokens(r["context"]), r["name"], r[step]["primitives"],
              r[step]["kernels"], _gb(_traffic(r, step)),
              f"{_traffic(r, step) / r['kv_bytes']:.2f}",
              f"{_traffic(r, step) / r['format_bytes']:.2f}",
              "n/a" if r[step]["host_ms"] is None else f"{r[step]['host_ms']:.3f} ms")
             for r in rows if step in r])
        lines.append("")
    lines += _cost_model(rows)
    lines += _verdicts(rows)
    return "\n".join(lines)


def _traffic(row: dict[str, Any], step: str = "decode") -> int:
    return row[step]["read"] + row[step]["written"]


def _gb(value: float) -> str:
    return f"{value / 1e9:.3f} GB" if value >= 1e7 else f"{value / 1e6:.3f} MB"


def _cost_model(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["### Decode cost model for the seed's model (16 full-attention layers)", "",
             f"Per token: 16 × (Metal kernels × {KERNEL_US} µs + bytes ÷ "
             f"{BANDWIDTH / 1e9:.0f} GB/s); the per-kernel cost is an assumption (a published "
             f"figure for Apple GPUs; {', '.join(f'{u:g}' for u in PESSIMISTIC_KERNEL_US)} µs "
             "as pessimistic cases), the bandwidth an M4 Max's. The floor is the mode's rows in "
             "the seed's format read once at that bandwidth.",
             ""]
    table_rows = []
    for r in rows:
        costs = [attention_ms(r["decode"]["kernels"], _traffic(r), us)
                 for us in (KERNEL_US, *PESSIMISTIC_KERNEL_US)]
        floor = SEED_LAYERS * r["format_bytes"] / BANDWIDTH * 1000
        table_rows.append((report.fmt_tokens(r["context"]), r["name"],
                           " / ".join(f"{c:.1f}" for c in costs), f"{floor:.1f}",
                           f"{costs[0] / floor:.2f}×"))
    lines += report.table(["context", "contender", "attention ms / token (2.75 / 5 / 10 µs)",
                           "floor ms", "÷ floor"], table_rows)
    return [*lines, ""]


def _verdicts(rows: list[dict[str, Any]]) -> list[str]:
    ours = [r for r in rows if r["kind"] == "longleaf"]
    if not ours:
        return []
    verdicts = _Verdicts()
    counts = {(r["mode"], r["context"]): r["decode"]["kernels"] for r in ours}
    worst = max(counts.values())
    verdicts.goal("Decode ≤ 40 Metal kernels per layer, every mode and context", worst <= 40,
                  f"worst {worst}")
    first, last = min(r["context"] for r in ours), max(r["context"] for r in ours)
    growth = max((counts[(m, last)] / counts[(m, first)] for m, _ in counts
                  if (m, last) in counts and (m, first) in counts), default=1.0)
    verdicts.goal(f"Decode kernels at {report.fmt_tokens(last)} ≤ 1.1× those at "
                  f"{report.fmt_tokens(first)}", growth <= 1.1, f"worst {growth:.2f}×")
    for name, key in (("held", "kv_bytes"), ("in the seed's row format", "format_bytes")):
        ratios = {(r["mode"], r["context"]): _traffic(r) / r[key] for r in ours}
        quantized = [v for (m, _), v in ratios.items() if m != "fp16"]
        fp16 = [v for (m, _), v in ratios.items() if m == "fp16"]
        if quantized:
            verdicts.goal(f"Decode traffic ≤ 1.2× the KV bytes {name} (quantized modes)",
                          max(quantized) <= 1.2, f"worst {max(quantized):.2f}×")
        if fp16 and key == "kv_bytes":
            verdicts.goal("Decode traffic ≤ 1.1× the KV bytes (fp16)", max(fp16) <= 1.1,
                          f"worst {max(fp16):.2f}×")
    lines = ["### Verdicts", "", *verdicts.lines]
    lines += _host_verdict(rows) + _seed_verdict(rows) + _chunk_verdict(rows)
    return [*lines, ""]


def _host_verdict(rows: list[dict[str, Any]]) -> list[str]:
    worst = []
    for r in rows:
        if r["kind"] != "longleaf" or r["mode"] == "fp16":
            continue
        theirs = next((o for o in rows if o["kind"] == "mlx-quant" and o["mode"] == r["mode"]
                       and o["context"] == r["context"]), None)
        if theirs and theirs["decode"]["host_ms"]:
            worst.append(r["decode"]["host_ms"] / theirs["decode"]["host_ms"])
    if not worst:
        return []
    return [f"- Host time to build a decode graph ≤ 3× mlx-lm's QuantizedKVCache: "
            f"**{'met' if max(worst) <= 3 else 'NOT met'}** (worst {max(worst):.2f}×)"]


def _seed_verdict(rows: list[dict[str, Any]]) -> list[str]:
    def pick(kind: str) -> dict[str, Any] | None:
        return next((r for r in rows if r["kind"] == kind and r["mode"] == "q6"
                     and r["context"] == max(o["context"] for o in rows)), None)

    ours, theirs = pick("longleaf"), pick("mlx-quant")
    if ours is None or theirs is None:
        return []
    cost = {name: attention_ms(r["decode"]["kernels"], _traffic(r))
            for name, r in (("ours", ours), ("theirs", theirs))}
    floor = SEED_LAYERS * ours["format_bytes"] / BANDWIDTH * 1000
    met = cost["ours"] <= cost["theirs"] and cost["ours"] <= 1.5 * floor
    return [f"- Seed model at {report.fmt_tokens(ours['context'])} in q6: "
            f"{cost['ours']:.1f} ms of attention per token against mlx-lm's 6-bit "
            f"QuantizedKVCache {cost['theirs']:.1f} ms and a floor of {floor:.1f} ms "
            f"(≤ mlx-lm and ≤ 1.5× floor): **{'met' if met else 'NOT met'}**"]


def _chunk_verdict(rows: list[dict[str, Any]]) -> list[str]:
    top = max(r["context"] for r in rows)
    base = next((r for r in rows if r["kind"] == "mlx-fp16" and r["context"] == top
                 and "chunk" in r), None)
    ours = [r for r in rows if r["kind"] == "longleaf" and r["context"] == top and "chunk" in r]
    if base is None or not ours:
        return []
    theirs = _traffic(base, "chunk")
    worst = max(_traffic(r, "chunk") / theirs for r in ours)
    return [f"- Prefill chunk at {report.fmt_tokens(top)}: traffic ≤ 1.5× mlx-lm's fp16 path: "
            f"**{'met' if worst <= 1.5 else 'NOT met'}** (worst {worst:.2f}×; the transient "
            "is measured by `benchmarks longctx`)"]
