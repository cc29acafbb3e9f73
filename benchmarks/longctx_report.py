"""The Markdown section of ``python -m benchmarks longctx``: tables and verdicts."""

from __future__ import annotations

from typing import Any

from benchmarks.report import (
    GoalTally,
    fmt_bytes,
    fmt_ratio,
    fmt_tokens,
    machine_lines,
    ratio,
    table,
)
from engine.cache.pages import PREFILL_SCRATCH_BYTES

MIB = 2**20


def _find(rows: list[dict[str, Any]], **match: Any) -> dict[str, Any] | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


def _baseline(rows: list[dict[str, Any]], row: dict[str, Any]) -> dict[str, Any] | None:
    """mlx-lm's cache at the same bits: KVCache for fp16, QuantizedKVCache otherwise."""
    kind = "mlx-fp16" if row["mode"] == "fp16" else "mlx-quant"
    return _find(rows, kind=kind, mode=row["mode"], context=row["context"],
                 q_heads=row["q_heads"], run=row.get("run"))


def _kv_cache(rows: list[dict[str, Any]], row: dict[str, Any]) -> dict[str, Any] | None:
    """mlx-lm's KVCache measured next to ``row`` (same run, context and heads)."""
    return _find(rows, kind="mlx-fp16", context=row["context"], q_heads=row["q_heads"],
                 run=row.get("run"))


