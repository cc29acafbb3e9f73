"""Stored KV is reused only by the exact weights that made it: the fingerprint
covers every byte of every weight file, is cached by file identity, and stored
KV of other weights is set aside once, for its own chat and for every other."""

from __future__ import annotations

import json
import shutil
import stat
import struct
import threading
from pathlib import Path

import numpy as np
import pytest

from engine.events import Finished, ModelLoaded, Notice, SessionOpened
from engine.runtime.worker import EngineWorker
from engine.snapshots import SnapshotStore, fingerprint
from engine.snapshots.fingerprint import model_fingerprint
from tests.engine.runtime.test_worker import EventLog
from tests.engine.tinymodels import make_tiny_model_dir

DOC = "The quick brown fox jumps over the lazy dog. Longleaf pines grow in sand. " * 6
QUESTION = {"role": "user", "content": "What grows in sand?"}
SET_ASIDE = ("Stored KV from a different version of this model was set aside; the "
             "conversation is read again.")


def change_a_tensor_mid_file(weights: Path, factor: float = 1.25) -> str:
    """Scale the float32 tensor holding the file's middle byte, in place: the same
    names, shapes, offsets and size, the first and last bytes untouched. Returns
    the tensor's name."""
    raw = weights.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + length])
    middle = (len(raw) - 8 - length) // 2
    name, entry = next((n, e) for n, e in header.items() if n != "__metadata__"
                       and e["data_offsets"][0] <= middle < e["data_offsets"][1])
    assert entry["dtype"] == "F32"
    start, end = (8 + length + o for o in entry["data_offsets"])
    # Outside what a header-and-samples fingerprint reads (the first and last 64 KiB).
    assert start >= 8 + length + 64 * 1024 and end <= len(raw) - 64 * 1024
    values = np.frombuffer(raw[start:end], dtype=np.float32) * np.float32(factor)
    with open(weights, "r+b") as out:
        out.seek(start)
        out.write(values.astype(np.float32).tobytes())
    return name


@pytest.fixture
def three_copies(tmp_path: Path) -> dict[str, Path]:
    """The same tiny model as ``original``; ``changed`` (same folder name, one tensor
    in the middle of the file scaled); ``copy`` (unchanged, another path and name)."""
    original = make_tiny_model_dir(tmp_path / "a", "llama")
    changed = tmp_path / "b" / original.name
    shutil.copytree(original, changed)
    change_a_tensor_mid_file(changed / "model.safetensors")
    copy = tmp_path / "c" / "same-weights-elsewhere"
    shutil.copytree(original, copy)
    return {"original": original, "changed": changed, "copy": copy}


def test_a_tensor_changed_mid_file_changes_the_fingerprint(three_copies):
    digests = {k: model_fingerprint(v)["digest"] for k, v in three_copies.items()}
    assert digests["changed"] != digests["original"]
    assert digests["copy"] == digests["original"]


def test_a_second_fingerprint_reads_no_weight_byte(three_copies, monkeypatch):
    folder = three_copies["original"]
    first = model_fingerprint(folder)
    cache = fingerprint._cache_path()
    assert stat.S_IMODE(cache.stat().st_mode) == 0o600
    monkeypatch.setattr(fingerprint, "_known", {})  # a new process: only the file cache

    def no_hashing(path: Path) -> str:
        raise AssertionError(f"{path} hashed again")

    monkeypatch.setattr(fingerprint, "hash_file", no_hashing)
    assert model_fingerprint(folder) == first
    # Any write to the file (here: the same bytes) changes its ctime: hashed again.
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes())
    with pytest.raises(AssertionError, match="hashed again"):
        model_fingerprint(folder)


def _reading(log: EventLog, engine: EngineWorker, chat: str, messages) -> tuple[Finished, list]:
    log.result(engine.open_session(chat, "q8", 16), SessionOpened)
    ending = log.ending(engine.ingest(chat, messages, threading.Event()))
    assert isinstance(ending, Finished), ending
    notices = [e.message for e in log.for_request(ending.request_id) if isinstance(e, Notice)]
    return ending, notices


def test_stored_kv_of_other_weights_is_never_reused_and_told_once(three_copies, tmp_path):
    document = [{"role": "user", "content": DOC}]
    log = EventLog()
    engine = EngineWorker(log, snapshots=SnapshotStore(tmp_path / "kv"))
    engine.start()
    try:
        log.result(engine.load_model(str(three_copies["original"])), ModelLoaded)
        first, _ = _reading(log, engine, "x", document)
        held = first.stats.prompt_tokens
        assert log.ending(engine.close_session("x")).reason == "done"
        stored, _ = _reading(log, engine, "z", document)
        assert stored.stats.reused_tokens == held  # the same weights: reused
        assert log.ending(engine.close_session("z")).reason == "done"

        log.result(engine.load_model(str(three_copies["changed"])), ModelLoaded)
        # Another chat's KV of the old weights serves no new chat ...
        fresh, notices = _reading(log, engine, "y", document)
        assert fresh.stats.reused_tokens == 0 and notices == []
        assert log.ending(engine.close_session("y", store=False)).reason == "done"
        # ... nor its own chat: read again, told once.
        again, notices = _reading(log, engine, "x", [*document, QUESTION])
        assert again.stats.reused_tokens == 0
        assert again.stats.prefill_tokens == again.stats.prompt_tokens
        assert notices == [SET_ASIDE]
        assert log.ending(engine.close_session("x", store=False)).reason == "done"
        later, notices = _reading(log, engine, "x", [*document, QUESTION])
        assert later.stats.reused_tokens == 0 and notices == []

        # The same weights at another path are the same model: "z" is reused.
        log.result(engine.load_model(str(three_copies["copy"])), ModelLoaded)
        back, notices = _reading(log, engine, "z", [*document, QUESTION])
        assert back.stats.reused_tokens == held and notices == []
    finally:
        engine.shutdown(timeout=10.0)
