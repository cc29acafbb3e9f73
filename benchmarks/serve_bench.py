"""``python -m benchmarks serve``: the HTTP server's time to first token and tokens/s.

An agent-like conversation (a long system prompt and earlier turns, about
``tokens`` tokens on the demo model) is sent to ``python -m engine serve``,
then resent with one more short turn, then resent again after a server restart
(its KV comes back from the server's stored snapshots). The same three requests
go to ``mlx_lm.server`` on the same model folder, and the CLI answers the same
prompt for the decode rate. Every number is measured by a streaming client on
this machine, in one run.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import cast

import httpx

# A busy shared CPU loads slowly and reads a 7k-token prompt in minutes: the
# limits are generous so that a slow run still finishes with numbers.
HEALTH_TIMEOUT = 1800.0
REQUEST_TIMEOUT = httpx.Timeout(7200.0, connect=30.0)



@dataclass(frozen=True)
class Timing:
    """One streamed request, as the client saw it."""

    server: str
    request: str
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    decode_tps: float


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def conversation(tokens: int, extra_turn: bool,
                 count: Callable[[list[dict[str, str]]], int] | None = None
                 ) -> list[dict[str, str]]:
    """About ``tokens`` tokens of an agent's context; ``extra_turn`` adds one short turn.

    ``count`` gives a conversation's tokens as the model renders it (None: about
    four characters a token).
    """
    count = count or (lambda turns: len(json.dumps(turns)) // 4)
    messages = [{"role": "system", "content": "You are a coding agent. Tools: read, edit, run. "
                 + "Follow the repository's conventions and keep answers short. " * 20}]
    turn = 0
    while count(messages) < tokens:
        messages.append({"role": "user", "content": f"Step {turn}: here is file {turn}.py:\n"
                         + f"def f{turn}(x):\n    return x * {turn} + 1\n" * 12})
        messages.append({"role": "assistant", "content": f"Read file {turn}.py; f{turn} "
                         "scales its input. Next step?"})
        turn += 1
    messages.append({"role": "user", "content": "What does the last file do?"})
    if extra_turn:
        messages += [{"role": "assistant", "content": "It scales its input and adds one."},
                     {"role": "user", "content": "And the first?"}]
    return messages


@dataclass(frozen=True)
class Streamed:
    """One streamed answer as the client saw it: when it was sent, when its first
    and last text pieces came (None: no text), the text, the pieces and the usage."""

    started: float
    first: float | None
    last: float | None
    text: str
    pieces: int
    usage: dict

    @property
    def tokens(self) -> int:
        """The tokens generated: the server's usage, else the text pieces."""
        return int(self.usage.get("completion_tokens") or self.pieces)


def stream_answer(url: str, messages: list[dict[str, str]], max_tokens: int) -> Streamed:
    """Stream one greedy answer from ``url``'s chat completions."""
    # "default_model" is mlx_lm.server's name for its --model; Longleaf answers any id.
    body = {"model": "default_model", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = last = None
    usage: dict = {}
    text, pieces = "", 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body,
                      timeout=REQUEST_TIMEOUT) as reply:
        reply.raise_for_status()
        for line in reply.iter_lines():
            if not line.startswith("data:") or line.endswith("[DONE]"):
                continue
            chunk = json.loads(line[5:])
            usage = chunk.get("usage") or usage
            choices = chunk.get("choices") or []
            if choices and choices[0].get("delta", {}).get("content"):
                now = time.perf_counter()
                first = first or now
                last = now
                text += choices[0]["delta"]["content"]
                pieces += 1
    return Streamed(started, first, last, text, pieces, usage)


def _stream(url: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, float,
                                                                                dict]:
    """One answer's time to first token, decode rate and usage."""
    answer = stream_answer(url, messages, max_tokens)
    first, last = answer.first, answer.last
    ttft = (first or time.perf_counter()) - answer.started
    rate = (answer.tokens - 1) / (last - first) if first and last and last > first else 0.0
    return ttft, rate, answer.usage


