"""Sliding windows and linear-attention state: bounded, and kept in the KV budget."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from mlx_lm.utils import load

from engine.cache import other_layers
from engine.cache.paged_cache import PagedKVCache
from engine.models.loader import load_model
from engine.session import checkpoints
from engine.session.prefill import activation_value_bytes
from engine.session.session import Session, new_chat_outside_pages
from tests.engine.tinymodels import TINY_SLIDING_WINDOW, make_tiny_model_dir

MIB = 2**20
CHUNK = 32


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SimpleNamespace]:
    root = tmp_path_factory.mktemp("other-layer-models")
    loaded = {}
    for arch in ("gemma3_text", "qwen3_next"):
        model, tokenizer = load(str(make_tiny_model_dir(root, arch)))
        loaded[arch] = SimpleNamespace(model=model, tokenizer=tokenizer,
                                       info=SimpleNamespace(max_context=4096))
    return loaded


def _session(loaded: SimpleNamespace, budget: int | None = None) -> Session:
    return Session("s", loaded, "q8", page_size=16, chunk_size=CHUNK, budget_bytes=budget)


def _feed(session: Session, tokens: int) -> None:
    ids = [(7 * i) % 200 + 3 for i in range(tokens)]
    session.prefill(ids, request_id=0, cancel=threading.Event(), emit=lambda e: None,
                    tick=lambda: None)


def _unpaged(session: Session) -> list:
    return [c for c in session.cache if not isinstance(c, PagedKVCache)]


def test_sliding_windows_are_bounded_by_window_and_chunk_from_the_start(models) -> None:
    session = _session(models["gemma3_text"])
    windows = _unpaged(session)
    facts = session.facts
    row = 2 * facts.kv_heads * facts.head_dim * activation_value_bytes()
    expected = len(windows) * (TINY_SLIDING_WINDOW + CHUNK - 1) * row
    before = session.other_layers()
    assert before == other_layers.OtherLayers(expected, other_layers.SLIDING,
                                              checkpoints.MAX_KEPT) and windows
    _feed(session, 5 * TINY_SLIDING_WINDOW)  # wraps every window
    held = session.stats().other_bytes
    assert 0 < held <= session.other_layers().bound_bytes == expected


def test_linear_attention_state_counts_its_fixed_size_once_made(models) -> None:
    session = _session(models["qwen3_next"])  # loaded without the probe: size unknown
    assert session.other_layers() == other_layers.OtherLayers(0, other_layers.LINEAR,
                                                              checkpoints.MAX_KEPT)
    _feed(session, 40)
    made = session.other_layers().bound_bytes
    assert made == session.stats().other_bytes > 0
    _feed(session, 40)  # the state does not grow with the context
    assert session.other_layers().bound_bytes == made


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_next"])
def test_the_kv_budget_keeps_their_bound_beside_the_pages(models, arch: str) -> None:
    budget = 4 * MIB
    session = _session(models[arch], budget)
    _feed(session, 40)
    reserved = session.other_layers().reserve_bytes
    assert reserved == (1 + checkpoints.MAX_KEPT) * session.other_layers().bound_bytes > 0
    pool = next(c.pool for c in session.cache if isinstance(c, PagedKVCache))
    assert session.guard.refresh(session.session_id) == pool.budget_bytes == budget - reserved
    assert session.fit_report(100).budget_bytes == budget - reserved
    # Another chat sharing the guard sees this one's reserve as held.
    assert session.guard.kv_share("other") == budget - pool.bytes_allocated - reserved


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_next"])
def test_the_reserve_holds_the_layers_and_every_checkpoint_a_chat_keeps(
        tmp_path, arch: str) -> None:
    """A chat of several messages keeps a checkpoint at each of the last boundaries:
    whole copies of its windows or state, which the reserve counts, from before the
    first token (the probe measured the linear state) and for a chat not opened yet."""
    loaded = load_model(make_tiny_model_dir(tmp_path, arch))
    session = Session("s", loaded, "q8", page_size=16, chunk_size=CHUNK)
    fresh = session.other_layers()
    assert fresh.bound_bytes > 0
    assert new_chat_outside_pages(loaded, CHUNK) == fresh
    ids = [(7 * i) % 200 + 3 for i in range(5 * TINY_SLIDING_WINDOW)]
    # A long first message, then short ones: its end is kept beside the newest.
    session.prefill(ids, request_id=0, cancel=threading.Event(), emit=lambda e: None,
                    tick=lambda: None, boundaries=[40, 50, 60, 70])
    assert len(session.checkpoints.kept) == checkpoints.MAX_KEPT
    held = session.stats().other_bytes + session.checkpoints.nbytes
    assert session.other_layers() == fresh  # the bound did not move as they filled
    assert 2 * fresh.bound_bytes < held <= fresh.reserve_bytes


@pytest.mark.parametrize("arch", ["gemma3_text", "qwen3_next", "llama"])
def test_config_facts_give_what_a_loaded_model_reserves_outside_its_pages(
        tmp_path, arch: str) -> None:
    """The Models dialog's reserve from config.json alone (a model not loaded, or not
    downloaded) is what a loaded model's new chat reserves, at the same bytes per
    activation (a Mac's 16 bits in the dialog; the CPU here computes in 32)."""
    from engine.cache.outside import MAC_VALUE_BYTES
    from engine.models.info import inspect_model_dir
    from engine.session.session import DEFAULT_CHUNK, outside_pages_reserve

    folder = make_tiny_model_dir(tmp_path, arch, dtype="bfloat16")
    outside = inspect_model_dir(folder).outside
    reserve = new_chat_outside_pages(load_model(folder), DEFAULT_CHUNK).reserve_bytes
    assert outside_pages_reserve(outside, activation_value_bytes()) == reserve
    assert (reserve > 0) is (arch != "llama")
    assert outside_pages_reserve(outside) == outside_pages_reserve(
        outside, MAC_VALUE_BYTES)
