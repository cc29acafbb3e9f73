"""The headless CLI: greedy parity with mlx-lm, JSON fields, models and info."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.generate import stream_generate
from mlx_lm.sample_utils import make_sampler
from mlx_lm.utils import load

from engine.cache import kvquant
from engine.cache.modes import DEFAULT_MODE
from engine.cli import build_parser, main
from engine.paths import models_dir
from tests.engine.tinymodels import make_tiny_model_dir

PROMPT = "What is the capital of France?"


def _run(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    status = main(list(argv), out=out)
    return status, out.getvalue()


def _mlx_lm_tokens(model, tokenizer, prompt: str, max_tokens: int) -> list[int]:
    """What ``mlx_lm generate --temp 0`` produces: same template, encoding and sampler."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    tokens = []
    for response in stream_generate(model, tokenizer, ids, max_tokens=max_tokens,
                                    sampler=make_sampler(0.0)):
        if response.finish_reason != "stop":
            tokens.append(response.token)
    return tokens


@pytest.fixture(scope="module")
def model_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli-models")


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_next", "gemma3_text"])
def test_generate_fp16_greedy_matches_mlx_lm(model_root: Path, arch: str) -> None:
    folder = make_tiny_model_dir(model_root, arch)
    status, out = _run("generate", "--model", str(folder), "--kv", "fp16", "--temp", "0",
                       "--max-tokens", "20", "--prompt", PROMPT, "--json")
    assert status == 0
    result = json.loads(out)
    model, tokenizer = load(str(folder))
    assert result["tokens"] == _mlx_lm_tokens(model, tokenizer, PROMPT, 20)
    assert result["kv_mode"] == "fp16" and result["prompt_tokens"] > 0


