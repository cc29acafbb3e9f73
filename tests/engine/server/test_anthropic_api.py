"""The Anthropic endpoints through the official ``anthropic`` SDK, against a live server."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.engine.server.conftest import Served

# This SDK version no longer takes temperature as an argument; the server still reads it.
GREEDY = {"temperature": 0}


def client(served: Served) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.url, api_key=served.key, max_retries=0)


def test_message_not_streamed(served: Served) -> None:
    reply = client(served).messages.create(
        model="anything", max_tokens=5, system="You are terse.",
        messages=[{"role": "user", "content": [{"type": "text", "text": "Hello"}]}],
        extra_body=GREEDY)
    assert reply.role == "assistant" and reply.model == served.bridge.model_id
    assert reply.content[0].type == "text"
    assert reply.stop_reason in ("end_turn", "max_tokens")
    assert 0 < reply.usage.output_tokens <= 5
    assert reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0) > 0


def test_message_streamed_matches_not_streamed(served: Served) -> None:
    messages = [{"role": "user", "content": "Tell a story"}]
    whole = client(served).messages.create(model="m", max_tokens=8, messages=messages,
                                           extra_body=GREEDY)
    kinds: list[str] = []
    text = ""
    with client(served).messages.stream(model="m", max_tokens=8, messages=messages,
                                        extra_body=GREEDY) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "content_block_delta":
                text += event.delta.text
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    raw = [k for k in kinds if k in ("message_start", "content_block_start",
                                     "content_block_delta", "content_block_stop",
                                     "message_delta", "message_stop")]
    assert raw[:2] == ["message_start", "content_block_start"]
    assert raw[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.stop_reason == whole.stop_reason


def test_resent_conversation_reads_the_cache(served: Served) -> None:
    api = client(served)
    turns = [{"role": "user", "content": "Remember these words: " + "apple pear " * 40}]
    first = api.messages.create(model="m", max_tokens=3, messages=turns, extra_body=GREEDY)
    resent = [*turns, {"role": "assistant", "content": first.content[0].text or "ok"},
              {"role": "user", "content": "Which?"}]
    again = api.messages.create(model="m", max_tokens=3, messages=resent, extra_body=GREEDY)
    total = again.usage.input_tokens + again.usage.cache_read_input_tokens
    assert again.usage.cache_read_input_tokens >= 0.9 * total


def test_count_tokens_matches_usage(served: Served) -> None:
    messages = [{"role": "user", "content": "Count these few words"}]
    counted = client(served).messages.count_tokens(model="m", messages=messages,
                                                   system="Be brief.")
    reply = client(served).messages.create(model="m", max_tokens=1, messages=messages,
                                           system="Be brief.", extra_body=GREEDY)
    assert counted.input_tokens == reply.usage.input_tokens + \
        (reply.usage.cache_read_input_tokens or 0)


def test_stop_sequence(served: Served) -> None:
    api = client(served)
    messages = [{"role": "user", "content": "Say many things"}]
    free = api.messages.create(model="m", max_tokens=12, messages=messages,
                               extra_body=GREEDY).content[0].text
    assert len(free) > 3
    stop = free[2:4]
    cut = api.messages.create(model="m", max_tokens=12, messages=messages, extra_body=GREEDY,
                              stop_sequences=[stop])
    assert cut.content[0].text == free[:free.index(stop)]
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop


def test_errors_in_anthropic_shape(served: Served) -> None:
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=served.url, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=2, messages=[{"role": "user", "content": "x"}])
    with pytest.raises(anthropic.BadRequestError) as raised:
        client(served).messages.create(model="m", max_tokens=2, messages=[
            {"role": "user", "content": [{"type": "image", "source": {}}]}])
    assert raised.value.body["type"] == "error"
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    reply = httpx.post(served.url + "/v1/messages", content=b"[", timeout=30,
                       headers={"x-api-key": served.key})
    assert reply.status_code == 400 and reply.json()["type"] == "error"
    missing = httpx.post(served.url + "/v1/messages", timeout=30,
                         json={"messages": [{"role": "user", "content": "x"}]},
                         headers={"x-api-key": served.key})
    assert missing.status_code == 400 and "max_tokens" in missing.json()["error"]["message"]
