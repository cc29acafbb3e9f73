"""Smoke test of ``python -m benchmarks`` at tiny sizes: it runs, and its report is complete.

Correctness only: no assertion here reads a timing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks import report
from benchmarks.__main__ import parse_tokens
from engine.cache.kvquant import project_kv_bytes
from tests.engine.tinymodels import make_tiny_model_dir

REPO = Path(__file__).resolve().parents[2]
CONTEXTS = (256, 512)
HEAD_DIMS = (64, 128)  # 128 exercises the pre-sized mlx-lm 6-bit baseline
MODES = ("fp16", "q8", "q6", "q4")
KV_HEADS = 2
PRESERVED = "Hand-written notes that the benchmark must keep.\n"


def _isolated_env(root: Path) -> dict[str, str]:
    """The environment for a bench subprocess, with every user dir under ``root``.

    Module-scoped fixtures run before the suite's function-scoped isolation, so set
    the same variables here.
    """
    env = dict(os.environ)
    for var in ("XDG_DATA_HOME", "XDG_CONFIG_HOME", "XDG_CACHE_HOME", "HF_HOME"):
        env[var] = str(root / var.lower())
    env["LONGLEAF_HOME"] = str(root / "longleaf")
    return env


def _run_cli(args: list[str], root: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks", *args],
        cwd=REPO,
        env=_isolated_env(root),
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def cache_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """One tiny ``benchmarks cache`` run through the real CLI: (markdown, json)."""
    out = tmp_path_factory.mktemp("bench")
    doc, raw = out / "benchmarks.md", out / "results.json"
    doc.write_text("# Benchmarks\n\n" + PRESERVED)
    args = [
        "cache",
        "--contexts", ",".join(str(c) for c in CONTEXTS),
        "--head-dims", ",".join(str(d) for d in HEAD_DIMS),
        "--kv-heads", str(KV_HEADS), "--q-heads", "4",
        "--prefill-tokens", "512", "--prefill-chunk", "256", "--quant-chunk", "256",
        "--prefill-q-heads", "2", "--prefill-kv-heads", "1",
        "--repeats", "2", "--warmup", "1", "--prefill-repeats", "1", "--quant-repeats", "2",
        "--output", str(doc), "--json", str(raw),
    ]  # fmt: skip
    _run_cli(args, out)
    return doc.read_text(), json.loads(raw.read_text())


def _table_after(markdown: str, heading: str) -> list[list[str]]:
    """Cells of the first table after a heading that starts with ``heading``."""
    tail = markdown.split("\n### " + heading, 1)[1]
    block: list[str] = []
    for line in tail.splitlines()[1:]:
        if line.startswith("|"):
            block.append(line)
        elif block:
            break
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in block[2:]]


def test_report_keeps_other_text_and_has_one_cache_section(cache_run: tuple[str, dict]) -> None:
    markdown, _ = cache_run
    assert PRESERVED in markdown
    assert markdown.count("<!-- bench:cache:start -->") == 1
    assert markdown.count("<!-- bench:cache:end -->") == 1


def test_report_names_the_machine(cache_run: tuple[str, dict]) -> None:
    markdown, results = cache_run
    for label in ("- Date:", "- CPU:", "- OS:", "- mlx ", "- BLAS:", "- Load average"):
        assert label in markdown
    assert results["machine"]["mlx"] in markdown


def test_decode_table_has_every_cell(cache_run: tuple[str, dict]) -> None:
    markdown, _ = cache_run
    rows = _table_after(markdown, "Decode step")
    keys = {(int(r[0]), int(r[1]), r[2]) for r in rows}
    assert keys == {(d, c, m) for d in HEAD_DIMS for c in CONTEXTS for m in MODES}
    for row in rows:
        assert len(row) == 8 and "n/a" not in row
        float(row[3]), float(row[4])  # paged and KVCache times are numbers
        if row[2] == "fp16":
            assert row[5] == row[6] == "—"
        else:
            float(row[5])
            assert re.fullmatch(r"\d+\.\d\d× [✅❌]", row[6])
        assert re.fullmatch(r"\d+\.\d\d× [✅❌]", row[7])


def test_prefill_table_has_every_cell(cache_run: tuple[str, dict]) -> None:
    markdown, _ = cache_run
    rows = _table_after(markdown, "Prefill")
    assert {(int(r[0]), r[1]) for r in rows} == {(d, m) for d in HEAD_DIMS for m in MODES}
    for row in rows:
        assert len(row) == 7 and "n/a" not in row
        assert re.fullmatch(r"\d+\.\d\d× [✅❌]", row[4])
        assert all(cell.endswith("MiB") for cell in row[5:7])


def test_peak_memory_table_has_every_cell(cache_run: tuple[str, dict]) -> None:
    markdown, results = cache_run
    rows = _table_after(markdown, "Peak memory")
    assert {(int(r[0]), r[1]) for r in rows} == {(d, m) for d in HEAD_DIMS for m in MODES}
    for row in rows:
        assert len(row) == 10 and "n/a" not in row
        assert re.fullmatch(r"(-?\d+\.\d|—)( / (-?\d+\.\d|—)){2} MiB", row[9])
        if row[1] == "fp16":
            assert row[4] == row[6] == row[7] == row[8] == "—"
        else:
            assert row[4].endswith("MiB") and re.fullmatch(r"\d+\.\d\d× [✅❌]", row[6])
    for row in results["prefill"]:
        assert row["peak_bytes"] > 0 and row["last_chunk_s"] > 0
        # Only the paged and fp16 caches run the whole prefill.
        assert (row["prefill_s"] is None) == (row["kind"] == "mlx-quant")


def test_quantize_table_has_every_cell(cache_run: tuple[str, dict]) -> None:
    markdown, _ = cache_run
    rows = _table_after(markdown, "quantize+pack")
    assert {(int(r[0]), r[1]) for r in rows} == {(d, m) for d in HEAD_DIMS for m in MODES[1:]}
    for row in rows:
        assert "n/a" not in row
        assert len(row[4].split(" / ")) == len(CONTEXTS)


def test_bytes_table_matches_the_storage_arithmetic(cache_run: tuple[str, dict]) -> None:
    markdown, results = cache_run
    rows = _table_after(markdown, "Bytes held")
    assert {(int(r[0]), int(r[1]), r[2]) for r in rows} == {
        (d, c, m) for d in HEAD_DIMS for c in CONTEXTS for m in MODES
    }
    for row in results["decode"]:
        if row["kind"] == "paged":
            expected = project_kv_bytes(1, KV_HEADS, row["head_dim"], row["context"], row["mode"])
            assert row["bytes"] == expected
    # mlx-lm's quantized cache with fp16 scale + bias per 64 values: D * bits / 8 + 4 * D / 64
    # bytes per row, pre-sized (q6 at 128) or not.
    bits = {"q8": 8, "q6": 6, "q4": 4}
    for row in results["reference_bytes"]:
        if row["mode"] in bits:
            d, c = row["head_dim"], row["context"]
            per_row = d * bits[row["mode"]] // 8 + 4 * d // 64
            assert row["bytes"] == 2 * KV_HEADS * c * per_row


def test_goals_table_lists_every_goal(cache_run: tuple[str, dict]) -> None:
    markdown, results = cache_run
    rows = _table_after(markdown, "Goals")
    goals = [r[0] for r in rows]
    assert len(goals) == 7, goals
    for fragment in ("decode ≤ 1.0×", "decode ≤ 1.2×", "prefill ≤ 1.15×", "peak memory",
                     "new token < 5%", "chunk < 5%", "bytes held ≤ 0.95×"):  # fmt: skip
        assert any(fragment in goal for goal in goals), fragment
    for row in rows:
        assert row[1] in ("**met**", "**NOT met**")
    assert results["mlx_6bit_workaround_head_dims"] == [128]


@pytest.fixture(scope="module")
def generate_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """One tiny ``benchmarks generate`` run on a tiny llama folder: (markdown, json)."""
    out = tmp_path_factory.mktemp("bench-generate")
    model = make_tiny_model_dir(out / "models", "llama")
    doc, raw = out / "benchmarks.md", out / "results.json"
    report.write_section(doc, "cache", "cache numbers stay")
    args = [
        "generate", "--model", str(model), "--prompts", "96,160", "--max-tokens", "4",
        "--output", str(doc), "--json", str(raw),
    ]  # fmt: skip
    _run_cli(args, out)
    return doc.read_text(), json.loads(raw.read_text())


def test_generate_report_has_every_cell(generate_run: tuple[str, dict]) -> None:
    markdown, results = generate_run
    assert "cache numbers stay" in markdown
    assert markdown.count("<!-- bench:generate:start -->") == 1
    speed = _table_after(markdown, "Speed")
    assert [r[1] for r in speed] == list(MODES) * 2
    for row in speed:
        assert len(row) == 10 and "n/a" not in row
        assert re.fullmatch(r"\d+\.\d\d×", row[5]) and re.fullmatch(r"\d+\.\d\d×", row[8])
    agree = _table_after(markdown, "Greedy agreement")
    assert len(agree) == len(speed)
    for row in agree:
        assert all(re.fullmatch(r"\d/4 \((identical|first differs at \d)\)", c) for c in row[2:])
    for row in results["rows"]:
        for side in ("engine", "mlx_lm"):
            assert row[side]["generated"] == 4 and len(row[side]["tokens"]) == 4
        # Same prompt ids on both sides, close to the requested length.
        assert row["engine"]["prompt_tokens"] == row["mlx_lm"]["prompt_tokens"]
        assert abs(row["engine"]["prompt_tokens"] - row["target"]) <= 8


def test_agreement_run_compares_every_mode_with_fp16(tmp_path: Path) -> None:
    model = make_tiny_model_dir(tmp_path / "models", "llama")
    doc, raw = tmp_path / "benchmarks.md", tmp_path / "results.json"
    report.write_section(doc, "generate", "generate numbers stay")
    args = [
        "agreement", "--model", str(model), "--prompt", "96", "--modes", "q8,q4",
        "--max-tokens", "5", "--output", str(doc), "--json", str(raw),
    ]  # fmt: skip
    _run_cli(args, tmp_path)
    markdown, results = doc.read_text(), json.loads(raw.read_text())
    assert "generate numbers stay" in markdown
    assert markdown.count("<!-- bench:agreement:start -->") == 1
    rows = _table_after(markdown, "Token ids equal to fp16")
    assert [r[1] for r in rows] == ["fp16", "q8", "q4"]  # fp16 runs as the reference
    reference = results["rows"][0]["engine"]["tokens"]
    assert rows[0][2] == "5/5 (identical)" and len(reference) == 5
    for cells, row in zip(rows, results["rows"], strict=True):
        tokens = row["engine"]["tokens"]
        same = sum(a == b for a, b in zip(tokens, reference, strict=True))
        assert cells[2].startswith(f"{same}/5 (")
        assert abs(int(cells[0]) - 96) <= 8


# Relative max error vs an fp64 reference on random rows, measured 0.0 / 0.0004 / 0.011 /
# 0.035 / 0.19 (fp32, fp16, 8, 6, 4 bits); bounds leave ~2x room.
ERROR_BOUND = {"mlx-fp16": 1e-5, "fp16": 2e-3, "q8": 0.03, "q6": 0.08, "q4": 0.4}


def _reference_attention(queries, keys, values) -> np.ndarray:
    q, k, v = (np.array(x, dtype=np.float64)[0] for x in (queries, keys, values))
    heads, length, head_dim = q.shape
    repeats, context = heads // k.shape[0], k.shape[1]
    out = np.empty_like(q)
    for head in range(heads):
        scores = q[head] @ k[head // repeats].T / np.sqrt(head_dim)
        # Causal within the new chunk; the cached prefix is fully visible.
        visible = np.arange(context)[None] <= (context - length + np.arange(length))[:, None]
        scores = np.where(visible, scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        out[head] = (weights / weights.sum(-1, keepdims=True)) @ v[head // repeats]
    return out


@pytest.mark.parametrize("length", [1, 40])
def test_every_contender_computes_the_same_attention(length: int) -> None:
    """The harness feeds every cache the same rows and runs a real attention on them."""
    import mlx.core as mx

    from benchmarks import cache_bench, contenders

    prefix, head_dim = 300, 128
    queries = cache_bench._random((1, 4, length, head_dim), mx.float32, seed=11)
    keys = cache_bench._random((1, 2, length, head_dim), mx.float32, seed=12)
    values = cache_bench._random((1, 2, length, head_dim), mx.float32, seed=13)
    cached_k = cache_bench._random((1, 2, prefix, head_dim), mx.float32, seed=1)
    cached_v = cache_bench._random((1, 2, prefix, head_dim), mx.float32, seed=2)
    expected = _reference_attention(
        queries, mx.concatenate([cached_k, keys], 2), mx.concatenate([cached_v, values], 2)
    )
    entries = contenders.contenders(MODES, 256, mx.float32)
    for _ in range(2):  # a second round catches inputs mutated by an earlier contender
        for entry in entries:
            cache = entry.make_cache(2, head_dim, 1024)
            mx.eval(cache.update_and_fetch(cached_k, cached_v))
            out = np.array(cache_bench.attention_step(entry, cache, queries, keys, values))[0]
            error = np.abs(out - expected).max() / np.abs(expected).max()
            bound = ERROR_BOUND["mlx-fp16" if entry.kind == "mlx-fp16" else entry.mode]
            assert error < bound, (entry.name, error)


def test_write_section_replaces_in_place(tmp_path: Path) -> None:
    doc = tmp_path / "b.md"
    report.write_section(doc, "generate", "first")
    report.write_section(doc, "cache", "cache body")
    report.write_section(doc, "generate", "second")
    text = doc.read_text()
    assert "first" not in text and text.count("second") == 1
    assert text.index("second") < text.index("cache body")


def test_goal_tally_verdicts() -> None:
    tally = report.GoalTally()
    tally.check("a", "x", 0.9, 1.0)
    tally.check("a", "y", 1.0, 1.0)
    tally.check("b", "x", 0.5, 1.0)
    tally.check("b", "y", 1.3, 1.0)
    lines = tally.lines()
    assert "| a | **met** | 2/2 | 1.00 | — |" in lines
    assert "| b | **NOT met** | 1/2 | 1.30 | y (1.30) |" in lines


@pytest.mark.parametrize(("text", "tokens"), [("4k", 4096), ("16K", 16384), ("300", 300)])
def test_parse_tokens(text: str, tokens: int) -> None:
    assert parse_tokens(text) == tokens
