"""FitReport arithmetic: context, page budget and RAM limits per KV mode."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load

from engine.cache import kvquant
from engine.cache.pages import PREFILL_SCRATCH_BYTES, PageLayout
from engine.errors import ContextTooLong, MemoryShort, UnsupportedModeError
from engine.memory.fit import (
    MODES,
    FitInputs,
    ModelFacts,
    PrefillFacts,
    fit_report,
    prefill_facts,
    without,
)
from engine.memory.guard import BudgetView, Hold, MemoryGuard, MemoryReading
from engine.session.session import Session
from tests.engine.tinymodels import loaded_for_session, make_tiny_model_dir

GIB = 2**30
MIB = 2**20
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
    # Held in memory: 256 one-byte codes and two scales and biases a row, K and V.
    assert report.for_mode("q8").bytes_needed == 16 * 4 * 1024 * 528


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
    # Free RAM less the copy a layer's storage makes as it grows (512 MiB in fp16 at
    # 262k), which the guard keeps free of pages.
    growth = PageLayout("fp16", 256, 4, 256).part_bytes(262_144)
    assert growth == 512 * MIB
    page = kvquant.project_kv_bytes(16, 4, 256, 256, "fp16")
    assert fp16.tokens_fit_ram == (7 * GIB - growth) // page * 256
    with pytest.raises(ContextTooLong, match="q6") as error:
        report.raise_if_too_long()
    assert "262,144" in str(error.value) and f"{fp16.tokens_fit:,}" in str(error.value)


def test_a_prompt_short_of_memory_is_not_one_past_the_models_context() -> None:
    """The app sets a turn aside for good only when no memory could hold it: the
    error says which limit binds."""
    short = _report(token_count=262_144, available_bytes=7 * GIB, session_mode="fp16")
    assert type(short.error()) is MemoryShort
    past = _report(token_count=262_145, available_bytes=64 * GIB, session_mode="q4")
    assert type(past.error()) is ContextTooLong and "No KV mode" in str(past.error())
    with pytest.raises(MemoryShort):
        short.raise_if_too_long()


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


def test_a_mode_the_report_does_not_project_is_an_engine_error() -> None:
    report = _report(token_count=10, session_mode="q8")
    assert report.session_mode == "q8" and report.for_mode("q4").mode == "q4"
    with pytest.raises(UnsupportedModeError, match="int4"):
        report.for_mode("int4")


# -- the prefill peak ----------------------------------------------------------------

PREFILL = PrefillFacts(weights_bytes=14 * GIB, activation_bytes_per_token=160 * 1024,
                       scratch_bytes=256 * MIB)


def test_prefill_peak_is_weights_kv_scratch_and_one_chunks_activations() -> None:
    report = _report(token_count=131_072, prefill=PREFILL, chunk_tokens=512, session_mode="q6")
    transient = 256 * MIB + 512 * 160 * 1024
    assert report.transient_bytes == transient
    for mode in MODES:
        entry = report.for_mode(mode)
        assert entry.prefill_peak_bytes == 14 * GIB + entry.bytes_needed + transient
    assert report.prefill_peak_bytes == report.for_mode("q6").prefill_peak_bytes
    pages_only = _report(token_count=131_072, session_mode="q6")
    assert pages_only.prefill_peak_bytes == 0
    # Without reading, what growing a layer's storage holds for a moment stays.
    assert pages_only.transient_bytes == PageLayout("q6", 256, 4, 256).part_bytes(262_144)


def test_the_prefill_transient_must_fit_free_ram_beside_the_pages() -> None:
    # q6 at 262k needs 6.25 GiB of pages: 6.5 GiB free holds them and the 192 MiB a
    # layer's storage takes as it grows, but not once one prefill chunk needs 512 MiB
    # (256 MiB scratch, 256 tokens of 1 MiB) beside them.
    available = int(6.5 * GIB)
    assert _report(token_count=262_144, available_bytes=available, session_mode="q6").fits
    chunk = PrefillFacts(weights_bytes=0, activation_bytes_per_token=MIB, scratch_bytes=256 * MIB)
    report = _report(token_count=262_144, available_bytes=available, session_mode="q6",
                     prefill=chunk, chunk_tokens=256)
    assert not report.fits and report.suggested_mode == "q4"
    page = kvquant.project_kv_bytes(16, 4, 256, 256, "q6")
    assert report.for_mode("q6").tokens_fit_ram == (available - 512 * MIB) // page * 256
    assert "after the safety headroom and 512.0 MB for reading it in" in report.message()


def test_a_batchs_decode_step_takes_what_it_needs_past_a_chunks_transient() -> None:
    # A row's step needs 257 MiB (its activations, and its scratch counted as the
    # whole budget where the heads are unknown): one row's fits in the chunk's
    # 512 MiB kept free already; four rows take 516 MiB more.
    chunk = PrefillFacts(weights_bytes=0, activation_bytes_per_token=MIB, scratch_bytes=256 * MIB)
    args = {"token_count": 4096, "available_bytes": 8 * GIB, "prefill": chunk,
            "chunk_tokens": 256}
    alone = _report(**args)
    assert chunk.step_transient_bytes(1) == 257 * MIB
    assert _report(**args, decode_rows=1).free_bytes == alone.free_bytes
    assert _report(**args, decode_rows=4).free_bytes == alone.free_bytes - 516 * MIB
    # Never below nothing: forty rows need more than is free.
    assert _report(**args, decode_rows=40).free_bytes == 0


@pytest.fixture(scope="module")
def wide_llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, SimpleNamespace]:
    # Wide enough that the MLP's activations, not per-call overhead, dominate a chunk.
    folder = make_tiny_model_dir(tmp_path_factory.mktemp("fit-models"), "llama",
                                 hidden_size=256, intermediate_size=1024)
    model, tokenizer = load(str(folder))
    return folder, SimpleNamespace(model=model, tokenizer=tokenizer,
                                   info=SimpleNamespace(max_context=4096))


def test_prefill_facts_count_every_weight_and_the_compute_width(wide_llama) -> None:
    folder, loaded = wide_llama
    facts = prefill_facts(loaded.model, compute_bytes=4)
    stored = (folder / "model.safetensors").stat().st_size  # float32 weights plus a header
    assert 0 < stored - facts.weights_bytes < 64 * 1024
    assert facts.weights_bytes == sum(a.nbytes for _, a in tree_flatten(loaded.model.parameters()))
    assert prefill_facts(loaded.model, compute_bytes=2).activation_bytes_per_token * 2 == \
        facts.activation_bytes_per_token


def test_a_real_chunk_stays_within_the_predicted_transient(wide_llama) -> None:
    _, loaded = wide_llama
    chunk = 256
    session = Session("s", loaded, "fp16", chunk_size=chunk)
    # The attention's own block arithmetic: a first chunk's block is the chunk itself,
    # far under the 256 MiB budget at this size.
    scratch = session.prefill_facts.scratch_for(chunk, context=chunk)
    assert scratch < session.prefill_facts.scratch_for(chunk) < PREFILL_SCRATCH_BYTES
    ids = [(7 * i) % 300 + 3 for i in range(chunk)]
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    session.prefill(ids, request_id=0, cancel=threading.Event(), emit=lambda e: None,
                    tick=lambda: None)
    measured = mx.get_peak_memory() - before
    pages = session.stats().bytes_allocated  # the storage, as allocated
    predicted = scratch + chunk * session.prefill_facts.activation_bytes_per_token + pages
    # An upper bound, and not a wild one.
    assert measured <= predicted <= 3 * measured


def test_a_session_counts_the_scratch_budget_its_attention_keeps(wide_llama) -> None:
    _, loaded = wide_llama
    session = Session("s", loaded, "q8")
    pool = next(layer.pool for layer in session.cache if hasattr(layer, "pool"))
    assert session.prefill_facts.scratch_bytes == pool.scratch_bytes == PREFILL_SCRATCH_BYTES
    assert Session("e", loaded, "q8", scratch_bytes=MIB).prefill_facts.scratch_bytes == MIB


def test_the_default_stream_limit_is_what_free_memory_holds_of_8k_conversations() -> None:
    from engine.memory.fit import MOST_STREAMS, STREAM_CONTEXT, default_streams

    facts = PrefillFacts(weights_bytes=0, activation_bytes_per_token=MIB, scratch_bytes=MIB,
                         vocab_size=1000)
    per_token = 25_600  # the seed's model in q6: 16 layers x 4 heads x 400 B
    one = per_token * STREAM_CONTEXT + facts.step_transient_bytes(1)
    assert default_streams(per_token, facts, 3 * one + one // 2) == 3
    assert default_streams(per_token, facts, one // 2) == 1  # one always runs
    assert default_streams(per_token, facts, 100 * one) == MOST_STREAMS


def test_without_frees_the_pages_of_sessions_set_aside_and_keeps_their_reserves() -> None:
    holds = (Hold("asking", 1, 10 * MIB, 0),
             Hold("idle", 2, 40 * MIB, 5 * MIB),  # pages of its own, and a reserve
             Hold("lender", 3, 30 * MIB, 0),      # pages shared with "borrower"
             Hold("borrower", 3, 30 * MIB, 0))
    facts = ModelFacts(attention_layers=16, kv_heads=4, head_dim=256, max_context=262_144)
    inputs = FitInputs(facts, 256, BudgetView(200 * MIB, GIB, holds), session_id="asking")
    reading = MemoryReading(16 * GIB, 8 * GIB)
    before = inputs.budget.kv_share("asking")
    assert before == 200 * MIB - 75 * MIB
    # Its pages go back, its reserve stays: the session stays open.
    after, freed = without(inputs, reading, {"idle"})
    assert after.budget.kv_share("asking") == before + 40 * MIB
    assert freed.available_bytes == reading.available_bytes + 40 * MIB
    # Pages another session still holds are not freed; once both go, they are.
    assert without(inputs, reading, {"lender"})[0].budget.kv_share("asking") == before
    both = without(inputs, reading, {"lender", "borrower"})[0]
    assert both.budget.kv_share("asking") == before + 30 * MIB
    # The asking session never counts itself gone.
    assert without(inputs, reading, {"asking"}) == (inputs, reading)


def test_the_tokens_a_fit_check_promises_the_pools_limit_holds(tmp_path) -> None:
    # A long context (fp16 storage's growth copy at 262k tokens outweighs a chunk's
    # transient here) on a machine with little free memory.
    loaded = loaded_for_session(make_tiny_model_dir(tmp_path, "llama"), max_context=262_144)
    free = [2 * GIB]
    guard = MemoryGuard(headroom_bytes=0,
                        probe=lambda: MemoryReading(64 * GIB, free[0]))
    session = Session("s", loaded, "fp16", page_size=256, guard=guard, scratch_bytes=16 * MIB)
    pool = session.page_pool()
    assert pool is not None
    assert pool.growth_transient_bytes(262_144) > session.prefill_facts.transient_bytes(
        session.chunk_size)
    free[0] = 100 * MIB
    guard.refresh("s")
    promised = session.fit_report(1).for_mode("fp16").tokens_fit
    assert session.holds(promised)
    pool.ensure(promised)  # what the check said fits, the pages take
