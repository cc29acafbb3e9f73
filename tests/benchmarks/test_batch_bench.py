"""``python -m benchmarks batch`` at tiny sizes: it runs, and its report is complete.

Correctness only: no assertion here reads a timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from benchmarks import report
from tests.engine.tinymodels import make_tiny_model_dir

REPO = Path(__file__).resolve().parents[2]


def test_batch_report_has_a_row_per_stream_count(tmp_path: Path) -> None:
    model = make_tiny_model_dir(tmp_path / "models", "llama")
    doc, raw = tmp_path / "benchmarks.md", tmp_path / "results.json"
    report.write_section(doc, "generate", "generate numbers stay")
    args = ["batch", "--model", str(model), "--streams", "1,3", "--prompt-tokens", "96",
            "--max-tokens", "4", "--chunk", "16", "--output", str(doc), "--json", str(raw)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run([sys.executable, "-m", "benchmarks", *args], cwd=tmp_path, env=env,
                   check=True, capture_output=True, timeout=300)
    markdown, results = doc.read_text(), json.loads(raw.read_text())
    assert "generate numbers stay" in markdown
    # mlx-lm's caches are said in the dtype they hold (the model computes in float32 here).
    assert results["mlx_lm_kv_dtype"] == "float32"
    assert "`BatchGenerator`, float32 (the model's compute dtype here) `KVCache`s" in markdown
    assert markdown.count("<!-- bench:batch:start -->") == 1
    # Conversations of different lengths: no two rows the same length.
    assert len(set(results["prompt_tokens"])) == 3
    assert [row["streams"] for row in results["rows"]] == [1, 3]
    for row in results["rows"]:
        for side in ("engine", "mlx_lm"):
            # Every stream's tokens after its first, on both sides.
            assert row[side]["tokens"] == row["streams"] * 3
    lines = [line for line in markdown.splitlines() if line.startswith("| ")]
    assert len(lines) == 3 and "n/a" not in lines[1] + lines[2]
    # The step's transient as measured, beside what admission counts for it.
    assert lines[0].rstrip(" |").endswith("transient measured / counted (MiB)")
    for row, line in zip(results["rows"], lines[1:], strict=True):
        measured = row["engine"]["engine_peak_bytes"] - row["engine"]["pages_bytes"]
        assert line.rstrip(" |").endswith(
            f"{measured / 2**20:.1f} / {row['engine']['transient_bytes'] / 2**20:.1f}")
    # The question came while the document was still read in, and was timed.
    first = results["first_token"]
    assert first["document_still_reading"] and first["seconds"] > 0 < first["chunk_seconds"]
    assert "chunk times" in markdown
    # The answer's pace beside the read and alone, under both schedules.
    for run in (first, results["first_token_every_step"]):
        assert run["answer_tps_alone"] > 0 < run["answer_tps_beside_read"]
        assert run["read_tps_beside_answer"] > 0
    assert "A chunk read at every step (the schedule before, same run)" in markdown
    assert "the read with turns against a chunk every step" in markdown
    # What the batch launches on a GPU: more rows, more kernels, but under the
    # per-row count of one row alone (rows of one mode share their rotations).
    alone, three = results["layer_kernels"]["1"], results["layer_kernels"]["3"]
    assert alone < three < 3 * alone
    assert f"{alone} / {three} at 1 / 3 streams" in markdown
