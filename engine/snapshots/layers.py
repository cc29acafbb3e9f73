"""Per-layer capture and restore of a session's cache, and mode conversion of pages.

Paged layers are stored as their pages exactly as held (codes and fp16 scales,
page-major, in logical order), so a reopen in the same mode restores the same
bytes. Every other layer (linear-attention arrays, rotating sliding windows) is
stored as mlx-lm's own ``state``: its arrays, plus the plain values (offsets,
window sizes) in the manifest.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from engine.cache import adapter, kvquant
from engine.cache.modes import FULL_PRECISION_BITS, MODES, KvMode
from engine.cache.paged_cache import PagedKVCache
from engine.cache.rotation import rotation_for
from engine.snapshots.tensors import StoredArrays

PAGE_PARTS: tuple[str, ...] = ("k_codes", "k_scales", "v_codes", "v_scales")
# Highest precision first: a snapshot converts to its own mode or any later one.


class LayerMismatch(Exception):
    """The stored layers do not fit this cache's layers (another layout or format)."""


def rotation_id(cache: list[Any]) -> str | None:
    """Format id of the row rotation the paged layers store (None: no rotation)."""
    for layer in cache:
        if isinstance(layer, PagedKVCache):
            return getattr(getattr(layer, "rotation", None), "format_id", None)
    return None


def can_convert(stored: KvMode, target: KvMode) -> bool:
    """Whether pages stored in ``stored`` mode can become ``target`` without a re-read."""
    return MODES.index(target) >= MODES.index(stored)


def _basis(rotation: Any) -> str | None:
    return getattr(rotation, "format_id", None)


def convert_rows(
    codes: mx.array, scales: mx.array | None, stored: KvMode, target: KvMode, head_dim: int,
    source_rotation: Any = None, target_rotation: Any = None,
) -> tuple[mx.array, mx.array | None]:
    """Stored rows of mode ``stored`` as mode ``target`` (same or lower precision).

    The rows are dequantized to float32, taken out of the stored rotation and into
    the target's when the two differ (``engine.cache.rotation``), and quantized
    again: what a fresh ``target`` cache would store for those values.
    """
    same_basis = _basis(source_rotation) == _basis(target_rotation)
    if stored == target and same_basis:
        return codes, scales
    values = kvquant.dequantize_rows(codes, scales, kvquant.bits_for(stored), head_dim)
    if not same_basis:
        if source_rotation is not None:
            values = source_rotation.unrotate(values)
        if target_rotation is not None:
            values = target_rotation.rotate(values)
    return kvquant.quantize_rows(values, kvquant.bits_for(target))


# -- capture -------------------------------------------------------------------


def _key(index: int, part: str) -> str:
    return f"layer.{index}.{part}"


def _capture_paged(index: int, layer: PagedKVCache, arrays: dict[str, mx.array]) -> dict:
    *rows, offset, _mode, _page_size, kv_heads, head_dim = layer.state
    for part, value in zip(PAGE_PARTS, rows, strict=True):
        if offset and value is not None:
            arrays[_key(index, part)] = value
    pages = len(layer.block_table) if offset else 0
    return {
        "index": index, "kind": "paged", "offset": int(offset), "kv_heads": int(kv_heads),
        "head_dim": int(head_dim), "pages": pages, "bytes": int(layer.nbytes) if offset else 0,
    }


def _capture_leaves(state: Any, prefix: str, arrays: dict[str, mx.array]) -> tuple[list, int]:
    """mlx-lm ``state`` as (path, kind, plain value) leaves; arrays go to ``arrays``."""
    leaves: list[list[Any]] = []
    nbytes = 0
    # tree_flatten returns a dict only when handed one to fill; here its list.
    for path, value in cast("list[tuple[str, Any]]", tree_flatten(state)):
        if isinstance(value, mx.array):
            arrays[f"{prefix}.{path}"] = value
            leaves.append([path, "array", None])
            nbytes += value.nbytes
        elif value is None or isinstance(value, (bool, int, float, str)):
            leaves.append([path, "value", value])
        else:
            raise TypeError(f"{prefix} holds a {type(value)}, which cannot be stored.")
    return leaves, nbytes


def _capture_state(index: int, layer: Any, arrays: dict[str, mx.array]) -> dict:
    leaves, nbytes = _capture_leaves(layer.state, _key(index, "state"), arrays)
    return {
        "index": index, "kind": "state", "class": type(layer).__name__,
        "trimmable": bool(layer.is_trimmable()), "offset": int(getattr(layer, "offset", 0) or 0),
        "leaves": leaves, "bytes": nbytes,
    }


