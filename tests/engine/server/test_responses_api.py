"""``POST /v1/responses`` through the official ``openai`` SDK's Responses API, against
a live server: text and tool calls, streamed and not, and prefix reuse."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from mlx_lm.utils import load_tokenizer

from engine.server import protocol, responses
from engine.server.errors import BadRequest
from engine.session import sampling
from tests.engine.server.conftest import Served, start_server
from tests.engine.server.tool_models import make_tool_model_dir, scripted_processors

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}, "strict": False}
STREAM_ORDER = ["response.created", "response.in_progress", "response.output_item.added",
                "response.content_part.added", "response.output_text.delta",
                "response.output_text.done", "response.content_part.done",
                "response.output_item.done"]


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=served.key, max_retries=0)


def codex_input(question: str) -> list[dict]:
    """Input items as Codex sends them: developer instructions, then the user's turn."""
    return [{"type": "message", "role": "developer", "content": [
                {"type": "input_text", "text": "You are a coding agent. " * 30}]},
            {"type": "message", "role": "user", "content": [
                {"type": "input_text", "text": question}]}]


def test_a_string_input_not_streamed(served: Served) -> None:
    reply = client(served).responses.create(model="m", input="Hello there",
                                            max_output_tokens=5, temperature=0,
                                            instructions="Be brief.", store=False)
    assert reply.object == "response" and reply.status in ("completed", "incomplete")
    assert reply.output[0].type == "message" and reply.output_text
    assert reply.output_text == reply.output[0].content[0].text
    assert 0 < reply.usage.output_tokens <= 5 and reply.usage.input_tokens > 0
    if reply.status == "incomplete":
        assert reply.incomplete_details.reason == "max_output_tokens"