class Running:
    """A server subprocess on 127.0.0.1, healthy and warmed up, or failed.

    Its output goes to ``log`` (a failure says why there). ``mlx_lm.server``
    answers /health before it has loaded its model, which it does on the first
    request: every server answers one tiny request before any is timed.
    """

    def __init__(self, command: list[str], port: int, env: dict[str, str], log: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.log = log
        with log.open("ab") as out:
            self.process = subprocess.Popen(command, env=env, stdout=out,
                                            stderr=subprocess.STDOUT)
        deadline = time.monotonic() + HEALTH_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{command[:4]} exited with {self.process.returncode}; "
                                   f"see {log}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    _stream(self.url, [{"role": "user", "content": "Hi"}], 1)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"{command[:4]} did not become healthy; see {log}")

    def stop(self) -> None:
        self.process.terminate()  # SIGTERM: uvicorn shuts down and stores the sessions
        try:
            self.process.wait(300)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _timed(name: str, label: str, url: str, messages: list[dict[str, str]],
           max_tokens: int) -> Timing:
    ttft, rate, usage = _stream(url, messages, max_tokens)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return Timing(name, label, int(usage.get("prompt_tokens") or 0), int(cached), ttft, rate)


def _three(name: str, start: Callable[[], Running], first: list[dict[str, str]],
           resent: list[dict[str, str]], max_tokens: int) -> list[Timing]:
    """First request, the same resent with one more turn, and that again after a restart."""
    server = start()
    try:
        results = [_timed(name, "first", server.url, first, max_tokens),
                   _timed(name, "resent +1 turn", server.url, resent, max_tokens)]
    finally:
        server.stop()
    server = start()
    try:
        results.append(_timed(name, "after restart", server.url, resent, max_tokens))
    finally:
        server.stop()
    return results


def token_counter(folder: Path) -> Callable[[list[dict[str, str]]], int]:
    """Tokens of a conversation as ``folder``'s chat template renders it."""
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(folder)
    return lambda turns: len(tokenizer.apply_chat_template(turns, add_generation_prompt=True))


def _cli_rate(env: dict[str, str], prompt: list[dict[str, str]], max_tokens: int) -> float:
    text = "\n\n".join(m["content"] for m in prompt)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as handle:
        handle.write(text)
    out = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", "demo",
                          "--kv", "q8", "--prompt-file", handle.name, "--temp", "0",
                          "--max-tokens", str(max_tokens), "--json"],
                         env=env, capture_output=True, text=True, check=True)
    Path(handle.name).unlink()
    return float(json.loads(out.stdout.strip().splitlines()[-1])["decode_tps"])


def float32_copy(folder: Path, into: Path) -> Path:
    """``folder`` with its half-precision weights stored as float32.

    MLX's CPU backend emulates float16 very slowly; Longleaf's loader computes
    in float32 there, mlx-lm computes in the dtype the weights are stored in.
    Given the same weights in float32, ``mlx_lm.server`` computes as Longleaf does.
    """
    import mlx.core as mx

    into.mkdir(parents=True, exist_ok=True)
    for path in folder.iterdir():
        if path.suffix == ".safetensors":
            # A .safetensors file loads as a dict of arrays; the stub declares
            # every form mx.load can return.
            weights = cast("dict[str, mx.array]", mx.load(str(path)))
            weights = {name: w.astype(mx.float32) if w.dtype in (mx.float16, mx.bfloat16)
                       else w for name, w in weights.items()}
            mx.save_safetensors(str(into / path.name), weights, metadata={"format": "mlx"})
        elif path.is_file():
            shutil.copy2(path, into / path.name)
    return into


def _on_cpu() -> bool:
    import mlx.core as mx

    return mx.default_device().type == mx.DeviceType.cpu


def _pair(model: str, folder: Path, reference_folder: Path | None, home: str,
          env: dict[str, str], tokens: int, max_tokens: int, label: str) -> list[Timing]:
    """Longleaf's server on ``model`` and (when given) ``mlx_lm.server`` on the folder.

    Each pair has a data folder of its own: no stored KV of an earlier pair warms it.
    """
    logs = Path(home) / label
    logs.mkdir(parents=True, exist_ok=True)
    env = {**env, "LONGLEAF_HOME": str(logs)}
    count = token_counter(folder)
    first, resent = conversation(tokens, False, count), conversation(tokens, True, count)

    def longleaf() -> Running:
        port = _port()
        return Running([sys.executable, "-m", "engine", "serve", "--model", model,
                        "--port", str(port), "--kv", "q8"], port, env,
                       logs / f"longleaf-{label}.log")

    timings = _three(f"longleaf ({label})", longleaf, first, resent, max_tokens)
    if reference_folder is not None:
        def reference() -> Running:
            port = _port()
            return Running([sys.executable, "-m", "mlx_lm", "server", "--model",
                            str(reference_folder), "--port", str(port)], port, env,
                           logs / f"mlx_lm-{label}.log")
        timings += _three(f"mlx_lm.server ({label})", reference, first, resent, max_tokens)
    return timings


