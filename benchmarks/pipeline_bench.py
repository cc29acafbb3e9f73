"""``python -m benchmarks pipeline``: one process vs a two-rank pipeline on this machine.

Each run is the real CLI (``python -m engine generate --json``, with
``--pipeline 2`` for the split), on a tiny random-weight qwen3_next (hybrid)
model built the way the tests build theirs, so the difference between the rows
is what the pipeline costs: the processes, the hidden-state send, mlx-lm's
all_gather and the lock-step, on the same cores. The prompt is filler text cut
to the wanted token count with the model's own tokenizer. One and two ranks
alternate ``repeats`` times per context, so a shared machine's load falls on
both alike, and the overhead is the median of each pair's difference. The ring
backend's floor (``benchmarks.ring_floor``) runs once at the start.

Then requests answered together (``streams``): ``python -m engine serve`` on one
process and on the ranks, a wider random qwen3_next (``_wide_model``: its dense
layers weigh more than a step's overhead, as a real model's do), and each count of
short requests streamed at once. Each count is sent once untimed, so the timed
run finds every prompt stored and its streams start decoding at about the same time;
the aggregate rate is every request's tokens over the wall time from sending them
to the last one's end (a request's first token included). Not the streams' own
rates between their first and last pieces: two ranks on two cores spin while they
wait on each other, and the server's process then gets pieces out in bursts.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks import report

REPO = Path(__file__).resolve().parents[1]
FILLER = "The river bends past the mill, and the miller counts the sacks of grain. "


@dataclass(frozen=True)
class PipelineBenchConfig:
    """What to run."""

    contexts: tuple[int, ...] = (8192, 32768)
    ranks: tuple[int, ...] = (1, 2)
    max_tokens: int = 64
    mode: str = "fp16"
    chunk_size: int = 512
    repeats: int = 2
    streams: tuple[int, ...] = (1, 2, 4)  # requests answered together; () skips them
    stream_tokens: int = 256


QUICK = PipelineBenchConfig(contexts=(1024,), max_tokens=16, repeats=1, streams=(1, 2),
                            stream_tokens=8)
STREAM_PROMPT = "The river bends past the mill, and the miller counts the sacks. " * 12


def _tiny_model(folder: Path) -> Path:
    from tests.engine.tinymodels import make_tiny_model_dir

    # The tests' tiny config declares a 4k context; the benchmark reads 32k.
    return make_tiny_model_dir(folder, "qwen3_next", max_position_embeddings=65536)


def _wide_model(folder: Path, layers: int = 8) -> Path:
    """A random qwen3_next whose dense layers are wide enough to weigh in a step
    (about 27M parameters), its answers never ended by the model itself."""
    from tests.engine.tinymodels import make_tiny_model_dir

    return make_tiny_model_dir(folder, "qwen3_next", endless=True, hidden_size=512,
                               intermediate_size=1536, num_hidden_layers=layers,
                               mlp_only_layers=list(range(layers)),
                               max_position_embeddings=65536)


def _prompt(model: Path, tokens: int) -> str:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    ids = tokenizer.encode(FILLER * (tokens // 8 + 1))[:tokens]
    text = tokenizer.decode(ids)
    # One sequence of ids decodes to one string; the stub also declares a batch's list.
    assert isinstance(text, str)
    return text


def _run_once(model: Path, prompt_file: Path, ranks: int, config: PipelineBenchConfig) -> dict:
    command = [sys.executable, "-m", "engine", "generate", "--model", str(model),
               "--prompt-file", str(prompt_file), "--max-tokens", str(config.max_tokens),
               "--temp", "0", "--kv", config.mode, "--chunk-size", str(config.chunk_size),
               "--json"]
    if ranks > 1:
        command += ["--pipeline", str(ranks)]
    load = os.getloadavg()[0]
    done = subprocess.run(command, env=_env(), cwd=REPO, capture_output=True, text=True,
                          check=False)
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    result = json.loads(done.stdout.strip().splitlines()[-1])
    keep = ("prompt_tokens", "tokens", "prefill_tps", "decode_tps", "time_to_first_token")
    return {"load": load, "ids": result["tokens"],
            **{key: result[key] if key != "tokens" else len(result[key]) for key in keep}}


def _env() -> dict[str, str]:
    env = {**os.environ}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def ring_floor() -> dict:
    """The ring backend's message costs between two local ranks (benchmarks.ring_floor)."""
    from engine.distributed.group import Group
    from engine.distributed.launch import launcher_command

    command = [*launcher_command(), "-n", "2", "--backend", "ring", sys.executable, "-m",
               "benchmarks.ring_floor"]
    # Through the pipeline's own Group: the launcher is run the way the CLI runs it.
    with tempfile.TemporaryDirectory(prefix="ring-floor-") as folder:
        done, _ = Group(command, _env(), Path(folder), 2).watch()
    rows = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not rows:
        return {"error": (done.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(rows[-1])


def run_pipeline_bench(config: PipelineBenchConfig, progress: Callable[[str], None],
                       partial_results: Callable[[dict], None] | None = None) -> dict:
    """Every context at every rank count; returns the rows (and the config)."""
    results: dict[str, Any] = {"config": asdict(config), "rows": []}
    progress("pipeline: the ring backend's floor")
    results["floor"] = ring_floor()
    with tempfile.TemporaryDirectory(prefix="pipeline-bench-") as folder:
        model = _tiny_model(Path(folder))
        for context in config.contexts:
            prompt_file = Path(folder) / f"prompt-{context}.txt"
            prompt_file.write_text(_prompt(model, context), encoding="utf-8")
            for repeat in range(config.repeats):
                for ranks in config.ranks:
                    progress(f"pipeline: {context} tokens on {ranks} rank(s), run {repeat + 1}")
                    row = {"context": context, "ranks": ranks, "repeat": repeat,
                           **_run_once(model, prompt_file, ranks, config)}
                    results["rows"].append(row)
                    if partial_results is not None:
                        partial_results(results)
        if config.streams:
            wide = _wide_model(Path(folder))
            results["streams"] = []
            for ranks in config.ranks:
                progress(f"pipeline: {', '.join(map(str, config.streams))} requests at once "
                         f"on {ranks} rank(s)")
                results["streams"] += served_streams(wide, ranks, config)
                if partial_results is not None:
                    partial_results(results)
    return results


def served_streams(model: Path, ranks: int, config: PipelineBenchConfig) -> list[dict]:
    """Each count of ``config.streams`` requests streamed at once from a server of
    ``ranks`` rank(s): their tokens a second over the wall time, and their texts."""
    from benchmarks import serve_bench

    home = tempfile.mkdtemp(prefix="pipeline-streams-")
    port = serve_bench._port()
    command = [sys.executable, "-m", "engine", "serve", "--model", str(model), "--port",
               str(port), "--kv", config.mode, "--parallel", str(max(config.streams))]
    if ranks > 1:
        command += ["--pipeline", str(ranks)]
    rows = []
    try:
        server = serve_bench.Running(command, port, {**_env(), "LONGLEAF_HOME": home},
                                     Path(home) / "serve.log")
    except RuntimeError as error:
        shutil.rmtree(home, ignore_errors=True)
        return [{"ranks": ranks, "streams": count, "error": str(error)}
                for count in config.streams]
    try:
        for count in config.streams:
            prompts = [[{"role": "user", "content": f"Request {i}: {STREAM_PROMPT}"}]
                       for i in range(count)]
            _together(server.url, prompts, config.stream_tokens)  # stores every prompt
            load = os.getloadavg()[0]
            rows.append({"ranks": ranks, "streams": count, "load": load,
                         **_together(server.url, prompts, config.stream_tokens)})
    finally:
        server.stop()
        shutil.rmtree(home, ignore_errors=True)
    return rows


def _together(url: str, prompts: list[list[dict[str, str]]], max_tokens: int) -> dict:
    """Stream ``prompts`` at once; every request's tokens over the wall time from
    sending them to the last one's end, and their texts."""
    streamed: dict[int, tuple[str, int]] = {}
    threads = [threading.Thread(target=_stream_text,
                                args=(url, messages, max_tokens, streamed, index))
               for index, messages in enumerate(prompts)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    runs = [streamed[index] for index in range(len(prompts)) if index in streamed]
    if len(runs) < len(prompts) or not all(tokens for _, tokens in runs):
        return {"error": "a request failed or made no token"}
    tokens = [count for _, count in runs]
    return {"tok_s": sum(tokens) / seconds, "seconds": seconds, "tokens": tokens,
            "texts": [text for text, _ in runs]}


def _stream_text(url: str, messages: list[dict[str, str]], max_tokens: int,
                 streamed: dict[int, tuple[str, int]], index: int) -> None:
    """One streamed answer: its text and its tokens (the usage the server reports)."""
    from benchmarks.serve_bench import stream_answer

    answer = stream_answer(url, messages, max_tokens)
    streamed[index] = (answer.text, answer.tokens)


def _ms_per_token(row: dict | None) -> float | None:
    return 1000.0 / row["decode_tps"] if row and row.get("decode_tps") else None


def render_pipeline_report(results: dict, info: dict, command: str, load_after: str) -> str:
    """The Markdown section: the floor, the rows, the per-token overhead and the prefill ratio."""
    config = results["config"]
    lines = ["## Pipeline: one process vs two local ranks (ring backend)", "",
             f"Command: `{command}`", "", *report.machine_lines(info, load_after), "",
             "Tiny random-weight qwen3_next (hybrid), greedy, "
             f"{config['mode']}, chunks of {config['chunk_size']}; 1 and 2 ranks alternate "
             f"{config.get('repeats', 1)} time(s) per context.", ""]
    floor = results.get("floor") or {}
    if floor:
        lines += ["The ring backend's floor on this machine (2 local ranks, one message "
                  "evaluated alone): " + ", ".join(
                      f"{name.replace(' ms', '')} {value:.3f} ms" if name.endswith(" ms")
                      else f"{name} {value:.2f}" if isinstance(value, float) else
                      f"{name}: {value}" for name, value in floor.items()) + ".", ""]
    rows = results["rows"]
    lines += report.table(
        ["context", "ranks", "load at start", "prompt tokens", "TTFT s", "prefill tok/s",
         "decode tok/s", "ms/token"],
        [[report.fmt_tokens(r["context"]), r["ranks"], _fmt(r.get("load"), 1),
          r.get("prompt_tokens", "-"), _fmt(r.get("time_to_first_token"), 2),
          _fmt(r.get("prefill_tps"), 0), _fmt(r.get("decode_tps"), 1),
          _fmt(_ms_per_token(r), 2)]
         if "error" not in r else [report.fmt_tokens(r["context"]), r["ranks"], "",
                                   r["error"], "", "", "", ""]
         for r in rows])
    lines += ["", "Against one process at the same context, the median over the runs' pairs "
              "(goals: ≤ 2 ms per decode token, prefill ≥ 0.8×):", ""]
    verdicts = []
    for context in dict.fromkeys(r["context"] for r in rows):
        overheads, prefills, same = [], [], True
        for repeat in dict.fromkeys(r.get("repeat", 0) for r in rows):
            by_ranks = {r["ranks"]: r for r in rows if r["context"] == context
                        and r.get("repeat", 0) == repeat and "error" not in r}
            one, two = by_ranks.get(1), by_ranks.get(2)
            if not one or not two:
                continue
            same = same and one.get("ids") == two.get("ids")
            one_ms, two_ms = _ms_per_token(one), _ms_per_token(two)
            if one_ms is not None and two_ms is not None:
                overheads.append(two_ms - one_ms)
            prefill = report.ratio(two["prefill_tps"], one["prefill_tps"])
            if prefill is not None:
                prefills.append(prefill)
        if not prefills:
            continue
        overhead = statistics.median(overheads) if overheads else None
        prefill = statistics.median(prefills)
        verdicts.append([report.fmt_tokens(context), _fmt(overhead, 2) + _goal(overhead, 2.0),
                         report.fmt_ratio(prefill) + _goal(-prefill, -0.8),
                         "yes" if same else "NO"])
    lines += report.table(["context", "decode overhead ms/token", "prefill 2 ranks / 1",
                           "same tokens"], verdicts)
    lines += _streams_lines(results.get("streams") or [], config)
    return "\n".join(lines) + "\n"


def _streams_lines(rows: list[dict], config: dict) -> list[str]:
    """The requests answered together: each count's aggregate rate against one
    request's on the same ranks, and whether the ranks said what one process said."""
    if not rows:
        return []
    lines = ["", "Requests streamed at once through `python -m engine serve --parallel "
             f"{max(r['streams'] for r in rows)}`, a wider random qwen3_next (8 layers, "
             f"hidden 512, about 27M parameters), {config['mode']}, "
             f"{config.get('stream_tokens', '?')} tokens a request; each count sent once "
             "untimed first, so every prompt is stored; every request's tokens over the "
             "wall time from sending them to the last one's end:", ""]
    alone = {r["ranks"]: r.get("tok_s") for r in rows if r["streams"] == 1}
    one_process = {r["streams"]: r.get("texts") for r in rows if r["ranks"] == 1}
    table = []
    for row in rows:
        if "error" in row:
            table.append([row["ranks"], row["streams"], "", row["error"], "", "", ""])
            continue
        same = ("" if row["ranks"] == 1 or one_process.get(row["streams"]) is None
                else "yes" if row["texts"] == one_process[row["streams"]] else "NO")
        table.append([row["ranks"], row["streams"], _fmt(row.get("load"), 1),
                      _fmt(row["seconds"], 2), _fmt(row["tok_s"], 1),
                      report.fmt_ratio(report.ratio(row["tok_s"], alone.get(row["ranks"]))),
                      same])
    return lines + report.table(["ranks", "requests at once", "load at start", "wall s",
                                 "aggregate tok/s", "× one request",
                                 "same texts as one process"], table)


def _fmt(value: float | None, digits: int) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def _goal(value: float | None, bound: float) -> str:
    return "" if value is None else (" ✅" if value <= bound else " ❌")
