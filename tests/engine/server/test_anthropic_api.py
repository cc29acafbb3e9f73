"""The Anthropic endpoints through the official ``anthropic`` SDK, against a live server."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from mlx_lm.utils import load_tokenizer

from engine.server import protocol
from engine.session import sampling
from engine.session.session import Session
from tests.engine.server.conftest import Served, start_server
from tests.engine.tinymodels import make_tiny_model_dir

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
            {"role": "user", "content": [{"type": "text"}]}])
    assert raised.value.body["type"] == "error"
    assert raised.value.body["error"]["type"] == "invalid_request_error"
    reply = httpx.post(served.url + "/v1/messages", content=b"[", timeout=30,
                       headers={"x-api-key": served.key})
    assert reply.status_code == 400 and reply.json()["type"] == "error"
    missing = httpx.post(served.url + "/v1/messages", timeout=30,
                         json={"messages": [{"role": "user", "content": "x"}]},
                         headers={"x-api-key": served.key})
    assert missing.status_code == 400 and "max_tokens" in missing.json()["error"]["message"]


# -- Claude Code's requests ---------------------------------------------------------

def recording(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Record the token ids before each answer's first step (greedy answers unchanged)."""
    seen: list[list[int]] = []
    original = sampling.build_logits_processors

    def build(params):
        first: list[bool] = []

        def record(history, logits):
            if not first:
                first.append(True)
                seen.append(history.tolist())
            return logits
        return [record, *original(params)]
    monkeypatch.setattr(sampling, "build_logits_processors", build)
    return seen


def tokenizer(served: Served):
    return load_tokenizer(Path(served.bridge.info.path))


