"""Bad input, engine level: each case asserts the message a user sees (``Failed.message``
from the worker) or that the engine handled it and stays usable.

Documents have their own matrix in tests/engine/documents/test_matrix.py; the
memory cases are in tests/engine/memory/test_guard.py.
"""

from __future__ import annotations

import json
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from engine.events import Failed, Finished, ModelLoaded, TokenChunk
from engine.format import GB
from engine.memory.guard import MemoryGuard, MemoryReading
from engine.runtime.worker import EngineWorker
from engine.session.sampling import SamplingParams
from tests.engine.tinymodels import make_tiny_model_dir

GREEDY = SamplingParams(temperature=0.0, max_tokens=8)


class Events:
    def __init__(self) -> None:
        self.events: list[Any] = []
        self.changed = threading.Condition()

    def __call__(self, event: object) -> None:
        with self.changed:
            self.events.append(event)
            self.changed.notify_all()

    def ending(self, request_id: int) -> Finished | Failed:
        def match(e: object) -> bool:
            return isinstance(e, Finished | Failed) and e.request_id == request_id

        with self.changed:
            assert self.changed.wait_for(lambda: any(map(match, self.events)), 120.0)
            return next(e for e in self.events if match(e))

    def text(self, request_id: int) -> str:
        return "".join(e.text for e in self.events
                       if isinstance(e, TokenChunk) and e.request_id == request_id)


@pytest.fixture(scope="module")
def tiny_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bad-input-models")


@pytest.fixture
def worker() -> Iterator[tuple[EngineWorker, Events]]:
    events = Events()
    # Plenty of fake RAM: these cases are about input, not memory.
    memory = MemoryReading(64 * GB, 32 * GB)
    engine = EngineWorker(events, memory_guard=MemoryGuard(probe=lambda: memory))
    engine.start()
    yield engine, events
    engine.shutdown(timeout=10.0)


def _failed(events: Events, request_id: int) -> Failed:
    ending = events.ending(request_id)
    assert isinstance(ending, Failed), ending
    return ending


