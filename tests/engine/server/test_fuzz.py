"""1,000 malformed requests against both APIs leave the server answering.

Most go through the ASGI app in process (httpx's ASGITransport, on the live
server's loaded bridge), so the run stays short; a round of them also goes over
the real socket, and both APIs answer a good request after.
"""

from __future__ import annotations

import asyncio
import json
import random

import anthropic
import httpx
import openai

from engine.server.app import Server
from tests.engine.server.conftest import Served

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/messages",
             "/v1/messages/count_tokens", "/v1/responses", "/api/chat", "/api/generate",
             "/api/show")
KEYS = ("messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p",
        "top_k", "stop", "stop_sequences", "seed", "n", "best_of", "stream", "stream_options",
        "model", "kv_mode", "echo", "system", "tools", "tool_choice", "logprobs", "user",
        "input", "instructions", "text", "response_format", "output_config", "format",
        "options", "logit_bias", "top_logprobs", "presence_penalty", "min_p",
        "repetition_penalty", "parallel_tool_calls", "thinking", "raw", "include")
HUGE = (10**30, -10**30, 2**64, 1e308, -1e308, float("nan"), float("inf"))
ANSWERED = (200, 400, 413)


def _value(rng: random.Random, depth: int = 0) -> object:
    pick = rng.randrange(12 if depth < 2 else 8)
    if pick == 0:
        return rng.choice(HUGE)
    if pick == 1:
        return rng.choice([None, True, False, 0, -1, 1, 0.5])
    if pick == 2:
        return rng.choice(["", "x", "\udc80", "demo@q3", "user", "assistant", "tool"])
    if pick == 3:
        return "y" * rng.choice([1, 100, 5000])
    if pick == 4:
        return {"role": rng.choice(["user", "assistant", "tool", "system", 7]),
                "content": _value(rng, depth + 1)}
    if pick == 5:
        return {"type": rng.choice(["text", "tool_use", "tool_result", "image", None]),
                "text": _value(rng, depth + 1), "input": _value(rng, depth + 1)}
    if pick == 6:
        return {"type": "function", "function": {"name": _value(rng, depth + 1),
                                                 "parameters": _value(rng, depth + 1)}}
    if pick == 7:
        return rng.randint(-5, 5)
    return [_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]


def _body(rng: random.Random) -> bytes:
    if rng.random() < 0.1:
        return rng.choice([b"", b"[", b"\xff\xfe", b"null", b"123", b'{"messages": [',
                           b'"string"', b"{" * 5000])
    body = {rng.choice(KEYS): _value(rng) for _ in range(rng.randint(0, 6))}
    if rng.random() < 0.5:  # close to valid, so the checks past the first one run too
        body.setdefault("messages", [{"role": "user", "content": "hi"}])
        body.setdefault("prompt", "hi")
        body.setdefault("input", "hi")
    body["max_tokens"] = body.get("max_tokens", 1) if rng.random() < 0.3 else 1
    # Short answers on every API: Ollama's and the Responses API's limits have their
    # own names and longer defaults.
    body["max_output_tokens"] = 1
    if not isinstance(body.get("options"), dict) or rng.random() < 0.7:
        body["options"] = {"num_predict": 1}
    else:
        body["options"]["num_predict"] = 1
    return json.dumps(body).encode()


async def _fuzz(client: httpx.AsyncClient, rng: random.Random, count: int,
                key: str) -> list[tuple[str, bytes, int, str]]:
    odd = []
    for _ in range(count):
        path, content = rng.choice(ENDPOINTS), _body(rng)
        headers = {"x-api-key" if "messages" in path else "authorization":
                   key if "messages" in path else f"Bearer {key}"}
        reply = await client.post(path, content=content, headers=headers)
        shaped = "error" in reply.json() if reply.status_code != 200 else True
        if reply.status_code not in ANSWERED or not shaped:
            odd.append((path, content[:300], reply.status_code, reply.text[:300]))
    return odd


def test_a_thousand_malformed_requests(served: Served) -> None:
    app = Server(served.bridge, served.key).app()
    rng = random.Random(26)

    async def in_process() -> list:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://asgi",
                                     timeout=120) as client:
            return await _fuzz(client, rng, 900, served.key)

    async def over_the_socket() -> list:
        async with httpx.AsyncClient(base_url=served.url, timeout=120) as client:
            return await _fuzz(client, rng, 100, served.key)

    odd = asyncio.run(in_process()) + asyncio.run(over_the_socket())
    assert not odd, odd[:5]
    chat = openai.OpenAI(base_url=served.url + "/v1", api_key=served.key, max_retries=0)
    assert chat.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "still there?"}],
        max_tokens=2).choices[0].finish_reason in ("stop", "length")
    messages = anthropic.Anthropic(base_url=served.url, api_key=served.key, max_retries=0)
    assert messages.messages.create(model="m", max_tokens=2, messages=[
        {"role": "user", "content": "and you?"}]).stop_reason in ("end_turn", "max_tokens")