def test_system_messages_inside_messages_fold_into_user_turns() -> None:
    body = {"max_tokens": 5, "system": "Top.", "messages": [
        {"role": "system", "content": "Early."},
        {"role": "user", "content": [{"type": "text", "text": "Question"}]},
        {"role": "system", "content": [{"type": "text", "text": "Env.",
                                        "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": "Answer"},
        {"role": "system", "content": "Reminder."},
        {"role": "user", "content": "Next"}]}
    assert protocol.anthropic_messages(body).messages == [
        {"role": "system", "content": "Top.\n\nEarly."},
        {"role": "user", "content": "Question\n\nEnv."},
        {"role": "assistant", "content": "Answer"},
        {"role": "user", "content": "Reminder.\n\nNext"}]
    # Resent with one more turn, the earlier turns render the same.
    body["messages"] += [{"role": "assistant", "content": "More"},
                         {"role": "system", "content": "Last."}]
    assert protocol.anthropic_messages(body).messages[-2:] == [
        {"role": "assistant", "content": "More"}, {"role": "user", "content": "Last."}]


def test_claude_code_first_request_is_answered(served: Served) -> None:
    """As Claude Code sends it with its Agent tool: a system message after the user's."""
    reply = httpx.post(served.url + "/v1/messages?beta=true", timeout=60, headers={
        "x-api-key": served.key, "anthropic-version": "2023-06-01",
        "anthropic-beta": "claude-code-20250219,interleaved-thinking-2025-05-14"}, json={
        "model": "claude-opus-5-5", "max_tokens": 128000, "stream": False,
        "system": [{"type": "text", "text": "You are an agent.",
                    "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "say hi"}]},
                     {"role": "system", "content": [{"type": "text", "text": "# Env"}]}],
        "metadata": {"user_id": "someone"}, "thinking": {"type": "adaptive"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "output_config": {"effort": "medium"}, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["stop_reason"] in ("end_turn", "max_tokens")


def test_thinking_blocks_in_history_are_read_or_dropped() -> None:
    chat = protocol.anthropic_messages({"max_tokens": 5, "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "They greet me.", "signature": "abc"},
            {"type": "redacted_thinking", "data": "opaque"},
            {"type": "text", "text": "Hello!"}]},
        {"role": "user", "content": "Again"}]})
    assert chat.messages[1] == {"role": "assistant", "content": "Hello!",
                                "reasoning_content": "They greet me."}


@pytest.mark.parametrize("api", ["anthropic", "openai"])
def test_a_last_assistant_message_is_continued(served: Served, api: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    seen = recording(monkeypatch)
    messages = [{"role": "user", "content": "Name a tree"},
                {"role": "assistant", "content": "The longleaf"}]
    if api == "anthropic":
        reply = client(served).messages.create(model="m", max_tokens=3, messages=messages,
                                               extra_body=GREEDY)
        assert reply.stop_reason in ("end_turn", "max_tokens")
    else:
        reply = openai.OpenAI(base_url=served.url + "/v1", api_key=served.key,
                              max_retries=0).chat.completions.create(
            model="m", max_tokens=3, messages=messages, temperature=0)
        assert reply.choices[0].finish_reason in ("stop", "length")
    # The answer goes on from the message's last word: no end of turn, no new turn.
    assert tokenizer(served).decode(seen[0]).endswith("<|im_start|>assistant\nThe longleaf")


def test_a_prompt_too_long_is_worded_as_anthropic_words_it(served: Served) -> None:
    with pytest.raises(anthropic.BadRequestError) as raised:
        client(served).messages.create(model="m", max_tokens=5, messages=[
            {"role": "user", "content": "word " * 6000}])
    message = raised.value.body["error"]["message"]
    match = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum", message)
    assert match, message
    assert int(match[1]) > int(match[2]) == served.bridge.max_context - 1


def test_message_start_counts_the_input(served: Served) -> None:
    messages = [{"role": "user", "content": "Count me in, " * 5}]
    counted = client(served).messages.count_tokens(model="m", messages=messages)
    with client(served).messages.stream(model="m", max_tokens=2, messages=messages,
                                        extra_body=GREEDY) as stream:
        start = next(event for event in stream if event.type == "message_start")
        usage = start.message.usage
        final = stream.get_final_message()
    assert usage.input_tokens + usage.cache_read_input_tokens == counted.input_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        counted.input_tokens


def test_root_is_answered_for_head_and_get(served: Served) -> None:
    assert httpx.head(served.url + "/").status_code == 200
    assert httpx.get(served.url + "/").text == "Longleaf is running"


def test_tools_for_a_model_without_tool_calling_are_refused(served: Served) -> None:
    with pytest.raises(anthropic.BadRequestError) as raised:
        client(served).messages.create(model="m", max_tokens=2, messages=[
            {"role": "user", "content": "x"}], tools=[
            {"name": "Bash", "input_schema": {"type": "object"}}])
    assert "defines no tool calling" in raised.value.body["error"]["message"]


@pytest.fixture(scope="module")
def impatient(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """The tiny model behind a server that keeps a silent stream alive every 0.2 s."""
    root = tmp_path_factory.mktemp("keepalive")
    running, stop = start_server(make_tiny_model_dir(root, "llama"), root / "kv",
                                 keepalive=0.2)
    yield running
    stop()


def test_a_long_read_keeps_the_stream_alive(impatient: Served,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    messages = [{"role": "user", "content": "Take your time"}]
    original = Session.prefill_chunks

    def slow(self, *args, **kwargs):
        time.sleep(1.5)  # a read far longer than the keep-alive interval
        return (yield from original(self, *args, **kwargs))
    monkeypatch.setattr(Session, "prefill_chunks", slow)
    deltas: list[str] = []
    with client(impatient).messages.stream(model="m", max_tokens=6, messages=messages,
                                           extra_body=GREEDY) as stream:
        for event in stream:
            if event.type == "content_block_delta":
                deltas.append(event.delta.text)
        final = stream.get_final_message()
    first_text = next(i for i, text in enumerate(deltas) if text)
    assert first_text >= 3 and not any(deltas[:first_text])  # real events while reading
    monkeypatch.undo()
    quick = client(impatient).messages.create(model="m", max_tokens=6, messages=messages,
                                              extra_body=GREEDY)
    assert final.content[0].text == "".join(deltas) == quick.content[0].text


PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAAB"
       "JRU5ErkJggg==")


def test_an_image_a_tool_returned_is_a_note_not_a_refusal(served: Served) -> None:
    # Before: a 400 "this server reads text blocks only", and since an agent sends
    # the screenshot back with every later turn, the conversation could not go on.
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": PNG}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "Look at shot.png"}, image]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                           "name": "read", "input": {"path": "shot.png"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [image]}]}]
    reply = client(served).messages.create(model="m", max_tokens=2, messages=messages)
    assert reply.stop_reason in ("end_turn", "max_tokens")
    read = protocol.anthropic_messages({"max_tokens": 2, "messages": messages})
    assert read.messages[0]["content"] == "Look at shot.png" + protocol.IMAGE_OMITTED
    assert read.messages[-1] == {"role": "tool", "content": protocol.IMAGE_OMITTED,
                                 "tool_call_id": "toolu_1"}
