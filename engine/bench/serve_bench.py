"""``python -m engine.bench serve``: the HTTP server's time to first token and tokens/s.

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
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

HEALTH_TIMEOUT = 600.0


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


def conversation(tokens: int, extra_turn: bool) -> list[dict[str, str]]:
    """About ``tokens`` tokens of an agent's context; ``extra_turn`` adds one short turn."""
    messages = [{"role": "system", "content": "You are a coding agent. Tools: read, edit, run. "
                 + "Follow the repository's conventions and keep answers short. " * 20}]
    turn = 0
    while len(json.dumps(messages)) < tokens * 4:  # about four characters a token
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


def _stream(url: str, messages: list[dict[str, str]], max_tokens: int) -> tuple[float, float,
                                                                                dict]:
    # "default_model" is mlx_lm.server's name for its --model; Longleaf answers any id.
    body = {"model": "default_model", "messages": messages, "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first = last = None
    usage: dict = {}
    pieces = 0
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=3600) as reply:
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
                pieces += 1
    generated = int(usage.get("completion_tokens") or pieces)
    ttft = (first or time.perf_counter()) - started
    rate = (generated - 1) / (last - first) if first and last and last > first else 0.0
    return ttft, rate, usage


class Running:
    """A server subprocess on 127.0.0.1, healthy or failed."""

    def __init__(self, command: list[str], port: int, env: dict[str, str]) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + HEALTH_TIMEOUT
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{command[:4]} exited with {self.process.returncode}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"{command[:4]} did not become healthy")

    def stop(self) -> None:
        self.process.terminate()  # SIGTERM: uvicorn shuts down and stores the sessions
        try:
            self.process.wait(120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _three(name: str, start, tokens: int, max_tokens: int) -> list[Timing]:
    results = []
    server = start()
    try:
        for label, extra in (("first", False), ("resent +1 turn", True)):
            ttft, rate, usage = _stream(server.url, conversation(tokens, extra), max_tokens)
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            results.append(Timing(name, label, int(usage.get("prompt_tokens") or 0),
                                  int(cached), ttft, rate))
    finally:
        server.stop()
    server = start()
    try:
        ttft, rate, usage = _stream(server.url, conversation(tokens, True), max_tokens)
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        results.append(Timing(name, "after restart", int(usage.get("prompt_tokens") or 0),
                              int(cached), ttft, rate))
    finally:
        server.stop()
    return results


def _cli_rate(env: dict[str, str], tokens: int, max_tokens: int) -> float:
    prompt = conversation(tokens, True)
    text = "\n\n".join(m["content"] for m in prompt)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as handle:
        handle.write(text)
    out = subprocess.run([sys.executable, "-m", "engine", "generate", "--model", "demo",
                          "--kv", "q8", "--prompt-file", handle.name, "--temp", "0",
                          "--max-tokens", str(max_tokens), "--json"],
                         env=env, capture_output=True, text=True, check=True)
    Path(handle.name).unlink()
    return float(json.loads(out.stdout.strip().splitlines()[-1])["decode_tps"])


def run(tokens: int = 7000, max_tokens: int = 64, mlx_lm: bool = True) -> dict:
    """Measure Longleaf's server, the CLI and (optionally) mlx_lm.server; plain results."""
    from engine.models.loader import resolve_model_path

    home = tempfile.mkdtemp(prefix="longleaf-serve-bench-")
    env = {**os.environ, "LONGLEAF_HOME": home}

    def longleaf() -> Running:
        port = _port()
        return Running([sys.executable, "-m", "engine", "serve", "--model", "demo",
                        "--port", str(port), "--kv", "q8"], port, env)

    timings = _three("longleaf", longleaf, tokens, max_tokens)
    if mlx_lm:
        folder = str(resolve_model_path("demo"))

        def reference() -> Running:
            port = _port()
            return Running([sys.executable, "-m", "mlx_lm.server", "--model", folder,
                            "--port", str(port)], port, env)
        timings += _three("mlx_lm.server", reference, tokens, max_tokens)
    return {"tokens": tokens, "max_tokens": max_tokens,
            "cli_decode_tps": _cli_rate(env, tokens, max_tokens),
            "timings": [asdict(t) for t in timings]}


def report(results: dict) -> str:
    """The results as a Markdown table."""
    lines = [f"Conversation of about {results['tokens']:,} tokens on the demo model, "
             f"{results['max_tokens']} answer tokens, greedy; CLI decode "
             f"{results['cli_decode_tps']:.1f} tok/s on the same prompt (q8).", "",
             "| server | request | prompt tokens | cached | TTFT s | TTFT / first | decode tok/s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    first: dict[str, float] = {}
    for t in results["timings"]:
        first.setdefault(t["server"], t["ttft_s"])
        ratio = t["ttft_s"] / first[t["server"]] if first[t["server"]] else 0.0
        lines.append(f"| {t['server']} | {t['request']} | {t['prompt_tokens']:,} | "
                     f"{t['cached_tokens']:,} | {t['ttft_s']:.2f} | {ratio:.3f} | "
                     f"{t['decode_tps']:.1f} |")
    return "\n".join(lines) + "\n"
