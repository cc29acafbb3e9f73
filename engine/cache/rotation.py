"""An orthonormal Hadamard rotation of key and value rows.

The per-row quantizer takes one scale per row from ``max|row|``, so a single outlier
channel sets the step for every other value in the row. Multiplying each row by an
orthonormal Hadamard matrix spreads every channel over the whole row before the
scale is taken; since the matrix is orthonormal, ``q·k`` is unchanged when the
queries get the same rotation, and the attention output comes back with the
transpose.

Format ``hadamard-v1`` (what snapshots and sessions record):

- the row of ``head_dim`` values is split into power-of-two blocks, largest first
  (``96 = 64 + 32``, ``80 = 64 + 16``); a power-of-two head_dim is one block;
- each value is first multiplied by a sign: ``-1`` where bit ``i`` of
  ``sha256(b"longleaf-hadamard-v1/layer=<layer>")`` (repeated by hashing the
  digest again for rows longer than 256) is set, ``+1`` otherwise;
- each block is then multiplied by the Sylvester Hadamard matrix of its size,
  scaled by ``1/sqrt(size)``.

So ``rotate(x) = x @ R`` with ``R = diag(signs) · blockdiag(H_n / sqrt(n))``, and
``unrotate(y) = y @ Rᵀ``. A prefill chunk takes one dense ``head_dim × head_dim``
matmul: on the CPU it is faster than a fast Walsh–Hadamard transform at head_dim
64/128/256 (measured: docs/benchmark-runs.md). Under the GPU attention schedule
every call does, one kernel (a query's with the attention's scale folded into
``R``). Under the CPU schedule a decode step and a speculative verification take
MLX's transform instead: a matmul rounds by how many rows it holds (BLAS picks its
kernel by shape), the transform rounds every row the same way, so a verified
token gets the numbers its decode step would have.
"""

from __future__ import annotations

import hashlib
import math

import mlx.core as mx
import numpy as np

from engine.cache.attention import schedule
from engine.cache.attention.scratch import PACKED_MAX_TOKENS
from engine.errors import EngineError

FORMAT = "hadamard-v1"
_SEED_PREFIX = b"longleaf-hadamard-v1/layer="


def power_of_two_blocks(head_dim: int) -> tuple[int, ...]:
    """``head_dim`` as a sum of powers of two, largest first (its binary digits)."""
    if head_dim < 1:
        raise ValueError(f"head_dim must be positive, got {head_dim}.")
    return tuple(1 << bit for bit in reversed(range(head_dim.bit_length())) if head_dim >> bit & 1)


def hadamard(size: int) -> np.ndarray:
    """The orthonormal Sylvester Hadamard matrix of a power-of-two ``size``."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"A Hadamard block needs a power-of-two size, got {size}.")
    matrix = np.ones((1, 1))
    while matrix.shape[0] < size:
        matrix = np.block([[matrix, matrix], [matrix, -matrix]])
    return matrix / math.sqrt(size)


def layer_signs(head_dim: int, layer: int) -> np.ndarray:
    """The ±1 sign of each channel for ``layer``, from the format's sha256 rule."""
    digest = hashlib.sha256(_SEED_PREFIX + str(layer).encode()).digest()
    stream = bytearray(digest)
    while len(stream) * 8 < head_dim:
        digest = hashlib.sha256(digest).digest()
        stream.extend(digest)
    bits = np.unpackbits(np.frombuffer(bytes(stream), dtype=np.uint8), bitorder="little")
    return 1.0 - 2.0 * bits[:head_dim].astype(np.float64)


def rotation_matrix(head_dim: int, layer: int, signs: bool = True) -> np.ndarray:
    """``R`` (float64) such that ``rotate(x) = x @ R``; orthonormal."""
    matrix = np.zeros((head_dim, head_dim))
    start = 0
    for size in power_of_two_blocks(head_dim):
        matrix[start : start + size, start : start + size] = hadamard(size)
        start += size
    if signs:
        matrix = layer_signs(head_dim, layer)[:, None] * matrix
    return matrix


