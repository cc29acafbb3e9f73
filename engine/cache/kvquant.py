"""KV row quantization: the storage format of the paged cache.

One symmetric quantizer serves every quantized mode: per row (one token of one KV
head, ``head_dim`` values) ``scale = max|row| / qmax`` stored as float16, and
``q = clip(round(x / scale), -qmax, qmax)``. Codes are biased into an unsigned
field (``u = q + qmax + 1``) and packed as a little-endian bit stream, which is
bit-identical to MLX's affine quantized layout (value ``i`` at bit ``bits * i``),
so :func:`as_mlx_affine` can hand the stored bytes to ``mx.quantized_matmul``.

The fp16 mode stores the values themselves: ``quantize_rows(x, 16)`` returns the
float16 values (``[..., head_dim]``, i.e. ``2 * head_dim`` bytes per row) and
``None`` for the scales.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx

from engine.cache import fusion
from engine.cache.modes import MODES
from engine.errors import UnsupportedModeError

__all__ = ["MODES"]  # re-exported: kvquant is where the storage code looks for it

# Every width-dependent number comes from a table and an unknown width raises:
# the seed PR found two `x if bits == 8 else y` expressions that put a new width
# on the wrong grid while allocating pages of the right size.
_BITS_BY_MODE: dict[str, int] = {"fp16": 16, "q8": 8, "q6": 6, "q4": 4}
_QMAX_BY_BITS: dict[int, int] = {8: 127, 6: 31, 4: 7}
_BIAS_BY_BITS: dict[int, int] = {8: 128, 6: 32, 4: 8}
# (values per packed group, bytes per packed group)
_GROUP_BY_BITS: dict[int, tuple[int, int]] = {16: (1, 2), 8: (1, 1), 6: (4, 3), 4: (2, 1)}
_SCALE_BYTES = 2  # one float16 scale per row
_MLX_GROUP_SIZES: tuple[int, ...] = (32, 64, 128)

_ALIASES: dict[str, str] = {
    "q8": "q8", "8": "q8", "8bit": "q8", "int8": "q8", "uint8": "q8", "q80": "q8",
    "q6": "q6", "6": "q6", "6bit": "q6", "int6": "q6", "uint6": "q6",
    "q4": "q4", "4": "q4", "4bit": "q4", "int4": "q4", "uint4": "q4", "q40": "q4",
    "fp16": "fp16", "f16": "fp16", "16": "fp16", "off": "fp16", "none": "fp16",
}
# Other projects' block formats with a different layout; accepting them would
# suggest compatibility that does not exist.
_FOREIGN_FORMATS: frozenset[str] = frozenset({"q6k", "q60"})

_ACCEPTED_NAMES = (
    "q8 (8, 8bit, int8, uint8, q8_0), q6 (6, 6bit, int6, uint6), "
    "q4 (4, 4bit, int4, uint4, q4_0), fp16 (f16, 16, off, none)"
)

# Smallest positive float16 (subnormal): keeps an all-zero row's scale non-zero.
_SCALE_FLOOR = 2.0**-24
_FP16_MAX = 65504.0


def normalize_mode(name: str | int) -> str:
    """Map a user-facing KV mode name to one of ``MODES``.

    Args:
        name: a mode name or alias; case, ``-`` and ``_`` are ignored.

    Returns:
        "fp16", "q8", "q6" or "q4".

    Raises:
        UnsupportedModeError: the name is unknown or names a foreign format.
    """
    key = str(name).strip().lower().replace("-", "").replace("_", "")
    if key in _FOREIGN_FORMATS:
        raise UnsupportedModeError(
            f"KV mode {name!r} is another project's block format and is not supported; "
            f"use q6 for Longleaf's 6-bit storage. Accepted: {_ACCEPTED_NAMES}."
        )
    if key not in _ALIASES:
        raise UnsupportedModeError(f"Unknown KV mode {name!r}. Accepted: {_ACCEPTED_NAMES}.")
    return _ALIASES[key]


def bits_for(mode: str) -> int:
    """Bits per stored value of a mode (16 for fp16)."""
    return _BITS_BY_MODE[normalize_mode(mode)]


def _table(table: dict[int, int] | dict[int, tuple[int, int]], bits: int, what: str):
    try:
        return table[bits]
    except KeyError:
        raise UnsupportedModeError(
            f"No {what} for a {bits}-bit KV width; supported widths: {sorted(table)}."
        ) from None


def qmax_for(bits: int) -> int:
    """Largest code magnitude of a quantized width (127, 31, 7)."""
    return _table(_QMAX_BY_BITS, bits, "clip bound")


def bias_for(bits: int) -> int:
    """Offset added to signed codes to store them unsigned (128, 32, 8)."""
    return _table(_BIAS_BY_BITS, bits, "code bias")


def _fits(head_dim: int, bits: int) -> bool:
    return head_dim > 0 and head_dim % _GROUP_BY_BITS[bits][0] == 0


def packed_dim(head_dim: int, bits: int) -> int:
    """Bytes one row of ``head_dim`` values takes in storage (scales excluded).

    Raises:
        UnsupportedModeError: the width is unknown or ``head_dim`` does not split
            into whole packed groups.
    """
    values, nbytes = _table(_GROUP_BY_BITS, bits, "packing")
    if head_dim <= 0 or head_dim % values:
        fitting = [m for m in ("q8", "q4") if _fits(head_dim, _BITS_BY_MODE[m])]
        hint = f" Use {' or '.join(fitting)} for this model." if fitting else ""
        raise UnsupportedModeError(
            f"This model's head_dim is {head_dim}, but {bits}-bit KV storage packs "
            f"{values} values per group and needs head_dim % {values} == 0.{hint}"
        )
    return head_dim // values * nbytes


def kv_bytes_per_token(head_dim: int, mode: str) -> int:
    """Bytes one token takes for one KV head, keys and values together, scales included."""
    bits = bits_for(mode)
    scale_bytes = 0 if bits == _BITS_BY_MODE["fp16"] else _SCALE_BYTES
    return 2 * (packed_dim(head_dim, bits) + scale_bytes)


def project_kv_bytes(layers: int, kv_heads: int, head_dim: int, tokens: int, mode: str) -> int:
    """Bytes a cache of ``tokens`` tokens takes over ``layers`` attention layers."""
    return layers * kv_heads * tokens * kv_bytes_per_token(head_dim, mode)


def _row_scales(x: mx.array, qmax: int) -> mx.array:
    """Float16 scales, rounded up so that ``max|row| / scale <= qmax`` after storage.

    Rounding the scale down to float16 would push the largest value past qmax and
    the clip would break ``|x - x_hat| <= scale / 2``; rounding up never does.
    Scales that would overflow float16 saturate at its maximum (values beyond
    ``qmax * 65504`` then clip).
    """
    exact = mx.maximum(mx.max(mx.abs(x), axis=-1, keepdims=True) / qmax, _SCALE_FLOOR)
    exact = mx.minimum(exact, _FP16_MAX)
    stored = exact.astype(mx.float16)
    bumped = (stored.view(mx.uint16) + 1).view(mx.float16)
    return mx.where(stored.astype(mx.float32) < exact, bumped, stored)


def _pack8(u: mx.array) -> mx.array:
    return u


def _unpack8(packed: mx.array) -> mx.array:
    return packed


def _pack6(u: mx.array) -> mx.array:
    groups = u.reshape(*u.shape[:-1], -1, 4)
    u0, u1, u2, u3 = (groups[..., i] for i in range(4))
    byte0 = u0 | ((u1 & 0x03) << 6)
    byte1 = (u1 >> 2) | ((u2 & 0x0F) << 4)
    byte2 = (u2 >> 4) | ((u3 & 0x3F) << 2)
    return mx.stack([byte0, byte1, byte2], axis=-1).reshape(*u.shape[:-1], -1)


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


_PACKERS: dict[int, tuple[Callable[[mx.array], mx.array], Callable[[mx.array], mx.array]]] = {
    8: (_pack8, _unpack8),
    6: (_pack6, _unpack6),
    4: (_pack4, _unpack4),
}


def quantize_rows(x: mx.array, bits: int) -> tuple[mx.array, mx.array | None]:
    """Quantize and pack rows of ``x`` along the last axis.

    Args:
        x: values, any float dtype, shape ``[..., head_dim]``.
        bits: 8, 6 or 4; 16 stores the float16 values unchanged.

    Returns:
        ``(codes, scales)``: uint8 codes ``[..., packed_dim]`` and float16 scales
        ``[..., 1]``. For ``bits == 16``: float16 values ``[..., head_dim]`` and None.
    """
    if bits == _BITS_BY_MODE["fp16"]:
        return _to_fp16(x), None
    packed_dim(x.shape[-1], bits)  # validates head_dim before any work
    return _compiled_quantizer(bits)(x)


def _to_fp16(x: mx.array) -> mx.array:
    """``x`` as float16, clipped to +-65504 instead of overflowing to inf.

    The fp16 page store is float16, but bfloat16 (and float32) activations can
    exceed its range; one inf key turns a whole softmax row into NaN, while a
    clipped value only saturates that one score. :func:`count_clipped_rows` says
    how many rows were clipped.
    """
    if x.dtype == mx.float16:
        return x
    # Clip in float32: bfloat16 has no 65504 (it rounds to 65536, which is inf in fp16).
    return mx.clip(x.astype(mx.float32), -_FP16_MAX, _FP16_MAX).astype(mx.float16)


def count_clipped_rows(x: mx.array) -> mx.array:
    """Rows of ``x`` (last axis) that fp16 storage clips: some ``|value| > 65504``.

    Lazy: a scalar uint32 array, so a caller can add it to what it evaluates anyway.
    """
    over = mx.any(mx.abs(x.astype(mx.float32)) > _FP16_MAX, axis=-1)
    return mx.sum(over.astype(mx.uint32))


def _quantize_packed(x: mx.array, bits: int) -> tuple[mx.array, mx.array]:
    qmax, bias = qmax_for(bits), bias_for(bits)
    pack, _ = _table(_PACKERS, bits, "packer")
    values = x.astype(mx.float32)
    scales = _row_scales(values, qmax)
    q = mx.clip(mx.round(values / scales.astype(mx.float32)), -qmax, qmax)
    return pack((q + bias).astype(mx.uint8)), scales


@functools.cache
def _compiled_quantizer(bits: int) -> Callable[[mx.array], tuple[mx.array, mx.array]]:
    """``_quantize_packed`` for ``bits``, compiled on first call.

    One decode step quantizes a single row per head and layer, where per-op launch
    overhead dominates; compiling fuses the dozen element-wise ops (bit-identical
    codes and scales). Compiled on first call, not at import, so importing this
    module (as model discovery does on a pool thread) calls no MLX function.
    """
    _table(_PACKERS, bits, "quantizer")
    return fusion.compiled(functools.partial(_quantize_packed, bits=bits))


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
    if bits == _BITS_BY_MODE["fp16"]:
        return codes.astype(dtype)
    if codes.shape[-1] != packed_dim(head_dim, bits):
        raise UnsupportedModeError(
            f"Packed rows hold {codes.shape[-1]} bytes, but {bits}-bit rows of "
            f"head_dim {head_dim} hold {packed_dim(head_dim, bits)}."
        )
    _, unpack = _table(_PACKERS, bits, "unpacker")
    signed = unpack(codes).astype(mx.float32) - bias_for(bits)
    return (signed * scales.astype(mx.float32)).astype(dtype)


def as_mlx_affine(
    codes: mx.array,
    scales: mx.array,
    bits: int,
    head_dim: int,
    group_size: int,
    dtype: mx.Dtype | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """Reinterpret stored rows as MLX affine-quantized weights, without repacking.

    ``mx.dequantize(w, s, b, group_size, bits)`` of the result equals
    :func:`dequantize_rows`, so ``mx.quantized_matmul(q, w, s, b, transpose=True)``
    computes ``q @ K^T`` straight from the pages.

    Args:
        codes: packed uint8 rows ``[..., packed_dim]``, contiguous in the last axis.
        scales: float16 row scales ``[..., 1]``.
        bits: 8, 6 or 4.
        head_dim: values per row; must be a multiple of ``group_size``.
        group_size: MLX group size, 32, 64 or 128.
        dtype: dtype of the returned scales and biases (default: that of ``scales``).
            The biases are ``-bias * scale``, which overflows float16 for scales above
            ``65504 / bias``; pass float32 if scales can be that large. bfloat16
            gives float32: its 8-bit mantissa cannot hold a float16 scale, which
            added ~0.08 to q8's 0.05 worst-case error on values.

    Returns:
        ``(w, scales, biases)``: uint32 words ``[..., packed_dim / 4]`` viewing the same
        bytes, and per-group scales and biases ``[..., head_dim / group_size]``.

    Raises:
        UnsupportedModeError: bits, group size or head_dim do not fit MLX's layout.
    """
    bias = bias_for(bits)
    if group_size not in _MLX_GROUP_SIZES:
        raise UnsupportedModeError(
            f"MLX quantized kernels take group sizes {_MLX_GROUP_SIZES}, not {group_size}."
        )
    if head_dim % group_size:
        raise UnsupportedModeError(
            f"head_dim {head_dim} is not a multiple of the MLX group size {group_size}; "
            "use a smaller group size or dequantize_rows for this model."
        )
    row_bytes = packed_dim(head_dim, bits)
    if codes.shape[-1] != row_bytes:
        raise UnsupportedModeError(
            f"Packed rows hold {codes.shape[-1]} bytes, but {bits}-bit rows of "
            f"head_dim {head_dim} hold {row_bytes}."
        )
    # head_dim % group_size == 0 with group_size >= 32 makes every width's row a
    # whole number of 32-bit words, so the uint32 view never straddles rows.
    words = codes.view(mx.uint32)
    groups = head_dim // group_size
    out_dtype = dtype if dtype is not None else scales.dtype
    if out_dtype == mx.bfloat16:
        # MLX's quantized kernels promote the other operand, so a bf16 model's
        # probabilities or queries meet float32 scales without a caller change.
        out_dtype = mx.float32
    group_scales = mx.repeat(scales.astype(out_dtype), groups, axis=-1)
    biases = -bias * group_scales
    return words, group_scales, biases