def test_streamed_matches_not_streamed(served: Served) -> None:
    api = client(served)
    whole = api.responses.create(model="m", input=codex_input("Tell a story"),
                                 max_output_tokens=8, temperature=0)
    kinds: list[str] = []
    text = ""
    with api.responses.stream(model="m", input=codex_input("Tell a story"),
                              max_output_tokens=8, temperature=0) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                text += event.delta
    # A cut at max_output_tokens ends with response.incomplete, as OpenAI's does.
    final = event.response
    assert final.status == whole.status
    assert text == whole.output_text == final.output[0].content[0].text
    ordered = [k for i, k in enumerate(kinds) if i == 0 or kinds[i - 1] != k]
    assert ordered[:len(STREAM_ORDER)] == STREAM_ORDER
    assert ordered[-1] in ("response.completed", "response.incomplete")
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_a_resent_conversation_reads_the_cache(served: Served) -> None:
    api = client(served)
    items = codex_input("Remember: " + "pine cone " * 40)
    first = api.responses.create(model="m", input=items, max_output_tokens=3, temperature=0,
                                 store=False, prompt_cache_key="session-1")
    resent = [*items, {"type": "message", "role": "assistant", "content": [
                  {"type": "output_text", "text": first.output_text or "ok"}]},
              {"type": "message", "role": "user", "content": [
                  {"type": "input_text", "text": "Which?"}]}]
    again = api.responses.create(model="m", input=resent, max_output_tokens=3, temperature=0,
                                 store=False, prompt_cache_key="session-1")
    cached = again.usage.input_tokens_details.cached_tokens
    assert cached >= 0.95 * first.usage.input_tokens


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"store": True}, "store"),
    ({"text": {"format": {"type": "json_schema", "name": "x",
                          "schema": {"$ref": "#/nowhere"}}}}, "text"),
    ({"background": True}, "background"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"tools": [{"type": "custom", "name": "apply_patch"}]}, "tools"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input"),
    ({"tools": [{"type": "web_search"}],
      "tool_choice": {"type": "function", "name": "x"}}, "tool_choice"),
])
def test_what_it_cannot_honour_is_400(served: Served, body: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client(served).responses.create(model="m", max_output_tokens=2,
                                        **{"input": "x", **body})
    assert raised.value.body["param"] == param


def test_previous_response_id_says_what_to_do(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client(served).responses.create(model="m", input="x", previous_response_id="r")
    assert "send the whole conversation" in raised.value.body["message"]


def test_codex_tools_read_as_function_tools() -> None:
    asked = responses.read({"input": "x", "tools": [
        WEATHER, {"type": "web_search", "external_web_access": False},
        {"type": "namespace", "name": "agents", "tools": [
            {"type": "function", "name": "spawn", "parameters": {"type": "object"}}]}],
        "tool_choice": "auto", "parallel_tool_calls": True, "reasoning": {"summary": "auto"},
        "store": False, "include": ["reasoning.encrypted_content"], "stream": True,
        "prompt_cache_key": "k", "client_metadata": {"turn_id": "t"}})
    assert [t["function"]["name"] for t in asked.chat.tools] == ["get_weather", "spawn"]
    assert asked.namespaces == {"spawn": "agents"} and asked.chat.stream


def test_items_render_as_chat_messages() -> None:
    asked = responses.read({"instructions": "Be brief.", "input": [
        {"type": "message", "role": "developer", "content": [
            {"type": "input_text", "text": "Rules."}]},
        {"role": "user", "content": "Weather?"},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather",
         "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]})
    chat = protocol.openai_chat({"messages": [
        {"role": "system", "content": "Be brief.\n\nRules."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "Checking.", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]}, 5)
    assert asked.chat.messages == chat.messages


def test_the_response_echoes_the_request_as_sent() -> None:
    """tool_choice, text and max_output_tokens come back as the request gave them
    (null for a limit it left out), as OpenAI's response objects do."""
    text = {"format": {"type": "json_schema", "name": "w", "strict": True,
                       "schema": {"type": "object", "properties": {}}}}
    sent = {"input": "x", "tools": [WEATHER], "tool_choice": "none", "text": text}
    echoed = responses.ResponseWriter(responses.read(sent), "m").response("completed")
    assert (echoed["tool_choice"], echoed["text"], echoed["max_output_tokens"]) == (
        "none", text, None)
    forced = {"type": "function", "name": "get_weather"}
    echoed = responses.ResponseWriter(responses.read(
        {"input": "x", "tools": [WEATHER], "tool_choice": forced, "max_output_tokens": 9}),
        "m").response("completed")
    assert (echoed["tool_choice"], echoed["text"], echoed["max_output_tokens"]) == (
        forced, {"format": {"type": "text"}}, 9)


def test_a_refusal_resent_reads_as_what_the_answer_said() -> None:
    """A conversation resent with the answer's refusal (a content part of its own,
    or chat's message-level ``refusal``) renders it as that turn's text."""
    refused = "I can't help with that."
    asked = responses.read({"input": [
        {"role": "user", "content": "Do it."},
        {"type": "message", "role": "assistant",
         "content": [{"type": "refusal", "refusal": refused}]},
        {"role": "user", "content": "Why?"}]})
    expected = [{"role": "user", "content": "Do it."},
                {"role": "assistant", "content": refused},
                {"role": "user", "content": "Why?"}]
    assert asked.chat.messages == expected
    for answer in ({"content": [{"type": "refusal", "refusal": refused}]},
                   {"content": None, "refusal": refused}):
        chat = protocol.openai_chat({"messages": [
            expected[0], {"role": "assistant", **answer}, expected[2]]}, 5)
        assert chat.messages == expected
    # An image is a note that it was left out (a refusal would end an agent's
    # conversation, which sends it back every turn); a file is still refused.
    output = {"type": "function_call_output", "call_id": "c1",
              "output": [{"type": "input_image", "image_url": "data:image/png;base64,AA"}]}
    imaged = responses.read({"input": [
        {"role": "user", "content": [{"type": "input_text", "text": "See "},
                                     {"type": "input_image", "image_url": "x"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"}, output]})
    assert [m["content"] for m in imaged.chat.messages] == [
        "See " + protocol.IMAGE_OMITTED, "", protocol.IMAGE_OMITTED]
    with pytest.raises(BadRequest) as refused_part:
        responses.read({"input": [{"role": "user", "content": [{"type": "input_file"}]}]})
    assert refused_part.value.param == "input"


@pytest.fixture(scope="module")
def tooled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("responses-tools")
    running, stop = start_server(make_tool_model_dir(root), root / "kv")
    yield running
    stop()


@pytest.fixture
def forced(tooled: Served, monkeypatch: pytest.MonkeyPatch):
    tokenizer = load_tokenizer(Path(tooled.bridge.info.path))

    def force(text: str) -> None:
        monkeypatch.setattr(sampling, "build_logits_processors",
                            scripted_processors(tokenizer, text))
    return force


def test_a_tool_round_trip_streamed(tooled: Served, forced) -> None:
    forced("Let me check. " + CALL)
    api = client(tooled)
    items = codex_input("Weather in Paris?")
    kinds: list[str] = []
    arguments = ""
    with api.responses.stream(model="m", input=items, tools=[WEATHER],
                              max_output_tokens=200) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.function_call_arguments.delta":
                arguments += event.delta
        first = stream.get_final_response()
    assert json.loads(arguments) == {"city": "Paris"}
    assert "response.function_call_arguments.done" in kinds
    assert [item.type for item in first.output] == ["message", "function_call"]
    call = first.output[1]
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Paris"}
    assert first.output_text == "Let me check. "
    forced("It is sunny.")
    follow = [*items, *[item.model_dump(exclude_none=True) for item in first.output],
              {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    answer = api.responses.create(model="m", input=follow, tools=[WEATHER],
                                  max_output_tokens=200)
    assert answer.output_text == "It is sunny." and answer.status == "completed"
    assert answer.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens - 1
