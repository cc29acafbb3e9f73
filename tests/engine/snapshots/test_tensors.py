"""Snapshots stream: a save holds one array beyond the cache, a load reads the file once."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from engine.snapshots import SnapshotRejected, load_snapshot, save_snapshot, tensors
from tests.engine.snapshot_fixtures import cache_session, config_only_model, filled_cache

MODE = "q8"
TOKENS = 512  # two 256-token pages per layer
LAYERS = 8


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    return config_only_model(tmp_path)


def _largest_array(cache: list) -> int:
    return max(a.nbytes for layer in cache for a in layer.state[:4] if a is not None)


def _extra_peak(step) -> int:
    """MLX bytes ``step`` allocated at its peak beyond what was held before it."""
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    step()
    return mx.get_peak_memory() - before


def test_a_save_holds_one_array_at_a_time_not_a_copy_of_the_cache(model_dir, tmp_path):
    cache = filled_cache(MODE, TOKENS, LAYERS)
    session = cache_session(cache, TOKENS, MODE, model_dir)
    kv_bytes = sum(layer.nbytes for layer in cache)
    extra = _extra_peak(lambda: save_snapshot(session, tmp_path / "kv", "chat"))
    # Gathering one array and making it contiguous: two of the largest at most,
    # where evaluating everything before writing held all of the cache again.
    assert extra <= 2 * _largest_array(cache) < kv_bytes / 2


def test_a_load_reads_verifies_and_restores_without_holding_the_file(model_dir, tmp_path):
    cache = filled_cache(MODE, TOKENS, LAYERS)
    save_snapshot(cache_session(cache, TOKENS, MODE, model_dir), tmp_path / "kv", "chat")
    expected = [[np.array(a) for a in layer.state[:4]] for layer in cache]
    target = filled_cache(MODE, TOKENS, LAYERS)
    for layer in target:  # storage kept, pages given back: the load refills them
        layer._drop_last(layer.offset, release=False)
    session = cache_session(target, 0, MODE, model_dir)
    prompt = list(range(TOKENS))
    extra = _extra_peak(lambda: load_snapshot(session, tmp_path / "kv", "chat", prompt,
                                              keep_last=False))
    assert session.tokens == prompt
    restored = [[np.array(a) for a in layer.state[:4]] for layer in target]
    assert all(np.array_equal(r, e) for rs, es in zip(restored, expected, strict=True)
               for r, e in zip(rs, es, strict=True))
    # One array read plus the rewrite of one layer's page storage; holding the whole
    # file until the end (as mx.load's dict did) is the cache's size again.
    assert extra < sum(layer.nbytes for layer in cache) / 2


class _Counting:
    def __init__(self, handle, read: list[int]) -> None:
        self.handle, self.sizes = handle, read

    def read(self, n: int = -1) -> bytes:
        block = self.handle.read(n)
        self.sizes.append(len(block))
        return block

    def close(self) -> None:
        self.handle.close()


def test_the_data_file_is_read_once(model_dir, tmp_path, monkeypatch):
    cache = filled_cache(MODE, TOKENS, 2)
    manifest = save_snapshot(cache_session(cache, TOKENS, MODE, model_dir), tmp_path, "chat")
    data = tmp_path / json.loads(manifest.read_text())["data_file"]
    opened, read = [], []
    real_open = open

    def counting_open(path, *args, **kwargs):
        handle = real_open(path, *args, **kwargs)
        if Path(path) != data:
            return handle
        opened.append(path)
        return _Counting(handle, read)

    def no_second_reader(*args, **kwargs):
        raise AssertionError("mx.load would read the file again")

    monkeypatch.setattr("builtins.open", counting_open)
    monkeypatch.setattr(mx, "load", no_second_reader)
    session = cache_session(filled_cache(MODE, TOKENS, 2), 0, MODE, model_dir)
    for layer in session.cache:
        layer._drop_last(layer.offset, release=False)
    load_snapshot(session, tmp_path, "chat", list(range(TOKENS)), keep_last=False)
    assert len(opened) == 1 and sum(read) == data.stat().st_size
    assert session.tokens == list(range(TOKENS))


def test_a_wrong_checksum_found_at_the_end_leaves_nothing_restored(model_dir, tmp_path):
    cache = filled_cache(MODE, TOKENS, 2)
    manifest = save_snapshot(cache_session(cache, TOKENS, MODE, model_dir), tmp_path, "chat")
    data = tmp_path / json.loads(manifest.read_text())["data_file"]
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01  # the last byte: every layer is restored before it is read
    data.write_bytes(bytes(raw))
    session = cache_session(filled_cache(MODE, TOKENS, 2), 0, MODE, model_dir)
    resets = []
    session.reset = lambda: resets.append(True)
    with pytest.raises(SnapshotRejected) as caught:
        load_snapshot(session, tmp_path, "chat", list(range(TOKENS)), keep_last=False)
    assert caught.value.reason == "corrupt" and "checksum" in str(caught.value)
    assert resets and session.tokens == [] and not data.exists()


ARRAYS = {
    "codes": mx.arange(24, dtype=mx.uint8).reshape(2, 3, 4),
    "scales": mx.array([[0.5], [-1.25]], dtype=mx.float16),
    "state": mx.array([1.5, -2.0, 3.25], dtype=mx.bfloat16),
    "wide": mx.arange(5, dtype=mx.float32) / 3,
    "flags": mx.array([True, False, True]),
    "transposed": mx.arange(6, dtype=mx.int32).reshape(2, 3).T,
}


def _equal(a: mx.array, b: mx.array) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool(mx.array_equal(a, b))


def test_streamed_files_are_safetensors_mlx_reads(tmp_path):
    path = tmp_path / "a.safetensors"
    arrays = dict(ARRAYS)
    digest = tensors.write_file(path, arrays, {"format": "test"}, 0o600)
    assert arrays == {}  # handed over one by one
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    loaded = mx.load(str(path))
    assert all(_equal(loaded[k], v) for k, v in ARRAYS.items())


def test_the_reader_reads_mlx_files_in_any_order_and_hashes_every_byte(tmp_path):
    path = tmp_path / "b.safetensors"
    mx.save_safetensors(str(path), ARRAYS, metadata={"format": "test"})
    size = path.stat().st_size
    reader = tensors.StreamedTensors(path, size)
    for key in reversed(list(ARRAYS)):
        assert _equal(reader.pop(key), ARRAYS[key])
    assert "missing" not in reader and reader.get("missing") is None
    assert reader.finish() == hashlib.sha256(path.read_bytes()).hexdigest()


def test_the_writer_writes_each_array_before_evaluating_the_next(monkeypatch):
    order = []
    real_raw = tensors._raw

    def recording_raw(value):
        order.append(("eval", value.size))
        return real_raw(value)

    class Recording(io.BytesIO):
        def write(self, data):
            order.append(("write", len(data)))
            return super().write(data)

    monkeypatch.setattr(tensors, "_raw", recording_raw)
    sizes = [a.size for a in ARRAYS.values()]
    tensors.write_streamed(Recording(), dict(ARRAYS), {})
    assert order[0][0] == "write"  # the header
    evals = [i for i, (kind, _) in enumerate(order) if kind == "eval"]
    assert [order[i][1] for i in evals] == sizes
    assert all(order[i + 1][0] == "write" for i in evals)


@pytest.mark.parametrize("damage", ["truncate", "long_header", "bad_offsets"])
def test_a_damaged_file_is_refused(tmp_path, damage):
    path = tmp_path / "c.safetensors"
    tensors.write_file(path, dict(ARRAYS), {}, 0o600)
    raw = path.read_bytes()
    if damage == "truncate":
        raw = raw[:-3]
    elif damage == "long_header":
        raw = (10**9).to_bytes(8, "little") + raw[8:]
    else:
        raw = raw.replace(b'"data_offsets":[0,', b'"data_offsets":[9,', 1)
    path.write_bytes(raw)
    with pytest.raises(tensors.BadTensors):
        reader = tensors.StreamedTensors(path, len(raw))
        for key in ARRAYS:
            reader.pop(key)
        reader.finish()
