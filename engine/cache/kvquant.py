"""KV row quantization: the storage format of the paged cache.

One symmetric quantizer serves every quantized mode: per row (one token of one KV
head, ``head_dim`` values) ``scale = max|row| / qmax`` stored as float16, and
``q = clip(round(x / scale), -qmax, qmax)``. Codes are biased into an unsigned
field (``u = q + qmax + 1``) and packed as a little-endian bit stream, which is
bit-identical to MLX's affine quantized layout (value ``i`` at bit ``bits * i``).
That is the seed's row format (:func:`row_format_bytes`), the one snapshots store.

In memory each row keeps its scale in the form MLX's quantized kernels read, so
``mx.quantized_matmul`` computes ``q @ K^T`` straight from the stored bytes with
nothing converted per step: a float16 scale and bias (``-bias * scale``) per MLX
group of the row (:func:`affine_scales`; 8 bytes a row at head_dim 256 instead of
the format's 2). A scale is capped where MLX's float16 read of the largest code
(``scale * u``, before the bias) would overflow, so the quantized modes hold about
±32k: a larger value is stored clipped there, never read back as inf (a snapshot
stored under the earlier cap is quantized again when read: :func:`within_cap`).

The fp16 mode stores the values themselves: ``quantize_rows(x, 16)`` returns the
float16 values (``[..., head_dim]``, i.e. ``2 * head_dim`` bytes per row) and
``None`` for the scales.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from engine.cache import fusion
from engine.cache.modes import FULL_PRECISION_BITS, MODES, KvMode, packed_group
from engine.errors import UnsupportedModeError

__all__ = ["MODES"]  # re-exported: kvquant is where the storage code looks for it

Packer = Callable[[mx.array], mx.array]

_SCALE_BYTES = 2  # one float16 scale (or bias) per row, or per MLX group of a row
_MLX_GROUP_SIZES: tuple[int, ...] = (128, 64, 32)  # largest first: fewest scales per row

# Smallest positive float16 (subnormal): keeps an all-zero row's scale non-zero.
_SCALE_FLOOR = 2.0**-24
_FP16_MAX = 65504.0


def bits_for(mode: KvMode) -> int:
    """Bits per stored value of a mode (16 for fp16)."""
    return MODES[mode].bits


def _quantized_width(bits: int, what: str) -> int:
    """``bits`` when a registered packing stores that width; else raises.

    Every width-dependent number is computed from a width that passed here, so a
    width no packing stores can never be put on another width's grid.
    """
    if bits not in _PACKERS:
        raise UnsupportedModeError(
            f"No {what} for a {bits}-bit KV width; supported widths: {sorted(_PACKERS)}."
        )
    return bits


def qmax_for(bits: int) -> int:
    """Largest code magnitude of a quantized width (127, 31, 7)."""
    return 2 ** (_quantized_width(bits, "clip bound") - 1) - 1


def bias_for(bits: int) -> int:
    """Offset added to signed codes to store them unsigned (128, 32, 8)."""
    return 2 ** (_quantized_width(bits, "code bias") - 1)


def _group(bits: int) -> tuple[int, int]:
    """(values, bytes) of the smallest run of ``bits``-bit values that fills whole bytes."""
    if bits != FULL_PRECISION_BITS:
        _quantized_width(bits, "packing")
    return packed_group(bits)


def _fits(head_dim: int, bits: int) -> bool:
    return head_dim > 0 and head_dim % _group(bits)[0] == 0


def packed_dim(head_dim: int, bits: int) -> int:
    """Bytes one row of ``head_dim`` values takes in storage (scales excluded).

    Raises:
        UnsupportedModeError: the width is unknown or ``head_dim`` does not split
            into whole packed groups.
    """
    values, nbytes = _group(bits)
    if head_dim <= 0 or head_dim % values:
        fitting = [m for m, row in MODES.items()
                   if row.bits != FULL_PRECISION_BITS and _fits(head_dim, row.bits)]
        hint = f" Use {' or '.join(fitting)} for this model." if fitting else ""
        raise UnsupportedModeError(
            f"This model's head_dim is {head_dim}, but {bits}-bit KV storage packs "
            f"{values} values per group and needs head_dim % {values} == 0.{hint}"
        )
    return head_dim // values * nbytes


def mlx_group_size(head_dim: int) -> int | None:
    """Largest MLX group size that divides ``head_dim`` (None: MLX's quantized
    kernels cannot read this model's rows)."""
    return next((g for g in _MLX_GROUP_SIZES if head_dim % g == 0), None)


def scale_groups(head_dim: int) -> int:
    """Scales (and biases) a row keeps in memory: one per MLX group, or one."""
    group = mlx_group_size(head_dim)
    return head_dim // group if group else 1


def kv_bytes_per_token(head_dim: int, mode: KvMode) -> int:
    """Bytes one token takes for one KV head in memory, keys and values together.

    Codes plus a float16 scale and bias per MLX group (:func:`scale_groups`);
    fp16 stores the values alone.
    """
    bits = bits_for(mode)
    if bits == FULL_PRECISION_BITS:
        return 2 * packed_dim(head_dim, bits)
    return 2 * (packed_dim(head_dim, bits) + 2 * _SCALE_BYTES * scale_groups(head_dim))


def row_format_bytes(head_dim: int, mode: KvMode) -> int:
    """Bytes of one token of one KV head in the seed's row format (codes and one
    float16 scale per row, keys and values): what a snapshot stores."""
    bits = bits_for(mode)
    scale_bytes = 0 if bits == FULL_PRECISION_BITS else _SCALE_BYTES
    return 2 * (packed_dim(head_dim, bits) + scale_bytes)


def project_kv_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int, mode: KvMode) -> int:
    """Bytes a cache of ``tokens`` tokens takes over ``layers`` attention layers."""
    return layers * kv_heads * tokens * kv_bytes_per_token(head_dim, mode)


