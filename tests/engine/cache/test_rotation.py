"""The Hadamard rotation of K/V rows: orthonormal, invertible, dot products kept, any width."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from engine.cache import kvquant
from engine.cache.attention.scratch import PACKED_MAX_TOKENS
from engine.cache.rotation import (
    FORMAT,
    HadamardRotation,
    hadamard,
    layer_signs,
    power_of_two_blocks,
    rotation_for,
    rotation_matrix,
)
from engine.errors import EngineError

HEAD_DIMS = (32, 64, 128, 256, 80, 96, 72, 100, 1)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("signs", [True, False])
def test_matrix_is_orthonormal(head_dim: int, signs: bool) -> None:
    matrix = rotation_matrix(head_dim, layer=3, signs=signs)
    np.testing.assert_allclose(matrix @ matrix.T, np.eye(head_dim), atol=1e-12)


@pytest.mark.parametrize("size", [1, 2, 4, 8, 64, 256])
def test_hadamard_entries_are_plus_minus_one_over_sqrt_n(size: int) -> None:
    np.testing.assert_allclose(np.abs(hadamard(size)) * np.sqrt(size), np.ones((size, size)))


def test_blocks_are_the_binary_digits_largest_first() -> None:
    assert power_of_two_blocks(64) == (64,)
    assert power_of_two_blocks(96) == (64, 32)
    assert power_of_two_blocks(80) == (64, 16)
    assert power_of_two_blocks(100) == (64, 32, 4)
    with pytest.raises(ValueError):
        power_of_two_blocks(0)
    with pytest.raises(ValueError):
        hadamard(12)


def test_non_power_of_two_width_is_block_diagonal() -> None:
    matrix = rotation_matrix(96, layer=0, signs=False)
    assert not matrix[:64, 64:].any() and not matrix[64:, :64].any()
    np.testing.assert_allclose(matrix[64:, 64:], hadamard(32))


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_round_trip_and_dot_products(head_dim: int) -> None:
    rotation = HadamardRotation(head_dim, layer=5)
    rng = np.random.default_rng(head_dim)
    q = mx.array(rng.standard_normal((1, 4, 3, head_dim)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 4, 7, head_dim)).astype(np.float32))
    back = rotation.unrotate(rotation.rotate(k))
    np.testing.assert_allclose(np.array(back), np.array(k), atol=1e-5)
    scores = q @ k.swapaxes(-1, -2)
    rotated = rotation.rotate(q) @ rotation.rotate(k).swapaxes(-1, -2)
    np.testing.assert_allclose(np.array(rotated), np.array(scores), atol=1e-4)
    # Norms are kept row by row, so the quantizer's scale sees the same energy.
    np.testing.assert_allclose(
        np.linalg.norm(np.array(rotation.rotate(k)), axis=-1),
        np.linalg.norm(np.array(k), axis=-1),
        rtol=1e-5,
    )


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("signs", [True, False])
def test_decode_rows_are_rotated_the_same_in_any_number(head_dim: int, signs: bool) -> None:
    rotation = HadamardRotation(head_dim, layer=2, signs=signs)
    rng = np.random.default_rng(head_dim)
    x = mx.array(rng.standard_normal((1, 3, PACKED_MAX_TOKENS, head_dim)).astype(np.float32))
    chunk = mx.concatenate([x] * 4, axis=2)  # a prefill chunk's rows take the matmul
    matrix = rotation_matrix(head_dim, 2, signs)
    for got in (rotation.rotate(x), rotation.rotate(chunk)[:, :, :PACKED_MAX_TOKENS]):
        np.testing.assert_allclose(np.array(got), np.array(x) @ matrix, atol=1e-5)
    np.testing.assert_allclose(np.array(rotation.unrotate(x)), np.array(x) @ matrix.T,
                               atol=1e-5)
    # A verification's rows come out bit for bit as one decode step's each.
    for turn in (rotation.rotate, rotation.unrotate):
        one_by_one = mx.concatenate([turn(x[:, :, i:i + 1]) for i in range(x.shape[2])],
                                    axis=2)
        np.testing.assert_array_equal(np.array(turn(x)), np.array(one_by_one))


def test_keeps_dtype() -> None:
    rotation = HadamardRotation(64)
    x = mx.ones((2, 64), dtype=mx.float16)
    assert rotation.rotate(x).dtype == mx.float16
    assert rotation.unrotate(x).dtype == mx.float16


def test_spreads_an_outlier_channel_so_q4_error_drops() -> None:
    # The reason for the rotation: one large channel sets the per-row scale.
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((256, 64)).astype(np.float32)
    rows[:, 7] *= 40.0
    x = mx.array(rows)
    rotation = HadamardRotation(64, layer=1)

    def q4_error(values: mx.array) -> float:
        codes, scales = kvquant.quantize_rows(values, 4)
        back = kvquant.dequantize_rows(codes, scales, 4, 64, mx.float32)
        return float(mx.mean((back - values) ** 2))

    plain = q4_error(x)
    rotated = q4_error(rotation.rotate(x))  # rotation is orthonormal: same error norm
    assert rotated < plain / 4


def test_signs_depend_on_layer_and_are_fixed_by_the_format() -> None:
    first, second = layer_signs(64, 0), layer_signs(64, 1)
    assert set(np.unique(first)) == {-1.0, 1.0}
    assert (first != second).any()
    np.testing.assert_array_equal(first, layer_signs(64, 0))
    # Longer rows than one sha256 digest (256 bits) extend the stream, not repeat it.
    long = layer_signs(512, 0)
    np.testing.assert_array_equal(long[:64], first)
    assert (long[:256] != long[256:]).any()


def test_format_ids_round_trip() -> None:
    with_signs = HadamardRotation(64, layer=2)
    plain = HadamardRotation(64, layer=2, signs=False)
    assert with_signs.format_id == f"{FORMAT}+signs"
    assert plain.format_id == FORMAT
    for rotation in (with_signs, plain):
        again = rotation_for(rotation.format_id, 64, 2)
        x = mx.arange(64, dtype=mx.float32)
        np.testing.assert_array_equal(np.array(again.rotate(x)), np.array(rotation.rotate(x)))
    assert rotation_for(None, 64, 2) is None
    with pytest.raises(EngineError, match="hadamard-v9"):
        rotation_for("hadamard-v9", 64, 2)

