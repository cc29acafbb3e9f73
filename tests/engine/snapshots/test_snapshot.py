"""KV snapshots on tiny models: exact reopen, integrity checks, crash safety,
mode conversion and the disk budget."""

from __future__ import annotations

import json
import os
import random
import signal
import stat
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.utils import load

from engine.cache import adapter, kvquant
from engine.cache.paged_cache import PagedKVCache
from engine.cache.rotation import HadamardRotation
from engine.models.loader import load_model
from engine.models.probe import MLX_LM, ProbeResult
from engine.session.sampling import SamplingParams
from engine.session.session import Session
from engine.snapshots import (
    SnapshotError,
    SnapshotRejected,
    SnapshotStore,
    delete_snapshot,
    list_snapshots,
    load_snapshot,
    save_snapshot,
    snapshot_info,
)
from engine.snapshots import files as snapshot_files
from tests.engine.tinymodels import make_tiny_model_dir

REPO = Path(__file__).resolve().parents[3]
PAGE = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
DOC = "The quick brown fox jumps over the lazy dog. Longleaf pines grow in sand. " * 8
OTHER_DOC = "How vexingly quick daft zebras jump! The five boxing wizards jump quickly. " * 8
QUESTION = "What is the capital of France?"


def _loaded(folder: Path) -> SimpleNamespace:
    model, tokenizer = load(str(folder))
    info = SimpleNamespace(max_context=4096, path=str(folder))
    return SimpleNamespace(model=model, tokenizer=tokenizer, info=info, folder=folder)


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SimpleNamespace]:
    root = tmp_path_factory.mktemp("snapshot-models")
    loaded = {arch: _loaded(make_tiny_model_dir(root, arch))
              for arch in ("llama", "qwen3_next", "gemma3_text")}
    loaded["llama-seed1"] = _loaded(make_tiny_model_dir(root, "llama", seed=1))
    return loaded


def _session(loaded: SimpleNamespace, mode: str = "q8", rotate: bool | None = None) -> Session:
    session = Session("chat", loaded, mode, page_size=PAGE, rotate=rotate)
    session.model_dir = loaded.folder
    return session


def _user(*texts: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text} for text in texts]


def _quiet() -> dict[str, Any]:
    return {"request_id": 1, "cancel": threading.Event(), "emit": lambda e: None,
            "tick": lambda: None}


def _ingest(session: Session, messages: list[dict[str, str]]) -> None:
    session.ingest(messages, **_quiet())


def _answer(session: Session, messages: list[dict[str, str]]) -> list[int]:
    tokens: list[int] = []
    quiet = {**_quiet(), "emit": lambda e: tokens.extend(getattr(e, "token_ids", ()) or ())}
    session.chat(messages, GREEDY, **quiet)
    return tokens


def _pages(session: Session) -> list[list[np.ndarray | None]]:
    """Every paged layer's held pages, as numpy arrays (None for fp16 scales)."""
    return [
        [None if a is None else np.array(a) for a in layer.state[:4]]
        for layer in session.cache if isinstance(layer, PagedKVCache)
    ]


def _same_pages(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or (x is not None and y is not None and np.array_equal(x, y))
        for la, lb in zip(a, b, strict=True) for x, y in zip(la, lb, strict=True)
    )


# -- reopen is exact ---------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "gemma3_text"])
def test_reopened_document_answers_like_the_uninterrupted_session(models, arch, tmp_path):
    loaded = models[arch]
    original = _session(loaded)
    _ingest(original, _user(DOC))
    stored = list(original.tokens)
    save_snapshot(original, tmp_path, "chat")
    follow = _user(DOC, QUESTION)
    expected = _answer(original, follow)

    reopened = _session(loaded)
    prompt = reopened.render(follow, add_generation_prompt=True)
    reused = load_snapshot(reopened, tmp_path, "chat", prompt)
    assert reused == len(stored) and reopened.tokens == stored
    assert adapter.cache_tokens(reopened.cache) == len(stored)
    assert _answer(reopened, follow) == expected
    # Only the new turn was computed: the prompt's last token is fed by the first step.
    assert reopened.tokens_ingested == len(prompt) - 1 - reused


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_reopened_chat_continues_after_its_answer_token_identically(models, arch, tmp_path):
    loaded = models[arch]
    original = _session(loaded)
    first = _user(DOC)
    answer = _answer(original, first)
    first_prompt = original.render(first, add_generation_prompt=True)
    save_snapshot(original, tmp_path, "chat")
    follow = [*first, {"role": "assistant", "content": loaded.tokenizer.decode(answer)},
              *_user(QUESTION)]
    expected = _answer(original, follow)

    reopened = _session(loaded)
    prompt = reopened.render(follow, add_generation_prompt=True)
    stored = json.loads((tmp_path / "chat.json").read_text())
    reused = load_snapshot(reopened, tmp_path, "chat", prompt)
    if arch == "llama":
        assert reused >= len(first_prompt)
    else:
        # The random answer does not survive decode and re-encode, so the stored ids
        # differ inside it, where linear-attention state cannot rewind: the reopen
        # goes back to the checkpoint the session took where the answer began.
        assert prompt[: len(stored["tokens"])] != stored["tokens"]
        assert reused == len(first_prompt) - 1
        assert reused in [c["tokens"] for c in stored["checkpoints"]]
        assert [c.tokens for c in reopened.checkpoints.kept][-1] == reused
    assert reopened.tokens == prompt[:reused]
    assert _answer(reopened, follow) == expected