def _checkpoint_key(number: int, index: int) -> str:
    return f"checkpoint.{number}.layer.{index}.state"


def capture_checkpoints(kept: list[Any], arrays: dict[str, mx.array]) -> list[dict]:
    """Records of a session's checkpoints (``engine.session.checkpoints.Checkpoint``)."""
    records = []
    for number, checkpoint in enumerate(kept):
        layers = []
        for index, state in checkpoint.states:
            leaves, _ = _capture_leaves(state, _checkpoint_key(number, index), arrays)
            layers.append({"index": index, "leaves": leaves})
        records.append({"tokens": int(checkpoint.tokens), "boundary": bool(checkpoint.boundary),
                        "layers": layers, "bytes": int(checkpoint.nbytes)})
    return records


def checkpoint_states(
    records: list[dict], number: int, arrays: StoredArrays
) -> tuple[tuple[int, Any], ...]:
    """``(layer index, state)`` of stored checkpoint ``number``, in fresh arrays."""
    return tuple(
        (layer["index"], _state(layer["leaves"], _checkpoint_key(number, layer["index"]), arrays))
        for layer in records[number]["layers"]
    )


def capture(cache: list[Any]) -> tuple[dict[str, mx.array], list[dict]]:
    """The arrays to store and one plain-value record per layer."""
    arrays: dict[str, mx.array] = {}
    records = [
        _capture_paged(i, layer, arrays) if isinstance(layer, PagedKVCache)
        else _capture_state(i, layer, arrays)
        for i, layer in enumerate(cache)
    ]
    return arrays, records


# -- restore -------------------------------------------------------------------


def check_layout(cache: list[Any], records: list[dict]) -> None:
    """Raise LayerMismatch unless every stored layer has the same kind as the cache's."""
    if len(records) != len(cache):
        raise LayerMismatch(f"{len(records)} stored layers for a cache of {len(cache)}")
    for record, layer in zip(records, cache, strict=True):
        paged = isinstance(layer, PagedKVCache)
        if (record["kind"] == "paged") != paged:
            raise LayerMismatch(f"layer {record['index']} is {record['kind']} in the snapshot")
        if not paged and record["class"] != type(layer).__name__:
            raise LayerMismatch(f"layer {record['index']} was a {record['class']}")


