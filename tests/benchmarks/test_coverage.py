"""The coverage table (``python -m benchmarks.coverage``): its rows, its children, its text."""

from __future__ import annotations

from benchmarks import coverage
from engine.models.probe import MAX_REL_DIFF


def test_a_model_without_attention_is_refused_as_the_loader_does() -> None:
    row = coverage.probe_one("mamba")
    assert row.verdict == "refused" and row.reason.startswith("no attention layers")

def test_unknown_architecture_is_not_built() -> None:
    row = coverage.probe_one("no_such_arch")
    assert row.verdict == coverage.NOT_BUILT
    assert row.reason.startswith("could not build a tiny config: ModuleNotFoundError")


def test_coverage_children_report_a_row_per_type() -> None:
    rows = coverage.probe_in_children(["qwen3", "no_such_arch"])
    assert [row.model_type for row in rows] == ["qwen3", "no_such_arch"]
    assert rows[0].verdict == "paged" and rows[0].max_rel_diff <= MAX_REL_DIFF
    assert rows[1].verdict == coverage.NOT_BUILT


def test_a_child_that_overruns_gets_a_row_and_the_rest_go_on() -> None:
    rows = coverage.probe_in_children(["qwen3", "llama"], time_limit=0.001)
    assert [row.verdict for row in rows] == [coverage.NOT_BUILT] * 2
    assert all("took over" in row.reason for row in rows)

def test_render_backs_every_row_with_its_numbers() -> None:
    rows = [
        coverage.Row("llama", "paged", "", 2.5e-4),
        coverage.Row("gemma4_text", "mlx-lm", "KV-shared layers: differ", 0.5),
        coverage.Row("odd", coverage.NOT_BUILT, "could not build a tiny config: x | y"),
    ]
    text = coverage.render(rows, "0.0")
    assert "| `llama` | paged | 2.5e-04 |  |" in text
    assert "| `gemma4_text` | mlx-lm cache | 5.0e-01 | KV-shared layers: differ |" in text
    assert "x \\| y" in text
    assert "3 text architectures, 1 paged, 1 mlx-lm cache, 0 refused, 1 not built" in text