@functools.cache
def scale_cap(bits: int) -> float:
    """The largest float16 scale whose every code reads back finite in float16 math:
    MLX's affine read computes ``scale * u`` (``u`` up to ``2 * bias - 1``) in the
    queries' dtype before it adds the bias."""
    return _largest_fp16_scale(2 * bias_for(bits) - 1)


def _largest_fp16_scale(factor: int) -> float:
    """The largest float16 ``s`` with ``s * factor`` at most float16's largest value."""
    cap = np.float16(_FP16_MAX / factor)
    while float(cap) * factor > _FP16_MAX:
        cap = np.nextafter(cap, np.float16(0))
    return float(cap)


def _row_scales(x: mx.array, qmax: int, cap: float) -> mx.array:
    """Float16 scales, rounded up so that ``max|row| / scale <= qmax`` after storage.

    Rounding the scale down to float16 would push the largest value past qmax and
    the clip would break ``|x - x_hat| <= scale / 2``; rounding up never does.
    Scales saturate at ``cap`` (:func:`scale_cap`; values beyond ``qmax * cap`` clip).
    """
    exact = mx.maximum(mx.max(mx.abs(x), axis=-1, keepdims=True) / qmax, _SCALE_FLOOR)
    exact = mx.minimum(exact, cap)
    stored = exact.astype(mx.float16)
    return mx.where(stored.astype(mx.float32) < exact, _next_up(stored), stored)


def _next_up(stored: mx.array) -> mx.array:
    """The next float16 above each positive ``stored``, elementwise (fusable).

    Adding between half an ulp and one ulp rounds to the next value: for a normal
    float16 ``v`` in ``[2^e, 2^(e+1))`` the ulp is ``2^(e-10)`` and
    ``v * 1.01 * 2^-11`` lies in ``[0.505, 1.01)`` ulps; a subnormal's ulp is
    ``2^-24``, so 0.6 of it. (Bit arithmetic on a view would break the compiled
    quantizer into three kernels.)
    """
    value = stored.astype(mx.float32)
    normal = value * (1 + 1.01 * 2.0**-11)
    subnormal = value + 0.6 * 2.0**-24
    return mx.where(value < 2.0**-14, subnormal, normal).astype(mx.float16)


def _pack8(u: mx.array) -> mx.array:
    return u


def _unpack8(packed: mx.array) -> mx.array:
    return packed


def _pack6(u: mx.array) -> mx.array:
    # Byte k of a group of four codes holds the bits of codes k and k + 1 that fall
    # in it: ``(u[k] >> 2k) | (u[k + 1] << (6 - 2k))`` (the seed's three formulas).
    # Elementwise over two strided views, so a compiled quantizer packs in the
    # kernel that computes the codes: no stack, no copy.
    groups = u.reshape(*u.shape[:-1], -1, 4)
    shift = mx.array([0, 2, 4], dtype=mx.uint8)
    low = groups[..., 0:3] >> shift
    high = (groups[..., 1:4] << (6 - shift)) & 0xFF
    return (low | high).reshape(*u.shape[:-1], -1)


def _unpack6(packed: mx.array) -> mx.array:
    groups = packed.reshape(*packed.shape[:-1], -1, 3)
    byte0, byte1, byte2 = (groups[..., i] for i in range(3))
    u0 = byte0 & 0x3F
    u1 = (byte0 >> 6) | ((byte1 & 0x0F) << 2)
    u2 = (byte1 >> 4) | ((byte2 & 0x03) << 4)
    u3 = byte2 >> 2
    return mx.stack([u0, u1, u2, u3], axis=-1).reshape(*packed.shape[:-1], -1)