def _fmt_ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _fmt_s(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def _layer_table(rows: list[dict[str, Any]]) -> list[str]:
    body = []
    for row in rows:
        skipped = row.get("skipped_estimate")
        prefill_peak = (f"skipped (needs ≥ {skipped / 2**30:.1f} GiB)" if skipped
                        else fmt_bytes(row["prefill_peak"]))
        body.append((
            fmt_tokens(row["context"]), row["q_heads"], row["name"], fmt_bytes(row["bytes"]),
            _fmt_ms(row["decode_ms"]), fmt_bytes(row["decode_peak"]),
            _fmt_s(row["prefill_s"]), prefill_peak,
        ))
    headers = ("context", "q heads", "cache", "bytes held", "decode ms", "decode transient",
               "chunk (512) s", "chunk transient")
    return table(headers, body)


def _goals(rows: list[dict[str, Any]], tally: GoalTally) -> None:
    paged = [r for r in rows if r["kind"] == "paged"]
    contexts = sorted({r["context"] for r in rows})
    for row in paged:
        where = f"{row['mode']} {fmt_tokens(row['context'])} h{row['q_heads']}"
        first = _find(paged, mode=row["mode"], q_heads=row["q_heads"], context=contexts[0])
        if row["context"] != contexts[0] and first:
            tally.check("chunk transient at this context ≤ 1.1× the smallest context's",
                        where, ratio(row["prefill_peak"], first["prefill_peak"]), 1.1)
        kv = _kv_cache(rows, row)
        if row["context"] == 131072 and kv and kv.get("prefill_peak"):
            tally.check("chunk transient ≤ 0.1× mlx-lm KVCache's at 128k", where,
                        ratio(row["prefill_peak"], kv["prefill_peak"]), 0.1)
        if row["context"] == 131072:
            tally.check("decode transient ≤ 64 MiB per layer at 128k", where,
                        row["decode_peak"] / (64 * MIB), 1.0)
        base = _baseline(rows, row)
        if base and 32768 <= row["context"] <= 131072:
            limit = 1.2 if row["mode"] == "fp16" else 1.0
            tally.check(f"decode time ≤ {limit}× mlx-lm's cache at the same bits, 32k-128k",
                        where, ratio(row["decode_ms"], base["decode_ms"]), limit)
        if kv and row["context"] in (32768, 131072) and kv.get("prefill_s"):
            tally.check("chunk time ≤ 1.15× mlx-lm KVCache at 32k and 128k", where,
                        ratio(row["prefill_s"], kv["prefill_s"]), 1.15)


def _ratio_table(rows: list[dict[str, Any]]) -> list[str]:
    body = []
    for row in (r for r in rows if r["kind"] == "paged"):
        base = _baseline(rows, row)
        kv = _kv_cache(rows, row)
        body.append((
            fmt_tokens(row["context"]), row["q_heads"], row["mode"],
            fmt_ratio(ratio(row["bytes"], None if base is None else base["bytes"])),
            fmt_ratio(ratio(row["decode_ms"], None if base is None else base["decode_ms"])),
            fmt_ratio(ratio(row["prefill_s"], None if kv is None else kv.get("prefill_s"))),
            fmt_ratio(ratio(row["prefill_peak"], None if kv is None else kv.get("prefill_peak"))),
        ))
    headers = ("context", "q heads", "paged mode", "bytes vs mlx-lm same bits",
               "decode time vs same bits", "chunk time vs KVCache", "chunk transient vs KVCache")
    return table(headers, body)


def _rotation_rows(rows: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(rotated row, the same mode's plain paged row) at each context and head count."""
    pairs = []
    for row in (r for r in rows if r["kind"] == "paged-rotated"):
        plain = _find(rows, kind="paged", mode=row["mode"], context=row["context"],
                      q_heads=row["q_heads"])
        if plain is not None:
            pairs.append((row, plain))
    return pairs


def _rotation_goals(rows: list[dict[str, Any]], tally: GoalTally) -> None:
    for rotated, plain in _rotation_rows(rows):
        if rotated["context"] != 32768:
            continue
        where = f"{rotated['mode']} 32k h{rotated['q_heads']}"
        tally.check("rotation costs ≤ 5% decode time at 32k", where,
                    ratio(rotated["decode_ms"], plain["decode_ms"]), 1.05)
        tally.check("rotation costs ≤ 5% chunk time at 32k", where,
                    ratio(rotated["prefill_s"], plain["prefill_s"]), 1.05)


def _rotation_table(rows: list[dict[str, Any]]) -> list[str]:
    body = [
        (fmt_tokens(rotated["context"]), rotated["q_heads"], rotated["mode"],
         fmt_ratio(ratio(rotated["decode_ms"], plain["decode_ms"])),
         fmt_ratio(ratio(rotated["prefill_s"], plain["prefill_s"])),
         fmt_ratio(ratio(rotated["prefill_peak"], plain["prefill_peak"])))
        for rotated, plain in _rotation_rows(rows)
    ]
    headers = ("context", "q heads", "mode", "decode time rotated / plain",
               "chunk time rotated / plain", "chunk transient rotated / plain")
    return table(headers, body)


def _schedule_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in rows if r.get("schedule") is not None]


def _fmt_count(value: int | None) -> str:
    return "n/a" if value is None else str(value)


def _schedule_goals(rows: list[dict[str, Any]], tally: GoalTally) -> None:
    paged = _schedule_rows(rows)
    contexts = sorted({r["context"] for r in paged})
    for row in paged:
        where = f"{row['name']} {fmt_tokens(row['context'])} h{row['q_heads']}"
        if row["schedule"] != "gpu":
            continue
        if row.get("prefill_peak") is not None:
            tally.check(f"gpu schedule: chunk transient ≤ the scratch budget "
                        f"({fmt_bytes(PREFILL_SCRATCH_BYTES)})", where,
                        row["prefill_peak"] / PREFILL_SCRATCH_BYTES, 1.0)
        tally.check("gpu schedule: ≤ 2 host syncs per layer per decode step", where,
                    row["decode_host_syncs"], 2)
        tally.check("gpu schedule: decode transient ≤ 128 MiB per layer", where,
                    row["decode_peak"] / (128 * MIB), 1.0)
        first = _find(paged, name=row["name"], schedule="gpu", q_heads=row["q_heads"],
                      context=contexts[0])
        if first and row.get("chunk_host_syncs") is not None and row is not first:
            tally.check("gpu schedule: host syncs per chunk no more than at the smallest "
                        "context (extra syncs)", where,
                        row["chunk_host_syncs"] - first["chunk_host_syncs"], 0)


def _schedule_table(rows: list[dict[str, Any]]) -> list[str]:
    body = [
        (fmt_tokens(r["context"]), r["q_heads"], r["name"], r["schedule"],
         _fmt_count(r.get("decode_host_syncs")), fmt_bytes(r["decode_peak"]),
         _fmt_ms(r["decode_ms"]), _fmt_count(r.get("chunk_host_syncs")),
         fmt_bytes(r["prefill_peak"]), _fmt_s(r["prefill_s"]))
        for r in _schedule_rows(rows)
    ]
    headers = ("context", "q heads", "cache", "schedule", "decode host syncs",
               "decode transient", "decode ms", "chunk host syncs", "chunk transient",
               "chunk (512) s")
    return table(headers, body)


def _hybrid_lines(hybrid: dict[str, Any] | None, tally: GoalTally) -> list[str]:
    if hybrid is None:
        return ["End-to-end hybrid ingest: not run."]
    predicted, measured = hybrid["predicted_peak"], hybrid["measured_peak"]
    off = abs(measured - predicted) / predicted if predicted else None
    tally.check("predicted vs measured prefill peak within 10% (hybrid; difference / predicted)",
                f"{fmt_tokens(hybrid['tokens'])} {hybrid['config'].mode}", off, 0.10)
    return [
        f"Tiny random `qwen3_next` (max_position_embeddings "
        f"{hybrid['config'].context:,}), {hybrid['tokens']:,} tokens read in "
        f"{hybrid['config'].mode} through `Session.ingest` in {hybrid['seconds']:.0f} s "
        f"({hybrid['prefill_tps']:.0f} tok/s):",
        "",
        *table(("predicted prefill peak (fit report)", "measured MLX peak", "difference",
                "KV held", "process peak RSS"),
               [(fmt_bytes(predicted), fmt_bytes(measured),
                 "n/a" if off is None else f"{100 * off:.0f}%",
                 fmt_bytes(hybrid["kv_bytes"]), fmt_bytes(hybrid["rss_peak"]))]),
    ]


def render_longctx_report(
    results: dict[str, Any], info: dict[str, Any], command: str, load_after: str
) -> str:
    """The whole ``longctx`` section."""
    config = results["config"]
    every_row = results["rows"]
    # The comparisons with mlx-lm read the paged cells of the first schedule run
    # (the backend's own unless told otherwise); the schedule table shows them all.
    own = config.schedules[0] if config.schedules else None
    rows = [r for r in every_row if r.get("schedule") in (None, own)]
    tally = GoalTally()
    _goals(rows, tally)
    _rotation_goals(rows, tally)
    _schedule_goals(every_row, tally)
    hybrid = _hybrid_lines(results.get("hybrid"), tally)
    lines = [
        "## Long context: one layer at the seed's scale (`benchmarks longctx`)",
        "",
        f"`{command}` — {results['wall_seconds'] / 60:.0f} min.",
        "",
        *machine_lines(info, load_after),
        "",
        f"One attention layer, head_dim {config.head_dim}, {config.kv_heads} KV heads, "
        f"{config.dtype}; each cache filled through `update_and_fetch` without attention, "
        f"then one decode step (median of {config.decode_repeats}) and one "
        f"{config.chunk}-token prefill chunk at the end of the context. Transient: MLX "
        "peak memory above what was active before the call (the cache itself excluded).",
        "",
        "### Verdicts",
        "",
        *tally.lines(),
        "",
        "### Paged cache against mlx-lm",
        "",
        *_ratio_table(rows),
        "",
        "### What the rotation costs (Hadamard-rotated rows against the same mode plain)",
        "",
        *_rotation_table(rows),
        "",
        f"### Attention schedules (host synchronizations per layer; comparisons above: {own})",
        "",
        *_schedule_table(every_row),
        "",
        "### Every cell",
        "",
        *_layer_table(rows),
        "",
        "### End to end: a hybrid model reads a long document",
        "",
        *hybrid,
    ]
    return "\n".join(lines) + "\n"
