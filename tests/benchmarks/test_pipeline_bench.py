"""The pipeline benchmark's report: pairs of runs, their median overhead, same tokens."""

from __future__ import annotations

from benchmarks.pipeline_bench import render_pipeline_report

INFO = {"date": "today", "cpu": "cpu", "cores": "2 usable of 2", "memory": "1 GiB",
        "os": "os", "python": "3", "mlx": "0", "device": "cpu", "mlx_lm": "0",
        "blas": "blas", "load_average": "1.00, 1.00, 1.00"}


def _row(ranks: int, repeat: int, decode_tps: float, prefill_tps: float,
         ids: list[int]) -> dict:
    return {"context": 8192, "ranks": ranks, "repeat": repeat, "load": 1.0,
            "prompt_tokens": 8200, "tokens": len(ids), "ids": ids, "prefill_tps": prefill_tps,
            "decode_tps": decode_tps, "time_to_first_token": 1.0}


def _report(rows: list[dict], floor: dict | None = None) -> str:
    results = {"config": {"mode": "fp16", "chunk_size": 512, "repeats": 3}, "rows": rows,
               "floor": floor or {}}
    return render_pipeline_report(results, INFO, "cmd", "2.00, 2.00, 2.00")


def test_the_overhead_is_the_median_of_each_pairs_difference() -> None:
    ids = [1, 2, 3]
    rows = [_row(1, 0, 100.0, 1000.0, ids), _row(2, 0, 50.0, 900.0, ids),     # 10 ms
            _row(1, 1, 200.0, 1000.0, ids), _row(2, 1, 100.0, 500.0, ids),    # 5 ms
            _row(1, 2, 100.0, 1000.0, ids), _row(2, 2, 80.0, 700.0, ids)]     # 2.5 ms
    text = _report(rows, {"header send/recv ms": 0.05, "load average": 3.0})
    verdict = text.splitlines()[-1]
    assert verdict.startswith("| 8k | 5.00 ❌ | 0.70× ❌ | yes |")
    assert "header send/recv 0.050 ms" in text


def test_a_pair_with_other_tokens_is_flagged_and_a_failed_run_is_left_out() -> None:
    rows = [_row(1, 0, 100.0, 1000.0, [1, 2]), _row(2, 0, 90.0, 900.0, [1, 3]),
            _row(1, 1, 100.0, 1000.0, [1, 2]),
            {"context": 8192, "ranks": 2, "repeat": 1, "error": "boom"}]
    text = _report(rows)
    assert text.splitlines()[-1] == "| 8k | 1.11 ✅ | 0.90× ✅ | NO |"
    assert "boom" in text


def test_requests_at_once_are_set_against_one_request_on_the_same_ranks() -> None:
    def streamed(ranks: int, streams: int, tok_s: float, texts: list[str]) -> dict:
        return {"ranks": ranks, "streams": streams, "load": 1.0, "tok_s": tok_s,
                "seconds": 2.0, "tokens": [8] * streams, "texts": texts}

    results = {"config": {"mode": "q8", "chunk_size": 512, "repeats": 1, "stream_tokens": 8},
               "rows": [], "floor": {},
               "streams": [streamed(1, 1, 50.0, ["a"]), streamed(1, 4, 110.0, list("abcd")),
                           streamed(2, 1, 40.0, ["a"]), streamed(2, 4, 100.0, list("abcx")),
                           {"ranks": 2, "streams": 8, "error": "boom"}]}
    text = render_pipeline_report(results, INFO, "cmd", "2.00, 2.00, 2.00")
    assert "`python -m engine serve --parallel 8`" in text
    rows = text.splitlines()[-5:]
    assert rows[1] == "| 1 | 4 | 1.0 | 2.00 | 110.0 | 2.20× |  |"
    assert rows[3] == "| 2 | 4 | 1.0 | 2.00 | 100.0 | 2.50× | NO |"
    assert rows[2].startswith("| 2 | 1 |") and rows[2].endswith("| 1.00× | yes |")
    assert "boom" in rows[4]
