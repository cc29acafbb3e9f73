"""Model facts as the picker and the Models dialog show them."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from app.format import short_tokens
from app.window.model_library import cost_text, installed_entry, library
from engine import RECOMMENDED_MODELS, ModeCost, outside_pages_reserve
from engine.models.discovery import inspect_candidate
from tests.engine.tinymodels import make_tiny_model_dir

GIB = 2**30


def test_short_tokens() -> None:
    assert [short_tokens(n) for n in (262_144, 131_072, 8192, 4096, 500)] == [
        "262k", "131k", "8.1k", "4k", "500"]


def test_cost_text_says_what_fits() -> None:
    assert cost_text(ModeCost("q6", int(6.1 * GIB), True), 262_144) == "262k in q6: 6.1 GB — fits"
    assert cost_text(ModeCost("fp16", 40 * GIB, False), 262_144) == (
        "262k in fp16: 40.0 GB — too big for this machine's RAM")
    assert "not possible" in cost_text(ModeCost("q6", None, False), 8192)


def test_recommended_models_leave_the_list_once_downloaded() -> None:
    installed, wanted = library([], total_ram=16 * GIB)
    assert installed == []
    assert [e.repo_id for e in wanted] == [m.repo_id for m in RECOMMENDED_MODELS]
    small = next(e for e in wanted if "Qwen3-4B" in e.name)
    assert not small.downloaded and small.size_text().startswith("≈ ")
    assert [c.mode for c in small.costs] == ["fp16", "q8", "q6", "q4"]
    # 16 GB: Qwen3 4B holds its 262k context in q4 only.
    assert [c.fits for c in small.costs] == [False, False, False, True]

    first = RECOMMENDED_MODELS[0]
    info = SimpleNamespace(attention_layers=first.attention_layers, kv_heads=first.kv_heads,
                           head_dim=first.head_dim, max_context=first.max_context,
                           outside=first.outside)
    found = SimpleNamespace(name=first.repo_id, path="/models/x", size_bytes=GIB,
                            weights_bytes=GIB, info=info)
    installed, wanted = library([found], total_ram=16 * GIB)
    assert [(e.name, e.path, e.size_text()) for e in installed] == [
        (first.repo_id, "/models/x", "1.0 GB")]
    assert first.repo_id not in [e.repo_id for e in wanted]


def test_files_beside_the_weights_do_not_count_as_weights(tmp_path: Path) -> None:
    """A download that kept the original checkpoint (or a .gguf) beside the MLX weights
    takes that room on disk, not in memory: the fit is the weights' alone."""
    folder = make_tiny_model_dir(tmp_path, "llama")
    alone = installed_entry(inspect_candidate("tiny", folder), total_ram=16 * GIB)
    (folder / "original").mkdir()
    with open(folder / "original" / "consolidated.00.pth", "wb") as checkpoint:
        checkpoint.truncate(14 * GIB)  # sparse: no room taken here
    found = inspect_candidate("tiny", folder)
    beside = installed_entry(found, total_ram=16 * GIB)
    assert found.size_bytes > 14 * GIB  # what the disk holds, as the size says
    assert beside.costs == alone.costs


def test_a_models_windows_and_their_checkpoints_take_room_from_its_context(
        tmp_path: Path) -> None:
    """A sliding-window model's verdict counts what its windows reserve beside the
    pages, as the engine's fit check does once it loads (before, the dialog said
    more context fitted than a chat could then read)."""
    from engine.memory.model_costs import full_context_costs

    folder = make_tiny_model_dir(tmp_path, "gemma3_text", sliding_window=1 << 20)
    found = inspect_candidate("tiny", folder)
    reserve = outside_pages_reserve(found.info.outside)
    assert reserve > GIB // 4
    info = found.info
    ram = 4 * GIB  # the headroom (2 GiB) and the reading reserve leave little beside
    entry = installed_entry(found, total_ram=ram)
    unreserved = full_context_costs(
        attention_layers=info.attention_layers, kv_heads=info.kv_heads,
        head_dim=info.head_dim, max_context=info.max_context,
        weights_bytes=found.weights_bytes, total_ram_bytes=ram)
    assert [c.tokens_fit for c in entry.costs] < [c.tokens_fit for c in unreserved]
    assert entry.costs == full_context_costs(
        attention_layers=info.attention_layers, kv_heads=info.kv_heads,
        head_dim=info.head_dim, max_context=info.max_context,
        weights_bytes=found.weights_bytes, total_ram_bytes=ram, outside_pages_bytes=reserve)
    qwen3_next = next(m for m in RECOMMENDED_MODELS if "Qwen3-Next" in m.repo_id)
    assert outside_pages_reserve(qwen3_next.outside) > 0
