"""Storage format of the paged KV cache: tables, packing, error bound, MLX bridge."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache import kvquant
from engine.errors import UnsupportedModeError

QUANT_BITS = (8, 6, 4)
DTYPES = {"fp32": mx.float32, "fp16": mx.float16, "bf16": mx.bfloat16}
GIB = 1024**3


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


# --- tables ---------------------------------------------------------------


def test_width_tables() -> None:
    assert [kvquant.bits_for(m) for m in ("fp16", "q8", "q6", "q4")] == [16, 8, 6, 4]
    assert [kvquant.qmax_for(b) for b in QUANT_BITS] == [127, 31, 7]
    assert [kvquant.bias_for(b) for b in QUANT_BITS] == [128, 32, 8]
    assert [kvquant.packed_dim(256, b) for b in (16, 8, 6, 4)] == [512, 256, 192, 128]


@pytest.mark.parametrize("bits", [0, 1, 2, 3, 5, 7, 12, 32])
def test_unknown_width_raises_instead_of_guessing(bits: int) -> None:
    with pytest.raises(UnsupportedModeError, match=f"{bits}-bit"):
        kvquant.packed_dim(64, bits)
    with pytest.raises(UnsupportedModeError, match=f"{bits}-bit"):
        kvquant.qmax_for(bits)
    with pytest.raises(UnsupportedModeError):
        kvquant.quantize_rows(mx.zeros((2, 64)), bits)


def test_q6_head_dim_error_names_head_dim_and_suggests_other_modes() -> None:
    with pytest.raises(UnsupportedModeError, match=r"head_dim is 70.*q8 or q4"):
        kvquant.packed_dim(70, 6)
    with pytest.raises(UnsupportedModeError, match=r"head_dim is 33.*Use q8 for"):
        kvquant.kv_bytes_per_token(33, "q4")
    with pytest.raises(UnsupportedModeError, match="head_dim is 66"):
        kvquant.quantize_rows(mx.zeros((1, 66)), 6)


def test_row_format_bytes_match_the_spec() -> None:
    got = {m: kvquant.row_format_bytes(256, m) for m in ("q8", "q6", "q4", "fp16")}
    assert got == {"q8": 516, "q6": 388, "q4": 260, "fp16": 1024}
    assert kvquant.row_format_bytes(64, "q6") == 2 * (48 + 2)


def test_bytes_in_memory_add_a_scale_and_bias_per_mlx_group() -> None:
    # head_dim 256 reads in MLX groups of 128: two scales and two biases a row,
    # 8 bytes where the row format has 2 (12 more a token-head, keys and values).
    got = {m: kvquant.kv_bytes_per_token(256, m) for m in ("q8", "q6", "q4", "fp16")}
    assert got == {"q8": 528, "q6": 400, "q4": 272, "fp16": 1024}
    assert kvquant.kv_bytes_per_token(64, "q6") == 2 * (48 + 4)
    assert kvquant.kv_bytes_per_token(80, "q8") == 2 * (80 + 4)  # no MLX group: one pair
    assert [kvquant.scale_groups(d) for d in (256, 128, 96, 80)] == [2, 1, 3, 1]


def test_projected_bytes_match_the_spec() -> None:
    gib = {
        m: kvquant.project_kv_bytes(16, 4, 256, 262_144, m) / GIB
        for m in ("q8", "q6", "q4", "fp16")
    }
    assert {m: round(v, 2) for m, v in gib.items()} == {
        "q8": 8.25, "q6": 6.25, "q4": 4.25, "fp16": 16.00,
    }
    assert kvquant.project_kv_bytes(16, 4, 256, 262_144, "q6") == 16 * 4 * 262_144 * 400
    assert kvquant.project_kv_bytes(3, 2, 64, 0, "q8") == 0


# --- exact bit layout -----------------------------------------------------


def test_q6_bit_layout_matches_the_spec_byte_formulas() -> None:
    rng = np.random.default_rng(0)
    u = rng.integers(1, 64, size=(5, 32)).astype(np.uint8)  # 0 is not a q6 code
    u[:, 0], u[:, 1] = 63, 1  # every row spans the full grid, so its scale is 0.5
    scales = mx.full((5, 1), 0.5, dtype=mx.float16)
    x = (mx.array(u.astype(np.float32)) - 32) * 0.5
    codes, stored = kvquant.quantize_rows(x, 6)
    assert codes.dtype == mx.uint8 and codes.shape == (5, 24)
    assert np.array_equal(np.array(stored), np.array(scales))
    g = u.reshape(5, 8, 4).astype(np.int64)
    expected = np.stack(
        [
            g[..., 0] | (g[..., 1] & 0x03) << 6,
            (g[..., 1] >> 2) | (g[..., 2] & 0x0F) << 4,
            (g[..., 2] >> 4) | (g[..., 3] & 0x3F) << 2,
        ],
        axis=-1,
    ).reshape(5, 24)
    assert np.array_equal(np.array(codes), expected.astype(np.uint8))
    back = kvquant.dequantize_rows(codes, stored, 6, 32)
    assert np.array_equal(np.array(back), np.array(x))


def test_q6_hand_built_group() -> None:
    # codes u = 1, 2, 3, 63 -> byte0 = 1 | 2<<6, byte1 = 0 | 3<<4, byte2 = 0 | 63<<2
    x = mx.array([[1 - 32, 2 - 32, 3 - 32, 63 - 32]], dtype=mx.float32)
    codes, scales = kvquant.quantize_rows(x, 6)
    assert scales.item() == 1.0
    assert np.array(codes).tolist() == [[0x81, 0x30, 0xFC]]


def test_q4_low_nibble_first() -> None:
    x = mx.array([[1 - 8, 15 - 8, 0, 7]], dtype=mx.float32)  # u = 1, 15, 8, 15
    codes, scales = kvquant.quantize_rows(x, 4)
    assert scales.item() == 1.0
    assert np.array(codes).tolist() == [[0xF1, 0xF8]]


def test_q8_one_biased_code_per_byte() -> None:
    x = mx.array([[-127, 0, 1, 127]], dtype=mx.float32)
    codes, scales = kvquant.quantize_rows(x, 8)
    assert scales.item() == 1.0
    assert np.array(codes).tolist() == [[1, 128, 129, 255]]


def test_fp16_mode_stores_values() -> None:
    x = mx.array([[1.5, -2.25, 3.0, 65504.0]], dtype=mx.float32)
    codes, scales = kvquant.quantize_rows(x, 16)
    assert scales is None and codes.dtype == mx.float16
    assert codes.nbytes == kvquant.packed_dim(4, 16)
    assert np.array_equal(np.array(kvquant.dequantize_rows(codes, None, 16, 4)), np.array(x))


# --- round trip and error bound (property tests) ----------------------------

shapes = st.tuples(
    st.lists(st.integers(1, 3), min_size=0, max_size=3),
    st.sampled_from([4, 8, 16, 32, 64, 128, 256]),
)


def _rows(seed: int, lead: list[int], dim: int, magnitude: float, zero_rows: bool) -> np.ndarray:
    rng = np.random.default_rng(seed)
    # Huge, yet within what every input dtype and every mode holds (q4's capped
    # scale reaches 7 * 4366, every code then reading back finite in float16).
    values = np.clip(rng.standard_normal((*lead, dim)) * magnitude, -3.05e4, 3.05e4)
    if zero_rows:
        values.reshape(-1, dim)[::2] = 0.0
    return values


@settings(max_examples=120, deadline=None)
@given(
    shape=shapes,
    bits=st.sampled_from(QUANT_BITS),
    dtype=st.sampled_from(sorted(DTYPES)),
    magnitude=st.sampled_from([1e-6, 1e-3, 1.0, 30.0, 3e3, 6e4]),
    zero_rows=st.booleans(),
    seed=st.integers(0, 2**31),
)
def test_round_trip_and_error_bound(
    shape: tuple[list[int], int],
    bits: int,
    dtype: str,
    magnitude: float,
    zero_rows: bool,
    seed: int,
) -> None:
    lead, dim = shape
    x = mx.array(_rows(seed, lead, dim, magnitude, zero_rows).astype(np.float32))
    x = x.astype(DTYPES[dtype])
    codes, scales = kvquant.quantize_rows(x, bits)
    assert codes.dtype == mx.uint8 and scales.dtype == mx.float16
    assert codes.shape == (*lead, kvquant.packed_dim(dim, bits))
    assert scales.shape == (*lead, 1)

    x_hat = kvquant.dequantize_rows(codes, scales, bits, dim)
    assert x_hat.shape == x.shape and x_hat.dtype == mx.float32
    error = np.abs(_np(x) - _np(x_hat))
    scale = _np(scales)
    assert np.all(scale > 0)
    # x / scale is rounded in float32: allow its last-bit wobble, nothing more.
    assert np.all(error <= scale / 2 * (1 + 2**-20))
    # The stored scale is max|row| / qmax rounded up to the next float16, no coarser.
    peak = np.max(np.abs(_np(x)), axis=-1, keepdims=True)
    qmax = kvquant.qmax_for(bits)
    assert np.all(scale * qmax >= peak)
    assert np.all((scale <= peak / qmax * (1 + 2**-10)) | (peak == 0) | (scale < 2**-14))

    # Re-quantizing the reconstruction gives back the very same bytes, wherever the
    # scale is a normal float16 (subnormal scales are too coarse to keep the peak at qmax).
    codes2, scales2 = kvquant.quantize_rows(x_hat, bits)
    normal = (scale >= 2**-14)[..., 0] | (peak == 0)[..., 0]
    assert np.array_equal(np.array(codes2)[normal], np.array(codes)[normal])
    assert np.array_equal(np.array(scales2)[normal], np.array(scales)[normal])


def test_scales_round_up_to_the_next_float16_exactly() -> None:
    # Every positive finite float16 but the largest: the next one up, bit for bit.
    patterns = np.arange(1, 0x7BFF, dtype=np.uint16)
    got = np.array(kvquant._next_up(mx.array(patterns.view(np.float16))))
    assert np.array_equal(got.view(np.uint16), patterns + 1)


@pytest.mark.parametrize("bits", QUANT_BITS)
def test_all_zero_rows_are_safe(bits: int) -> None:
    codes, scales = kvquant.quantize_rows(mx.zeros((3, 64), dtype=mx.bfloat16), bits)
    assert np.all(_np(scales) > 0)
    x_hat = kvquant.dequantize_rows(codes, scales, bits, 64)
    assert np.array_equal(np.array(x_hat), np.zeros((3, 64), dtype=np.float32))


@pytest.mark.parametrize("bits", QUANT_BITS)
def test_values_beyond_float16_saturate_where_every_code_reads_back_finite(bits: int) -> None:
    x = mx.array([[1e9, -1e9, 1.0, 0.0], [3e38, 0.0, 0.0, -3e38]], dtype=mx.float32)
    codes, scales = kvquant.quantize_rows(x, bits)
    x_hat = np.array(kvquant.dequantize_rows(codes, scales, bits, 4))
    assert np.all(np.isfinite(x_hat))
    cap = kvquant.scale_cap(bits)
    assert np.all(np.array(scales.astype(mx.float32)) == cap)
    top = 2 * kvquant.bias_for(bits) - 1  # the largest unsigned code
    assert cap * top <= 65504 < float(np.nextafter(np.float16(cap), np.float16(1e4))) * top
    limit = cap * kvquant.qmax_for(bits)
    assert limit > 30_500
    assert x_hat[0, 0] == limit and x_hat[0, 1] == -limit


@pytest.mark.parametrize("bits", QUANT_BITS)
def test_a_value_past_the_limit_reads_back_clipped_in_float16_not_inf(bits: int) -> None:
    """MLX's float16 read (the GPU schedule's, with float16 queries) of a stored
    40,000: before, ``scale * u`` overflowed and an attention read turned to NaN."""
    x = mx.zeros((1, 256)).at[0, 0].add(40000.0).astype(mx.float16)
    codes, scale_and_bias = kvquant.quantize_for_store(x, bits, 2)
    read = mx.dequantize(codes.view(mx.uint32), scale_and_bias[0], scale_and_bias[1],
                         group_size=128, bits=bits)
    assert read.dtype == mx.float16 and bool(mx.isfinite(read).all())
    limit = kvquant.scale_cap(bits) * kvquant.qmax_for(bits)
    assert abs(float(read[0, 0]) - limit) <= limit * 2**-9  # float16's rounding of the read


@pytest.mark.parametrize("bits", QUANT_BITS)
def test_every_code_survives_pack_and_unpack(bits: int) -> None:
    qmax = kvquant.qmax_for(bits)
    signed = np.arange(-qmax, qmax + 1)
    signed = np.concatenate([signed, np.full(-len(signed) % 4, qmax)])  # whole q6 groups
    for shift in range(4):  # every code in every slot of a packed group
        row = np.roll(signed, shift).astype(np.float32)[None, :]
        codes, scales = kvquant.quantize_rows(mx.array(row), bits)
        back = kvquant.dequantize_rows(codes, scales, bits, row.shape[-1])
        assert np.array_equal(np.array(back), row)


def test_dequantize_rejects_wrong_row_width() -> None:
    codes, scales = kvquant.quantize_rows(mx.ones((2, 64)), 6)
    with pytest.raises(UnsupportedModeError, match="48 bytes"):
        kvquant.dequantize_rows(codes, scales, 6, 128)


def test_dequantize_dtype() -> None:
    codes, scales = kvquant.quantize_rows(mx.ones((2, 64)), 4)
    assert kvquant.dequantize_rows(codes, scales, 4, 64, dtype=mx.bfloat16).dtype == mx.bfloat16


@pytest.mark.parametrize("bits", QUANT_BITS)
def test_gaussian_relative_error_is_bounded_by_the_grid(bits: int) -> None:
    # Per row, |x - x_hat| / max|x| <= 1 / (2 qmax), plus float16 scale rounding.
    x = mx.random.normal((512, 128), key=mx.random.key(7))
    codes, scales = kvquant.quantize_rows(x, bits)
    x_hat = kvquant.dequantize_rows(codes, scales, bits, 128)
    rel = np.max(np.abs(_np(x) - _np(x_hat)) / np.max(np.abs(_np(x)), axis=-1, keepdims=True))
    half_step = 1 / (2 * kvquant.qmax_for(bits))
    assert half_step * 0.8 < rel <= half_step * (1 + 2**-10)


# --- MLX affine bridge ------------------------------------------------------


@pytest.mark.parametrize("bits", QUANT_BITS)
@pytest.mark.parametrize("head_dim", [64, 128, 256, 96])
def test_stored_rows_are_what_mlx_dequantizes_identically(bits: int, head_dim: int) -> None:
    x = mx.random.normal((2, 3, 40, head_dim), key=mx.random.key(bits + head_dim)) * 3
    groups = kvquant.scale_groups(head_dim)
    codes, pairs = kvquant.quantize_for_store(x, bits, groups)
    row_codes, scales = kvquant.quantize_rows(x, bits)
    assert np.array_equal(np.array(codes), np.array(row_codes))
    assert pairs.shape == (2, 2, 3, 40, groups) and pairs.dtype == mx.float16
    assert np.array_equal(np.array(pairs[0, ..., :1]), np.array(scales))
    assert np.array_equal(np.array(pairs[1]), -kvquant.bias_for(bits) * np.array(pairs[0]))
    assert np.array_equal(np.array(kvquant.affine_scales(scales, bits, groups)), np.array(pairs))
    words = codes.view(mx.uint32)
    assert np.array(words).tobytes() == np.array(codes).tobytes()
    ours = kvquant.dequantize_rows(codes, scales, bits, head_dim)
    theirs = mx.dequantize(words, pairs[0].astype(mx.float32), pairs[1].astype(mx.float32),
                           group_size=kvquant.mlx_group_size(head_dim), bits=bits)
    assert np.array_equal(np.array(theirs), np.array(ours))


@pytest.mark.parametrize("bits", [8, 6, 4])
def test_rows_stored_under_the_earlier_cap_are_quantized_again_within_it(bits: int) -> None:
    # The earlier cap kept only the bias finite: the largest codes of such a scale
    # read back inf in float16. Quantized again, the row keeps its values, the
    # largest clipped at the cap's range, as a row stored now is.
    earlier = kvquant._largest_fp16_scale(kvquant.bias_for(bits))
    assert earlier > kvquant.scale_cap(bits)
    values = mx.array([[1.0, -3.0, 2.0, 0.5] * 2, [0.25] * 8], dtype=mx.float32)
    codes, scales = kvquant.quantize_rows(values, bits)
    scales = mx.array([[earlier], [float(scales[1, 0])]], dtype=mx.float16)  # row 0: earlier
    old = kvquant.dequantize_rows(codes, scales, bits, 8)
    kept, capped = kvquant.within_cap(codes, scales, bits, 8)
    assert float(mx.max(capped)) <= kvquant.scale_cap(bits)
    reread = _np(kvquant.dequantize_rows(kept, capped, bits, 8))
    limit = kvquant.qmax_for(bits) * kvquant.scale_cap(bits)
    assert np.allclose(reread[0], np.clip(_np(old)[0], -limit, limit),
                       atol=kvquant.scale_cap(bits) / 2)
    assert np.array_equal(reread[1], _np(old)[1])  # a row within the cap: as stored


def test_rows_within_the_cap_are_restored_untouched() -> None:
    codes, scales = kvquant.quantize_rows(mx.array([[1.0, 2.0, 3.0, 4.0]]), 6)
    kept, same = kvquant.within_cap(codes, scales, 6, 4)
    assert kept is codes and same is scales


def test_mlx_group_size_choice() -> None:
    assert kvquant.mlx_group_size(256) == 128
    assert kvquant.mlx_group_size(64) == 64
    assert kvquant.mlx_group_size(96) == 32
    assert kvquant.mlx_group_size(40) is None


def _bit_stream(u: np.ndarray, bits: int) -> np.ndarray:
    """Little-endian bit stream, value i at bit ``bits * i``, built bit by bit."""
    rows, count = u.shape
    stream = np.zeros((rows, count * bits // 8), dtype=np.uint8)
    for bit in range(bits):
        pos = np.arange(count) * bits + bit
        np.bitwise_or.at(
            stream, (slice(None), pos // 8), (((u >> bit) & 1) << (pos % 8)).astype(np.uint8)
        )
    return stream


@pytest.mark.parametrize("bits", QUANT_BITS)
def test_mlx_affine_matches_mx_quantize_packing(bits: int) -> None:
    # Rows whose own min/max make MLX's affine quantizer pick our exact grid.
    qmax, bias = kvquant.qmax_for(bits), kvquant.bias_for(bits)
    rng = np.random.default_rng(bits)
    signed = rng.integers(-qmax, qmax + 1, size=(4, 64))
    signed[:, 0], signed[:, 1] = -bias, 2**bits - 1 - bias  # span MLX's full field
    theirs, _, _ = mx.quantize(mx.array(signed.astype(np.float32)), group_size=64, bits=bits)
    assert np.array(theirs).tobytes() == _bit_stream(signed + bias, bits).tobytes()
    in_range = np.clip(signed, -qmax, qmax).astype(np.float32)
    codes, _ = kvquant.quantize_rows(mx.array(in_range), bits)
    expected = _bit_stream(in_range.astype(np.int64) + bias, bits)
    assert np.array(codes).tobytes() == expected.tobytes()


@pytest.mark.parametrize("bits", QUANT_BITS)
def test_quantized_matmul_on_stored_rows_matches_float_matmul(bits: int) -> None:
    keys = mx.random.normal((96, 64), key=mx.random.key(1))
    queries = mx.random.normal((5, 64), key=mx.random.key(2))
    codes, pairs = kvquant.quantize_for_store(keys, bits, 1)
    scores = mx.quantized_matmul(
        queries, codes.view(mx.uint32), pairs[0].astype(mx.float32),
        pairs[1].astype(mx.float32), transpose=True, group_size=64, bits=bits
    )
    reference = queries @ kvquant.dequantize_rows(codes, pairs[0], bits, 64).T
    assert np.allclose(np.array(scores), np.array(reference), rtol=1e-5, atol=1e-4)


# --- bf16 models (issue 15) -------------------------------------------------

@pytest.mark.parametrize("bits", QUANT_BITS)
def test_bf16_values_meet_exact_scales_and_biases(bits: int) -> None:
    # A bf16 model's rows keep float16 scales and biases: bf16's 8-bit mantissa
    # would have moved q8's worst error on values from ~0.05 to ~0.09 in this case.
    values = mx.random.normal((64, 128), key=mx.random.key(7)) * 3
    codes, pairs = kvquant.quantize_for_store(values.astype(mx.bfloat16), bits, 4)
    assert pairs.dtype == mx.float16
    theirs = mx.dequantize(codes.view(mx.uint32), pairs[0].astype(mx.float32),
                           pairs[1].astype(mx.float32), group_size=32, bits=bits)
    ours = kvquant.dequantize_rows(codes, pairs[0, :, :1], bits, 128)
    assert np.array_equal(_np(theirs), _np(ours))


def test_fp16_probabilities_times_stored_values_match_float_matmul() -> None:
    values = mx.random.normal((96, 64), key=mx.random.key(8)) * 3
    probs = mx.softmax(mx.random.normal((5, 96), key=mx.random.key(9)), axis=-1)
    codes, pairs = kvquant.quantize_for_store(values, 8, 1)
    mixed = mx.quantized_matmul(
        probs.astype(mx.float16), codes.view(mx.uint32), pairs[0], pairs[1],
        transpose=False, group_size=64, bits=8,
    )
    reference = probs.astype(mx.float16).astype(mx.float32) @ kvquant.dequantize_rows(
        codes, pairs[0], 8, 64
    )
    # float16 products of scale * code + bias: a few ulps of the largest value.
    assert np.allclose(_np(mixed), _np(reference), rtol=2e-3, atol=2e-2)


def test_fp16_mode_clips_values_beyond_float16_instead_of_inf() -> None:
    # bf16 reaches 3.4e38; the fp16 page store holds at most 65504.
    x = mx.array([[1.0, 7.0e4, -2.0e5, 3.0], [0.5, -0.5, 2.0, 6.0e4]], dtype=mx.bfloat16)
    codes, _ = kvquant.quantize_rows(x, 16)
    stored = _np(kvquant.dequantize_rows(codes, None, 16, 4))
    assert np.all(np.isfinite(stored))
    assert stored[0].tolist() == [1.0, 65504.0, -65504.0, 3.0]
    assert np.array_equal(stored[1], _np(x[1]))
    assert kvquant.count_clipped_rows(x).item() == 1


def test_fp16_mode_keeps_float16_input_as_is() -> None:
    x = mx.array([[1.0, -65504.0, 0.25, 2.0]], dtype=mx.float16)
    codes, _ = kvquant.quantize_rows(x, 16)
    assert codes.dtype == mx.float16 and np.array_equal(_np(codes), _np(x))
    assert kvquant.count_clipped_rows(x).item() == 0


@pytest.mark.parametrize("bits", [16, 8, 6, 4])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
def test_a_nan_is_stored_as_zero_and_its_row_keeps_its_other_values(bits: int,
                                                                   dtype: mx.Dtype) -> None:
    # A read weighs the rows it hides by 0, and 0 times NaN is NaN: no stored row
    # may hold one. Quantized, one NaN made its row's scale NaN, the whole row with it.
    x = mx.array([[float("nan"), 1.0, -2.0, 3.0, 0.5, -0.25, 1.5, 2.5]], dtype=dtype)
    codes, scales = kvquant.quantize_rows(x, bits)
    stored = _np(kvquant.dequantize_rows(codes, scales, bits, 8))
    assert stored[0, 0] == 0.0
    tolerance = 0.0 if bits == 16 else float(_np(scales)[0, 0]) / 2
    assert np.all(np.abs(stored[0, 1:] - _np(x)[0, 1:]) <= tolerance)


def test_fp16_mode_stores_an_infinite_float16_value_clipped() -> None:
    x = mx.array([[1.0, float("inf"), -float("inf"), 2.0]], dtype=mx.float16)
    codes, _ = kvquant.quantize_rows(x, 16)
    assert _np(codes).tolist() == [[1.0, 65504.0, -65504.0, 2.0]]