class HadamardRotation:
    """Rotates rows (last axis) of keys, values and queries of one attention layer.

    Args:
        head_dim: values per row.
        layer: the layer's index in the model; picks the sign flips.
        signs: apply the layer's random sign flips (part of the format id).
    """

    def __init__(self, head_dim: int, layer: int = 0, signs: bool = True) -> None:
        self.head_dim = head_dim
        self.layer = layer
        self.signs = signs
        matrix = rotation_matrix(head_dim, layer, signs)
        self._forward = mx.array(matrix.astype(np.float32))
        self._inverse = mx.array(np.ascontiguousarray(matrix.T, dtype=np.float32))
        self._signs = mx.array(layer_signs(head_dim, layer).astype(np.float32) if signs
                               else np.ones(head_dim, dtype=np.float32))
        self._blocks = power_of_two_blocks(head_dim)
        self._cast: dict[mx.Dtype, tuple[mx.array, mx.array, mx.array]] = {}
        self._scaled_forward: dict[tuple[mx.Dtype, float], mx.array] = {}

    @property
    def format_id(self) -> str:
        """What the stored rows are: ``hadamard-v1`` plus its sign rule."""
        return f"{FORMAT}+signs" if self.signs else FORMAT

    def _matrices(self, dtype: mx.Dtype) -> tuple[mx.array, mx.array, mx.array]:
        if dtype not in self._cast:
            self._cast[dtype] = (self._forward.astype(dtype), self._inverse.astype(dtype),
                                 self._signs.astype(dtype))
        return self._cast[dtype]

    def _transform(self, x: mx.array) -> mx.array:
        """``x @ blockdiag(H_n / sqrt(n))``: one Walsh–Hadamard transform per block."""
        if len(self._blocks) == 1:
            return mx.hadamard_transform(x)
        starts = np.cumsum((0, *self._blocks[:-1]))
        return mx.concatenate([mx.hadamard_transform(x[..., start:start + size])
                               for start, size in zip(starts, self._blocks, strict=True)],
                              axis=-1)

    def rotate(self, x: mx.array) -> mx.array:
        """``x`` (``[..., tokens, head_dim]``) in the rotated basis."""
        forward, _, signs = self._matrices(x.dtype)
        if _per_row(x):
            return self._transform(x * signs)
        return x @ forward

    def rotate_query(self, x: mx.array, scale: float = 1.0) -> mx.array:
        """:meth:`rotate` for queries, times ``scale`` (the dispatcher's name; rows
        not stored). Under the GPU schedule the scale rides in the matmul's matrix."""
        if _per_row(x):
            rotated = self.rotate(x)
            return rotated if scale == 1.0 else rotated * scale
        return x @ self._scaled(x.dtype, scale)

    def _scaled(self, dtype: mx.Dtype, scale: float) -> mx.array:
        key = (dtype, scale)
        if key not in self._scaled_forward:
            self._scaled_forward[key] = (self._forward * scale).astype(dtype)
        return self._scaled_forward[key]

    def unrotate(self, x: mx.array) -> mx.array:
        """The inverse of :meth:`rotate`."""
        _, inverse, signs = self._matrices(x.dtype)
        if _per_row(x):
            return self._transform(x) * signs
        return x @ inverse

    def __repr__(self) -> str:
        return f"HadamardRotation({self.format_id}, head_dim={self.head_dim}, layer={self.layer})"


def _per_row(x: mx.array) -> bool:
    """Whether ``x`` takes the transform that rounds each row alike: a decode step's or
    a verification's rows (per head) under the CPU schedule."""
    return schedule.current() == schedule.CPU and _decode_sized(x)


def _decode_sized(x: mx.array) -> bool:
    """A decode step's or a verification's rows (per head), not a prefill chunk's."""
    return x.ndim >= 2 and x.shape[-2] <= PACKED_MAX_TOKENS


def rotation_for(format_id: str | None, head_dim: int, layer: int) -> HadamardRotation | None:
    """The rotation a recorded format id names (None: rows stored as given).

    Raises:
        EngineError: an id this version does not know (a newer format).
    """
    if format_id is None:
        return None
    if format_id == f"{FORMAT}+signs":
        return HadamardRotation(head_dim, layer, signs=True)
    if format_id == FORMAT:
        return HadamardRotation(head_dim, layer, signs=False)
    raise EngineError(f"Unknown KV rotation format {format_id!r}; this version reads {FORMAT}.")