def _pack4(u: mx.array) -> mx.array:
    pairs = u.reshape(*u.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack4(packed: mx.array) -> mx.array:
    low = packed & 0x0F
    high = packed >> 4
    return mx.stack([low, high], axis=-1).reshape(*packed.shape[:-1], -1)


_PACKERS: dict[int, tuple[Packer, Packer]] = {
    8: (_pack8, _unpack8),
    6: (_pack6, _unpack6),
    4: (_pack4, _unpack4),
}


def register_packing(bits: int, pack: Packer, unpack: Packer) -> None:
    """Store ``bits``-bit codes with ``pack`` and read them with ``unpack``.

    ``pack`` takes unsigned codes ``[..., head_dim]`` (uint8) and returns their
    little-endian bit stream ``[..., packed_dim]`` (value ``i`` at bit ``bits * i``,
    MLX's affine layout, which its quantized kernels read); ``unpack`` inverts it.
    A mode of that width is then added with :meth:`engine.cache.modes.ModeRegistry.add`.
    """
    _PACKERS[bits] = (pack, unpack)
    _compiled_quantizer.cache_clear()


def unregister_packing(bits: int) -> None:
    """Forget a packing :func:`register_packing` added."""
    del _PACKERS[bits]
    _compiled_quantizer.cache_clear()


def quantize_rows(x: mx.array, bits: int) -> tuple[mx.array, mx.array | None]:
    """Quantize and pack rows of ``x`` along the last axis.

    Args:
        x: values, any float dtype, shape ``[..., head_dim]``.
        bits: 8, 6 or 4; 16 stores the float16 values unchanged.

    Returns:
        ``(codes, scales)``: uint8 codes ``[..., packed_dim]`` and float16 scales
        ``[..., 1]``. For ``bits == 16``: float16 values ``[..., head_dim]`` and None.
    """
    if bits == FULL_PRECISION_BITS:
        return _to_fp16(x), None
    packed_dim(x.shape[-1], bits)  # validates head_dim before any work
    return _compiled_quantizer(bits)(x)


def _to_fp16(x: mx.array) -> mx.array:
    """``x`` as float16, clipped to +-65504 instead of overflowing to inf, NaN as 0.

    The fp16 page store is float16, but bfloat16 (and float32) activations can
    exceed its range; one inf key turns a whole softmax row into NaN, while a
    clipped value only saturates that one score. :func:`count_clipped_rows` says
    how many rows were clipped. A NaN is stored as 0 (:func:`_finite`).
    """
    return _compiled_fp16(x)


def _finite(x: mx.array) -> mx.array:
    """``x`` in float32 with NaN as 0 (infinities stay, for the caller's clip).

    Every stored row is finite: a read weighs the rows it hides by 0, but 0 times
    NaN is NaN, and a page's hidden rows may be another conversation's (a freed
    page's old rows, rows a rewind left behind). A NaN quantized would also make
    its row's scale NaN, and the whole row read back NaN.
    """
    return mx.nan_to_num(x.astype(mx.float32), nan=0.0, posinf=mx.inf, neginf=-mx.inf)


def _finite_fp16(x: mx.array) -> mx.array:
    # Clip in float32: bfloat16 has no 65504 (it rounds to 65536, which is inf in fp16).
    return mx.clip(_finite(x), -_FP16_MAX, _FP16_MAX).astype(mx.float16)


_compiled_fp16 = fusion.compiled(_finite_fp16)


def count_clipped_rows(x: mx.array) -> mx.array:
    """Rows of ``x`` (last axis) that fp16 storage clips: some ``|value| > 65504``.

    Lazy: a scalar uint32 array, so a caller can add it to what it evaluates anyway.
    """
    over = mx.any(mx.abs(x.astype(mx.float32)) > _FP16_MAX, axis=-1)
    return mx.sum(over.astype(mx.uint32))


def _quantize_packed(x: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    qmax, bias = qmax_for(bits), bias_for(bits)
    pack, _ = _PACKERS[_quantized_width(bits, "packer")]
    values = _finite(x)
    scales = _row_scales(values, qmax, scale_cap(bits))
    q = mx.clip(mx.round(values / scales.astype(mx.float32)), -qmax, qmax)
    return pack((q + bias).astype(mx.uint8)), scales


def _quantize_affine(x: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    codes, scales = _quantize_packed(x, bits)
    return codes, _scale_and_bias(scales, bits)


def _scale_and_bias(scales: mx.array, bits: int) -> mx.array:
    """``[2, ..., 1]``: each row's scale, then its bias ``-bias * scale`` (exact in
    float16: the bias is a power of two and the scale is capped)."""
    factors = mx.array([1.0, -bias_for(bits)], dtype=mx.float16).reshape(
        2, *([1] * scales.ndim))
    return scales.astype(mx.float16)[None] * factors


def quantize_for_store(x: mx.array, bits: int, groups: int) -> tuple[mx.array, mx.array | None]:
    """Rows of ``x`` in the in-memory format: codes and MLX scales and biases.

    Args:
        x: values, any float dtype, ``[..., head_dim]``.
        bits: 8, 6 or 4; 16 stores the float16 values unchanged.
        groups: scales per row (:func:`scale_groups`).

    Returns:
        ``(codes, scale_and_bias)``: codes as :func:`quantize_rows` gives them and
        float16 ``[2, ..., groups]`` (scales, then biases; a broadcast view of one per
        row); for 16 bits the float16 values and None.
    """
    if bits == FULL_PRECISION_BITS:
        return _to_fp16(x), None
    packed_dim(x.shape[-1], bits)  # validates head_dim before any work
    codes, scale_and_bias = _compiled_quantizer(bits, affine=True)(x)
    return codes, mx.broadcast_to(scale_and_bias, (*scale_and_bias.shape[:-1], groups))


def affine_scales(scales: mx.array, bits: int, groups: int) -> mx.array:
    """Row scales (``[..., 1]``, the row format's, at most :func:`scale_cap`: see
    :func:`within_cap`) as the in-memory ``[2, ..., groups]``."""
    pairs = _scale_and_bias(scales, bits)
    return mx.broadcast_to(pairs, (*pairs.shape[:-1], groups))


def within_cap(codes: mx.array, scales: mx.array, bits: int,
               head_dim: int) -> tuple[mx.array, mx.array]:
    """Stored rows (row format) whose scales are all at most :func:`scale_cap`.

    A snapshot stored before the cap was lowered may hold larger scales, whose
    largest codes MLX's float16 read turns to inf (the attention then to NaN).
    Those rows are quantized again from their values: the same values, a larger
    one clipped at the cap's range, as it would be stored now. One host read
    of the largest scale (per restored layer) decides.
    """
    if float(mx.max(scales.astype(mx.float32))) <= scale_cap(bits):
        return codes, scales
    values = dequantize_rows(codes, scales, bits, head_dim)
    requantized, capped = quantize_rows(values, bits)
    assert capped is not None  # quantized modes always have scales
    return requantized, capped


@functools.cache
def _compiled_quantizer(
    bits: int, affine: bool = False
) -> Callable[[mx.array], tuple[mx.array, mx.array]]:
    """``_quantize_packed`` (or ``_quantize_affine``) for ``bits``, compiled on first call.

    One decode step quantizes a single row per head and layer, where per-op launch
    overhead dominates; compiling fuses the dozen element-wise ops (bit-identical
    codes and scales). Compiled on first call, not at import, so importing this
    module (as model discovery does on a pool thread) calls no MLX function.
    """
    _quantized_width(bits, "quantizer")
    quantize = _quantize_affine if affine else _quantize_packed
    return fusion.compiled(functools.partial(quantize, bits=bits))


def dequantize_rows(
    codes: mx.array,
    scales: mx.array | None,
    bits: int,
    head_dim: int,
    dtype: mx.Dtype = mx.float32,
) -> mx.array:
    """Inverse of :func:`quantize_rows`: ``scale * (u - bias)`` as ``dtype``.

    Args:
        codes: packed uint8 codes ``[..., packed_dim]`` (float16 values for 16 bits).
        scales: float16 scales ``[..., 1]`` (ignored for 16 bits).
        bits: 8, 6, 4 or 16.
        head_dim: values per row.
        dtype: result dtype; float32 by default because the CPU backend emulates fp16.
    """
    if bits == FULL_PRECISION_BITS:
        return codes.astype(dtype)
    if codes.shape[-1] != packed_dim(head_dim, bits):
        raise UnsupportedModeError(
            f"Packed rows hold {codes.shape[-1]} bytes, but {bits}-bit rows of "
            f"head_dim {head_dim} hold {packed_dim(head_dim, bits)}."
        )
    if scales is None:
        raise UnsupportedModeError(f"{bits}-bit rows cannot be read without their scales.")
    _, unpack = _PACKERS[_quantized_width(bits, "unpacker")]
    signed = unpack(codes).astype(mx.float32) - bias_for(bits)
    return (signed * scales.astype(mx.float32)).astype(dtype)
