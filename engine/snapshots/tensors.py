"""Safetensors written and read one array at a time, checksummed as they stream.

``mx.save_safetensors`` evaluates every array before writing, so saving a cache
would hold a second copy of all its pages; ``mx.load`` then keeps each array it
has read for as long as the dict lives, and the checksum needs a pass of its
own. Here the writer evaluates and writes one array, hashes its bytes and lets
it go before the next; the reader hands out arrays in file order, hashing every
byte it passes, so one read both loads and verifies. The files are plain
safetensors (``mx.load`` reads them, and this reader reads ``mx.save_safetensors``'
files), so the snapshot format does not change.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, Protocol

import mlx.core as mx
import numpy as np

_LENGTH = struct.Struct("<Q")
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on the JSON header
_SKIP_BLOCK = 1 << 20
_METADATA = "__metadata__"

# safetensors dtype name -> (MLX dtype, numpy dtype of the same bytes)
_DTYPES: dict[str, tuple[mx.Dtype, np.dtype]] = {
    "BOOL": (mx.bool_, np.dtype(np.bool_)),
    "U8": (mx.uint8, np.dtype(np.uint8)),
    "U16": (mx.uint16, np.dtype(np.uint16)),
    "U32": (mx.uint32, np.dtype(np.uint32)),
    "U64": (mx.uint64, np.dtype(np.uint64)),
    "I8": (mx.int8, np.dtype(np.int8)),
    "I16": (mx.int16, np.dtype(np.int16)),
    "I32": (mx.int32, np.dtype(np.int32)),
    "I64": (mx.int64, np.dtype(np.int64)),
    "F16": (mx.float16, np.dtype(np.float16)),
    "BF16": (mx.bfloat16, np.dtype(np.uint16)),  # numpy has no bfloat16: move the bits
    "F32": (mx.float32, np.dtype(np.float32)),
}
_NAMES = {mlx: name for name, (mlx, _) in _DTYPES.items()}


class BadTensors(Exception):
    """The file is not the safetensors its header describes (damaged or truncated)."""


def _header(arrays: dict[str, mx.array], metadata: dict[str, str]) -> bytes:
    header: dict[str, object] = {_METADATA: metadata}
    offset = 0
    for key, value in arrays.items():
        if value.dtype not in _NAMES:
            raise TypeError(f"{key} is {value.dtype}, which a snapshot cannot store.")
        # Shapes and sizes are known before evaluation: nothing is computed yet.
        header[key] = {"dtype": _NAMES[value.dtype], "shape": list(value.shape),
                       "data_offsets": [offset, offset + value.nbytes]}
        offset += value.nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # keeps the data 8-byte aligned, as the spec advises
    return _LENGTH.pack(len(encoded)) + encoded


def _raw(value: mx.array) -> memoryview:
    value = mx.contiguous(value.view(mx.uint16) if value.dtype == mx.bfloat16 else value)
    mx.eval(value)
    # mx.array exports the buffer protocol, which MLX's stubs do not declare.
    return memoryview(value).cast("B")  # type: ignore[arg-type]


def write_streamed(out: BinaryIO, arrays: dict[str, mx.array], metadata: dict[str, str]) -> str:
    """Write ``arrays`` to ``out`` as safetensors; returns the sha256 of all bytes written.

    The dict is emptied as it goes: each array is evaluated, written and dropped
    before the next is touched, so the memory held beyond the source is one
    array's bytes (a layer's keys or values), not a copy of everything.
    """
    digest = hashlib.sha256()
    header = _header(arrays, metadata)
    out.write(header)
    digest.update(header)
    for key in list(arrays):
        data = _raw(arrays.pop(key))
        out.write(data)
        digest.update(data)
        del data
    return digest.hexdigest()


class StoredArrays(Protocol):
    """What a restore reads stored arrays through: a dict, or :class:`StreamedTensors`."""

    def __contains__(self, key: object, /) -> bool: ...

    def __getitem__(self, key: str, /) -> mx.array: ...

    def pop(self, key: str, default: None, /) -> mx.array | None: ...


class StreamedTensors:
    """A safetensors file's arrays, read forward once while its bytes are hashed.

    Behaves as a read-only mapping of name to array. An array asked for is read
    (with every byte before it) if it has not been yet; arrays passed on the way
    are kept until asked for, so asking in file order keeps at most one array
    in memory, and ``pop`` lets it go. Call :meth:`finish` for the file's sha256.

    Args:
        path: the file.
        size: its size as recorded when written; a header pointing past it is
            damage, not a reason to read on.

    Raises:
        BadTensors: the header is unreadable or describes more than the file holds.
    """

    def __init__(self, path: Path, size: int) -> None:
        self._file = open(path, "rb")  # noqa: SIM115 -- closed by finish() or close()
        self._digest = hashlib.sha256()
        self._position = 0
        self._size = size
        try:
            self._entries = self._read_header()
        except BaseException:
            self.close()
            raise
        self._pending: Iterator[tuple[str, dict]] = iter(
            sorted(self._entries.items(), key=lambda item: item[1]["data_offsets"][0]))
        self._held: dict[str, mx.array] = {}

    def _read(self, count: int) -> bytes:
        data = self._file.read(count)
        if len(data) != count:
            raise BadTensors("the file ends early")
        self._digest.update(data)
        self._position += len(data)
        return data

    def _read_header(self) -> dict[str, dict]:
        (length,) = _LENGTH.unpack(self._read(_LENGTH.size))
        if length > min(_MAX_HEADER, self._size - _LENGTH.size):
            raise BadTensors("the header is longer than the file")
        try:
            header = json.loads(self._read(length))
            header.pop(_METADATA, None)
            self._base = self._position
            for entry in header.values():
                start, end = (int(x) for x in entry["data_offsets"])
                mlx_dtype, _ = _DTYPES[entry["dtype"]]
                count = int(np.prod(entry["shape"], dtype=np.int64))
                if not 0 <= start <= end <= self._size - self._base \
                        or end - start != count * mlx_dtype.size:
                    raise BadTensors("an array lies outside the file")
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise BadTensors(f"unreadable header ({error})") from error
        return header

    def _skip_to(self, offset: int) -> None:
        if offset < self._position:
            raise BadTensors("arrays overlap")
        while self._position < offset:
            self._read(min(_SKIP_BLOCK, offset - self._position))

    def _read_next(self) -> bool:
        item = next(self._pending, None)
        if item is None:
            return False
        key, entry = item
        start, end = entry["data_offsets"]
        self._skip_to(self._base + start)
        mlx_dtype, np_dtype = _DTYPES[entry["dtype"]]
        raw = np.frombuffer(self._read(end - start), dtype=np_dtype).reshape(entry["shape"])
        value = mx.array(raw)
        self._held[key] = value.view(mlx_dtype) if value.dtype != mlx_dtype else value
        return True

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __getitem__(self, key: str) -> mx.array:
        if key not in self._entries:
            raise KeyError(key)
        while key not in self._held:
            if not self._read_next():
                raise KeyError(key)  # a key asked for twice after pop
        return self._held[key]

    def get(self, key: str, default: mx.array | None = None) -> mx.array | None:
        return self[key] if key in self._entries else default

    def pop(self, key: str, default: mx.array | None = None) -> mx.array | None:
        """The array, no longer kept here (it is freed once its last user is)."""
        value = self.get(key, default)
        self._held.pop(key, None)
        return value

    def finish(self) -> str:
        """Read (and hash) the rest of the file; its sha256. Closes the file.

        Arrays not asked for yet are read and kept, so they can still be asked for.
        """
        try:
            while self._read_next():
                pass
            self._skip_to(self._size)
            if self._file.read(1):
                raise BadTensors("the file is longer than recorded")
            return self._digest.hexdigest()
        finally:
            self.close()

    def close(self) -> None:
        self._file.close()


def write_file(path: Path, arrays: dict[str, mx.array], metadata: dict[str, str],
               mode: int) -> str:
    """Create ``path`` (which must not exist) with ``mode`` and stream ``arrays`` into it.

    Returns:
        The sha256 of the file's bytes.
    """
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as out:
        return write_streamed(out, arrays, metadata)
