"""The fit line above the composer."""

from __future__ import annotations

from types import SimpleNamespace

from app.memory.fit_check import fit_html, wait_sentence
from tests.app.conftest import send_and_wait


def _report() -> SimpleNamespace:
    entries = {m: SimpleNamespace(bytes_needed=n, supported=True, fits=True)
               for m, n in (("q4", 1 << 20), ("q6", 2 << 20), ("q8", 3 << 20), ("fp16", 4 << 20))}
    return SimpleNamespace(for_mode=entries.__getitem__, max_context=8192, budget_bytes=None,
                           available_bytes=8 << 30)


def test_the_fit_line_lists_modes_in_the_one_order_used_everywhere() -> None:
    html, ok = fit_html(_report(), "q6", 1000)
    assert ok
    positions = [html.index(f"{mode} ") for mode in ("fp16", "q8", "q6", "q4")]
    assert positions == sorted(positions)


def test_the_fit_line_shows_the_prefill_peak_when_the_engine_knows_it() -> None:
    report = _report()
    assert "Reading it in" not in fit_html(report, "q6", 1000)[0]
    report.for_mode("q6").prefill_peak_bytes = 3 << 30
    html, _ = fit_html(report, "q6", 1000)
    assert ("Reading it in needs up to ≈ 3.0 GB at once (the model, this memory and "
            "working space)") in html, html


def test_the_fit_line_speaks_plainly() -> None:
    html, _ = fit_html(_report(), "q6", 1000)
    assert html.startswith("✓ After this message: 1,000 of 8,192 tokens · memory for them: ")
    for jargon in ("KV", "RAM", "budget", "turn", "scratch"):
        assert jargon not in html


def test_the_wait_is_said_from_the_measured_rate_only_for_long_reads() -> None:
    assert wait_sentence(5400, 18.0) == "Reading 5,400 tokens takes about 5m 00s at 18 tok/s here"
    assert wait_sentence(5400, None) == ""  # never measured: no guess
    assert wait_sentence(500, 18.0) == ""


def test_before_sending_a_long_text_the_fit_line_says_how_long_reading_takes(
        qtbot, window) -> None:
    c = window.controller
    c.new_session("q8")
    c.store.set_prefill_rate(c.model_id, 20.0)
    window.composer.set_text("word " * 3000)
    window.fit.run()
    prompt, _ = window.fit.prompt_tokens()
    assert prompt >= 2048
    assert wait_sentence(prompt, 20.0) in window.composer.fit.text()


def test_a_long_read_records_the_prefill_rate_for_the_loaded_model(qtbot, window) -> None:
    c = window.controller
    assert c.prefill_rate() is None
    assert send_and_wait(qtbot, window, "word " * 400) == "complete"
    assert c.prefill_rate() is not None and c.prefill_rate() > 0
    assert c.store.prefill_rate("another model") is None
