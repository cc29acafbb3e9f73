"""The cache benchmark's section of docs/benchmark-runs.md: its tables and the goal tally.

Each goal is checked on every measured cell, so a verdict says how many cells met it
and which ones missed, never just a best case.
"""

from __future__ import annotations

from typing import Any

from benchmarks.report import (
    MIB,
    GoalTally,
    fmt_bytes,
    fmt_ratio,
    fmt_tokens,
    machine_lines,
    ratio,
    table,
)
from engine.cache.modes import MODES

DECODE_GOAL_QUANT = 1.0
DECODE_GOAL_FP16 = 1.2
PREFILL_GOAL = 1.15
QUANTIZE_GOAL_PERCENT = 5.0
BYTES_GOAL = 0.95


def _one(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    for row in rows:
        if all(row.get(k) == v for k, v in match.items()):
            return row
    return None


def _row(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any]:
    """The first row that matches, where the run always records one."""
    row = _one(rows, **match)
    if row is None:
        raise LookupError(f"The results have no row with {match}.")
    return row


def _value(row: dict[str, Any] | None, key: str) -> Any:
    return None if row is None else row[key]


def _quant_modes(rows: list[dict[str, Any]]) -> list[str]:
    return [m for m in ("q8", "q6", "q4") if any(r["mode"] == m for r in rows)]


def _paged_modes(rows: list[dict[str, Any]]) -> list[str]:
    return [m for m in MODES if _one(rows, kind="paged", mode=m)]


def _decode_lines(results: dict[str, Any], tally: GoalTally) -> list[str]:
    rows = []
    decode = results["decode"]
    for head_dim in results["config"]["head_dims"]:
        for context in results["config"]["contexts"]:
            at = {"head_dim": head_dim, "context": context}
            fp16 = _value(_one(decode, kind="mlx-fp16", **at), "decode_ms")
            for mode in _paged_modes(decode):
                ours = _value(_one(decode, kind="paged", mode=mode, **at), "decode_ms")
                quant = _value(_one(decode, kind="mlx-quant", mode=mode, **at), "decode_ms")
                vs_quant, vs_fp16 = ratio(ours, quant), ratio(ours, fp16)
                where = f"{mode} D{head_dim} {fmt_tokens(context)}"
                if mode != "fp16":
                    tally.check("decode ≤ 1.0× mlx-lm QuantizedKVCache", where, vs_quant, 1.0)
                tally.check("decode ≤ 1.2× mlx-lm KVCache", where, vs_fp16, DECODE_GOAL_FP16)
                rows.append(
                    (
                        head_dim,
                        context,
                        mode,
                        f"{ours:.3f}",
                        f"{fp16:.3f}",
                        "—" if quant is None else f"{quant:.3f}",
                        "—" if mode == "fp16" else fmt_ratio(vs_quant, DECODE_GOAL_QUANT),
                        fmt_ratio(vs_fp16, DECODE_GOAL_FP16),
                    )
                )
    headers = (
        "head_dim",
        "context",
        "mode",
        "paged (ms)",
        "mlx-lm KVCache (ms)",
        "mlx-lm QuantizedKVCache same bits (ms)",
        "paged / quantized (≤ 1.0)",
        "paged / KVCache (≤ 1.2)",
    )
    return table(headers, rows)


def _prefill_lines(results: dict[str, Any], tally: GoalTally) -> list[str]:
    rows = []
    prefill = results["prefill"]
    for head_dim in results["config"]["head_dims"]:
        fp16 = _row(prefill, kind="mlx-fp16", head_dim=head_dim)
        for mode in _paged_modes(prefill):
            ours = _row(prefill, kind="paged", mode=mode, head_dim=head_dim)
            time_ratio = ratio(ours["prefill_s"], fp16["prefill_s"])
            tally.check(
                "prefill ≤ 1.15× mlx-lm KVCache", f"{mode} D{head_dim}", time_ratio, PREFILL_GOAL
            )
            rows.append(
                (
                    head_dim,
                    mode,
                    f"{ours['prefill_s']:.2f}",
                    f"{fp16['prefill_s']:.2f}",
                    fmt_ratio(time_ratio, PREFILL_GOAL),
                    fmt_bytes(ours["full_peak_bytes"]),
                    fmt_bytes(fp16["full_peak_bytes"]),
                )
            )
    headers = (
        "head_dim",
        "mode",
        "paged (s)",
        "mlx-lm KVCache (s)",
        "paged / KVCache (≤ 1.15)",
        "peak paged, whole prefill",
        "peak KVCache, whole prefill",
    )
    return table(headers, rows)


def _scratch(*rows: dict[str, Any] | None) -> str:
    parts = [
        "—" if row is None else f"{(row['peak_bytes'] - row['bytes']) / MIB:.1f}" for row in rows
    ]
    return " / ".join(parts) + " MiB"


def _memory_lines(results: dict[str, Any], tally: GoalTally) -> list[str]:
    rows = []
    prefill = results["prefill"]
    for head_dim in results["config"]["head_dims"]:
        fp16 = _row(prefill, kind="mlx-fp16", head_dim=head_dim)
        for mode in _paged_modes(prefill):
            ours = _row(prefill, kind="paged", mode=mode, head_dim=head_dim)
            quant = _one(prefill, kind="mlx-quant", mode=mode, head_dim=head_dim)
            peak_quant = ratio(ours["peak_bytes"], _value(quant, "peak_bytes"))
            if mode != "fp16":
                tally.check(
                    "prefill peak memory < mlx-lm QuantizedKVCache",
                    f"{mode} D{head_dim}",
                    peak_quant,
                    1.0,
                )
            rows.append(
                (
                    head_dim,
                    mode,
                    fmt_bytes(ours["peak_bytes"]),
                    fmt_bytes(fp16["peak_bytes"]),
                    "—" if quant is None else fmt_bytes(quant["peak_bytes"]),
                    fmt_ratio(ratio(ours["peak_bytes"], fp16["peak_bytes"])),
                    "—" if quant is None else fmt_ratio(peak_quant, 1.0),
                    "—"
                    if quant is None
                    else fmt_ratio(ratio(quant["peak_bytes"], fp16["peak_bytes"])),
                    "—"
                    if quant is None
                    else fmt_ratio(ratio(ours["last_chunk_s"], quant["last_chunk_s"])),
                    _scratch(ours, fp16, quant),
                )
            )
    headers = (
        "head_dim",
        "mode",
        "paged",
        "KVCache",
        "quantized same bits",
        "paged / KVCache",
        "paged / quantized (< 1)",
        "quantized / KVCache",
        "last-chunk time paged / quantized",
        "scratch (peak − held) paged / KVCache / quantized",
    )
    return table(headers, rows)


def _quantize_lines(results: dict[str, Any], tally: GoalTally) -> list[str]:
    config = results["config"]
    rows = []
    quantize, decode, prefill = results["quantize"], results["decode"], results["prefill"]
    chunk = config["quant_chunk"]
    for head_dim in config["head_dims"]:
        for mode in _quant_modes(quantize):
            token = _row(quantize, head_dim=head_dim, mode=mode, tokens=1)
            block = _row(quantize, head_dim=head_dim, mode=mode, tokens=chunk)
            shares = []
            for context in config["contexts"]:
                step = _value(
                    _one(decode, kind="paged", mode=mode, head_dim=head_dim, context=context),
                    "decode_ms",
                )
                share = ratio(token["quantize_ms"], step)
                tally.check(
                    "quantize+pack of a new token < 5% of a decode step",
                    f"{mode} D{head_dim} {fmt_tokens(context)}",
                    None if share is None else 100 * share,
                    QUANTIZE_GOAL_PERCENT,
                )
                shares.append("n/a" if share is None else f"{100 * share:.1f}%")
            ours_prefill = _one(prefill, kind="paged", mode=mode, head_dim=head_dim)
            per_chunk = None
            if ours_prefill is not None:
                per_chunk = 1000 * ours_prefill["prefill_s"] * chunk / ours_prefill["tokens"]
            chunk_share = ratio(block["quantize_ms"], per_chunk)
            tally.check(
                f"quantize+pack of a {chunk}-token chunk < 5% of its prefill",
                f"{mode} D{head_dim}",
                None if chunk_share is None else 100 * chunk_share,
                QUANTIZE_GOAL_PERCENT,
            )
            rows.append(
                (
                    head_dim,
                    mode,
                    f"{token['quantize_ms']:.3f}",
                    f"{token['mlx_quantize_ms']:.3f}",
                    " / ".join(shares),
                    f"{block['quantize_ms']:.2f}",
                    f"{block['mlx_quantize_ms']:.2f}",
                    "n/a" if chunk_share is None else f"{100 * chunk_share:.1f}%",
                )
            )
    contexts = " / ".join(fmt_tokens(c) for c in config["contexts"])
    headers = (
        "head_dim",
        "mode",
        "new token (ms)",
        "mx.quantize new token (ms)",
        f"% of paged decode step at {contexts} (< 5%)",
        f"{chunk}-token chunk (ms)",
        f"mx.quantize {chunk} chunk (ms)",
        f"% of paged prefill time for {chunk} tokens (< 5%)",
    )
    return table(headers, rows)


def _bytes_lines(results: dict[str, Any], tally: GoalTally) -> list[str]:
    config = results["config"]
    rows = []
    decode, reference = results["decode"], results["reference_bytes"]
    for head_dim in config["head_dims"]:
        for context in config["contexts"]:
            at = {"head_dim": head_dim, "context": context}
            fp16_ref = _value(_one(reference, mode="fp16", **at), "bytes")
            for mode in _paged_modes(decode):
                ours = _value(_one(decode, kind="paged", mode=mode, **at), "bytes")
                as_run = _value(_one(decode, kind="mlx-quant", mode=mode, **at), "bytes")
                ref = None if mode == "fp16" else _value(_one(reference, mode=mode, **at), "bytes")
                vs_ref = ratio(ours, ref)
                if mode != "fp16":
                    tally.check(
                        "bytes held ≤ 0.95× mlx-lm QuantizedKVCache (fp16 scales)",
                        f"{mode} D{head_dim} {fmt_tokens(context)}",
                        vs_ref,
                        BYTES_GOAL,
                    )
                rows.append(
                    (
                        head_dim,
                        context,
                        mode,
                        f"{ours:,}",
                        "—" if ref is None else f"{ref:,}",
                        "—" if ref is None else fmt_ratio(vs_ref, BYTES_GOAL),
                        "—" if as_run is None else f"{as_run:,}",
                        "—" if as_run is None else fmt_ratio(ratio(ours, as_run)),
                        fmt_ratio(ratio(ours, fp16_ref)),
                    )
                )
    headers = (
        "head_dim",
        "context",
        "mode",
        "paged bytes",
        "mlx-lm quantized, fp16 scales",
        "paged / quantized (≤ 0.95)",
        f"mlx-lm quantized as run ({config['dtype']} scales)",
        "paged / quantized as run",
        "paged / mlx-lm KVCache fp16",
    )
    return table(headers, rows)


def render_cache_report(
    results: dict[str, Any], info: dict[str, Any], command: str, load_after: str
) -> str:
    """The Markdown body of the cache benchmark's section."""
    config = results["config"]
    tally = GoalTally()
    decode = _decode_lines(results, tally)
    prefill = _prefill_lines(results, tally)
    memory = _memory_lines(results, tally)
    quantize = _quantize_lines(results, tally)
    held = _bytes_lines(results, tally)
    contexts = ", ".join(str(c) for c in config["contexts"])
    lines = [
        "## Paged KV cache vs mlx-lm's caches (`python -m benchmarks cache`)",
        "",
        f"Command: `{command}`",
        "",
        *machine_lines(info, load_after),
        f"- Wall time of the run: {results.get('wall_seconds', 0) / 60:.1f} min",
        "",
        f"Raw attention, one layer, batch 1, {config['q_heads']} query heads over "
        f"{config['kv_heads']} KV heads (GQA), compute dtype {config['dtype']}, page size "
        f"{config['page_size']}, contexts {contexts}, head_dims "
        f"{', '.join(str(d) for d in config['head_dims'])}. Every contender runs the calls an "
        "mlx-lm attention layer makes: `cache.make_mask`, `cache.update_and_fetch`, then the "
        "attention function the model would call (mlx-lm's `scaled_dot_product_attention` "
        "for `KVCache` / `QuantizedKVCache(group_size=64)`, the engine's dispatch for the "
        "paged cache), then `mx.eval`. Times are medians of repeats taken round-robin across "
        f"contenders in the same run ({config['decode_warmup']} warmup + "
        f"{config['decode_repeats']} timed decode steps; {config['prefill_repeats']} timed "
        "prefill run(s) after an untimed warmup). Ratios below 1 favour the paged cache.",
        "",
        "On the CPU backend mlx-lm's caches hold whatever dtype the model computes in, so "
        f"here `KVCache` holds {config['dtype']} values; the paged fp16 mode stores float16.",
    ]
    if results.get("mlx_6bit_workaround_head_dims"):
        dims = ", ".join(str(d) for d in results["mlx_6bit_workaround_head_dims"])
        lines += [
            "",
            f"mlx-lm {info['mlx_lm']}'s `QuantizedKVCache(bits=6)` fails at head_dim {dims} "
            "(it sizes its buffers as `head_dim // (32 // bits)` uint32 words: 25 instead of 24 "
            "at 128, so the first `update_and_fetch` raises a broadcast error). For those "
            "head_dims the benchmark pre-sizes its buffers correctly and then runs mlx-lm's own "
            "`update_and_fetch` and attention unchanged; skipping mlx-lm's regrowth copies can "
            "only make that baseline faster and leaner.",
        ]
    lines += [
        "",
        "### Goals",
        "",
        *tally.lines(),
        "",
        "### Decode step (one new token: update_and_fetch + attention)",
        "",
        *decode,
        "",
        f"### Prefill of {config['prefill_tokens']} tokens in chunks of {config['prefill_chunk']}",
        "",
        f"{config['prefill_q_heads']} query heads over {config['prefill_kv_heads']} KV head(s) "
        "(prefill attention on this CPU takes minutes at full width; every contender does the "
        f"same work). Median of {config['prefill_repeats']} timed prefill run(s) per contender "
        "after an untimed two-chunk warmup. Peak memory is `mx.get_peak_memory()` during the "
        "prefill minus the memory active before it (the inputs): the cache plus attention "
        "scratch.",
        "",
        *prefill,
        "",
        f"### Peak memory during a {config['prefill_tokens']}-token prefill, mlx-lm's quantized "
        "cache included",
        "",
        "mlx-lm's `QuantizedKVCache` prefills through `quantized_matmul`, which on the CPU "
        "backend is several times slower than the fused attention, so attending every chunk "
        "does not fit this run. Here every contender takes all chunks but the last through "
        "`update_and_fetch` (exactly as in a prefill, regrowth copies included) and runs "
        "attention on the last chunk only. Scratch grows with the context, so the last chunk "
        "sets the peak; the whole-prefill peaks in the table above check the method for the "
        "paged and fp16 caches. 'last-chunk time' compares that last chunk's attention (at "
        "the full context). This is one layer: its cache is small next to the attention "
        "scratch, so the last column splits the peak into bytes held and scratch; in a model "
        "the cache term is multiplied by the number of attention layers and the scratch is not.",
        "",
        *memory,
        "",
        "### quantize+pack (`quantize_rows` for K and V)",
        "",
        *quantize,
        "",
        "### Bytes held (`nbytes`) at each context",
        "",
        "The goal compares against mlx-lm's `QuantizedKVCache` filled with float16 K/V, as a "
        "float16 model fills it (scale and bias per 64 values, both float16). The cache timed "
        f"above holds {config['dtype']} scales and biases on this backend; that column is "
        "shown too.",
        "",
        *held,
    ]
    return "\n".join(lines) + "\n"
