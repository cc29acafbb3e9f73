"""A model split across machines: the panel's row per machine and the pool's fit."""

from __future__ import annotations

from dataclasses import replace

from app.format import human_bytes, short_tokens
from app.memory.fit_check import fit_html
from app.memory.panel import MemoryPanel
from app.sessions.caches import KvTotal
from engine.cache.modes import MODES
from engine.events import RankShare
from engine.memory.fit import fit_report
from engine.memory.stats import MemoryUsage, stats_sample

NOTHING = KvTotal(0, 0)  # no chat holds pages

GIB = 2**30
CONTEXT = 8192
# Rank 0 holds the whole context in every mode; the small machine far less in q8.
RANKS = (
    RankShare(0, "mac-studio", (12, 24), 3 << 20, 24, 20 * GIB, (CONTEXT,) * len(MODES)),
    RankShare(1, "macbook-air", (0, 12), 3 << 20, 24, 2 * GIB, (1500, 3000, 4000, 6000)),
)


def _sample(ranks: tuple[RankShare, ...], session: str = "s1"):
    plain = stats_sample(session, None, MemoryUsage(1, 2, 3, 4, 16 * GIB, 8 * GIB, 50.0, 0, None))
    return replace(plain, kv_mode="q8", tokens_in_context=300, kv_bytes_used=6 << 20,
                   kv_bytes_allocated=8 << 20, pages_allocated=64,
                   pages_in_use=48, ranks=ranks)


def _report(tokens: int, ranks: tuple[RankShare, ...] = RANKS):
    report = fit_report(token_count=tokens, attention_layers=2, kv_heads=2, head_dim=64,
                        max_context=CONTEXT, page_size=16, available_bytes=16 * GIB,
                        session_mode="q8")
    return replace(report, ranks=ranks)


def test_the_panel_has_a_row_per_machine_only_for_a_split_model(qtbot) -> None:
    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.show()
    panel.set_session("Notes", "q8", "held", "s1")
    panel.update_sample(_sample(()), NOTHING)
    assert not panel.machines_label.isVisible() and not panel.machines_heading.isVisible()
    panel.update_sample(_sample(RANKS[:1]), NOTHING)  # one machine is no list of machines
    assert not panel.machines_label.isVisible()

    panel.update_sample(_sample(RANKS), NOTHING)
    assert panel.machines_label.isVisible() and panel.machines_heading.isVisible()
    rows = panel.machines_label.text().split("<br>")
    assert len(rows) == 2
    for row, share in zip(rows, RANKS, strict=True):
        first, end = share.layers
        assert f"<b>{share.host}</b>" in row and f"layers {first}–{end - 1}" in row
        assert f"{human_bytes(share.kv_bytes)} in {share.pages_in_use:,} pages" in row
        assert f"{human_bytes(share.free_bytes)} free" in row
    # Another chat's sample leaves the shown chat's machines; another chat shown clears them.
    panel.update_sample(_sample((), session="s2"), NOTHING)
    assert panel.machines_label.isVisible()
    panel.set_session("Other", "q8", "held", "s2")
    assert not panel.machines_label.isVisible()


def test_the_projection_is_the_machines_together_and_names_the_tight_one(qtbot) -> None:
    panel = MemoryPanel()
    qtbot.addWidget(panel)
    panel.set_session("Notes", "q8", "held", "s1")
    panel.update_projection(_report(300), _report(CONTEXT))
    assert panel.fits_label.text() == (
        "Fits in the free memory of 2 machines: 3,000 of 8,192 tokens in q8. "
        "The tight one: macbook-air.")
    # The "Fits" column is the tightest machine's, per mode.
    for row, mode in enumerate(MODES):
        expected = RANKS[1].tokens_in(mode)
        assert panel.table.item(row, 2).text() == short_tokens(expected)
    # On one machine the sentence is this machine's own, as before.
    panel.update_projection(_report(300, ()), _report(CONTEXT, ()))
    assert panel.fits_label.text() == (
        "Fits in free memory: the whole context (8,192 tokens) in q8.")


def test_the_fit_line_says_what_the_machines_hold_and_which_one_is_short() -> None:
    html, ok = fit_html(_report(1000), "q8", 1000)
    assert ok
    assert ("On 2 machines: 3,000 tokens fit in q8 · macbook-air is the tight one "
            f"({human_bytes(2 * GIB)} free there)") in html
    # Rank 0 holds it, the small machine does not: the line says which machine.
    html, ok = fit_html(_report(4000), "q8", 4000)
    assert not ok and html.startswith("⚠")
    assert ("This won't fit in q8: rank 1 (macbook-air) holds only 3,000 tokens for its "
            "layers.") in html
    # Every machine holds the whole context: no machine is named.
    roomy = tuple(replace(share, tokens_fit=(CONTEXT,) * len(MODES)) for share in RANKS)
    html, ok = fit_html(_report(4000, roomy), "q8", 4000)
    assert ok and "tight" not in html and "On 2 machines: 8,192 tokens fit in q8" in html
    # One machine: nothing about machines.
    assert "machines" not in fit_html(_report(1000, ()), "q8", 1000)[0]