def run(tokens: int = 7000, max_tokens: int = 64, mlx_lm: bool = True,
        hybrid_tokens: int = 16000, mlx_tokens: int | None = None) -> dict:
    """Measure Longleaf's server, the CLI and (optionally) mlx_lm.server; plain results.

    The demo model answers a conversation of about ``tokens`` tokens; a tiny
    hybrid (qwen3_next, random weights) one of about ``hybrid_tokens`` (0: skip).
    ``mlx_tokens`` (when smaller than ``tokens``) sizes a second demo
    conversation that both servers answer, for a CPU where mlx_lm.server would
    take hours over the long one.
    """
    from engine.models.loader import resolve_model_path

    home = tempfile.mkdtemp(prefix="longleaf-serve-bench-")
    env = {**os.environ, "LONGLEAF_HOME": home}
    demo = Path(resolve_model_path("demo"))
    reference = None
    if mlx_lm:
        reference = float32_copy(demo, Path(home) / "demo-float32") if _on_cpu() else demo
    load = [os.getloadavg()[0]]
    short = mlx_tokens is not None and mlx_tokens < tokens
    timings = _pair("demo", demo, None if short else reference, home, env, tokens,
                    max_tokens, "demo")
    load.append(os.getloadavg()[0])
    if short and reference is not None and mlx_tokens is not None:
        timings += _pair("demo", demo, reference, home, env, mlx_tokens, max_tokens,
                         f"demo {mlx_tokens:,}")
        load.append(os.getloadavg()[0])
    if hybrid_tokens:
        from tests.engine.tinymodels import make_tiny_model_dir

        hybrid = make_tiny_model_dir(Path(home), "qwen3_next",
                                     max_position_embeddings=4 * hybrid_tokens)
        timings += _pair(str(hybrid), hybrid, hybrid if mlx_lm else None, home, env,
                         hybrid_tokens, max_tokens, "tiny hybrid")
        load.append(os.getloadavg()[0])
    cli = _cli_rate(env, conversation(tokens, True, token_counter(demo)), max_tokens)
    load.append(os.getloadavg()[0])
    shutil.rmtree(home, ignore_errors=True)
    return {"tokens": tokens, "hybrid_tokens": hybrid_tokens, "max_tokens": max_tokens,
            "mlx_tokens": mlx_tokens if short else None,
            "cli_decode_tps": cli, "load_1min": load,
            "reference_float32": bool(reference is not None and reference != demo),
            "timings": [asdict(t) for t in timings]}


DECODE_PROMPT = ("Write a long story about a forest of longleaf pines, the fires that "
                 "keep it open and the birds that nest in it. " * 6)


def decode_overhead(runs: int = 3, max_tokens: int = 128) -> dict:
    """The server's decode rate against the CLI's on one short prompt, interleaved.

    Both answer the same prompt greedily in q8; each run of one is followed by a
    run of the other, so a change in the machine's load falls on both. The rates
    are the server's as a streaming client sees them and the CLI's own.
    """
    home = tempfile.mkdtemp(prefix="longleaf-serve-decode-")
    env = {**os.environ, "LONGLEAF_HOME": home}
    port = _port()
    server = Running([sys.executable, "-m", "engine", "serve", "--model", "demo",
                      "--port", str(port), "--kv", "q8"], port, env, Path(home) / "serve.log")
    prompt = [{"role": "user", "content": DECODE_PROMPT}]
    served, cli, load = [], [], [os.getloadavg()[0]]
    try:
        for _ in range(runs):
            served.append(_stream(server.url, prompt, max_tokens)[1])
            cli.append(_cli_rate(env, prompt, max_tokens))
            load.append(os.getloadavg()[0])
    finally:
        server.stop()
        shutil.rmtree(home, ignore_errors=True)
    return {"max_tokens": max_tokens, "server_tps": served, "cli_tps": cli, "load_1min": load}


