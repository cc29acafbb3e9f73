"""The guard's load estimate against MLX's measured peak of a load: on this CPU
(weights unpacked or widened to float32) and, by arithmetic, on Metal (packed)."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest
from mlx_lm.utils import load_model as mlx_load_model

from engine.models import loader
from engine.models.loader import estimate_load_bytes, load_model, resolve_model_path
from engine.models.probe import probe_model
from tests.engine.tinymodels import make_tiny_model_dir

LOW, HIGH = 0.67, 1.5


def _folder(which: str, tmp_path):
    if which == "demo":
        return resolve_model_path("demo")
    arch, _, dtype = which.partition("-")
    return make_tiny_model_dir(tmp_path, arch, dtype=dtype or "float32")


def _peak_of(run) -> tuple[object, int]:
    """What ``run`` returns, and MLX's peak above what was held before it."""
    gc.collect()
    mx.clear_cache()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    result = run()
    return result, mx.get_peak_memory() - base


@pytest.mark.skipif(not loader._computes_on_cpu(), reason="measures the CPU backend")
@pytest.mark.parametrize("which", ["demo", "llama", "llama-float16", "qwen3_next"])
def test_load_estimate_is_near_the_measured_peak(which, tmp_path, monkeypatch):
    folder = _folder(which, tmp_path)
    estimate, _ = estimate_load_bytes(folder)
    loaded, cpu_peak = _peak_of(lambda: load_model(folder))
    assert LOW <= estimate / cpu_peak <= HIGH, (estimate, cpu_peak)
    # Metal keeps the weights as stored: what mlx-lm's loader holds before any
    # conversion, plus the probe's working set (measured here in float32, which
    # Metal's half-precision activations do not exceed).
    _, packed = _peak_of(lambda: mlx_load_model(folder))  # evaluates the weights
    _, probe_extra = _peak_of(lambda: probe_model(loaded.model))
    monkeypatch.setattr(loader, "_computes_on_cpu", lambda: False)
    metal_estimate, _ = estimate_load_bytes(folder)
    metal_peak = packed + probe_extra
    assert LOW <= metal_estimate / metal_peak <= HIGH, (metal_estimate, packed, probe_extra)
