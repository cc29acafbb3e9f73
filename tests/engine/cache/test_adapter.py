"""The paged cache inside mlx-lm's own models: logits, trim, restore, budget, stats.

Every arch runs a three-chunk prefill (page size 16, so many pages and a partial
last page) and then 20 decode steps, comparing the last-position logits at every
step. Random tiny models have near-ties, so logits are compared, never argmax.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models import base as mlx_base
from mlx_lm.models import llama
from mlx_lm.models.cache import (
    ArraysCache,
    KVCache,
    RotatingKVCache,
    make_prompt_cache,
    trim_prompt_cache,
)

from engine.cache import adapter, kvquant
from engine.cache.paged_cache import PagedKVCache
from engine.errors import KvBudgetExceeded, ModelLoadError, UnsupportedModeError
from tests.engine.tinymodels import ARCHS, load_tiny

CHUNKS = (40, 33, 17)
DECODE_STEPS = 20
PAGE_SIZE = 16

# Measured (CPU, float32 tiny models, this file's prompt and steps): the paged
# cache against a reference that stores the same rounded/quantized rows and attends
# them all, the new chunk's own included, differs by 0 (fp16) to 8e-6 in any logit, except
# where float32 noise of ~1e-7 in a new row flips one rounding decision of the
# quantizer (q8: 2.8e-4 on qwen3, 2.5e-4 on gemma3_text, ~1-2% of q8's own error).
# Allowed: 5e-5, or 5% of the mode's error against mlx-lm.
SAME_ROWS_TOLERANCE = 5e-5
SAME_ROWS_SHARE = 0.05
# fp16 pages against mlx-lm's float32 KVCache, max |logit error| / max |logit|:
# 0.007% llama, 0.012% qwen3, 0.010% qwen3_next, 0.10% gemma3_text (its q/k norms
# make scores peaked). Bound: 0.2%.
FP16_RELATIVE_BOUND = 2e-3
# q8 against the same: 0.19% llama, 0.36% qwen3, 1.08% qwen3_next, 1.77% gemma3_text.
# (q6: 1.1-6.5%, q4: 3.3-37%.) Bound: 3%.
Q8_RELATIVE_BOUND = 3e-2


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("adapter-models")
    return {arch: load_tiny(root, arch)[0] for arch in ARCHS}


class StoredRowsKVCache(KVCache):
    """mlx-lm's KVCache holding rows as the paged cache stores them (reference).

    Every row comes back stored (rounded or quantized), the new chunk's own
    included, exactly as the paged attention reads them.
    """

    def __init__(self, mode: str) -> None:
        super().__init__()
        # Not "bits": mlx-lm's attention takes a cache with .bits for its own quantized one.
        self.width = kvquant.bits_for(mode)

    def _stored(self, x: mx.array) -> mx.array:
        codes, scales = kvquant.quantize_rows(x, self.width)
        return kvquant.dequantize_rows(codes, scales, self.width, x.shape[-1], x.dtype)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        return super().update_and_fetch(self._stored(keys), self._stored(values))


def _reference_cache(model: Any, mode: str) -> list[Any]:
    cache = make_prompt_cache(model)
    return [StoredRowsKVCache(mode) if type(c) is KVCache else c for c in cache]


def _prompt(model: Any, length: int = sum(CHUNKS), seed: int = 1) -> mx.array:
    return mx.random.randint(0, model.args.vocab_size, (1, length), key=mx.random.key(seed))


def _decode_token(model: Any, step: int) -> mx.array:
    return mx.array([[(step * 37 + 11) % model.args.vocab_size]])


def _run(model: Any, cache: list[Any], steps: int = DECODE_STEPS) -> np.ndarray:
    """Last-position logits after the chunked prefill and after each decode step."""
    prompt, start, outputs = _prompt(model), 0, []
    for size in CHUNKS:
        logits = model(prompt[:, start : start + size], cache=cache)
        mx.eval(logits)
        start += size
    outputs.append(logits[0, -1])
    for step in range(steps):
        logits = model(_decode_token(model, step), cache=cache)
        outputs.append(logits[0, -1])
        mx.eval(outputs[-1])
    return np.stack([np.array(o) for o in outputs])


def _max_error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max())


@pytest.mark.parametrize("arch", ARCHS)
def test_paged_modes_match_mlx_lm_every_step(models: dict[str, Any], arch: str) -> None:
    model = models[arch]
    exact = _run(model, make_prompt_cache(model))
    scale = float(np.abs(exact).max())
    errors = {}
    for mode in kvquant.MODES:
        paged = _run(model, adapter.make_cache(model, mode, page_size=PAGE_SIZE, rotate=False))
        reference = _run(model, _reference_cache(model, mode))
        errors[mode] = _max_error(paged, exact)
        # Same stored rows: every step agrees to float32 noise.
        bound = max(SAME_ROWS_TOLERANCE, SAME_ROWS_SHARE * errors[mode])
        assert _max_error(paged, reference) < bound, mode
    assert errors["fp16"] < FP16_RELATIVE_BOUND * scale
    assert errors["q8"] < Q8_RELATIVE_BOUND * scale
    assert errors["fp16"] < errors["q8"] < errors["q6"] < errors["q4"]


def test_cache_layout_follows_mlx_lm(models: dict[str, Any]) -> None:
    for arch, model in models.items():
        theirs = make_prompt_cache(model)
        ours = adapter.make_cache(model, "q8", page_size=PAGE_SIZE)
        for mine, original in zip(ours, theirs, strict=True):
            if type(original) is KVCache:
                assert isinstance(mine, PagedKVCache), arch
            else:
                assert type(mine) is type(original), arch
    kinds = {type(c) for c in adapter.make_cache(models["qwen3_next"], "q4")}
    assert kinds == {ArraysCache, PagedKVCache}
    kinds = {type(c) for c in adapter.make_cache(models["gemma3_text"], "q4")}
    assert kinds == {RotatingKVCache, PagedKVCache}


def test_dispatch_is_idempotent_and_leaves_other_caches_alone(models: dict[str, Any]) -> None:
    model = models["llama"]
    adapter.make_cache(model, "q8")
    installed = llama.scaled_dot_product_attention
    adapter.make_cache(model, "q4")
    assert llama.scaled_dot_product_attention is installed
    assert installed._longleaf_original is mlx_base.scaled_dot_product_attention
    # mlx-lm's own cache still goes through mlx-lm's attention: bit-identical.
    before = _run(model, make_prompt_cache(model), steps=2)
    llama.scaled_dot_product_attention = mlx_base.scaled_dot_product_attention
    try:
        unpatched = _run(model, make_prompt_cache(model), steps=2)
    finally:
        llama.scaled_dot_product_attention = installed
    np.testing.assert_array_equal(before, unpatched)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_trim_rewinds_to_the_same_logits(models: dict[str, Any], arch: str) -> None:
    model = models[arch]
    cache = adapter.make_cache(model, "q6", page_size=PAGE_SIZE)
    first = _run(model, cache, steps=4)
    held = adapter.cache_tokens(cache)
    # gemma3's rotating caches have wrapped: nothing may trim, nothing changes.
    trimmed = adapter.trim_cache(cache, 4)
    if arch == "gemma3_text":
        assert trimmed == 0 and adapter.cache_tokens(cache) == held
        return
    assert trimmed == 4 and adapter.cache_tokens(cache) == held - 4
    again = []
    for step in range(4):
        logits = model(_decode_token(model, step), cache=cache)
        again.append(np.array(logits[0, -1]))
    np.testing.assert_allclose(np.stack(again), first[1:], atol=1e-5)
    assert trim_prompt_cache(cache, 3) == 3  # mlx-lm's own helper works too


def test_state_round_trip_continues_identically(models: dict[str, Any]) -> None:
    model = models["qwen3"]
    cache = adapter.make_cache(model, "q4", page_size=PAGE_SIZE)
    _run(model, cache, steps=3)
    restored = [PagedKVCache.from_state(c.state) for c in cache]
    for layer, original in zip(restored, cache, strict=True):
        layer.meta_state = original.meta_state  # mlx-lm's protocol: state, then meta_state
    assert [c.offset for c in restored] == [c.offset for c in cache]
    assert [c.nbytes for c in restored] == [c.nbytes for c in cache]
    token = _decode_token(model, 99)
    expected, got = model(token, cache=cache), model(token, cache=restored)
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-5)


def _stats_ok(stats: adapter.CacheStats, cache: list[Any]) -> None:
    paged = [c for c in cache if isinstance(c, PagedKVCache)]
    assert stats.tokens == adapter.cache_tokens(cache)
    assert stats.pages_in_use == sum(len(c.block_table) for c in paged)
    assert stats.pages_in_use + stats.pages_free == stats.pages_allocated
    assert stats.bytes_used == sum(c.nbytes for c in paged) <= stats.bytes_allocated
    assert [layer.layer for layer in stats.layers] == [
        i for i, c in enumerate(cache) if isinstance(c, PagedKVCache)
    ]
    assert all(layer.tokens == stats.tokens for layer in stats.layers)


@pytest.mark.parametrize("mode", kvquant.MODES)
def test_stats_and_nbytes_follow_the_storage_arithmetic(
    models: dict[str, Any], mode: str
) -> None:
    model = models["qwen3_next"]
    cache = adapter.make_cache(model, mode, page_size=PAGE_SIZE)
    empty = adapter.cache_stats(cache)
    assert (empty.tokens, empty.pages_in_use, empty.bytes_used, empty.last_page_fill) == (
        0, 0, 0, 0.0,
    )
    _run(model, cache, steps=5)
    stats = adapter.cache_stats(cache)
    _stats_ok(stats, cache)
    tokens = sum(CHUNKS) + 5
    pages = -(-tokens // PAGE_SIZE)
    config = model.args
    assert stats.mode == mode and stats.page_size == PAGE_SIZE and stats.tokens == tokens
    assert stats.pages_in_use == 2 * pages  # two full-attention layers
    assert stats.last_page_fill == pytest.approx((tokens - (pages - 1) * PAGE_SIZE) / PAGE_SIZE)
    assert stats.bytes_used == kvquant.project_kv_bytes(
        2, config.num_key_value_heads, config.head_dim, pages * PAGE_SIZE, mode
    )
    adapter.trim_cache(cache, 0)
    _stats_ok(adapter.cache_stats(cache), cache)


def _fits(model: Any, mode: str, tokens: int) -> int:
    args = model.args
    return kvquant.project_kv_bytes(2, args.num_key_value_heads, args.head_dim, tokens, mode)


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_budget_exhaustion_raises_before_any_layer_changes(
    models: dict[str, Any], arch: str
) -> None:
    model = models[arch]
    budget = _fits(model, "q8", 6 * PAGE_SIZE)  # 96 tokens in q8
    cache = adapter.make_cache(model, "q8", page_size=PAGE_SIZE, budget_bytes=budget)
    prompt = _prompt(model, 90)
    model(prompt, cache=cache)
    snapshot = [_layer_snapshot(c) for c in cache]
    with pytest.raises(KvBudgetExceeded) as raised:
        model(_prompt(model, 20, seed=7), cache=cache)
    error = raised.value
    assert error.tokens_fit == 96 and error.tokens_requested == 110
    assert error.suggested_mode == "q6"  # the best mode that fits 110 tokens
    assert "96 tokens" in str(error) and "q6" in str(error)
    assert [_layer_snapshot(c) for c in cache] == snapshot
    assert adapter.cache_stats(cache).bytes_allocated <= budget
    # Still usable: what fits goes on, and matches a fresh unbudgeted run.
    tail = _prompt(model, 6, seed=7)
    got = model(tail, cache=cache)
    fresh = adapter.make_cache(model, "q8", page_size=PAGE_SIZE)
    model(prompt, cache=fresh)
    np.testing.assert_allclose(np.array(got), np.array(model(tail, cache=fresh)), atol=1e-5)
    with pytest.raises(KvBudgetExceeded):
        adapter.ensure_capacity(cache, 1)


def _layer_snapshot(layer_cache: Any) -> tuple[Any, ...]:
    if isinstance(layer_cache, PagedKVCache):
        return ("paged", layer_cache.offset, tuple(layer_cache.block_table))
    arrays = [np.array(a) for a in layer_cache.cache if a is not None]
    return ("arrays", tuple(a.tobytes() for a in arrays))


def test_no_mode_fits_suggests_nothing(models: dict[str, Any]) -> None:
    model = models["llama"]
    budget = _fits(model, "fp16", PAGE_SIZE)
    cache = adapter.make_cache(model, "fp16", page_size=PAGE_SIZE, budget_bytes=budget)
    with pytest.raises(KvBudgetExceeded) as raised:
        model(_prompt(model, 200), cache=cache)
    assert raised.value.suggested_mode is None and raised.value.tokens_fit == PAGE_SIZE
    assert "budget" in str(raised.value) and adapter.cache_tokens(cache) == 0


def _tiny_llama(head_dim: int) -> Any:
    args = llama.ModelArgs(
        model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        rms_norm_eps=1e-5, vocab_size=64,
    )
    return llama.Model(args)


def test_q6_on_a_head_dim_not_divisible_by_4_names_it() -> None:
    with pytest.raises(UnsupportedModeError, match=r"head_dim is 30.*q8 or q4"):
        adapter.make_cache(_tiny_llama(30), "q6")


def test_head_dim_without_an_mlx_group_falls_back_to_dequantize() -> None:
    # head_dim 40: no MLX group size divides it, so decode dequantizes the prefix.
    model = _tiny_llama(40)
    mx.eval(model.parameters())
    builders: dict[str, Callable[[], list[Any]]] = {
        "paged": lambda: adapter.make_cache(model, "q8", page_size=8, rotate=False),
        "reference": lambda: _reference_cache(model, "q8"),
    }
    results = {name: _run(model, build(), steps=4) for name, build in builders.items()}
    assert _max_error(results["paged"], results["reference"]) < SAME_ROWS_TOLERANCE


def test_cache_stats_of_a_cache_without_paged_layers(tmp_path: Path) -> None:
    stats = adapter.cache_stats([])
    assert stats.tokens == 0 and stats.layers == () and stats.pages_allocated == 0


def _greedy(model: Any, cache: list[Any], prompt: list[int], tokens: int) -> list[int]:
    for start in range(0, len(prompt), 128):  # multi-chunk prefill
        logits = model(mx.array([prompt[start : start + 128]]), cache=cache)
        mx.eval(logits)
    out = [int(mx.argmax(logits[0, -1]).item())]
    while len(out) < tokens:
        logits = model(mx.array([out[-1:]]), cache=cache)
        out.append(int(mx.argmax(logits[0, -1]).item()))
    return out


@pytest.mark.slow
def test_demo_model_fp16_greedy_is_token_identical(demo_model: tuple[Any, Any]) -> None:
    model, tokenizer = demo_model
    text = "Longleaf pines grow in sandy soil across the southeastern coastal plain. " * 12
    prompt = tokenizer.encode(text)
    assert len(prompt) > 128
    expected = _greedy(model, make_prompt_cache(model), prompt, 64)
    got = _greedy(model, adapter.make_cache(model, "fp16", page_size=64), prompt, 64)
    assert got == expected


class _OwnAttentionLayer(nn.Module):
    """A layer whose module never calls mlx-lm's scaled_dot_product_attention."""