def decode_report(results: dict) -> str:
    """The decode comparison as Markdown: each pair, the medians, the verdict."""
    served, cli = sorted(results["server_tps"]), sorted(results["cli_tps"])
    server_median, cli_median = served[len(served) // 2], cli[len(cli) // 2]
    ratio = server_median / cli_median
    overhead_ms = 1000 / server_median - 1000 / cli_median
    rows = ["| run | server tok/s | CLI tok/s |", "|---:|---:|---:|"]
    rows += [f"| {i + 1} | {a:.1f} | {b:.1f} |"
             for i, (a, b) in enumerate(zip(results["server_tps"], results["cli_tps"],
                                            strict=True))]
    load = ", ".join(f"{x:.1f}" for x in results["load_1min"])
    return "\n".join([
        f"Demo model, q8, greedy, {results['max_tokens']} answer tokens, a short prompt; "
        f"server and CLI interleaved; 1-min load average during the run: {load}.", "",
        *rows, "",
        f"Medians: server {server_median:.1f} tok/s, CLI {cli_median:.1f} tok/s "
        f"({ratio:.2f}×); the server's own cost per token: {overhead_ms:+.1f} ms.", "",
        f"Server decode ≥ 0.95× the CLI's: {_verdict(ratio >= 0.95)}."])


def _find(results: dict, server: str, request: str) -> dict | None:
    return next((t for t in results["timings"]
                 if t["server"] == server and t["request"] == request), None)


def _verdict(ok: bool) -> str:
    return "**met**" if ok else "**not met**"


def verdicts(results: dict) -> list[str]:
    """One table row per goal the numbers can answer: goal, verdict, the numbers."""
    rows = []
    first = _find(results, "longleaf (demo)", "first")
    for request, bound in (("resent +1 turn", 0.1), ("after restart", 0.05)):
        again = _find(results, "longleaf (demo)", request)
        if first and again and first["ttft_s"] and again["prompt_tokens"]:
            share = again["cached_tokens"] / again["prompt_tokens"]
            ratio = again["ttft_s"] / first["ttft_s"]
            rows.append(f"| demo, {request}: cached ≥ 95% and TTFT ≤ {bound}× the first | "
                        f"{_verdict(share >= 0.95 and ratio <= bound)} | cached {share:.1%}, "
                        f"TTFT {again['ttft_s']:.2f} s vs {first['ttft_s']:.2f} s "
                        f"({ratio:.3f}×) |")
    rates = [t["decode_tps"] for t in results["timings"]
             if t["server"] == "longleaf (demo)" and t["decode_tps"]]
    if rates and results["cli_decode_tps"]:
        rate = sum(rates) / len(rates)
        ratio = rate / results["cli_decode_tps"]
        rows.append(f"| server decode ≥ 0.95× the CLI's | {_verdict(ratio >= 0.95)} | "
                    f"{rate:.1f} vs {results['cli_decode_tps']:.1f} tok/s ({ratio:.2f}×; "
                    f"mean of the server's {len(rates)} requests) |")
    demo = f"demo {results['mlx_tokens']:,}" if results.get("mlx_tokens") else "demo"
    for label, request in ((demo, "after restart"), ("tiny hybrid", "resent +1 turn"),
                           ("tiny hybrid", "after restart")):
        ours = _find(results, f"longleaf ({label})", request)
        theirs = _find(results, f"mlx_lm.server ({label})", request)
        if ours and theirs and theirs["ttft_s"]:
            ratio = ours["ttft_s"] / theirs["ttft_s"]
            rows.append(f"| {label}, {request}: TTFT ≤ 0.2× mlx_lm.server's | "
                        f"{_verdict(ratio <= 0.2)} | {ours['ttft_s']:.2f} s vs "
                        f"{theirs['ttft_s']:.2f} s ({ratio:.3f}×); cached "
                        f"{ours['cached_tokens']:,} vs {theirs['cached_tokens']:,} |")
    return rows


def report(results: dict) -> str:
    """The results as Markdown: the goals' verdicts, then every request."""
    load = ", ".join(f"{x:.1f}" for x in results.get("load_1min", []))
    lines = [f"Agent-like conversation of about {results['tokens']:,} tokens on the demo "
             f"model and about {results.get('hybrid_tokens', 0):,} on a tiny hybrid "
             f"(qwen3_next, random weights), {results['max_tokens']} answer tokens, greedy, "
             f"Longleaf in q8; CLI decode {results['cli_decode_tps']:.1f} tok/s on the demo "
             f"prompt (q8). 1-minute load average at the start, after each part and at the "
             f"end: {load}.", ""]
    if results.get("reference_float32"):
        lines += ["mlx_lm.server ran on a float32 copy of the demo folder: MLX's CPU backend "
                  "emulates float16, and on the float16 folder mlx_lm.server did not finish "
                  "one 7k-token prompt; Longleaf computes in float32 on the CPU too.", ""]
    if results.get("mlx_tokens"):
        lines += [f"Against mlx_lm.server the demo conversation is about "
                  f"{results['mlx_tokens']:,} tokens (both servers, same requests): its "
                  "prompt processing is too slow on this CPU for the long one.", ""]
    lines += ["| goal | verdict | numbers |", "|---|---|---|", *verdicts(results), "",
              "| server | request | prompt tokens | cached | TTFT s | TTFT / first | "
              "decode tok/s |", "|---|---|---:|---:|---:|---:|---:|"]
    first: dict[str, float] = {}
    for t in results["timings"]:
        first.setdefault(t["server"], t["ttft_s"])
        ratio = t["ttft_s"] / first[t["server"]] if first[t["server"]] else 0.0
        lines.append(f"| {t['server']} | {t['request']} | {t['prompt_tokens']:,} | "
                     f"{t['cached_tokens']:,} | {t['ttft_s']:.2f} | {ratio:.3f} | "
                     f"{t['decode_tps']:.1f} |")
    return "\n".join(lines) + "\n"