def _repage(rows: mx.array, tokens: int, stored_size: int, page_size: int) -> mx.array:
    """Pages ``[n, H, stored_size, w]`` as ``[m, H, page_size, w]`` holding ``tokens`` rows."""
    if stored_size == page_size:
        return rows[: -(-tokens // page_size)]
    flat = rows.swapaxes(0, 1).reshape(rows.shape[1], -1, rows.shape[-1])[:, :tokens]
    pages = -(-tokens // page_size)
    pad = pages * page_size - tokens
    if pad:
        flat = mx.concatenate([flat, mx.zeros((flat.shape[0], pad, flat.shape[-1]), flat.dtype)], 1)
    return flat.reshape(flat.shape[0], pages, page_size, -1).swapaxes(0, 1)


def _row_layout(mode: KvMode, head_dim: int) -> tuple[mx.Dtype, int, bool]:
    """Dtype and width of one stored row of ``mode``, and whether it has a scale."""
    bits = kvquant.bits_for(mode)
    if bits == FULL_PRECISION_BITS:
        return mx.float16, head_dim, False
    return mx.uint8, kvquant.packed_dim(head_dim, bits), True


def check_rows(
    parts: list[mx.array | None], mode: KvMode, pages: int, kv_heads: int, page_size: int,
    head_dim: int, what: str,
) -> None:
    """Raise LayerMismatch unless ``parts`` (k codes, k scales, v codes, v scales) are
    ``pages`` pages of ``mode`` rows: dtypes and shapes, never the values."""
    dtype, width, scaled = _row_layout(mode, head_dim)
    shape = (pages, kv_heads, page_size)
    for codes, scales in (parts[:2], parts[2:]):
        if codes is None or codes.dtype != dtype or tuple(codes.shape) != (*shape, width):
            found = None if codes is None else f"{codes.dtype} {tuple(codes.shape)}"
            raise LayerMismatch(f"{what} holds {found}, not {mode} rows {(*shape, width)}")
        if scaled != (scales is not None) or (
            scales is not None
            and (scales.dtype != mx.float16 or tuple(scales.shape) != (*shape, 1))
        ):
            raise LayerMismatch(f"{what} has scales that do not fit {mode} rows")


def _restore_paged(
    layer: PagedKVCache, record: dict, arrays: StoredArrays, tokens: int,
    stored_mode: KvMode, stored_page_size: int, stored_rotation: str | None,
) -> None:
    offset = min(record["offset"], tokens)
    pool = layer.pool
    rows: list[mx.array | None] = [None] * 4
    if offset:
        # Popped: each layer's stored pages are let go once that layer is restored.
        parts = [arrays.pop(_key(record["index"], p), None) for p in PAGE_PARTS]
        what = f"layer {record['index']}"
        head_dim, kv_heads = record["head_dim"], record["kv_heads"]
        # The data must be what the manifest says it is, before any of it is converted.
        check_rows(parts, stored_mode, record["pages"], kv_heads, stored_page_size, head_dim,
                   f"{what}'s stored data")
        parts = [None if p is None else _repage(p, offset, stored_page_size, pool.page_size)
                 for p in parts]
        # The rotation's signs follow the model's layer number, which on a pipeline
        # stage is not the layer's place in this rank's cache (``record["index"]``).
        rotations = (rotation_for(stored_rotation, head_dim, layer.layer), layer.rotation)
        k_codes, k_scales, v_codes, v_scales = parts
        if k_codes is None or v_codes is None:  # check_rows refused these above
            raise LayerMismatch(f"{what}'s stored data lacks its codes")
        k = convert_rows(k_codes, k_scales, stored_mode, pool.mode, head_dim, *rotations)
        v = convert_rows(v_codes, v_scales, stored_mode, pool.mode, head_dim, *rotations)
        rows = [k[0], k[1], v[0], v[1]]
        check_rows(rows, pool.mode, pool.pages_for(offset), kv_heads, pool.page_size, head_dim,
                   f"{what} as restored")
    layer.state = (*rows, offset, pool.mode, pool.page_size, record["kv_heads"], record["head_dim"])


def _state(leaves: list, prefix: str, arrays: StoredArrays) -> Any:
    values = []
    for path, kind, value in leaves:
        if kind == "array":
            key = f"{prefix}.{path}"
            if key not in arrays:
                raise LayerMismatch(f"{prefix} lacks {path}")
            # A copy: RotatingKVCache writes into its arrays in place, and one stored
            # array must never back two live states.
            value = mx.array(arrays[key])
        values.append((path, value))
    return tree_unflatten(values)


def _restore_state(layer: Any, record: dict, arrays: StoredArrays, drop: int) -> None:
    layer.state = _state(record["leaves"], _key(record["index"], "state"), arrays)
    if drop and layer.trim(drop) != drop:
        raise LayerMismatch(f"layer {record['index']} cannot rewind {drop} tokens")


def restore(
    cache: list[Any], records: list[dict], arrays: StoredArrays, *,
    tokens: int, total: int, stored_mode: KvMode, stored_page_size: int,
    stored_rotation: str | None = None,
    checkpoint: tuple[tuple[int, Any], ...] | None = None,
) -> None:
    """Put the stored layers into ``cache``, holding the first ``tokens`` of ``total``.

    ``arrays`` is a dict or an ``engine.snapshots.tensors.StreamedTensors``; each
    paged layer's arrays are popped from it as that layer is restored.

    Paged layers take only the pages those tokens need (converted to the cache's
    mode when it is lower, or to its rotation when that differs). Other layers
    are restored whole and rewound, or, given ``checkpoint`` (states taken at
    ``tokens``), take its states instead.

    Raises:
        LayerMismatch: the records or arrays do not fit the cache.
        KvBudgetExceeded: the pages do not fit the session's KV budget.
    """
    check_layout(cache, records)
    from_checkpoint = dict(checkpoint or ())
    for layer, record in zip(cache, records, strict=True):
        if record["kind"] == "paged":
            _restore_paged(layer, record, arrays, tokens, stored_mode, stored_page_size,
                           stored_rotation)
            # One layer at a time: a mode conversion's float32 rows of every layer
            # at once would take twice an fp16 cache's memory.
            mx.eval(adapter.eval_targets([layer]))
        elif checkpoint is not None:
            if record["index"] not in from_checkpoint:
                raise LayerMismatch(f"the checkpoint lacks layer {record['index']}")
            layer.state = from_checkpoint[record["index"]]
        else:
            _restore_state(layer, record, arrays, total - tokens)
