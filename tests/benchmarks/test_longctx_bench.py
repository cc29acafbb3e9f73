"""benchmarks longctx at toy sizes: every cell measured, the paged transient bounded."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import longctx_bench, longctx_report, report
from engine.cache import pages
from engine.cache.attention import streams
from engine.cache.attention.scratch import chunk_scratch_bytes

MIB = 2**20


@pytest.fixture(scope="module")
def layer_run() -> dict:
    config = longctx_bench.LongContextConfig(
        contexts=(1024, 4096), q_heads=(8,), modes=("fp16", "q6"), chunk=64,
        decode_repeats=1, page_size=64, dtype="float32",
    )
    return longctx_bench.run_layer_bench(config)


def test_every_contender_is_measured_at_every_context(layer_run: dict) -> None:
    names = {(r["name"], r["context"]) for r in layer_run["rows"]}
    expected = {"mlx-lm KVCache", "mlx-lm QuantizedKVCache 6-bit", "paged fp16", "paged q6",
                "paged q6 rotated"}
    assert names == {(n, c) for n in expected for c in (1024, 4096)}
    for row in layer_run["rows"]:
        assert row["bytes"] > 0 and row["decode_ms"] > 0
        if row["kind"] != "mlx-quant":
            assert row["prefill_s"] > 0 and row["prefill_peak"] > 0


def test_paged_cells_run_under_both_schedules_with_their_host_syncs(layer_run: dict) -> None:
    paged = [r for r in layer_run["rows"] if r["kind"].startswith("paged")]
    cells = {(r["name"], r["context"], r["schedule"]) for r in paged}
    assert len(cells) == len(paged) == 2 * len({(r["name"], r["context"]) for r in paged})
    for row in paged:
        assert row["decode_host_syncs"] >= 0 and row["chunk_host_syncs"] >= 0
        if row["schedule"] == "gpu":
            assert row["decode_host_syncs"] == row["chunk_host_syncs"] == 0, row
    # The CPU schedule waits once per block: fp16 decode blocks at 4k are several.
    cpu = next(r for r in paged if r["schedule"] == "cpu" and r["mode"] == "fp16"
               and r["context"] == 4096 and r["kind"] == "paged")
    assert cpu["decode_host_syncs"] > 0, cpu
    assert all(r.get("schedule") is None for r in layer_run["rows"]
               if not r["kind"].startswith("paged"))


def test_paged_chunk_transient_stays_within_a_small_scratch_budget(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With an 8 MiB budget, a chunk over 8k tokens stays near 8 MiB (unbounded: ~300 MiB)."""
    monkeypatch.setattr(pages, "PREFILL_SCRATCH_BYTES", 8 * MIB)
    config = longctx_bench.LongContextConfig(
        contexts=(8192,), q_heads=(8,), modes=("q6",), chunk=64, decode_repeats=1,
        page_size=64, dtype="float32",
    )
    rows = [r for r in longctx_bench.run_layer_bench(config)["rows"] if r["kind"] == "paged"]
    block = chunk_scratch_bytes(64, 8, config.kv_heads, config.head_dim, 64, 8 * MIB,
                                head_streams=streams.streams_for(config.kv_heads))
    unbounded = 4 * 8192 * (3 * 8 * 64 + 8 * config.kv_heads * config.head_dim)
    chunk_inputs = 4 * 64 * config.head_dim * (8 + 4 * config.kv_heads)
    assert block <= 8 * MIB < unbounded / 30
    assert rows[0]["prefill_peak"] <= block + 4 * chunk_inputs + MIB, rows[0]


def test_report_has_the_tables_and_verdicts(layer_run: dict, tmp_path: Path) -> None:
    results = {**layer_run, "wall_seconds": 1.0}
    body = longctx_report.render_longctx_report(
        results, report.machine_info(), "python -m benchmarks longctx", "0, 0, 0"
    )
    assert "### Verdicts" in body and "decode transient" in body
    cells = body.split("### Every cell")[1]
    assert cells.count("| paged q6 |") == 2  # one row per context, the first schedule's
    schedules = body.split("### Attention schedules")[1].split("###")[0]
    assert schedules.count("| paged q6 | cpu |") == schedules.count("| paged q6 | gpu |") == 2
    assert "gpu schedule: ≤ 2 host syncs per layer per decode step | **met**" in body
    rotation = body.split("### What the rotation costs")[1].split("###")[0]
    assert rotation.count("| q6 |") == 2  # rotated against plain q6 at both contexts
    assert "End to end" in body
    path = tmp_path / "benchmarks.md"
    report.write_section(path, "longctx", body)
    assert "<!-- bench:longctx:start -->" in path.read_text()
