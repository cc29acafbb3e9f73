"""The serve bench's decode comparison: medians, the per-token cost and the verdict."""

from __future__ import annotations

from benchmarks.serve_bench import decode_report


def test_the_decode_report_compares_medians_and_says_the_cost_per_token() -> None:
    results = {"max_tokens": 128, "server_tps": [40.0, 50.0, 10.0],
               "cli_tps": [50.0, 52.0, 48.0], "load_1min": [1.0, 1.2]}
    text = decode_report(results)
    assert "server 40.0 tok/s, CLI 50.0 tok/s (0.80×)" in text
    assert "+5.0 ms" in text  # 1000/40 - 1000/50
    assert text.endswith("**not met**.")
    results["server_tps"] = [49.0, 49.0, 49.0]
    assert decode_report(results).endswith("**met**.")
