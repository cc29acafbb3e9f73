"""The speculative benchmark end to end on a tiny model: rows, margins, the report."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.speculative_bench import (
    SpeculativeConfig,
    metal_estimate,
    quote_start,
    render_report,
    run_speculative_bench,
)
from tests.engine.session.batch_noise import first_divergence
from tests.engine.tinymodels import make_tiny_model_dir


def test_bench_reports_every_question_with_its_margins(tmp_path: Path) -> None:
    folder = make_tiny_model_dir(tmp_path, "llama")
    config = SpeculativeConfig(model=str(folder), modes=("q6",), document_tokens=300,
                               max_tokens=10, pairs=2)
    results = run_speculative_bench(config, progress=lambda _: None)
    rows = results["rows"]
    assert [r["question"] for r in rows] == list(config.questions)
    for row in rows:
        assert 0 < row["tokens"] <= 10 and row["steps"] >= 1
        if row["tokens"] == row["off_tokens"] == config.max_tokens:
            # Cut at the same length, each accepted token saved plain decoding a pass.
            assert row["off_steps"] - row["steps"] == row["accepted_tokens"]
            assert row["metal_estimate"] == pytest.approx(row["off_steps"] / row["steps"])
        assert row["accepted_tokens"] <= row["draft_tokens"]
        # Greedy answers repeat exactly, drafts included: pairs differ by timing alone.
        assert len(row["pair_ratios"]) == 2 and row["repeats_agree"]
        # A margin for every position of the plain answer and for where it stopped.
        assert row["positions"] == row["off_tokens"] + 1
        # Any divergence must sit at a near-tie of plain decoding's batch noise.
        if row["first_divergence"] is not None:
            assert row["divergence_margin"] < row["noise_threshold"]
    report = render_report(results, {"mlx": "x", "platform": "y"}, "cmd", "1.0")
    assert report.count("| q6 |") == len(rows)
    assert "BLAS loaded" in report and "Batch noise" in report


def test_an_answer_that_stops_early_diverges_where_it_stopped() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    # One decoding chose to stop at index 2, the other a token.
    assert first_divergence([1, 2], [1, 2, 3, 4]) == 2
    assert first_divergence([1, 2, 3, 4], [1, 2]) == 2
    assert first_divergence([], [7]) == 0


def test_metal_estimate_compares_tokens_per_pass_with_plain_decodings() -> None:
    # An answer that ends itself: plain decoding took 16 passes for 14 tokens (the
    # prompt's last token and one queued past the end), and so did an answer that
    # drafted nothing: no speed-up, where tokens per pass alone says 0.88.
    stopped = {"ids": list(range(14)), "steps": 16}
    assert metal_estimate(stopped, dict(stopped)) == 1.0
    assert metal_estimate({"ids": list(range(48)), "steps": 48},
                          {"ids": list(range(48)), "steps": 21}) == 48 / 21
    # Answers of different lengths (a near-tie moved the end) compare per token.
    assert metal_estimate({"ids": list(range(20)), "steps": 22},
                          {"ids": list(range(48)), "steps": 43}) == (48 / 43) / (20 / 22)


def test_quote_question_names_a_paragraph_the_cut_document_holds() -> None:
    doc = "# Title\n\nShort one.\n\n```\ncode code\n```\n\n" + " ".join(
        f"word{i}" for i in range(40)) + "\n\n- a list item\n\nLast words here."
    assert quote_start(doc) == " ".join(f"word{i}" for i in range(8))
    # With no long paragraph, the longest prose one.
    assert quote_start("Two words.\n\nThree words here.") == "Three words here."