class _OwnAttentionModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = [_OwnAttentionLayer()]

    def make_cache(self) -> list[Any]:
        return [KVCache()]


def test_models_that_bypass_mlx_lm_attention_are_refused() -> None:
    with pytest.raises(ModelLoadError, match="cannot plug into it"):
        adapter.make_cache(_OwnAttentionModel(), "q8")


@pytest.mark.parametrize("mode", ["fp16", "q4"])
def test_eval_targets_are_the_page_storage_not_state_copies(
    models: dict[str, Any], mode: str
) -> None:
    model = models["qwen3_next"]
    cache = adapter.make_cache(model, mode, page_size=PAGE_SIZE)
    model(_prompt(model, 40), cache=cache)
    targets = adapter.eval_targets(cache)
    storage = [a for c in cache if isinstance(c, PagedKVCache) for a in c.store.arrays()]
    assert len(storage) == (4 if mode == "q4" else 2) * 2  # two paged layers
    assert all(any(t is a for t in targets) for a in storage)
    others = [c for c in cache if not isinstance(c, PagedKVCache)]
    assert len(targets) == len(storage) + len(others)
    mx.eval(targets)


def test_stats_count_the_layers_that_are_not_paged(models: dict[str, Any]) -> None:
    """Sliding windows and linear-attention state are memory the session holds too."""
    for arch, kinds in (("gemma3_text", RotatingKVCache), ("qwen3_next", ArraysCache)):
        model = models[arch]
        cache = adapter.make_cache(model, "q8", page_size=PAGE_SIZE)
        assert adapter.cache_stats(cache).other_bytes == 0
        mx.eval(model(_prompt(model, 40), cache=cache))
        others = [c for c in cache if isinstance(c, kinds)]
        assert others, arch
        expected = sum(int(c.nbytes) for c in cache if not isinstance(c, PagedKVCache))
        assert adapter.cache_stats(cache).other_bytes == expected > 0, arch
    llama = adapter.make_cache(models["llama"], "q8", page_size=PAGE_SIZE)
    mx.eval(models["llama"](_prompt(models["llama"], 40), cache=llama))
    assert adapter.cache_stats(llama).other_bytes == 0
