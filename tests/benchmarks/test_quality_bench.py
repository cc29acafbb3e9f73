"""``python -m benchmarks quality`` on a tiny model: its table is complete and its numbers sane.

Correctness only: no assertion reads a timing.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from benchmarks import report
from benchmarks.__main__ import main
from benchmarks.quality_bench import (
    QualityBenchConfig,
    Variant,
    bytes_per_token,
    compare,
    variants,
    verdicts,
)
from tests.engine.tinymodels import make_tiny_model_dir

CONTEXTS = (96, 160)
TOKENS = 6
VARIANTS = [
    "engine fp16", "engine fp16 rotated", "engine q8", "engine q8 rotated", "engine q6",
    "engine q6 rotated", "engine q4", "engine q4 rotated", "mlx-lm 8-bit g64",
    "mlx-lm 6-bit g64", "mlx-lm 4-bit g64",
]  # fmt: skip


def _table_after(markdown: str, heading: str) -> list[list[str]]:
    block = markdown.split(heading, 1)[1].strip().split("\n\n", 1)[0]
    rows = [line for line in block.splitlines() if line.startswith("|")]
    return [[c.strip() for c in row.strip("|").split("|")] for row in rows[2:]]


@pytest.fixture(scope="module")
def quality_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    """One tiny run on a qwen3 folder (head_dim 64: mlx-lm's group of 64 applies)."""
    out = tmp_path_factory.mktemp("bench-quality")
    model = make_tiny_model_dir(out / "models", "qwen3")
    doc, raw = out / "benchmarks.md", out / "results.json"
    report.write_section(doc, "generate", "generate numbers stay")
    args = ["quality", "--model", str(model), "--contexts", "96,160", "--tokens", str(TOKENS),
            "--output", str(doc), "--json", str(raw)]  # fmt: skip
    assert main(args) == 0
    return doc.read_text(), json.loads(raw.read_text())


def test_table_has_every_variant_at_every_context(quality_run: tuple[str, dict]) -> None:
    markdown, _ = quality_run
    assert "generate numbers stay" in markdown
    assert markdown.count("<!-- bench:quality:start -->") == 1
    rows = _table_after(markdown, "rotation `hadamard-v1+signs`.")
    assert [(int(r[0]), r[1]) for r in rows] == [(c, v) for c in CONTEXTS for v in VARIANTS]
    assert all(len(r) == 7 for r in rows)


def test_reference_is_exact_and_q4_is_worse_than_q8(quality_run: tuple[str, dict]) -> None:
    _, results = quality_run
    by = {(r["variant"], r["context"]): r for r in results["rows"]}
    for context in CONTEXTS:
        reference = by[("engine fp16", context)]
        assert reference["kl_mean"] == 0.0 and reference["kl_p99"] == 0.0
        assert reference["top1"] == 1.0
        # Rotated fp16 stores the same rows rounded in another basis: KL near zero.
        assert by[("engine fp16 rotated", context)]["kl_mean"] < 1e-3
        for kind in ("engine q{}", "engine q{} rotated", "mlx-lm {}-bit g64"):
            q8, q4 = by[(kind.format(8), context)], by[(kind.format(4), context)]
            assert q4["kl_mean"] > q8["kl_mean"] > 0.0
        for row in (r for r in results["rows"] if r["context"] == context):
            assert row["kl_p99"] >= row["kl_mean"] >= 0.0
            assert 0.0 <= row["top1"] <= 1.0 and row["ppl"] > 1.0


def test_goals_table_has_each_goal_per_context(quality_run: tuple[str, dict]) -> None:
    markdown, _ = quality_run
    goals = _table_after(markdown, "### Goals")
    assert [(g[0][:10], int(g[1])) for g in goals] == [
        (goal, c) for c in CONTEXTS for goal in ("rotated q6", "rotated q4", "rotated q8")
    ]
    assert all(g[2].startswith(("**met**", "**not met**")) for g in goals)


def test_compare_kl_top1_and_perplexity() -> None:
    p = np.log(np.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1]]))
    q = np.log(np.array([[0.25, 0.5, 0.25], [0.1, 0.8, 0.1]]))
    scores = compare(p, q, [0, 1])
    kl_first = 0.5 * np.log(2) + 0.25 * np.log(0.5)
    assert scores["kl_mean"] == pytest.approx(kl_first / 2)
    assert scores["top1"] == 0.5
    assert scores["ppl"] == pytest.approx(np.exp(-(np.log(0.25) + np.log(0.8)) / 2))
    assert compare(p, p, [0, 1])["kl_mean"] == 0.0


def test_bytes_per_token_follow_the_formats() -> None:
    # Held in memory: 48 bytes of 6-bit codes + a float16 scale and bias per row
    # (head_dim 64 is one MLX group), K and V; the seed's row format keeps 100.
    assert bytes_per_token(Variant("", "engine", "q6"), 64) == 104
    assert bytes_per_token(Variant("", "engine", "fp16"), 64) == 256
    # mlx-lm: 48 bytes of 6-bit codes + fp16 scale and bias per 64 values, K and V.
    assert bytes_per_token(Variant("", "mlx-lm", "q6"), 64) == 104
    assert bytes_per_token(Variant("", "mlx-lm", "q4"), 64) == 72


def test_variants_start_with_the_reference() -> None:
    names = [v.name for v in variants(QualityBenchConfig())]
    assert names == VARIANTS
    subset = variants(QualityBenchConfig(modes=("q6",), mlx_bits=(6,)))
    assert [v.name for v in subset] == [
        "engine fp16", "engine q6", "engine q6 rotated", "mlx-lm 6-bit g64"
    ]


def test_verdicts_compare_the_right_rows() -> None:
    rows = [
        {"variant": "engine q6 rotated", "context": 2048, "kl_mean": 1.0e-3},
        {"variant": "mlx-lm 6-bit g64", "context": 2048, "kl_mean": 5.0e-3},
        {"variant": "engine q4 rotated", "context": 2048, "kl_mean": 5.0e-2},
        {"variant": "engine q4", "context": 2048, "kl_mean": 1.0e-1},
    ]
    found = verdicts({"config": {"contexts": [2048]}, "rows": rows})
    assert [(goal[:10], verdict.split(":")[0]) for goal, _, verdict in found] == [
        ("rotated q6", "**met**"),
        ("rotated q4", "**not met**"),  # 0.5x, the goal is 0.4x
    ]
