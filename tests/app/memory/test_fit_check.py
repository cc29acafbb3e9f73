"""The fit line above the composer."""

from __future__ import annotations

from types import SimpleNamespace

from app.memory.fit_check import fit_html


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