def test_pages_are_restored_byte_for_byte(models, tmp_path):
    original = _session(models["llama"])
    _ingest(original, _user(DOC))
    save_snapshot(original, tmp_path, "chat")
    reopened = _session(models["llama"])
    load_snapshot(reopened, tmp_path, "chat", original.tokens, keep_last=False)
    assert _same_pages(_pages(reopened), _pages(original))


def test_a_conversation_that_differs_midway_reuses_the_common_prefix(models, tmp_path):
    original = _session(models["llama"], "fp16")
    _ingest(original, _user(DOC))
    save_snapshot(original, tmp_path, "chat")
    edited = _user(DOC[: len(DOC) // 2] + " Zürich café naïve " + DOC[len(DOC) // 2 :], QUESTION)
    reopened = _session(models["llama"], "fp16")
    prompt = reopened.render(edited, add_generation_prompt=True)
    keep = next(i for i, (a, b) in enumerate(zip(original.tokens, prompt, strict=False)) if a != b)
    assert 0 < keep < len(original.tokens)
    assert load_snapshot(reopened, tmp_path, "chat", prompt) == keep
    assert reopened.tokens == prompt[:keep]
    assert adapter.cache_tokens(reopened.cache) == keep
    fresh = _session(models["llama"], "fp16")
    assert _answer(reopened, edited) == _answer(fresh, edited)


def test_linear_attention_that_differs_midway_is_read_again(models, tmp_path):
    original = _session(models["qwen3_next"])
    _ingest(original, _user(DOC))
    save_snapshot(original, tmp_path, "chat")
    reopened = _session(models["qwen3_next"])
    prompt = reopened.render(_user(DOC[:40] + " zebras", QUESTION), add_generation_prompt=True)
    with pytest.raises(SnapshotRejected) as caught:
        load_snapshot(reopened, tmp_path, "chat", prompt)
    assert caught.value.reason == "diverged" and not caught.value.removed
    assert reopened.tokens == [] and adapter.cache_tokens(reopened.cache) == 0
    assert snapshot_info(tmp_path, "chat") is not None


def test_a_session_holding_more_is_left_alone(models, tmp_path):
    session = _session(models["llama"])
    _ingest(session, _user(DOC))
    save_snapshot(session, tmp_path, "chat")
    _ingest(session, _user(DOC, QUESTION))
    held = list(session.tokens)
    assert load_snapshot(session, tmp_path, "chat", held, keep_last=False) == len(held)
    assert session.tokens == held


def test_missing_snapshot_reuses_nothing(models, tmp_path):
    session = _session(models["llama"])
    assert load_snapshot(session, tmp_path, "nothing", [1, 2, 3]) == 0


# -- integrity -----------------------------------------------------------------------


@pytest.fixture
def saved(models, tmp_path) -> tuple[Session, Path]:
    session = _session(models["llama"])
    _ingest(session, _user(DOC))
    return session, save_snapshot(session, tmp_path, "chat")


def _data_file(manifest: Path) -> Path:
    return manifest.parent / json.loads(manifest.read_text())["data_file"]


def _assert_rejected_and_removed(models, folder: Path, prompt: list[int]) -> None:
    session = _session(models["llama"])
    with pytest.raises(SnapshotRejected) as caught:
        load_snapshot(session, folder, "chat", prompt)
    assert caught.value.reason == "corrupt" and caught.value.removed
    assert "\n" not in str(caught.value)
    assert session.tokens == [] and adapter.cache_tokens(session.cache) == 0
    assert list(folder.iterdir()) == []


@pytest.mark.parametrize("where", [0.5, 0.99, 0.02])
def test_a_flipped_byte_in_the_data_is_detected_and_removed(models, saved, where):
    session, manifest = saved
    data = _data_file(manifest)
    raw = bytearray(data.read_bytes())
    raw[int(len(raw) * where)] ^= 0x01
    data.write_bytes(bytes(raw))
    _assert_rejected_and_removed(models, manifest.parent, [*session.tokens, 1])


def test_a_flipped_byte_in_the_manifest_is_detected_and_removed(models, saved):
    session, manifest = saved
    text = manifest.read_text()
    stored = json.loads(text)["tokens"]
    # Change one stored token id: the JSON stays valid, only the self-hash catches it.
    original = f"[{stored[0]},{stored[1]},"
    assert original in text
    manifest.write_text(text.replace(original, f"[{stored[0]},{stored[1] + 1},", 1))
    _assert_rejected_and_removed(models, manifest.parent, [*session.tokens, 1])


def test_truncated_data_is_detected_and_removed(models, saved):
    session, manifest = saved
    data = _data_file(manifest)
    data.write_bytes(data.read_bytes()[:-100])
    _assert_rejected_and_removed(models, manifest.parent, [*session.tokens, 1])


def test_data_without_a_manifest_is_removed(models, saved):
    session, manifest = saved
    manifest.unlink()
    _assert_rejected_and_removed(models, manifest.parent, [*session.tokens, 1])


def test_a_manifest_without_data_is_removed(models, saved):
    session, manifest = saved
    _data_file(manifest).unlink()
    _assert_rejected_and_removed(models, manifest.parent, [*session.tokens, 1])


def test_kv_computed_by_other_model_code_is_set_aside(models, saved, monkeypatch):
    # An update of MLX or of mlx-lm's module for the model (a RoPE fix) changes the
    # values every layer writes; the weights' fingerprint alone let the old rows pass.
    from engine.snapshots import fingerprint

    session, manifest = saved
    now = fingerprint.session_code(session)
    monkeypatch.setattr(fingerprint, "_mlx_version", lambda: "0.99.0")
    fresh = _session(models["llama"])
    with pytest.raises(SnapshotRejected) as caught:
        load_snapshot(fresh, manifest.parent, "chat", [*session.tokens, 1])
    assert caught.value.reason == "code" and caught.value.set_aside
    assert "another version of MLX or of mlx-lm's code" in str(caught.value)
    assert fresh.tokens == [] and not manifest.exists()
    assert fingerprint.session_code(session) != now


def test_kv_stored_before_its_code_was_recorded_is_set_aside(models, saved):
    session, manifest = saved
    _reseal(manifest, lambda record: record.pop("code"))
    with pytest.raises(SnapshotRejected) as caught:
        load_snapshot(_session(models["llama"]), manifest.parent, "chat", [*session.tokens, 1])
    assert caught.value.reason == "code" and caught.value.set_aside


def test_a_data_file_the_disk_fails_to_read_now_is_kept(models, saved, monkeypatch):
    # An external or network disk's passing error (EIO, a timeout) is no damage: the
    # good snapshot was deleted, and the document read again at every reopen after.
    import errno

    from engine.snapshots import snapshot as snapshot_module

    session, manifest = saved
    data = _data_file(manifest)
    real = snapshot_module.tensors.StreamedTensors

    def failing(path, size):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(snapshot_module.tensors, "StreamedTensors", failing)
    fresh = _session(models["llama"])
    with pytest.raises(SnapshotRejected) as caught:
        load_snapshot(fresh, manifest.parent, "chat", [*session.tokens, 1])
    assert caught.value.reason == "unreadable" and not caught.value.removed
    assert "Input/output error" in str(caught.value) and "kept" in str(caught.value)
    assert manifest.exists() and data.exists()
    monkeypatch.setattr(snapshot_module.tensors, "StreamedTensors", real)
    again = _session(models["llama"])
    assert load_snapshot(again, manifest.parent, "chat", [*session.tokens, 1]) > 0


def test_a_snapshot_saved_again_while_it_was_read_is_not_removed(models, saved, monkeypatch):
    # Another process (the CLI beside the app) saves the chat again between this
    # reader's manifest and its data file: the old data file is gone, the new
    # snapshot is whole, and removing "chat" by name deleted it.
    from engine.snapshots import snapshot as snapshot_module

    session, manifest = saved
    real_check = snapshot_module._check_shape

    def saved_meanwhile(record):
        real_check(record)
        _ingest(session, _user(DOC, "And more."))
        save_snapshot(session, manifest.parent, "chat")

    monkeypatch.setattr(snapshot_module, "_check_shape", saved_meanwhile)
    with pytest.raises(SnapshotRejected) as caught:
        load_snapshot(_session(models["llama"]), manifest.parent, "chat", [*session.tokens, 1])
    assert caught.value.reason == "changed" and not caught.value.removed
    monkeypatch.setattr(snapshot_module, "_check_shape", real_check)
    assert manifest.exists() and _data_file(manifest).exists()
    again = _session(models["llama"])
    assert load_snapshot(again, manifest.parent, "chat", [*session.tokens, 1]) > 0


def _reseal(manifest: Path, change) -> None:
    """Rewrite the manifest through ``change`` and seal it again, as an attacker or a
    buggy writer could: its own checksum then passes."""
    from engine.snapshots.manifest import sealed

    record = json.loads(manifest.read_text())
    record.pop("manifest_sha256")
    change(record)
    manifest.write_bytes(sealed(record))


def _set_aside_files(folder: Path) -> list[str]:
    return sorted(p.name.split(".")[0] + p.suffix for p in (folder / "set-aside").iterdir())


@pytest.mark.parametrize("other", ["llama-seed1", "qwen3_next"])
def test_another_models_snapshot_is_set_aside_once(models, saved, other):
    session, manifest = saved
    stranger = _session(models[other])
    with pytest.raises(SnapshotRejected) as caught:
        load_snapshot(stranger, manifest.parent, "chat", [*session.tokens, 1])
    assert caught.value.reason == "model" and caught.value.set_aside
    assert not caught.value.removed
    assert "another model" in str(caught.value) and "set aside" in str(caught.value)
    assert stranger.tokens == [] and adapter.cache_tokens(stranger.cache) == 0
    assert not manifest.exists()
    assert _set_aside_files(manifest.parent) == ["chat.json", "chat.safetensors"]
    # Told once: the next reopen finds nothing to refuse.
    assert load_snapshot(stranger, manifest.parent, "chat", [*session.tokens, 1]) == 0


def test_an_older_format_version_is_set_aside_once(models, saved):
    session, manifest = saved
    _reseal(manifest, lambda m: m.update(version=1))
    reopened = _session(models["llama"])
    with pytest.raises(SnapshotRejected) as caught:
        load_snapshot(reopened, manifest.parent, "chat", [*session.tokens, 1])
    assert caught.value.reason == "format" and caught.value.set_aside
    assert "earlier version of Longleaf" in str(caught.value)
    assert _set_aside_files(manifest.parent) == ["chat.json", "chat.safetensors"]
    assert load_snapshot(reopened, manifest.parent, "chat", [*session.tokens, 1]) == 0


def test_a_newer_format_version_is_refused_and_kept(models, saved):
    session, manifest = saved
    _reseal(manifest, lambda m: m.update(version=99))
    with pytest.raises(SnapshotRejected) as caught:
        load_snapshot(_session(models["llama"]), manifest.parent, "chat", [*session.tokens, 1])
    assert caught.value.reason == "format" and not caught.value.set_aside
    assert manifest.exists() and _data_file(manifest).exists()


def test_files_are_private(saved):
    _, manifest = saved
    assert stat.S_IMODE(manifest.parent.stat().st_mode) == 0o700
    for path in manifest.parent.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_an_empty_session_is_not_stored(models, tmp_path):
    with pytest.raises(SnapshotError):
        save_snapshot(_session(models["llama"]), tmp_path, "chat")
    assert not any(tmp_path.iterdir())


# -- kill -9 during a write -------------------------------------------------------------

_CHILD = """
import json, os, signal, sys
from pathlib import Path
from types import SimpleNamespace
import mlx.core as mx
from mlx_lm.utils import load_model
from engine.cache import adapter
from engine.snapshots import files, save_snapshot

folder, directory, mode, ids, step = sys.argv[1:6]
ids = json.loads(ids)
model, _ = load_model(Path(folder))
cache = adapter.make_cache(model, mode, page_size=int(sys.argv[6]))
model(mx.array(ids)[None], cache=cache)
mx.eval(adapter.eval_targets(cache))
session = SimpleNamespace(cache=cache, tokens=ids, mode=mode, page_size=int(sys.argv[6]),
                          model_dir=folder)

def stop_at(reached):
    if reached == step:
        os.kill(os.getpid(), signal.SIGKILL)

files.write_hook = stop_at
print("ready", flush=True)
while True:
    save_snapshot(session, directory, "chat")
    if step != "anywhere":
        break
print("finished", flush=True)
"""


def _child(loaded, folder: Path, mode: str, ids: list[int], step: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    args = [str(loaded.folder), str(folder), mode, json.dumps(ids), step, str(PAGE)]
    return subprocess.Popen([sys.executable, "-c", _CHILD, *args], env=env, cwd=REPO,
                            stdout=subprocess.PIPE, text=True)


def _reference(loaded, mode: str, messages) -> Session:
    session = _session(loaded, mode)
    _ingest(session, messages)  # one chunk: the same forward pass as the child's
    return session


def _check_survivor(models, folder: Path, candidates: list[Session]) -> Session:
    """The snapshot left after a crash loads, verified, as one complete write."""
    SnapshotStore(folder, budget_bytes=2**30)  # sweeps what the crash left
    stored = json.loads((folder / "chat.json").read_text())
    assert sorted(p.name for p in folder.iterdir()) == sorted(["chat.json", stored["data_file"]])
    match = next(c for c in candidates if c.tokens == stored["tokens"])
    reopened = _session(models["llama"], match.mode)
    assert load_snapshot(reopened, folder, "chat", match.tokens, keep_last=False) == len(
        match.tokens)
    assert _same_pages(_pages(reopened), _pages(match))
    return match


STEPS = ["data:start", "data:written", "data:committed", "manifest:written",
         "manifest:committed"]


@pytest.mark.slow
@pytest.mark.parametrize("step", STEPS)
def test_kill_9_at_each_write_step_leaves_the_old_or_the_new_snapshot(models, tmp_path, step):
    loaded = models["llama"]
    old = _reference(loaded, "fp16", _user(DOC))
    new = _reference(loaded, "fp16", _user(OTHER_DOC))
    save_snapshot(old, tmp_path, "chat")
    child = _child(loaded, tmp_path, "fp16", new.tokens, step)
    child.communicate(timeout=300)
    assert child.returncode == -signal.SIGKILL
    survivor = _check_survivor(models, tmp_path, [old, new])
    assert survivor is (new if step == "manifest:committed" else old)


@pytest.mark.slow
def test_kill_9_at_random_moments_of_repeated_writes_never_leaves_a_bad_snapshot(
    models, tmp_path
):
    loaded = models["llama"]
    old = _reference(loaded, "fp16", _user(DOC))
    new = _reference(loaded, "fp16", _user(OTHER_DOC))
    chance = random.Random(13)
    for _ in range(3):
        save_snapshot(old, tmp_path, "chat")
        child = _child(loaded, tmp_path, "fp16", new.tokens, "anywhere")
        assert child.stdout.readline().strip() == "ready"
        threading.Event().wait(chance.uniform(0.05, 0.6))
        child.send_signal(signal.SIGKILL)
        child.communicate(timeout=60)
        _check_survivor(models, tmp_path, [old, new])


# -- modes from a snapshot -----------------------------------------------------------


def _paged_layers(session: Session) -> list[PagedKVCache]:
    return [layer for layer in session.cache if isinstance(layer, PagedKVCache)]


def _requantized(codes, scales, stored: str, target: str, source, destination):
    """What conversion must give: stored rows dequantized, moved from the stored
    rotation to the target's, quantized in the target mode."""
    values = kvquant.dequantize_rows(
        mx.array(codes), None if scales is None else mx.array(scales),
        kvquant.bits_for(stored), codes.shape[-1] if stored == "fp16" else 32)
    if getattr(source, "format_id", None) != getattr(destination, "format_id", None):
        if source is not None:
            values = source.unrotate(values)
        if destination is not None:
            values = destination.rotate(values)
    return kvquant.quantize_rows(values, kvquant.bits_for(target))


@pytest.mark.parametrize(("stored", "target"), [("fp16", "q6"), ("fp16", "q4"), ("q8", "q4")])
def test_a_lower_mode_is_converted_like_fresh_quantization(models, tmp_path, stored, target):
    loaded = models["llama"]
    original = _session(loaded, stored)
    _ingest(original, _user(DOC))
    save_snapshot(original, tmp_path, "chat")
    reopened = _session(loaded, target)
    follow = _user(DOC, QUESTION)
    prompt = reopened.render(follow, add_generation_prompt=True)
    assert load_snapshot(reopened, tmp_path, "chat", prompt) == len(original.tokens)
    layers = zip(_paged_layers(original), _paged_layers(reopened), strict=True)
    for (source, destination), held, converted in zip(
        layers, _pages(original), _pages(reopened), strict=True
    ):
        for codes, scales, (out_codes, out_scales) in (
            (held[0], held[1], converted[:2]), (held[2], held[3], converted[2:]),
        ):
            want_codes, want_scales = _requantized(
                codes, scales, stored, target, source.rotation, destination.rotation)
            assert np.array_equal(np.array(want_codes), out_codes)
            assert np.array_equal(np.array(want_scales), out_scales)
    assert reopened.tokens_ingested == 0
    assert len(_answer(reopened, follow)) > 0


def test_fp16_to_q6_bytes_equal_quantizing_the_fp16_pages_directly(models, tmp_path):
    original = _session(models["llama"], "fp16")
    _ingest(original, _user(DOC))
    save_snapshot(original, tmp_path, "chat")
    reopened = _session(models["llama"], "q6")
    load_snapshot(reopened, tmp_path, "chat", original.tokens, keep_last=False)
    for layer, held, converted in zip(
        _paged_layers(reopened), _pages(original), _pages(reopened), strict=True
    ):
        rows = mx.array(held[0]).astype(mx.float32)
        if layer.rotation is not None:  # q6 stores rows in the Hadamard basis
            rows = layer.rotation.rotate(rows)
        k_codes, k_scales = kvquant.quantize_rows(rows, 6)
        assert np.array_equal(np.array(k_codes), converted[0])
        assert np.array_equal(np.array(k_scales), converted[1])


def test_pages_in_another_rotation_are_moved_into_the_sessions(models, tmp_path):
    loaded = models["llama"]
    original = _session(loaded, "q8")
    original.cache = adapter.make_cache(loaded.model, "q8", page_size=PAGE, rotate=False)
    _ingest(original, _user(DOC))
    save_snapshot(original, tmp_path, "chat")
    assert json.loads((tmp_path / "chat.json").read_text())["rotation"] is None
    reopened = _session(loaded, "q8", rotate=True)
    assert all(layer.rotation is not None for layer in _paged_layers(reopened))
    load_snapshot(reopened, tmp_path, "chat", original.tokens, keep_last=False)
    count = len(original.tokens)
    for held, restored in zip(_paged_layers(original), _paged_layers(reopened), strict=True):
        keys, _ = restored.dequantized_prefix(count, mx.float32)
        want, _ = held.dequantized_prefix(count, mx.float32)
        # Requantized in the rotated basis: close to the stored rows, not equal.
        error = np.abs(np.array(restored.rotation.unrotate(keys)) - np.array(want)).max()
        assert 0 < error < 0.05 * np.abs(np.array(want)).max()


def _as_stage(session: Session, first: int) -> Session:
    """``session``'s paged layers numbered as a pipeline stage's that starts at model
    layer ``first`` (``adapter.make_cache`` on a rank past the first)."""
    for layer in _paged_layers(session):
        layer.layer += first
        if layer.rotation is not None:
            layer.rotation = HadamardRotation(layer.head_dim, layer=layer.layer)
    return session


@pytest.mark.parametrize("first", [0, 3])
def test_a_stages_rotated_pages_are_moved_out_of_their_own_layers_rotation(
        models, tmp_path, first):
    loaded = models["llama"]
    original = _as_stage(_session(loaded, "q8", rotate=True), first)
    _ingest(original, _user(DOC))
    save_snapshot(original, tmp_path, "chat")
    reopened = _as_stage(_session(loaded, "q8", rotate=False), first)
    load_snapshot(reopened, tmp_path, "chat", original.tokens, keep_last=False)
    count = len(original.tokens)
    for held, restored in zip(_paged_layers(original), _paged_layers(reopened), strict=True):
        keys, _ = restored.dequantized_prefix(count, mx.float32)
        want, _ = held.dequantized_prefix(count, mx.float32)
        want = np.array(held.rotation.unrotate(want))
        error = np.abs(np.array(keys) - want).max()
        assert error < 0.05 * np.abs(want).max()


@pytest.mark.parametrize(("stored", "target"), [("q8", "q4"), ("fp16", "q8")])
def test_kv_of_another_mode_is_not_restored_into_mlx_lms_own_cache_and_is_kept(
        models, tmp_path, stored, target):
    base = models["llama"]
    # The probe's fallback: mlx-lm's own cache, quantized at the mode's bits.
    real = replace(load_model(base.folder, probe=False), model=base.model,
                   tokenizer=base.tokenizer, probe=ProbeResult(
                       MLX_LM, "the paged cache differs here", None, quantized=True))
    loaded = SimpleNamespace(**vars(real), folder=base.folder)
    original = _session(loaded, stored)
    _ingest(original, _user(DOC))
    save_snapshot(original, tmp_path, "chat")
    reopened = _session(loaded, target)
    with pytest.raises(SnapshotRejected) as caught:
        load_snapshot(reopened, tmp_path, "chat", original.tokens, keep_last=False)
    # Not damaged: kept, for the chat that reopens it in its own mode.
    assert caught.value.reason == "mode" and not caught.value.removed
    assert reopened.tokens == [] and (tmp_path / "chat.json").exists()
    again = _session(loaded, stored)
    assert load_snapshot(again, tmp_path, "chat", original.tokens,
                         keep_last=False) == len(original.tokens)


@pytest.mark.parametrize(("stored", "target"), [("q8", "fp16"), ("q4", "q6"), ("q6", "q8")])
def test_a_higher_mode_than_stored_needs_a_reread(models, tmp_path, stored, target):
    original = _session(models["llama"], stored)
    _ingest(original, _user(DOC))
    save_snapshot(original, tmp_path, "chat")
    reopened = _session(models["llama"], target)
    with pytest.raises(SnapshotRejected) as caught:
        load_snapshot(reopened, tmp_path, "chat", [*original.tokens, 1])
    assert caught.value.reason == "mode" and not caught.value.removed
    assert "read" in str(caught.value) and reopened.tokens == []


# -- the disk budget ---------------------------------------------------------------------


def test_store_evicts_the_least_recently_used_and_lists_what_it_holds(models, tmp_path):
    loaded = models["llama"]
    session = _session(loaded)
    _ingest(session, _user(DOC))
    one = SnapshotStore(tmp_path / "probe", budget_bytes=2**30)
    one.save(session, "probe")
    size = one.total_bytes()
    store = SnapshotStore(tmp_path / "kv", budget_bytes=int(size * 3.5))
    for name in ("a", "b", "c"):
        store.save(session, name)
    assert store.total_bytes() == sum(i.disk_bytes for i in store.per_snapshot())
    reader = _session(loaded)
    assert store.load(reader, "a", session.tokens, keep_last=False) == len(session.tokens)
    store.save(session, "d")  # b is now the least recently used
    assert [i.name for i in store.per_snapshot()] == ["d", "a", "c"]
    assert store.total_bytes() <= store.budget_bytes
    info = store.info("d")
    assert info.tokens == len(session.tokens) and info.mode == "q8"
    assert abs(info.disk_bytes - size) < 64 and info.kv_bytes == session.stats().bytes_used
    store.save(session, "a")  # replacing a snapshot frees its own bytes first
    assert sorted(i.name for i in store.per_snapshot()) == ["a", "c", "d"]
    store.clear()
    assert store.per_snapshot() == [] and store.total_bytes() == 0


def test_a_snapshot_larger_than_the_budget_is_not_written(models, tmp_path):
    session = _session(models["llama"])
    _ingest(session, _user(DOC))
    store = SnapshotStore(tmp_path, budget_bytes=1000)
    with pytest.raises(SnapshotError):
        store.save(session, "chat")
    assert store.total_bytes() == 0


def test_default_budget_is_a_tenth_of_free_disk_at_most_20_gb(tmp_path, monkeypatch):
    # The disk's free space faked: read twice, the real one moves as other tests
    # write beside this one. 20 GB as the app says sizes: 2**30 bytes each.
    from types import SimpleNamespace

    from engine.snapshots import snapshot_store

    assert snapshot_store.MAX_DEFAULT_BUDGET == 20 * 2**30
    for free in (77 * 10**9, 300 * 10**9):
        monkeypatch.setattr(snapshot_store.shutil, "disk_usage",
                            lambda _path, free=free: SimpleNamespace(free=free))
        store = SnapshotStore(tmp_path)
        assert store.budget_bytes == int(min(20 * 2**30, free * 0.10))


def test_sweep_removes_leftovers_and_keeps_snapshots(saved):
    _, manifest = saved
    folder = manifest.parent
    (folder / f"{snapshot_files.TEMP_MARK}abc-chat.x.safetensors").write_bytes(b"partial")
    (folder / "chat.0123456789ab.safetensors").write_bytes(b"orphan")
    SnapshotStore(folder, budget_bytes=2**30)
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [manifest.name, _data_file(manifest).name])


def test_listing_and_delete(saved):
    _, manifest = saved
    folder = manifest.parent
    assert [i.name for i in list_snapshots(folder)] == ["chat"]
    assert delete_snapshot(folder, "chat") and not delete_snapshot(folder, "chat")
    assert list_snapshots(folder) == [] and list(folder.iterdir()) == []


def test_bad_names_are_refused(saved):
    _, manifest = saved
    for name in ("../x", "", ".hidden", "a/b"):
        with pytest.raises(ValueError):
            snapshot_info(manifest.parent, name)


# -- other sessions' settings ------------------------------------------------------------


def test_a_session_with_another_page_size_gets_the_same_rows(models, tmp_path):
    original = _session(models["llama"])
    _ingest(original, _user(DOC))
    save_snapshot(original, tmp_path, "chat")
    reopened = Session("chat", models["llama"], "q8", page_size=24)  # not a multiple of 16
    reopened.model_dir = models["llama"].folder
    count = len(original.tokens)
    assert load_snapshot(reopened, tmp_path, "chat", original.tokens, keep_last=False) == count
    pairs = [(a, b) for a, b in zip(original.cache, reopened.cache, strict=True)
             if isinstance(a, PagedKVCache)]
    for held, restored in pairs:
        assert len(restored.block_table) == -(-count // 24)
        for x, y in zip(held.dequantized_prefix(count, mx.float32),
                        restored.dequantized_prefix(count, mx.float32), strict=True):
            assert np.array_equal(np.array(x), np.array(y))


def test_pages_beyond_the_kv_budget_are_refused_and_nothing_is_held(models, tmp_path):
    original = _session(models["llama"])
    _ingest(original, _user(DOC))
    save_snapshot(original, tmp_path, "chat")
    small = Session("chat", models["llama"], "q8", page_size=PAGE, budget_bytes=4096)
    small.model_dir = models["llama"].folder
    with pytest.raises(SnapshotRejected) as caught:
        load_snapshot(small, tmp_path, "chat", [*original.tokens, 1])
    assert caught.value.reason == "budget" and not caught.value.removed
    assert small.tokens == [] and adapter.cache_tokens(small.cache) == 0
    assert snapshot_info(tmp_path, "chat") is not None


def test_the_code_kv_is_stored_as_is_the_code_the_model_loaded_with(models, monkeypatch):
    """mlx-lm updated on disk while Longleaf runs: the KV this process computes is
    stored as the loaded code's (a restart, running the new code, sets it aside),
    not as the new code's."""
    from engine.snapshots import fingerprint

    pinned = {"mlx": "0.30.0", "mlx_lm_model": "as loaded"}
    session = _session(SimpleNamespace(**vars(models["llama"]), code=pinned))
    monkeypatch.setattr(fingerprint, "_source_digest", lambda _file: "updated on disk")
    assert fingerprint.session_code(session) == pinned
    assert fingerprint.session_code(_session(models["llama"]))["mlx_lm_model"] \
        == "updated on disk"  # a model loaded without its code pinned: the disk's


def test_a_frozen_app_without_sources_fingerprints_the_code_by_its_bytecode(monkeypatch):
    """The packaged app keeps mlx-lm as bytecode only: reading the module's source
    failed every model load (FileNotFoundError). Its bytecode is digested instead:
    the same for the same code, another for other code."""
    import mlx_lm.models.llama as llama

    from engine.snapshots import fingerprint

    from_source = fingerprint._source_digest("mlx_lm.models.llama")
    fingerprint._source_digest.cache_clear()
    monkeypatch.setattr(llama, "__file__", "/frozen/_internal/mlx_lm/models/llama.py")
    frozen = fingerprint._source_digest("mlx_lm.models.llama")
    fingerprint._source_digest.cache_clear()
    assert frozen == fingerprint._source_digest("mlx_lm.models.llama") != from_source
    fingerprint._source_digest.cache_clear()
    monkeypatch.setattr(fingerprint, "_bytecode", lambda name: name.encode() + b"@other")
    assert fingerprint._source_digest("mlx_lm.models.llama") != frozen
    fingerprint._source_digest.cache_clear()
