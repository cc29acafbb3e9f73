"""Property tests for the KV storage format beyond test_kvquant.py's error bound:
every head_dim's packing rule, bit-exact round trips of every code in every mode,
fp16 storage, and row independence (the paged cache quantizes chunk by chunk)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache import kvquant
from engine.errors import UnsupportedModeError

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
VALUES_PER_GROUP = {"q8": 1, "q6": 4, "q4": 2, "fp16": 1}


@pytest.mark.parametrize("mode", kvquant.MODES)
def test_every_head_dim_packs_or_is_refused_by_name(mode: str) -> None:
    bits = kvquant.bits_for(mode)
    for head_dim in range(1, 301):
        if head_dim % VALUES_PER_GROUP[mode]:
            with pytest.raises(UnsupportedModeError, match=f"head_dim is {head_dim}"):
                kvquant.packed_dim(head_dim, bits)
            with pytest.raises(UnsupportedModeError):
                kvquant.kv_bytes_per_token(head_dim, mode)
            continue
        row = kvquant.packed_dim(head_dim, bits)
        assert row * 8 == head_dim * bits  # no padding bits, whatever the width
        scale = 0 if mode == "fp16" else 2
        assert kvquant.row_format_bytes(head_dim, mode) == 2 * (row + scale)
        in_memory = 0 if mode == "fp16" else 4 * kvquant.scale_groups(head_dim)
        assert kvquant.kv_bytes_per_token(head_dim, mode) == 2 * (row + in_memory)


@st.composite
def grid_rows(draw: st.DrawFn) -> tuple[str, np.ndarray, str]:
    """Rows whose values lie exactly on a mode's grid, with a power-of-two scale."""
    mode = draw(st.sampled_from(["q8", "q6", "q4"]))
    bits = kvquant.bits_for(mode)
    qmax = kvquant.qmax_for(bits)
    dim = VALUES_PER_GROUP[mode] * draw(st.integers(1, 48))
    lead = draw(st.lists(st.integers(1, 3), min_size=0, max_size=2))
    rows = int(np.prod(lead)) if lead else 1
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    signed = rng.integers(-qmax, qmax + 1, size=(rows, dim))
    # One +-qmax per row pins the row's scale to exactly the chosen power of two.
    signed[np.arange(rows), rng.integers(0, dim, size=rows)] = qmax * rng.choice([-1, 1], rows)
    exponent = draw(st.integers(-12, 8))
    values = (signed * 2.0**exponent).reshape(*lead, dim)
    return mode, values, draw(st.sampled_from(sorted(DTYPES)))


@settings(max_examples=300, deadline=None)
@given(case=grid_rows())
def test_grid_values_round_trip_bit_exactly(case: tuple[str, np.ndarray, str]) -> None:
    mode, values, dtype = case
    bits = kvquant.bits_for(mode)
    x = mx.array(values.astype(np.float32)).astype(DTYPES[dtype])
    codes, scales = kvquant.quantize_rows(x, bits)
    back = kvquant.dequantize_rows(codes, scales, bits, values.shape[-1])
    # Every code in every slot of a packed group must survive pack + unpack.
    np.testing.assert_array_equal(np.array(back), values.astype(np.float32))
    again, _ = kvquant.quantize_rows(back, bits)
    assert np.array_equal(np.array(again), np.array(codes))


@settings(max_examples=150, deadline=None)
@given(
    dim=st.integers(1, 96),
    lead=st.lists(st.integers(1, 4), min_size=0, max_size=2),
    scale=st.sampled_from([1e-5, 1.0, 300.0, 1e4]),
    seed=st.integers(0, 2**32 - 1),
)
def test_fp16_storage_is_the_float16_values(dim: int, lead: list[int], scale: float,
                                            seed: int) -> None:
    x = np.random.default_rng(seed).standard_normal((*lead, dim)).astype(np.float32) * scale
    codes, scales = kvquant.quantize_rows(mx.array(x), 16)
    assert scales is None and codes.shape == x.shape
    back = np.array(kvquant.dequantize_rows(codes, None, 16, dim))
    np.testing.assert_array_equal(back, x.astype(np.float16).astype(np.float32))


@settings(max_examples=150, deadline=None)
@given(
    mode=st.sampled_from(["q8", "q6", "q4"]),
    tokens=st.integers(2, 40),
    cut=st.integers(1, 39),
    seed=st.integers(0, 2**32 - 1),
)
def test_rows_quantize_independently_of_their_chunk(mode: str, tokens: int, cut: int,
                                                    seed: int) -> None:
    cut = min(cut, tokens - 1)
    bits = kvquant.bits_for(mode)
    x = mx.array(np.random.default_rng(seed).standard_normal((2, tokens, 32)).astype(np.float32))
    whole_codes, whole_scales = kvquant.quantize_rows(x, bits)
    for start, stop in ((0, cut), (cut, tokens)):
        codes, scales = kvquant.quantize_rows(x[:, start:stop], bits)
        assert np.array_equal(np.array(codes), np.array(whole_codes[:, start:stop]))
        assert np.array_equal(np.array(scales), np.array(whole_scales[:, start:stop]))
