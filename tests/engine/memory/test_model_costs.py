"""The full-context KV cost rule: each mode, its bytes, whether the model then fits."""

from __future__ import annotations

from engine.cache.kvquant import project_kv_bytes
from engine.memory.guard import default_headroom
from engine.memory.model_costs import full_context_costs, reading_reserve

GIB = 2**30


def test_each_mode_costs_what_the_page_format_stores() -> None:
    costs = full_context_costs(attention_layers=36, kv_heads=8, head_dim=128,
                               max_context=262_144, weights_bytes=0,
                               total_ram_bytes=1024 * GIB)
    assert [c.mode for c in costs] == ["fp16", "q8", "q6", "q4"]
    for cost in costs:
        assert cost.kv_bytes == project_kv_bytes(36, 8, 128, 262_144, cost.mode)
        assert cost.fits
    assert costs[0].kv_bytes > costs[1].kv_bytes > costs[2].kv_bytes > costs[3].kv_bytes


def test_fits_counts_the_weights_the_headroom_and_the_reading_reserve() -> None:
    kv_q8 = project_kv_bytes(4, 2, 64, 8192, "q8")
    total = 64 * GIB
    room = total - default_headroom(total) - reading_reserve(2, 64, 8192, "q8")
    exactly = full_context_costs(attention_layers=4, kv_heads=2, head_dim=64, max_context=8192,
                                 weights_bytes=room - kv_q8, total_ram_bytes=total)
    over = full_context_costs(attention_layers=4, kv_heads=2, head_dim=64, max_context=8192,
                              weights_bytes=room - kv_q8 + 1, total_ram_bytes=total)
    assert [c.fits for c in exactly] == [False, True, True, True]
    assert [c.fits for c in over] == [False, False, True, True]


def test_the_reading_reserve_is_what_the_fit_check_keeps_free_beside_the_pages() -> None:
    """A chunk's scratch budget for a short context; at the seed's 262k in fp16,
    the copy a layer's storage makes as it grows, larger than that budget."""
    from engine.cache.pages import PREFILL_SCRATCH_BYTES
    from engine.memory.fit import fit_report

    for tokens in (8192, 262_144):
        report = fit_report(token_count=tokens, attention_layers=16, kv_heads=4, head_dim=256,
                            max_context=tokens, page_size=256, available_bytes=64 * GIB,
                            session_mode="q8")
        assert reading_reserve(4, 256, tokens, "q8") == max(report.transient_bytes,
                                                            PREFILL_SCRATCH_BYTES)
    assert reading_reserve(4, 256, 262_144, "fp16") > PREFILL_SCRATCH_BYTES


def test_a_head_size_q6_cannot_pack_has_no_q6_cost() -> None:
    costs = {c.mode: c for c in full_context_costs(
        attention_layers=2, kv_heads=2, head_dim=30, max_context=1024, weights_bytes=0,
        total_ram_bytes=64 * GIB)}
    assert costs["q6"].kv_bytes is None and not costs["q6"].fits
    assert costs["q8"].kv_bytes is not None


def test_a_mode_that_does_not_fit_says_how_much_context_would() -> None:
    from engine.memory.model_costs import FIT_STEP

    weights, ram = 10 * 2**30, 24 * 2**30
    costs = {c.mode: c for c in full_context_costs(
        attention_layers=48, kv_heads=8, head_dim=128, max_context=262_144,
        weights_bytes=weights, total_ram_bytes=ram)}
    q4 = costs["q4"]
    assert not q4.fits and 0 < q4.tokens_fit < 262_144 and q4.tokens_fit % FIT_STEP == 0
    room = ram - default_headroom(ram) - weights
    at, past = q4.tokens_fit, q4.tokens_fit + FIT_STEP
    assert project_kv_bytes(48, 8, 128, at, "q4") + reading_reserve(8, 128, at, "q4") <= room
    assert project_kv_bytes(48, 8, 128, past, "q4") + reading_reserve(8, 128, past, "q4") > room
    assert costs["fp16"].tokens_fit < costs["q8"].tokens_fit < q4.tokens_fit
    tiny = full_context_costs(attention_layers=2, kv_heads=1, head_dim=64, max_context=4096,
                              weights_bytes=weights, total_ram_bytes=ram)
    assert all(c.fits and c.tokens_fit == 4096 for c in tiny)


def test_the_room_counts_what_the_layers_outside_the_pages_reserve() -> None:
    """A sliding-window or hybrid model's windows and linear state (and the
    checkpoints a chat keeps of them) take room the KV pages cannot have: the verdict
    the Models dialog gives must be the one the engine's fit check gives."""
    kv_q8 = project_kv_bytes(4, 2, 64, 8192, "q8")
    total = 64 * GIB
    room = total - default_headroom(total) - reading_reserve(2, 64, 8192, "q8")
    outside = 3 * GIB
    exactly = full_context_costs(attention_layers=4, kv_heads=2, head_dim=64, max_context=8192,
                                 weights_bytes=room - kv_q8 - outside, total_ram_bytes=total,
                                 outside_pages_bytes=outside)
    over = full_context_costs(attention_layers=4, kv_heads=2, head_dim=64, max_context=8192,
                              weights_bytes=room - kv_q8 - outside + 1, total_ram_bytes=total,
                              outside_pages_bytes=outside)
    assert exactly[1].fits and not over[1].fits