def test_generate_json_reports_pages_and_speeds(model_root: Path, tmp_path: Path) -> None:
    folder = make_tiny_model_dir(model_root, "qwen3")
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT * 4, encoding="utf-8")
    status, out = _run("generate", "--model", str(folder), "--kv", "Q6", "--page-size", "16",
                       "--prompt-file", str(prompt_file), "--max-tokens", "6", "--temp", "0.8",
                       "--seed", "3", "--json")
    assert status == 0
    result = json.loads(out)
    assert set(result) >= {"text", "tokens", "prompt_tokens", "kv_mode", "kv_bytes",
                           "pages_in_use", "pages_allocated", "peak_memory_bytes",
                           "prefill_tps", "decode_tps"}
    assert result["kv_mode"] == "q6" and 0 < len(result["tokens"]) <= 6
    held = result["prompt_tokens"] + len(result["tokens"])
    pages = -(-held // 16)
    assert held - 1 <= pages * 16 and result["pages_in_use"] in (2 * pages, 2 * (pages - 1))
    page_bytes = kvquant.project_kv_bytes(1, 2, 64, 16, "q6")  # one layer's page, 2 KV heads
    assert result["kv_bytes"] == result["pages_allocated"] * page_bytes
    assert result["pages_allocated"] >= result["pages_in_use"]
    assert result["peak_memory_bytes"] > 0 and result["prefill_tps"] > 0
    # Same seed, same sample.
    assert json.loads(_run("generate", "--model", str(folder), "--kv", "q6", "--page-size",
                           "16", "--prompt-file", str(prompt_file), "--max-tokens", "6",
                           "--temp", "0.8", "--seed", "3", "--json")[1])["tokens"] == \
        result["tokens"]


def test_generate_streams_text(model_root: Path) -> None:
    folder = make_tiny_model_dir(model_root, "qwen3")
    status, out = _run("generate", "--model", str(folder), "--kv", "q4", "--temp", "0",
                       "--max-tokens", "5", "--prompt", PROMPT)
    model, tokenizer = load(str(folder))
    assert status == 0
    assert out == tokenizer.decode(_mlx_lm_tokens(model, tokenizer, PROMPT, 5)) + "\n"


def test_generate_errors_are_one_line_and_exit_1(tmp_path: Path, capsys) -> None:
    status, _ = _run("generate", "--model", str(tmp_path / "nothing"), "--prompt", "hi")
    assert status == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nothing" in err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_bad_kv_mode_is_refused_before_loading(tmp_path: Path, capsys, command: str) -> None:
    argv = [command, "--model", str(tmp_path / "nothing"), "--kv", "q6_k"]
    with pytest.raises(SystemExit) as exited:
        _run(*argv, *(["--prompt", "hi"] if command == "generate" else []))
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "q6_k" in err and "another project" in err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_kv_takes_the_same_names_in_every_command(command: str) -> None:
    extra = ["--prompt", "hi"] if command == "generate" else []
    args = build_parser().parse_args([command, "--model", "demo", "--kv", "8bit", *extra])
    assert args.kv == "q8"


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_kv_has_the_registrys_default_in_every_command(command: str) -> None:
    extra = ["--prompt", "hi"] if command == "generate" else []
    assert build_parser().parse_args([command, "--model", "demo", *extra]).kv == DEFAULT_MODE


def test_a_session_name_that_is_no_file_name_is_refused_before_loading(
        tmp_path: Path, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        _run("generate", "--model", str(tmp_path / "nothing"), "--prompt", "hi",
             "--session", "chat 1,3")
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--session names a file" in err and "'chat 1,3'" in err
    assert "unexpected" not in err


def test_a_session_dir_that_cannot_be_a_folder_is_said_in_words(
        tmp_path: Path, capsys) -> None:
    (tmp_path / "afile").write_text("not a folder")
    for folder in ("afile", "afile/sub"):
        status, _ = _run("generate", "--model", str(tmp_path / "nothing"), "--prompt", "hi",
                         "--session", "s", "--session-dir", str(tmp_path / folder))
        assert status == 1  # was a FileExistsError (NotADirectoryError) traceback
        assert capsys.readouterr().err == (
            f"error: --session-dir {tmp_path / folder} cannot hold stored KV: "
            f"{tmp_path / 'afile'} is a file, not a folder.\n")


@pytest.mark.parametrize(("extra", "said"), [
    (["--pipeline", "0"], "--pipeline takes the number of ranks, 1 or more."),
    (["--split", "1,2"], "--split needs --pipeline N or --hostfile FILE."),
    (["--pipeline", "2"], "cannot be split across machines: mlx-lm has no pipeline split"),
])
def test_a_pipeline_generate_cannot_run_is_refused_before_any_rank_starts(
        monkeypatch: pytest.MonkeyPatch, capsys, extra: list[str], said: str) -> None:
    from engine import cli

    launched: list[object] = []
    monkeypatch.setattr(cli, "launch", lambda *args: launched.append(args) or 0)
    # Before: 0 ran on one process, --split alone was ignored, and the demo's ranks
    # started before one of them refused it.
    status, _ = _run("generate", "--model", "demo", "--prompt", "hi",
                     "--speculative", "off", *extra)
    assert status == 1 and said in capsys.readouterr().err
    assert launched == []


def test_models_lists_folders_in_the_models_dir(model_root: Path) -> None:
    source = make_tiny_model_dir(model_root, "llama")
    target = models_dir() / "my-tiny-llama"
    target.mkdir()
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    status, out = _run("models", "--json")
    assert status == 0
    entries = json.loads(out)
    assert {"name": "my-tiny-llama", "path": str(target)} in entries


def test_info_prints_facts_and_full_context_projection(model_root: Path) -> None:
    folder = make_tiny_model_dir(model_root, "qwen3_next")
    status, out = _run("info", str(folder), "--json")
    assert status == 0
    result = json.loads(out)
    facts = result["facts"]
    assert facts["architecture"] == "qwen3_next" and facts["attention_layers"] == 2
    for mode, nbytes in result["kv_bytes_full_context"].items():
        assert nbytes == kvquant.project_kv_bytes(2, 2, 32, 4096, mode)
    status, text = _run("info", str(folder))
    assert status == 0 and "q6" in text and "4,096 tokens" in text


def test_module_entry_point_exits_cleanly(model_root: Path) -> None:
    folder = make_tiny_model_dir(model_root, "llama")
    result = subprocess.run(
        [sys.executable, "-m", "engine", "generate", "--model", str(folder), "--kv", "q8",
         "--temp", "0", "--max-tokens", "3", "--prompt", "hi", "--json"],
        capture_output=True, text=True, timeout=120,
    )
    # Exit status 0 too: MLX streams of the engine thread are cleared before exit.
    assert result.returncode == 0, result.stderr
    assert len(json.loads(result.stdout)["tokens"]) == 3


def _generating(folder: Path) -> subprocess.Popen:
    """``generate`` of a long greedy answer, its text streamed to a pipe."""
    return subprocess.Popen(
        [sys.executable, "-m", "engine", "generate", "--model", str(folder), "--temp", "0",
         "--max-tokens", "4000", "--prompt", "Tell me a long story"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_a_reader_that_leaves_the_pipe_stops_the_answer_quietly(model_root: Path) -> None:
    # As `generate … | head -c 20`: before, a traceback per token on stderr, and
    # the whole answer made for nobody.
    running = _generating(make_tiny_model_dir(model_root, "llama", endless=True))
    assert running.stdout is not None and running.stderr is not None
    assert running.stdout.read(20)
    running.stdout.close()
    assert running.wait(timeout=120) == 1
    err = running.stderr.read().decode()
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_ctrl_c_stops_generate_with_the_shells_status(model_root: Path) -> None:
    import signal

    running = _generating(make_tiny_model_dir(model_root, "llama", endless=True))
    assert running.stdout is not None and running.stderr is not None
    assert running.stdout.read(20)  # answering
    running.send_signal(signal.SIGINT)
    assert running.wait(timeout=120) == 130
    err = running.stderr.read().decode()
    assert err.strip() == "Interrupted.", err


@pytest.mark.slow
def test_demo_fp16_greedy_matches_mlx_lm() -> None:
    from engine.models.loader import load_model

    try:
        loaded = load_model("demo")
    except Exception as error:  # the wheel is optional in some environments
        pytest.skip(f"demo model unavailable: {error}")
    status, out = _run("generate", "--model", "demo", "--kv", "fp16", "--temp", "0",
                       "--max-tokens", "8", "--prompt", PROMPT, "--json")
    assert status == 0
    result = json.loads(out)
    assert result["text"].startswith("The capital of France is Paris")
    expected = _mlx_lm_tokens(loaded.model, loaded.tokenizer, PROMPT, 8)
    assert result["tokens"] == expected
    mx.clear_cache()


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_generate_session_reuses_its_stored_cache(
    model_root: Path, tmp_path: Path, arch: str
) -> None:
    folder = make_tiny_model_dir(model_root, arch)
    prompt = PROMPT * 6
    argv = ("generate", "--model", str(folder), "--kv", "q8", "--page-size", "16", "--temp",
            "0", "--max-tokens", "8", "--prompt", prompt, "--json", "--session", "doc",
            "--session-dir", str(tmp_path / "kv"))
    first = json.loads(_run(*argv)[1])
    assert first["reused_tokens"] == 0
    assert first["prefill_tokens"] == first["prompt_tokens"]
    # Under the CLI's own name, never one an app chat could have.
    assert [p.name for p in (tmp_path / "kv").glob("*.json")] == ["cli-doc.json"]
    again = json.loads(_run(*argv)[1])
    # Everything but the prompt's last token (it gives the first answer token's logits).
    assert again["reused_tokens"] == again["prompt_tokens"] - 1
    assert again["prefill_tokens"] == 1
    assert again["tokens"] == first["tokens"]
    plain = json.loads(_run(*argv[:-4])[1])
    assert plain["reused_tokens"] == 0 and plain["tokens"] == first["tokens"]


def test_generate_reports_speculation_and_can_turn_it_off(model_root: Path, tmp_path: Path) -> None:
    folder = make_tiny_model_dir(model_root, "llama")
    prompt_file = tmp_path / "repeat.txt"
    prompt_file.write_text(PROMPT * 6, encoding="utf-8")
    runs = {}
    for mode in ("off", "lookup", None):
        chosen = () if mode is None else ("--speculative", mode)
        status, out = _run("generate", "--model", str(folder), "--temp", "0", "--max-tokens",
                           "24", "--prompt-file", str(prompt_file), *chosen, "--json")
        assert status == 0
        runs[mode] = json.loads(out)
    # The default is the app's, lookup; its drafts follow from token counts alone.
    assert runs[None]["draft_tokens"] == runs["lookup"]["draft_tokens"]
    assert runs[None]["accepted_tokens"] == runs["lookup"]["accepted_tokens"]
    assert runs["off"]["draft_tokens"] == runs["off"]["accepted_tokens"] == 0
    looked_up = runs["lookup"]
    assert looked_up["draft_tokens"] > 0
    assert 0 <= looked_up["accepted_tokens"] <= looked_up["draft_tokens"]
    assert looked_up["tokens"] == runs["off"]["tokens"]


def test_a_session_run_makes_room_from_its_own_stored_kv_never_a_chats(
        model_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--session`` stores in the app's folder by default, under the budget it can
    compute (not the one set in the app): it may evict the CLI's own sessions, never
    a chat's stored KV, even the least recently used."""
    import threading

    from engine.models.loader import load_model
    from engine.session.session import Session
    from engine.snapshots import snapshot_store

    folder = make_tiny_model_dir(model_root, "llama")
    kv = tmp_path / "kv"
    chat = Session("0a1b2c3d", load_model(folder), "q8", page_size=16)
    chat.prefill(list(range(3, 83)), request_id=0, cancel=threading.Event(),
                 emit=lambda e: None, tick=lambda: None)
    snapshot_store.SnapshotStore(kv).save(chat, "0a1b2c3d")  # the oldest snapshot
    argv = ("generate", "--model", str(folder), "--kv", "q8", "--page-size", "16", "--temp",
            "0", "--max-tokens", "4", "--json", "--session-dir", str(kv))
    assert _run(*argv, "--prompt", PROMPT * 3, "--session", "doc")[0] == 0
    full = snapshot_store.SnapshotStore(kv).total_bytes()
    monkeypatch.setattr(snapshot_store, "default_budget", lambda directory, counted_with=(): full)
    assert _run(*argv, "--prompt", PROMPT * 4, "--session", "other")[0] == 0
    assert sorted(p.stem for p in kv.glob("*.json")) == ["0a1b2c3d", "cli-other"]


def test_what_the_engine_says_about_stored_kv_is_printed_beside_the_text(
        model_root: Path, tmp_path: Path, capsys) -> None:
    folder = make_tiny_model_dir(model_root, "llama")
    argv = ("generate", "--model", str(folder), "--temp", "0", "--max-tokens", "3",
            "--prompt", PROMPT, "--session", "doc", "--session-dir", str(tmp_path / "kv"))
    assert _run(*argv)[0] == 0
    capsys.readouterr()
    for data in (tmp_path / "kv").glob("*.safetensors"):
        data.write_bytes(data.read_bytes()[:100])  # cut short, as a disk gone mid-write
    assert _run(*argv)[0] == 0  # answered, with the notice on stderr
    assert "incomplete or damaged" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["info", "models"])
def test_a_reader_that_leaves_before_the_listing_gets_no_traceback(
        model_root: Path, command: str) -> None:
    argv = ["info", str(make_tiny_model_dir(model_root, "llama"))] if command == "info" \
        else ["models", "--json"]
    listing = subprocess.Popen([sys.executable, "-m", "engine", *argv],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert listing.stdout is not None and listing.stderr is not None
    listing.stdout.close()  # as `… | true`: gone before the first line
    listing.wait(timeout=120)
    err = listing.stderr.read().decode()
    assert "Traceback" not in err and "BrokenPipe" not in err, err


@pytest.mark.parametrize(("option", "bad"), [("--page-size", "0"), ("--chunk-size", "0"),
                                             ("--chunk-size", "1000000000"),
                                             ("--page-size", "lots")])
def test_sizes_out_of_range_are_refused_before_loading(option: str, bad: str, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["generate", "--model", "demo", "--prompt", "hi",
                                   option, bad])
    assert exited.value.code == 2
    assert f"{option} takes a number of tokens from 1 to " in capsys.readouterr().err


def test_ctrl_c_while_the_cli_is_still_loading_says_so_without_a_traceback(
        tmp_path: Path) -> None:
    # Ctrl-C lands in the imports (about a second) when the CLI reaches its import.
    (tmp_path / "sitecustomize.py").write_text(
        "import sys\n"
        "class Interrupt:\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'engine.cli':\n"
        "            raise KeyboardInterrupt\n"
        "sys.meta_path.insert(0, Interrupt())\n")
    ran = subprocess.run([sys.executable, "-m", "engine", "models"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert ran.returncode == 130 and ran.stderr.strip() == "Interrupted.", ran.stderr
