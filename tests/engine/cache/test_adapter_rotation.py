"""Rotated paged caches inside mlx-lm's own models: same answers in fp16, closer when quantized.

Random tiny models have no outlier channels, which is what the rotation is for, so the
quantized comparison first gives each model outlier channels without changing what it
computes: one RoPE pair of key channels is multiplied by ``OUTLIER`` and the matching
query channels divided by it (q·k unchanged), and one value channel is multiplied and
the output projection's matching columns divided (the attention output unchanged).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from engine.cache import adapter
from engine.cache.paged_cache import PagedKVCache
from engine.cache.rotation import HadamardRotation
from tests.engine.tinymodels import ARCHS, load_tiny

CHUNKS = (40, 33, 17)
DECODE_STEPS = 12
PAGE_SIZE = 16
OUTLIER = 30.0
# fp16 pages against mlx-lm's float32 KVCache, max |logit error| / max |logit|, unrotated
# / rotated (measured): llama 9.7e-5 / 7.6e-5, qwen3 1.5e-4 / 1.6e-4, qwen3_next 8.3e-5 /
# 1.1e-4, gemma3_text 1.2e-3 / 1.4e-3 (its q/k norms make scores peaked). Rotation only
# moves where float16 rounds. The bound tests/engine/cache/test_adapter.py allows fp16: 0.2%.
FP16_RELATIVE_BOUND = 2e-3


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for _, m in model.named_modules() if hasattr(m, "k_proj") and hasattr(m, "o_proj")]


def _scale_channels(weight: mx.array, rows: list[int], factor: float) -> mx.array:
    scale = np.ones(weight.shape[0], dtype=np.float32)
    scale[rows] = factor
    return weight * mx.array(scale).reshape(-1, *([1] * (weight.ndim - 1)))


def _scale_norm(norm: nn.Module, channels: list[int], factor: float) -> None:
    weight = np.array(norm.weight)
    if isinstance(norm, nn.RMSNorm):
        weight[channels] *= factor
    else:  # Gemma's RMSNorm multiplies by (1 + weight)
        weight[channels] = (1.0 + weight[channels]) * factor - 1.0
    norm.weight = mx.array(weight)


def inject_outliers(model: nn.Module) -> None:
    """Give every attention layer one outlier key pair and one outlier value channel.

    The last channel of the first half and the last channel are a RoPE pair for
    non-traditional RoPE, and both lie outside qwen3_next's partial rotary span, so
    scaling them together commutes with RoPE.
    """
    for attention in _attention_modules(model):
        kv_heads = attention.k_proj.weight.shape[0] // _head_dim(attention)
        head_dim = _head_dim(attention)
        pair = [head_dim // 2 - 1, head_dim - 1]
        if hasattr(attention, "k_norm"):
            _scale_norm(attention.k_norm, pair, OUTLIER)
            _scale_norm(attention.q_norm, pair, 1.0 / OUTLIER)
        else:
            k_rows = [h * head_dim + c for h in range(kv_heads) for c in pair]
            q_heads = attention.q_proj.weight.shape[0] // head_dim
            q_rows = [h * head_dim + c for h in range(q_heads) for c in pair]
            attention.k_proj.weight = _scale_channels(attention.k_proj.weight, k_rows, OUTLIER)
            attention.q_proj.weight = _scale_channels(
                attention.q_proj.weight, q_rows, 1.0 / OUTLIER
            )
        channel = 3
        v_rows = [h * head_dim + channel for h in range(kv_heads)]
        attention.v_proj.weight = _scale_channels(attention.v_proj.weight, v_rows, OUTLIER)
        out_columns = attention.o_proj.weight.shape[1] // head_dim
        o_weight = attention.o_proj.weight.T
        o_rows = [h * head_dim + channel for h in range(out_columns)]
        attention.o_proj.weight = _scale_channels(o_weight, o_rows, 1.0 / OUTLIER).T


def _head_dim(attention: nn.Module) -> int:
    head_dim = getattr(attention, "head_dim", None)
    if head_dim is None:
        return attention.k_proj.weight.shape[0] // attention.n_kv_heads
    return int(head_dim)


def _run(model: Any, cache: list[Any]) -> np.ndarray:
    """Last-position logits after a chunked prefill and after each decode step."""
    vocab = model.args.vocab_size
    prompt = mx.random.randint(0, vocab, (1, sum(CHUNKS)), key=mx.random.key(1))
    start, outputs = 0, []
    for size in CHUNKS:
        logits = model(prompt[:, start : start + size], cache=cache)
        mx.eval(logits)
        start += size
    outputs.append(logits[0, -1])
    for step in range(DECODE_STEPS):
        logits = model(mx.array([[(step * 37 + 11) % vocab]]), cache=cache)
        outputs.append(logits[0, -1])
        mx.eval(outputs[-1])
    return np.stack([np.array(o) for o in outputs])


def _error(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max())


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("rotation-models")
    return {arch: load_tiny(root, arch)[0] for arch in ARCHS}


@pytest.fixture(scope="module")
def outlier_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("rotation-outlier-models")
    built = {}
    for arch in ARCHS:
        model = load_tiny(root, arch)[0]
        inject_outliers(model)
        built[arch] = model
    return built


def test_outlier_injection_keeps_the_model(tmp_path: Path) -> None:
    # The injection is a change of basis, not of the function.
    plain = load_tiny(tmp_path, "llama")[0]
    scaled = load_tiny(tmp_path, "llama")[0]
    inject_outliers(scaled)
    a, b = _run(plain, make_prompt_cache(plain)), _run(scaled, make_prompt_cache(scaled))
    assert _error(a, b) < 1e-3 * float(np.abs(a).max())


@pytest.mark.parametrize("arch", ARCHS)
def test_fp16_rotated_gives_the_same_logits(models: dict[str, Any], arch: str) -> None:
    model = models[arch]
    exact = _run(model, make_prompt_cache(model))
    scale = float(np.abs(exact).max())
    plain = _run(model, adapter.make_cache(model, "fp16", page_size=PAGE_SIZE, rotate=False))
    rotated = _run(model, adapter.make_cache(model, "fp16", page_size=PAGE_SIZE, rotate=True))
    assert _error(rotated, exact) < FP16_RELATIVE_BOUND * scale
    assert _error(rotated, plain) < FP16_RELATIVE_BOUND * scale


@pytest.mark.parametrize("arch", ARCHS)
def test_rotation_brings_quantized_logits_closer(outlier_models: dict[str, Any], arch: str) -> None:
    model = outlier_models[arch]
    exact = _run(model, make_prompt_cache(model))
    for mode in ("q8", "q6", "q4"):
        plain = _run(model, adapter.make_cache(model, mode, page_size=PAGE_SIZE, rotate=False))
        rotated = _run(model, adapter.make_cache(model, mode, page_size=PAGE_SIZE, rotate=True))
        assert _error(rotated, exact) < _error(plain, exact), mode


def test_every_paged_layer_gets_its_own_rotation(models: dict[str, Any]) -> None:
    model = models["qwen3_next"]  # hybrid: only full-attention layers are paged
    cache = adapter.make_cache(model, "q6", page_size=PAGE_SIZE, rotate=True)
    paged = [(i, c) for i, c in enumerate(cache) if isinstance(c, PagedKVCache)]
    assert paged
    for index, layer_cache in paged:
        assert isinstance(layer_cache.rotation, HadamardRotation)
        assert layer_cache.rotation.layer == index
        assert layer_cache.rotation.head_dim == layer_cache.head_dim
    unpaged = [c for c in cache if not isinstance(c, PagedKVCache)]
    assert all(not hasattr(c, "rotation") for c in unpaged)


@pytest.mark.parametrize("mode", ["fp16", "q8", "q6", "q4"])
def test_stats_say_whether_rows_are_rotated(models: dict[str, Any], mode: str) -> None:
    model = models["llama"]
    rotated = adapter.make_cache(model, mode, page_size=PAGE_SIZE, rotate=True)
    plain = adapter.make_cache(model, mode, page_size=PAGE_SIZE, rotate=False)
    assert adapter.cache_stats(rotated).rotation == "hadamard-v1+signs"
    assert adapter.cache_stats(plain).rotation is None
    default = adapter.make_cache(model, mode, page_size=PAGE_SIZE)
    expected = "hadamard-v1+signs" if adapter.rotates_by_default(mode) else None
    assert adapter.cache_stats(default).rotation == expected


def test_rotated_cache_trims_and_keeps_agreeing(models: dict[str, Any]) -> None:
    # Trimming drops rotated rows like any others; the rest stay in the rotated basis.
    model = models["llama"]
    cache = adapter.make_cache(model, "q8", page_size=PAGE_SIZE, rotate=True)
    exact_cache = make_prompt_cache(model)
    prompt = mx.random.randint(0, model.args.vocab_size, (1, 50), key=mx.random.key(3))
    for c in (cache, exact_cache):
        mx.eval(model(prompt, cache=c))
        assert adapter.trim_cache(c, 9) == 9
    token = mx.array([[5]])
    ours, exact = model(token, cache=cache)[0, -1], model(token, cache=exact_cache)[0, -1]
    assert _error(np.array(ours), np.array(exact)) < 0.05 * float(mx.abs(exact).max())


def test_state_round_trip_keeps_the_rotation(models: dict[str, Any]) -> None:
    # mlx-lm's protocol sets state, then meta_state; the latter names the rotation.
    model = models["qwen3"]
    cache = adapter.make_cache(model, "q4", page_size=PAGE_SIZE, rotate=True)
    _run(model, cache)
    restored = [PagedKVCache.from_state(c.state) for c in cache]
    for original, layer in zip(cache, restored, strict=True):
        layer.meta_state = original.meta_state
        assert repr(layer.rotation) == repr(original.rotation)
    assert adapter.rotation_format(restored) == adapter.rotation_format(cache)
    token = mx.array([[7]])
    expected, got = model(token, cache=cache), model(token, cache=restored)
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=1e-5)
