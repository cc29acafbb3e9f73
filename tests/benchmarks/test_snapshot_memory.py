"""``python -m benchmarks reopen`` on a tiny model: it runs and its report is complete.

Correctness only: no assertion reads a timing.
"""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import report
from benchmarks.__main__ import main
from tests.engine.tinymodels import make_tiny_model_dir


def _table_after(markdown: str, heading: str) -> list[list[str]]:
    block = markdown.split(f"### {heading}\n", 1)[1].strip().split("\n\n", 1)[0]
    rows = [line for line in block.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]


def test_reopen_bench_reuses_the_snapshot_and_answers_like_the_uninterrupted_chat(
    tmp_path: Path,
) -> None:
    model = make_tiny_model_dir(tmp_path / "models", "llama")
    doc, raw = tmp_path / "benchmarks.md", tmp_path / "results.json"
    report.write_section(doc, "generate", "generate numbers stay")
    args = ["reopen", "--model", str(model), "--prompts", "96,160", "--max-tokens", "4",
            "--output", str(doc), "--json", str(raw)]  # fmt: skip
    assert main(args) == 0
    markdown, results = doc.read_text(), json.loads(raw.read_text())
    assert "generate numbers stay" in markdown
    assert markdown.count("<!-- bench:reopen:start -->") == 1
    goals = _table_after(markdown, "Goals")
    assert len(goals) == 4 and all(g[1] in ("**met**", "**NOT met**") for g in goals)
    assert goals[0][1] == "**met**" and goals[3][1] == "**met**"
    measured = _table_after(markdown, "Measurements")
    assert len(measured) == 2
    for row, cells in zip(results["rows"], measured, strict=True):
        assert row["reused_tokens"] >= row["prompt_tokens"]
        assert row["reopen_ingested"] == row["follow_up_prompt_tokens"] - row["reused_tokens"]
        assert row["reread_ingested"] == row["follow_up_prompt_tokens"]
        assert row["reopened"] == row["uninterrupted"] and len(row["reopened"]) == 8
        # A snapshot keeps the seed's row format: one scale a row where memory holds
        # a scale and a bias per MLX group (at head_dim 64, 2 of 52 bytes a row).
        assert row["disk_bytes"] > 0.9 * row["kv_bytes_held"] > 0
        assert cells[2] == str(row["reused_tokens"]) and cells[-1] == "yes"
    # The snapshots went to a temporary folder that is gone again.
    assert not list(tmp_path.glob("**/*.safetensors.partial*"))
