"""FitReport arithmetic: context, page budget and RAM limits per KV mode."""

from __future__ import annotations

import pytest

from engine.cache import kvquant
from engine.errors import ContextTooLong
from engine.fit import MODES, fit_report

GIB = 2**30
# A 16-layer, 4-KV-head, head_dim 256 model at 256 tokens per page.
MODEL = {"attention_layers": 16, "kv_heads": 4, "head_dim": 256, "page_size": 256}


def _report(**kwargs):
    args = {"max_context": 262_144, "available_bytes": 64 * GIB, **MODEL, **kwargs}
    return fit_report(**args)


def test_bytes_needed_follow_kvquant_rounded_to_pages() -> None:
    report = _report(token_count=1000)
    for mode in MODES:
        expected = kvquant.project_kv_bytes(16, 4, 256, 1024, mode)  # 4 whole pages
        assert report.for_mode(mode).bytes_needed == expected
    assert report.for_mode("q8").bytes_needed == 16 * 4 * 1024 * 516


def test_everything_fits_when_small() -> None:
    report = _report(token_count=4096, session_mode="q6")
    assert report.fits and report.suggested_mode == "fp16"
    report.raise_if_too_long()


def test_full_context_in_ram_suggests_the_best_mode_that_fits() -> None:
    # fp16 at 262k needs 16 GiB, q8 ~8.06 GiB, q6 ~6.06 GiB, q4 ~4.06 GiB.
    report = _report(token_count=262_144, available_bytes=7 * GIB, session_mode="fp16")
    assert [report.for_mode(m).fits for m in MODES] == [False, False, True, True]
    assert not report.fits and report.suggested_mode == "q6"
    fp16 = report.for_mode("fp16")
    assert fp16.tokens_fit_ram == 7 * GIB // kvquant.project_kv_bytes(16, 4, 256, 256, "fp16") * 256
    with pytest.raises(ContextTooLong, match="q6") as error:
        report.raise_if_too_long()
    assert "262,144" in str(error.value) and f"{fp16.tokens_fit:,}" in str(error.value)


def test_headroom_and_held_bytes_shift_the_ram_limit() -> None:
    held = kvquant.project_kv_bytes(16, 4, 256, 256, "q8")
    base = _report(token_count=10, available_bytes=GIB, session_mode="q8")
    less = _report(token_count=10, available_bytes=GIB, headroom_bytes=GIB // 2, session_mode="q8")
    more = _report(token_count=10, available_bytes=GIB, session_mode="q8",
                   session_bytes_allocated=held)
    q8 = [r.for_mode("q8").tokens_fit_ram for r in (base, less, more)]
    assert q8[1] < q8[0] < q8[2] and q8[2] - q8[0] == 256


def test_context_limit_cannot_be_fixed_by_a_mode() -> None:
    report = _report(token_count=9000, max_context=8192, session_mode="q4")
    assert not report.fits and report.suggested_mode is None
    assert all(m.tokens_fit == 8192 for m in report.modes)
    message = report.message()
    assert "9,000" in message and "8,192" in message and "shorten" in message


def test_page_budget_limits_tokens() -> None:
    budget = kvquant.project_kv_bytes(16, 4, 256, 256 * 10, "q4")  # ten q4 pages
    report = _report(token_count=2000, budget_bytes=budget, session_mode="q8")
    assert report.for_mode("q4").tokens_fit == 2560 and report.for_mode("q4").fits
    assert not report.for_mode("q8").fits_budget
    assert report.suggested_mode == "q4"
    assert "budget" in report.message() and "q4" in report.message()


def test_q6_unsupported_head_dim_is_reported_not_raised() -> None:
    report = _report(token_count=100, head_dim=66)
    assert not report.for_mode("q6").supported and not report.for_mode("q6").fits
    assert report.for_mode("q8").fits


def test_aliases_are_accepted() -> None:
    report = _report(token_count=10, session_mode="8bit")
    assert report.session_mode == "q8" and report.for_mode("int4").mode == "q4"