def _config(folder: Path, **changes: Any) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def _split_in_two_shards(folder: Path) -> None:
    weights = mx.load(str(folder / "model.safetensors"))
    names = sorted(weights)
    halves = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2:]}
    for file, part in halves.items():
        mx.save_safetensors(str(folder / file), {n: weights[n] for n in part})
    (folder / "model.safetensors").unlink()
    index = {"weight_map": {n: f for f, part in halves.items() for n in part}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    (folder / "model-00002-of-00002.safetensors").unlink()  # the download stopped


def _weights_folder_in_place_of_file(folder: Path) -> None:
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors").mkdir()


# (damage, the message the user sees; {folder} is the damaged folder)
BROKEN_FOLDERS: dict[str, tuple[Callable[[Path], None], str]] = {
    "no config.json": (
        lambda f: (f / "config.json").unlink(),
        "{folder} has no config.json, so it is not an mlx-lm model folder. Choose the "
        "folder that holds config.json and the .safetensors weights."),
    "config.json is not an object": (
        lambda f: (f / "config.json").write_text("[1, 2]"),
        "{folder}/config.json has no model_type, so the architecture is unknown. "
        "Download the model again or pick an mlx-lm model."),
    "config with wrong value types": (
        lambda f: _config(f, num_attention_heads="four"),
        "The config.json in {folder} does not describe a valid llama model"),
    "config with a zero size": (
        lambda f: _config(f, hidden_size=0),
        "The config.json in {folder} does not describe a valid llama model"),
    "unknown architecture": (
        lambda f: _config(f, model_type="llama9000"),
        "mlx-lm does not support the architecture 'llama9000' of {name}. Choose another "
        "model, or update Longleaf (and with it mlx-lm)."),
    "no weights": (
        lambda f: (f / "model.safetensors").unlink(),
        "{folder} has no model*.safetensors weights. mlx-lm needs safetensors; download "
        "the MLX version of the model or convert it with mlx_lm.convert."),
    "empty weights file": (
        lambda f: (f / "model.safetensors").write_bytes(b""),
        "model.safetensors in {folder} is corrupt or truncated; download the model again"),
    "weights truncated mid-tensor": (
        lambda f: (f / "model.safetensors").write_bytes(
            (f / "model.safetensors").read_bytes()[:-100]),
        "model.safetensors in {folder} is corrupt or truncated; download the model again "
        "(tensor "),
    "weights path is a folder": (
        _weights_folder_in_place_of_file,
        "model.safetensors in {folder} cannot be read (Is a directory); check that it is "
        "a file you may read, or download the model again."),
    "a shard of two is missing": (
        _split_in_two_shards,
        "{folder} is missing 1 weight file(s) listed in model.safetensors.index.json "
        "(model-00002-of-00002.safetensors); the download is incomplete. Download the "
        "model again."),
    "no tokenizer": (
        lambda f: (f / "tokenizer.json").unlink(),
        "{folder} has no tokenizer (tokenizer.json or tokenizer.model). Copy the tokenizer "
        "files from the original model into this folder, or download it again."),
    "corrupt tokenizer.json": (
        lambda f: (f / "tokenizer.json").write_text("{not json"),
        "The tokenizer files in {folder} cannot be read"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_FOLDERS))
def test_broken_model_folder_message(case: str, tiny_root: Path, tmp_path: Path,
                                     worker) -> None:
    engine, events = worker
    folder = tmp_path / "My Model"
    shutil.copytree(make_tiny_model_dir(tiny_root, "llama"), folder)
    damage, expected = BROKEN_FOLDERS[case]
    damage(folder)
    failed = _failed(events, engine.load_model(str(folder)))
    assert failed.error_type == "ModelLoadError"
    assert failed.message.startswith(expected.format(folder=folder, name=folder.name))
    assert "Traceback" not in failed.message and "unexpected error" not in failed.message


def test_missing_model_folder_message(tmp_path: Path, worker) -> None:
    engine, events = worker
    failed = _failed(events, engine.load_model(str(tmp_path / "gone")))
    assert failed.message == (
        f"Model folder {tmp_path / 'gone'} does not exist; choose a folder that contains "
        "config.json, *.safetensors and tokenizer files.")
    (tmp_path / "README.md").write_text("a file")
    failed = _failed(events, engine.load_model(str(tmp_path / "README.md")))
    assert failed.message.startswith(
        f"Model folder {tmp_path / 'README.md'} is a file, not a folder; choose a folder")


def _loaded(engine: EngineWorker, events: Events, folder: Path) -> None:
    assert isinstance(events.ending(engine.load_model(str(folder))), Finished)
    assert any(isinstance(e, ModelLoaded) for e in events.events)


def test_q6_on_a_head_dim_not_divisible_by_4(tiny_root: Path, worker) -> None:
    engine, events = worker
    _loaded(engine, events, make_tiny_model_dir(tiny_root, "llama", head_dim=30))
    failed = _failed(events, engine.open_session("s", "q6", 16))
    assert failed.error_type == "UnsupportedModeError"
    assert failed.message == (
        "This model's head_dim is 30, but 6-bit KV storage packs 4 values per group and "
        "needs head_dim % 4 == 0. Use q8 or q4 for this model.")
    report = engine.fit_check(None, 100)
    assert not report.for_mode("q6").supported and report.for_mode("q4").fits
    # The suggested modes work on the same model.
    for mode in ("q8", "q4"):
        assert isinstance(events.ending(engine.open_session(mode, mode, 16)), Finished)
        ending = events.ending(engine.chat(mode, [{"role": "user", "content": "Hi"}], GREEDY,
                                           threading.Event()))
        assert isinstance(ending, Finished) and ending.reason in ("stop", "length")


def test_foreign_kv_mode_name(tiny_root: Path, worker) -> None:
    engine, events = worker
    _loaded(engine, events, make_tiny_model_dir(tiny_root, "llama"))
    failed = _failed(events, engine.open_session("s", "Q6_K", 16))
    assert failed.message.startswith(
        "KV mode 'Q6_K' is another project's block format and is not supported; use q6 "
        "for Longleaf's 6-bit storage.")


@pytest.fixture
def chatting(tiny_root: Path, worker) -> tuple[EngineWorker, Events]:
    engine, events = worker
    _loaded(engine, events, make_tiny_model_dir(tiny_root, "llama"))
    assert isinstance(events.ending(engine.open_session("s", "q8", 16)), Finished)
    return engine, events


CONTROL = ("NUL\x00 BEL\x07 ESC\x1b[31m red DEL\x7f BOM\ufeff RLO\u202e ZWJ\u200d "
           "C1\x85 tab\t CR\r LF\n NBSP\xa0 noncharacter\uffff")


@pytest.mark.parametrize("content", [CONTROL, "lone surrogates \ud800 and \udfff", ""],
                         ids=["control characters", "lone surrogates", "empty message"])
def test_prompts_with_odd_characters_are_answered(chatting, content: str) -> None:
    engine, events = chatting
    messages = [{"role": "user", "content": content}]
    ending = events.ending(engine.chat("s", messages, GREEDY, threading.Event()))
    assert isinstance(ending, Finished) and ending.reason in ("stop", "length"), ending
    assert ending.stats.prompt_tokens > 0
    assert engine.count_tokens(content) >= 0
    # The cache holds what was answered: the next turn builds on it.
    follow = [*messages, {"role": "assistant", "content": events.text(ending.request_id)},
              {"role": "user", "content": "And?"}]
    assert isinstance(events.ending(engine.chat("s", follow, GREEDY, threading.Event())),
                      Finished)


SAMPLED = SamplingParams(temperature=0.7, max_tokens=4)
HELLO = [{"role": "user", "content": "Hello"}]


def test_a_top_k_past_the_vocabulary_keeps_every_token(chatting) -> None:
    engine, events = chatting
    # Some clients send a huge top_k for "no limit": mlx-lm raises on it.
    wide = SamplingParams(temperature=0.7, top_k=10**6, max_tokens=4)
    ending = events.ending(engine.chat("s", HELLO, wide, threading.Event()))
    assert isinstance(ending, Finished) and ending.stats.generated_tokens > 0, ending
    assert isinstance(events.ending(engine.chat("s", HELLO, SAMPLED, threading.Event())),
                      Finished)


def test_answers_still_sample_after_one_failed_inside_the_sampler(
        chatting, monkeypatch: pytest.MonkeyPatch) -> None:
    from mlx_lm.sample_utils import make_sampler

    from engine.session import sampling

    engine, events = chatting
    # mlx-lm's own sampler, raising inside its compiled draw (as a top_k past the
    # vocabulary made it): MLX's random state is left without a value.
    monkeypatch.setattr(sampling, "build_sampler",
                        lambda params: make_sampler(temp=0.7, top_k=10**6))
    assert "ValueError" in _failed(events, engine.chat("s", HELLO, SAMPLED,
                                                       threading.Event())).message
    monkeypatch.undo()
    # Every later sampled answer drew from that state and failed, until a restart.
    ending = events.ending(engine.chat("s", HELLO, SAMPLED, threading.Event()))
    assert isinstance(ending, Finished), ending


def test_million_character_paste_is_refused_with_numbers(chatting) -> None:
    engine, events = chatting
    paste = ("The quick brown fox jumps over the lazy dog. " * 22_300)[:1_000_000]
    tokens = engine.count_tokens(paste)
    assert tokens > 4096
    messages = [{"role": "user", "content": paste}]
    failed = _failed(events, engine.chat("s", messages, GREEDY, threading.Event()))
    assert failed.error_type == "ContextTooLong"
    needed = re.match(r"This conversation needs ([\d,]+) tokens \([\d.]+ MB of KV in q8\)",
                      failed.message)
    assert needed and tokens < int(needed[1].replace(",", "")) < tokens + 32  # + template
    assert "but only 4,096 fit in q8: the model's context is 4,096 tokens" in failed.message
    assert failed.message.endswith("No KV mode raises the model's context: shorten the "
                                   "conversation or start a new one.")
    # Nothing was ingested, and the session still answers a normal prompt.
    ending = events.ending(engine.chat("s", [{"role": "user", "content": "Hi"}], GREEDY,
                                       threading.Event()))
    assert isinstance(ending, Finished) and ending.stats.prompt_tokens < 20


def test_empty_conversation_and_unknown_session(chatting) -> None:
    engine, events = chatting
    failed = _failed(events, engine.chat("s", [], GREEDY, threading.Event()))
    assert failed.message == "Nothing to answer: the conversation is empty."
    failed = _failed(events, engine.chat("nope", [{"role": "user", "content": "Hi"}], GREEDY,
                                         threading.Event()))
    assert failed.message == "No open session named 'nope'; open it first."


def test_weights_full_of_nan_are_refused_at_load_with_the_reason(
    tiny_root: Path, tmp_path: Path, worker
) -> None:
    """The load-time probe sees non-finite logits: a clear refusal, not garbage later."""
    engine, events = worker
    folder = tmp_path / "nan-model"
    shutil.copytree(make_tiny_model_dir(tiny_root, "llama"), folder)
    weights = mx.load(str(folder / "model.safetensors"))
    mx.save_safetensors(str(folder / "model.safetensors"),
                        {name: w * float("nan") for name, w in weights.items()})
    failed = events.ending(engine.load_model(str(folder)))
    assert isinstance(failed, Failed) and failed.error_type == "ModelLoadError"
    assert "non-finite logits" in failed.message
