"""Tools: rendered into a real tool-aware chat template, calls parsed from a forced
answer and returned in the OpenAI and the Anthropic format."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from mlx_lm.tool_parsers import json_tools, pythonic, qwen3_coder
from mlx_lm.utils import load_tokenizer

from engine.server import protocol
from engine.server.tools import ToolCall, ToolCallReader, ToolSyntax, with_short_ids
from engine.session import sampling
from engine.session.prompt_ids import render_conversation
from tests.engine.server.conftest import Served, start_server
from tests.engine.server.tool_models import (
    MISTRAL_TEMPLATE,
    TOOL_TEMPLATE,
    make_tool_model_dir,
    scripted_processors,
    serve_templated,
)

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
ANTHROPIC_WEATHER = {"name": "get_weather", "description": "The weather in a city.",
                     "input_schema": WEATHER["function"]["parameters"]}
JSON_SYNTAX = ToolSyntax(json_tools.tool_call_start, json_tools.tool_call_end,
                         json_tools.parse_tool_call)


@pytest.fixture(scope="module")
def tooled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("server-tools")
    running, stop = start_server(make_tool_model_dir(root), root / "kv")
    yield running
    stop()


@pytest.fixture
def forced(tooled: Served, monkeypatch: pytest.MonkeyPatch):
    """Make every answer write ``text`` (then end its turn)."""
    tokenizer = load_tokenizer(Path(tooled.bridge.info.path))

    def force(text: str) -> None:
        monkeypatch.setattr(sampling, "build_logits_processors",
                            scripted_processors(tokenizer, text))
    return force


def read_all(reader: ToolCallReader, text: str, step: int) -> list[str | ToolCall]:
    parts: list[str | ToolCall] = []
    for start in range(0, len(text), step):
        parts += reader.feed(text[start:start + step])
    return parts + reader.finish()


def joined(parts: list[str | ToolCall]) -> list[str | ToolCall]:
    out: list[str | ToolCall] = []
    for part in parts:
        if isinstance(part, str) and out and isinstance(out[-1], str):
            out[-1] += part
        else:
            out.append(part)
    return out


@pytest.mark.parametrize("step", [1, 2, 5, 1000])
def test_reader_splits_text_and_calls_however_the_text_comes(step: int) -> None:
    text = "Let me look. <tools> are fine. " + CALL + CALL.replace("Paris", "Oslo") + " Done."
    parts = joined(read_all(ToolCallReader(JSON_SYNTAX, [WEATHER]), text, step))
    assert parts[0] == "Let me look. <tools> are fine. "
    assert [(p.name, json.loads(p.arguments)) for p in parts if isinstance(p, ToolCall)] == \
        [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert parts[-1] == " Done."


def test_unreadable_call_stays_text_and_a_cut_call_is_still_read() -> None:
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert joined(read_all(ToolCallReader(JSON_SYNTAX, None), broken, 3)) == [broken]
    cut = CALL[:-len("</tool_call>")]  # the answer hit its end before the end marker
    parts = read_all(ToolCallReader(JSON_SYNTAX, None), cut, 4)
    assert len(parts) == 1 and isinstance(parts[0], ToolCall)
    assert parts[0].input() == {"city": "Paris"}


WAIT = {"type": "function", "function": {"name": "wait", "parameters": {
    "type": "object", "properties": {"seconds": {"type": "number"}}}}}


def syntax_of(parser) -> ToolSyntax:
    return ToolSyntax(parser.tool_call_start, parser.tool_call_end, parser.parse_tool_call)


@pytest.mark.parametrize(("parser", "text"), [
    (json_tools, "<tool_call>\n" + '{"a":' * 1200 + "1" + "}" * 1200 + "\n</tool_call>"),
    (json_tools, '<tool_call>\n{"name": "f", "arguments": ' + "[" * 3000),
    (json_tools, "<tool_call>\n[]\n</tool_call>"),
    (qwen3_coder, "<tool_call>\n<function=wait>\n<parameter=seconds>\ninf\n</parameter>\n"
                  "</function>\n</tool_call>"),
    (pythonic, "<|tool_call_start|>[wait(seconds=1e999)]<|tool_call_end|>"),
    (json_tools, '<tool_call>\n{"name": "wait", "arguments": "{\\"seconds\\": NaN}"}\n'
                 "</tool_call>"),
], ids=["deep", "deep-cut", "empty-list", "inf", "1e999", "nan-in-text"])
def test_a_call_no_parser_reads_into_json_stays_text(parser, text: str) -> None:
    # Before: RecursionError and OverflowError escaped the reader (a 500, or a stream
    # cut without an error event), an empty list of calls dropped the text, and
    # Infinity or NaN went out as arguments no JSON client can read.
    reader = ToolCallReader(syntax_of(parser), [WAIT])
    assert joined(read_all(reader, text, 1000)) == [text]


@pytest.mark.parametrize("cut", ["<tool_call>\n", '<tool_call>\n{"name": "get_wea',
                                 '<tool_call>\n{"name": "x"}\n</tool'])
def test_a_call_cut_short_and_unreadable_stays_as_written(cut: str) -> None:
    # No end marker the model never wrote: an agent resending the answer must send
    # back the model's own text.
    parts = read_all(ToolCallReader(JSON_SYNTAX, None), cut, 3)
    assert joined(parts) == [cut]


def test_tools_and_tool_results_render_into_the_template(tmp_path) -> None:
    tokenizer = load_tokenizer(make_tool_model_dir(tmp_path))
    openai_body = {"tools": [WEATHER], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}]}
    anthropic_body = {"max_tokens": 5, "system": "Be brief.", "tools": [ANTHROPIC_WEATHER],
                      "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1",
                                           "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                      "content": [{"type": "text", "text": "sunny, 21 C"}]}]}]}
    chat = protocol.openai_chat(openai_body, 5)
    text = tokenizer.decode(render_conversation(tokenizer, chat.messages,
                                                add_generation_prompt=True, tools=chat.tools))
    # The tool is listed in the system turn, before the instructions that follow the list.
    assert '"name": "get_weather"' in text.split("For each function call")[0]
    assert CALL in text  # the call as the model would write it
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    other = protocol.anthropic_messages(anthropic_body)
    assert render_conversation(tokenizer, other.messages, add_generation_prompt=True,
                               tools=other.tools) == \
        render_conversation(tokenizer, chat.messages, add_generation_prompt=True,
                            tools=chat.tools)
    plain = render_conversation(tokenizer, chat.messages[:2], add_generation_prompt=True)
    assert "<tools>" not in tokenizer.decode(plain)
    # A result marked as an error says so to the model, as Anthropic's API tells its own.
    anthropic_body["messages"][-1]["content"][0]["is_error"] = True
    failed = protocol.anthropic_messages(anthropic_body)
    assert failed.messages[-1]["content"] == protocol.TOOL_ERROR + "sunny, 21 C"


@pytest.mark.parametrize("body", [
    {"tools": {"name": "x"}},
    {"tools": [{"type": "function"}]},
    {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
        {"role": "tool", "content": "y"}]},
])
def test_bad_tools_are_400(body: dict) -> None:
    with pytest.raises(protocol.BadRequest):
        protocol.openai_chat({"messages": [{"role": "user", "content": "x"}], **body}, 5)


@pytest.mark.parametrize("tool", [
    {"type": "web_search_20250305", "name": "web_search", "max_uses": 5},
    {"type": "bash_20250124", "name": "bash"},
])
def test_anthropics_own_tools_are_400_not_offered_as_bare_names(tool: dict) -> None:
    with pytest.raises(protocol.BadRequest, match=rf"Anthropic's '{tool['type']}' tool"):
        protocol.anthropic_messages({"max_tokens": 5, "messages": MESSAGES,
                                     "tools": [ANTHROPIC_WEATHER, tool]})
    # A custom tool may say so.
    assert protocol.anthropic_messages({"max_tokens": 5, "messages": MESSAGES, "tools": [
        {**ANTHROPIC_WEATHER, "type": "custom"}]}).tools


def test_openai_tool_call_not_streamed_then_streamed(tooled: Served, forced) -> None:
    forced(CALL)
    api = openai.OpenAI(base_url=tooled.url + "/v1", api_key=tooled.key, max_retries=0)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    reply = api.chat.completions.create(model="m", messages=messages, tools=[WEATHER],
                                        max_tokens=80)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    chunks = list(api.chat.completions.create(model="m", messages=messages, tools=[WEATHER],
                                              max_tokens=80, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    streamed = [t for d in deltas for t in (d.tool_calls or [])]
    assert [(t.index, t.function.name) for t in streamed] == [(0, "get_weather")]
    assert json.loads(streamed[0].function.arguments) == {"city": "Paris"}
    assert not "".join(d.content or "" for d in deltas)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # The tool's result goes back; the conversation so far comes from the cache.
    forced("It is sunny.")
    follow = [*messages, choice.message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = api.chat.completions.create(model="m", messages=follow, tools=[WEATHER],
                                         max_tokens=80)
    assert answer.choices[0].message.content == "It is sunny."
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens


def test_without_tools_the_markers_are_text(tooled: Served, forced) -> None:
    forced(CALL)
    api = openai.OpenAI(base_url=tooled.url + "/v1", api_key=tooled.key, max_retries=0)
    reply = api.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Say it"}], max_tokens=80)
    assert reply.choices[0].message.content == CALL
    assert reply.choices[0].finish_reason == "stop"


def test_anthropic_tool_use_not_streamed_then_streamed(tooled: Served, forced) -> None:
    forced("Checking. " + CALL)
    api = anthropic.Anthropic(base_url=tooled.url, api_key=tooled.key, max_retries=0)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    reply = api.messages.create(model="m", max_tokens=80, messages=messages,
                                tools=[ANTHROPIC_WEATHER])
    assert reply.stop_reason == "tool_use"
    assert [b.type for b in reply.content] == ["text", "tool_use"]
    assert reply.content[0].text == "Checking. "
    assert reply.content[1].name == "get_weather"
    assert reply.content[1].input == {"city": "Paris"}
    kinds = []
    with api.messages.stream(model="m", max_tokens=80, messages=messages,
                             tools=[ANTHROPIC_WEATHER]) as stream:
        for event in stream:
            kinds.append(event.type)
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert [b.type for b in final.content] == ["text", "tool_use"]
    assert final.content[1].input == {"city": "Paris"}
    assert final.content[0].text == "Checking. "
    forced("Sunny.")
    follow = [*messages, {"role": "assistant", "content": [b.model_dump() for b in final.content]},
              {"role": "user", "content": [{"type": "tool_result",
                                            "tool_use_id": final.content[1].id,
                                            "content": "sunny, 21 C"}]}]
    answer = api.messages.create(model="m", max_tokens=80, messages=follow,
                                 tools=[ANTHROPIC_WEATHER])
    assert answer.content[0].text == "Sunny." and answer.stop_reason == "end_turn"


MESSAGES = [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(("choice", "expected"), [
    (None, ("auto", None)), ("auto", ("auto", None)), ("required", ("required", None)),
    ({"type": "function", "function": {"name": "get_weather"}}, ("named", "get_weather")),
])
def test_openai_tool_choice_is_read(choice, expected) -> None:
    body = {"messages": MESSAGES, "tools": [WEATHER]}
    chat = protocol.openai_chat({**body, "tool_choice": choice} if choice else body, 5)
    assert (chat.tool_choice, chat.tool_name) == expected and chat.tools


@pytest.mark.parametrize(("choice", "expected"), [
    ({"type": "auto"}, ("auto", None)), ({"type": "any"}, ("required", None)),
    ({"type": "tool", "name": "get_weather"}, ("named", "get_weather")),
    ({"type": "auto", "disable_parallel_tool_use": True}, ("auto", None)),
])
def test_anthropic_tool_choice_is_read(choice, expected) -> None:
    chat = protocol.anthropic_messages({"max_tokens": 5, "messages": MESSAGES,
                                        "tools": [ANTHROPIC_WEATHER], "tool_choice": choice})
    assert (chat.tool_choice, chat.tool_name) == expected and chat.tools


def test_tool_choice_none_still_renders_the_tools() -> None:
    chat = protocol.openai_chat({"messages": MESSAGES, "tools": [WEATHER],
                                 "tool_choice": "none"}, 5)
    assert chat.tools == [WEATHER] and chat.tool_choice == "none"
    other = protocol.anthropic_messages({"max_tokens": 5, "messages": MESSAGES,
                                         "tools": [ANTHROPIC_WEATHER],
                                         "tool_choice": {"type": "none"}})
    assert other.tools == chat.tools and other.tool_choice == "none"
    # No call can be made, so an answer held to a schema is no conflict.
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object"}}}
    held = protocol.openai_chat({"messages": MESSAGES, "tools": [WEATHER],
                                 "tool_choice": "none", "response_format": schema}, 5)
    assert held.sampling.grammar is not None


def test_tool_choice_none_reuses_the_cache_and_reads_no_call(tooled: Served,
                                                             forced) -> None:
    # Before: "none" left the tools out of the prompt, which then differed from the
    # tool list on: an agent's whole conversation was read again for that turn.
    forced(CALL)
    api = openai.OpenAI(base_url=tooled.url + "/v1", api_key=tooled.key, max_retries=0)
    asked = {"model": "m", "messages": MESSAGES, "tools": [WEATHER], "max_tokens": 80}
    first = api.chat.completions.create(**asked)
    none = api.chat.completions.create(**asked, tool_choice="none")
    assert none.usage.prompt_tokens == first.usage.prompt_tokens
    assert none.usage.prompt_tokens_details.cached_tokens == none.usage.prompt_tokens - 1
    # A call the model writes anyway is its text.
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == CALL
    assert none.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(("anthropic_api", "body"), [
    (False, {"tools": [WEATHER], "tool_choice": "any"}),
    (False, {"tools": [WEATHER], "tool_choice": {"type": "function"}}),
    (False, {"tools": [WEATHER], "tool_choice": {"type": "function",
                                                 "function": {"name": "other"}}}),
    (False, {"tool_choice": "required"}),
    (True, {"tools": [ANTHROPIC_WEATHER], "tool_choice": "auto"}),
    (True, {"tools": [ANTHROPIC_WEATHER], "tool_choice": {"type": "tool"}}),
    (True, {"tools": [ANTHROPIC_WEATHER], "tool_choice": {"type": "tool", "name": "other"}}),
    (True, {"tool_choice": {"type": "any"}}),
])
def test_bad_tool_choice_is_400(anthropic_api: bool, body: dict) -> None:
    with pytest.raises(protocol.BadRequest) as raised:
        if anthropic_api:
            protocol.anthropic_messages({"max_tokens": 5, "messages": MESSAGES, **body})
        else:
            protocol.openai_chat({"messages": MESSAGES, **body}, 5)
    assert raised.value.param == "tool_choice"


# A tool whose every call is short: the tiny models' random weights write a string
# on and on, but a forced call here has only a few to choose from.
CHOOSY = {"type": "function", "function": {
    "name": "pick_city", "parameters": {
        "type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
        "required": ["city"], "additionalProperties": False}}}
UNIT = {"type": "function", "function": {
    "name": "pick_unit", "parameters": {
        "type": "object", "properties": {"unit": {"enum": ["C", "F"]}},
        "required": ["unit"], "additionalProperties": False}}}


@pytest.fixture
def unwritten(tooled: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """The model's call syntax is one no forced-call grammar here writes."""
    syntax = ToolSyntax.of(load_tokenizer(Path(tooled.bridge.info.path)))
    monkeypatch.setattr(type(tooled.bridge), "tool_syntax",
                        property(lambda self: replace(syntax, kind="pythonic")))


def test_a_forced_choice_is_decoded_to_the_call(tooled: Served) -> None:
    # No script: the model's own (random) answer, kept to the call by the grammar.
    api = openai.OpenAI(base_url=tooled.url + "/v1", api_key=tooled.key, max_retries=0)
    for choice in ("required", {"type": "function", "function": {"name": "pick_city"}}):
        reply = api.chat.completions.create(model="m", messages=MESSAGES,
                                            tools=[UNIT, CHOOSY], tool_choice=choice,
                                            parallel_tool_calls=False, max_tokens=120)
        (call,) = reply.choices[0].message.tool_calls
        assert reply.choices[0].finish_reason == "tool_calls"
        assert reply.model_extra["tool_choice_met"] is True
        if choice != "required":
            assert call.function.name == "pick_city"
        assert json.loads(call.function.arguments) in (
            {"city": "Paris"}, {"city": "Oslo"}, {"unit": "C"}, {"unit": "F"})
    other = anthropic.Anthropic(base_url=tooled.url, api_key=tooled.key, max_retries=0)
    message = other.messages.create(
        model="m", max_tokens=120, messages=MESSAGES, tools=[{
            "name": "pick_city", "input_schema": CHOOSY["function"]["parameters"]}],
        tool_choice={"type": "tool", "name": "pick_city", "disable_parallel_tool_use": True})
    (use,) = message.content
    assert use.type == "tool_use" and use.input["city"] in ("Paris", "Oslo")
    assert message.stop_reason == "tool_use"


PLACE = {"type": "object", "properties": {"place": {"enum": ["home", "away"]}},
         "required": ["place"], "additionalProperties": False}


def test_a_response_format_beside_tools_answers_with_a_call_or_that_format(
        tooled: Served) -> None:
    api = openai.OpenAI(base_url=tooled.url + "/v1", api_key=tooled.key, max_retries=0)
    place = {"type": "json_schema", "json_schema": {"name": "p", "schema": PLACE}}
    for seed in range(3):
        reply = api.chat.completions.create(
            model="m", messages=MESSAGES, tools=[UNIT, CHOOSY], parallel_tool_calls=False,
            response_format=place, max_tokens=120, seed=seed, temperature=1.0)
        message = reply.choices[0].message
        if message.tool_calls:
            assert reply.choices[0].finish_reason == "tool_calls" and not message.content
        else:
            assert json.loads(message.content or "") in ({"place": "home"},
                                                         {"place": "away"})
    # A forced call beside a format: the call (the format is the final answer's).
    reply = api.chat.completions.create(
        model="m", messages=MESSAGES, tools=[UNIT, CHOOSY], tool_choice="required",
        parallel_tool_calls=False, response_format=place, max_tokens=120)
    assert len(reply.choices[0].message.tool_calls or []) == 1


def test_a_response_format_beside_tools_no_grammar_here_writes_is_400(
        tooled: Served, unwritten) -> None:
    # Held to the format, the answer could never call a tool.
    api = openai.OpenAI(base_url=tooled.url + "/v1", api_key=tooled.key, max_retries=0)
    place = {"type": "json_schema", "json_schema": {"name": "p", "schema": PLACE}}
    with pytest.raises(openai.BadRequestError) as raised:
        api.chat.completions.create(model="m", messages=MESSAGES, tools=[CHOOSY],
                                    response_format=place, max_tokens=20)
    assert raised.value.body["param"] == "response_format"
    assert "cannot be used together with this model" in raised.value.body["message"]
    with pytest.raises(openai.BadRequestError) as raised:
        api.responses.create(model="m", input="Weather?", tools=[{
            "type": "function", **CHOOSY["function"]}], max_output_tokens=20,
            text={"format": {"type": "json_schema", "name": "p", "schema": PLACE}})
    assert raised.value.body["param"] == "text"
    other = anthropic.Anthropic(base_url=tooled.url, api_key=tooled.key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="output_config"):
        other.messages.create(model="m", max_tokens=20, messages=MESSAGES, tools=[{
            "name": "pick_city", "input_schema": CHOOSY["function"]["parameters"]}],
            output_config={"format": {"type": "json_schema", "schema": PLACE}})
    ollama_reply = httpx.post(tooled.url + "/api/chat", json={
        "model": "m", "messages": MESSAGES, "tools": [CHOOSY], "format": PLACE,
        "stream": False}, headers={"Authorization": f"Bearer {tooled.key}"}, timeout=60)
    assert ollama_reply.status_code == 400 and "format" in ollama_reply.text
    # Under tool_choice "none" no call can come: the format alone holds the answer.
    reply = api.chat.completions.create(model="m", messages=MESSAGES, tools=[CHOOSY],
                                        tool_choice="none", response_format=place,
                                        max_tokens=40)
    assert json.loads(reply.choices[0].message.content or "") in ({"place": "home"},
                                                                  {"place": "away"})


def test_openai_forced_tool_choice_says_whether_the_answer_made_the_call(
        tooled: Served, forced, unwritten) -> None:
    api = openai.OpenAI(base_url=tooled.url + "/v1", api_key=tooled.key, max_retries=0)
    named = {"type": "function", "function": {"name": "get_weather"}}
    forced(CALL)
    reply = api.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER],
                                        tool_choice=named, max_tokens=80)
    assert reply.choices[0].finish_reason == "tool_calls"
    assert reply.model_extra["tool_choice_met"] is True
    forced("No call.")
    reply = api.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER],
                                        tool_choice="required", max_tokens=80)
    # Decoding is free in a syntax no grammar here writes: the answer ends normally
    # and says so.
    assert reply.choices[0].message.content == "No call."
    assert reply.choices[0].finish_reason == "stop"
    assert reply.model_extra["tool_choice_met"] is False
    chunks = list(api.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER],
                                              tool_choice="required", max_tokens=80,
                                              stream=True))
    last = [c for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    assert last.model_extra["tool_choice_met"] is False
    auto = api.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER],
                                       max_tokens=80)
    assert "tool_choice_met" not in (auto.model_extra or {})


def test_tools_on_a_model_without_tool_calling_are_400(
        tooled: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(type(tooled.bridge), "tool_syntax", property(lambda self: None))
    api = openai.OpenAI(base_url=tooled.url + "/v1", api_key=tooled.key, max_retries=0)
    for choice in ("auto", "required"):
        with pytest.raises(openai.BadRequestError) as raised:
            api.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER],
                                        tool_choice=choice, max_tokens=5)
        assert raised.value.body["param"] == "tools"
        assert "defines no tool calling" in raised.value.body["message"]
    other = anthropic.Anthropic(base_url=tooled.url, api_key=tooled.key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError):
        other.messages.create(model="m", max_tokens=5, messages=MESSAGES,
                              tools=[ANTHROPIC_WEATHER], tool_choice={"type": "any"})
    # tool_choice "none" leaves the tools out: nothing is lost.
    reply = api.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER],
                                        tool_choice="none", max_tokens=2)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_parallel_calls_refused_keep_the_first(tooled: Served, forced) -> None:
    forced(CALL + CALL.replace("Paris", "Oslo"))
    api = openai.OpenAI(base_url=tooled.url + "/v1", api_key=tooled.key, max_retries=0)
    both = api.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER],
                                       max_tokens=200)
    assert len(both.choices[0].message.tool_calls) == 2
    one = api.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER],
                                      max_tokens=200, parallel_tool_calls=False)
    (call,) = one.choices[0].message.tool_calls
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    other = anthropic.Anthropic(base_url=tooled.url, api_key=tooled.key, max_retries=0)
    reply = other.messages.create(model="m", max_tokens=200, messages=MESSAGES,
                                  tools=[ANTHROPIC_WEATHER], tool_choice={
                                      "type": "auto", "disable_parallel_tool_use": True})
    assert [b.input for b in reply.content if b.type == "tool_use"] == [{"city": "Paris"}]


def test_anthropic_stream_of_a_call_alone_opens_no_text_block(tooled: Served, forced,
                                                              unwritten) -> None:
    forced(CALL)
    api = anthropic.Anthropic(base_url=tooled.url, api_key=tooled.key, max_retries=0)
    events = []
    with api.messages.stream(model="m", max_tokens=80, messages=MESSAGES,
                             tools=[ANTHROPIC_WEATHER],
                             tool_choice={"type": "tool", "name": "get_weather"}) as stream:
        for event in stream:
            events.append(event)
        final = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert [(e.index, e.content_block.type) for e in starts] == [(0, "tool_use")]
    assert [b.type for b in final.content] == ["tool_use"]
    assert final.content[0].input == {"city": "Paris"} and final.stop_reason == "tool_use"
    delta = next(e for e in events if e.type == "message_delta")
    assert delta.model_extra["tool_choice_met"] is True
    forced("Sunny.")
    reply = api.messages.create(model="m", max_tokens=80, messages=MESSAGES,
                                tools=[ANTHROPIC_WEATHER], tool_choice={"type": "any"})
    assert [b.type for b in reply.content] == ["text"] and reply.stop_reason == "end_turn"
    assert reply.model_extra["tool_choice_met"] is False


@pytest.mark.parametrize("before", ["\n", "\n\n"])
def test_line_breaks_before_a_call_open_no_text_block(tooled: Served, forced,
                                                      before: str) -> None:
    # Templates (and a forced call's grammar) may break the line before a call.
    forced(before + CALL)
    api = anthropic.Anthropic(base_url=tooled.url, api_key=tooled.key, max_retries=0)
    reply = api.messages.create(model="m", max_tokens=80, messages=MESSAGES,
                                tools=[ANTHROPIC_WEATHER])
    assert [b.type for b in reply.content] == ["tool_use"]
    chat = openai.OpenAI(base_url=tooled.url + "/v1", api_key=tooled.key, max_retries=0)
    answer = chat.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER],
                                          max_tokens=80).choices[0].message
    assert not answer.content and len(answer.tool_calls or []) == 1
    forced(before)  # blank text alone is the answer, as written
    reply = api.messages.create(model="m", max_tokens=80, messages=MESSAGES,
                                tools=[ANTHROPIC_WEATHER])
    assert [(b.type, b.text) for b in reply.content] == [("text", before)]


def test_anthropic_stream_of_an_empty_answer_has_one_empty_text_block(tooled: Served,
                                                                      forced) -> None:
    forced("")
    api = anthropic.Anthropic(base_url=tooled.url, api_key=tooled.key, max_retries=0)
    with api.messages.stream(model="m", max_tokens=20, messages=MESSAGES,
                             tools=[ANTHROPIC_WEATHER]) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert [(b.type, b.text) for b in final.content] == [("text", "")]
    assert kinds.index("content_block_start") < kinds.index("message_delta")
    assert final.stop_reason == "end_turn"


def test_parallel_calls_streamed_give_the_items_they_give_whole(tooled: Served,
                                                                forced) -> None:
    """The newline between two calls is no text of its own: a stream opens no text
    block or message item for it, so what a client keeps (and sends back) is the
    same streamed or not."""
    forced("Let me check.\n" + CALL + "\n" + CALL.replace("Paris", "Rome") + "\n")
    other = anthropic.Anthropic(base_url=tooled.url, api_key=tooled.key, max_retries=0)
    ask = {"model": "m", "max_tokens": 200, "messages": MESSAGES, "tools": [ANTHROPIC_WEATHER]}
    with other.messages.stream(**ask) as stream:
        streamed = stream.get_final_message().content
    whole = other.messages.create(**ask).content
    for content in (streamed, whole):
        assert [(b.type, getattr(b, "text", None) or b.input) for b in content] == [
            ("text", "Let me check.\n"), ("tool_use", {"city": "Paris"}),
            ("tool_use", {"city": "Rome"})]
    api = openai.OpenAI(base_url=tooled.url + "/v1", api_key=tooled.key, max_retries=0)
    tools = [{"type": "function", **WEATHER["function"]}]
    with api.responses.stream(model="m", input="Weather?", tools=tools,
                              max_output_tokens=200) as stream:
        output = stream.get_final_response().output
    created = api.responses.create(model="m", input="Weather?", tools=tools,
                                   max_output_tokens=200).output
    for items in (output, created):
        assert [item.type for item in items] == ["message", "function_call", "function_call"]
        assert items[0].content[0].text == "Let me check.\n"


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    """A model whose template demands Mistral's 9-character call ids."""
    yield from serve_templated(tmp_path_factory, "tiny-llama-mistral", MISTRAL_TEMPLATE)


def test_a_mistral_tool_round_trip_is_answered(mistral: Served,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: the server's call_<24 hex> ids failed the template's check, so the
    # call sent back with its result was a 500, every time.
    tokenizer = load_tokenizer(Path(mistral.bridge.info.path))
    monkeypatch.setattr(sampling, "build_logits_processors", scripted_processors(
        tokenizer, '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]'))
    api = openai.OpenAI(base_url=mistral.url + "/v1", api_key=mistral.key, max_retries=0)
    reply = api.chat.completions.create(model="m", messages=MESSAGES,
                                        tools=[WEATHER], max_tokens=80)
    message = reply.choices[0].message
    assert message.tool_calls is not None
    ident = message.tool_calls[0].id
    assert len(ident) == 9 and ident.isalnum()
    follow = [*MESSAGES, message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": ident, "content": "sunny"}]
    again = api.chat.completions.create(model="m", messages=follow,
                                        tools=[WEATHER], max_tokens=5)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
    # A conversation begun on another server (Anthropic's toolu_ ids) is read too.
    claude = anthropic.Anthropic(base_url=mistral.url, api_key=mistral.key, max_retries=0)
    counted = claude.messages.count_tokens(model="m", tools=[ANTHROPIC_WEATHER], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_01AbCdEf",
                                           "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_01AbCdEf",
                                      "content": "sunny"}]}])
    assert counted.input_tokens > 0


def test_short_ids_pair_a_call_with_its_result() -> None:
    messages = with_short_ids([
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "toolu_01AbCdEf", "type": "function",
             "function": {"name": "f", "arguments": {}}},
            {"id": "abcDEF123", "type": "function", "function": {"name": "f", "arguments": {}}}]},
        {"role": "tool", "content": "1", "tool_call_id": "toolu_01AbCdEf"},
        {"role": "tool", "content": "2", "tool_call_id": "abcDEF123"}])
    first, kept = (call["id"] for call in messages[0]["tool_calls"])
    assert len(first) == 9 and first.isalnum() and first == messages[1]["tool_call_id"]
    assert kept == messages[2]["tool_call_id"] == "abcDEF123"  # already a Mistral id


NULL_ARGUMENTS = '<tool_call>\n{"name": "get_weather", "arguments": null}\n</tool_call>'


def test_a_call_without_arguments_comes_back_as_an_empty_object(tooled: Served,
                                                                 forced) -> None:
    # Before: "null" (OpenAI), {"value": None} or None (Anthropic, not streamed or
    # streamed), which the server itself refused when the client sent them back.
    forced(NULL_ARGUMENTS)
    api = openai.OpenAI(base_url=tooled.url + "/v1", api_key=tooled.key, max_retries=0)
    message = api.chat.completions.create(model="m", messages=MESSAGES, tools=[WEATHER],
                                          max_tokens=80).choices[0].message
    assert message.tool_calls is not None
    assert message.tool_calls[0].function.arguments == "{}"
    claude = anthropic.Anthropic(base_url=tooled.url, api_key=tooled.key, max_retries=0)
    ask = {"model": "m", "max_tokens": 80, "messages": MESSAGES, "tools": [ANTHROPIC_WEATHER]}
    whole = claude.messages.create(**ask).content
    with claude.messages.stream(**ask) as stream:
        streamed = stream.get_final_message().content
    assert [(b.type, b.input) for b in whole] == [(b.type, b.input) for b in streamed] == [
        ("tool_use", {})]
    forced("ok")
    follow = [*MESSAGES, message.model_dump(exclude_none=True),
              {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "?"}]
    api.chat.completions.create(model="m", messages=follow, tools=[WEATHER], max_tokens=5)
    claude.messages.create(**{**ask, "messages": [
        *MESSAGES, {"role": "assistant", "content": [b.model_dump() for b in streamed]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": streamed[0].id,
                                      "content": "?"}]}]})


@pytest.mark.parametrize(("arguments", "read"), [
    ("null", {}), ('""', {}), ('"{\\"city\\": \\"Oslo\\"}"', {"city": "Oslo"}),
    ("5", None), ("[1]", None), ('"Oslo"', None)])
def test_arguments_that_are_no_object_leave_the_call_as_text(arguments: str,
                                                             read: dict | None) -> None:
    text = '<tool_call>\n{"name": "get_weather", "arguments": ' + arguments + "}\n</tool_call>"
    parts = read_all(ToolCallReader(JSON_SYNTAX, [WEATHER]), text, 1000)
    if read is None:
        assert joined(parts) == [text]
    else:
        assert len(parts) == 1 and isinstance(parts[0], ToolCall)
        assert parts[0].input() == read


# TOOL_TEMPLATE rendering an assistant turn's thought, as Qwen3's does in a tool loop.
THINKING_TOOL_TEMPLATE = TOOL_TEMPLATE.replace(
    "{% if message.content %}{{ message.content }}\n{% endif %}",
    "{% if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n"
    "</think>\n\n{% endif %}{% if message.content %}{{ message.content }}\n{% endif %}")


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serve_templated(tmp_path_factory, "tiny-thinking-tools",
                               THINKING_TOOL_TEMPLATE)


def test_a_thought_sent_back_as_reasoning_content_is_read_from_the_cache(
        thinking: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    assert THINKING_TOOL_TEMPLATE != TOOL_TEMPLATE
    tokenizer = load_tokenizer(Path(thinking.bridge.info.path))
    thought = "They want the weather in Paris, so I look it up."
    monkeypatch.setattr(sampling, "build_logits_processors", scripted_processors(
        tokenizer, f"<think>\n{thought}\n</think>\n\n{CALL}"))
    api = openai.OpenAI(base_url=thinking.url + "/v1", api_key=thinking.key, max_retries=0)
    cached = {}
    for sent in ("reasoning_content", None):
        asked = [{"role": "user", "content": f"Weather in Paris? ({sent})"}]
        reply = api.chat.completions.create(model="m", messages=asked, tools=[WEATHER],
                                            max_tokens=200)
        (call,) = reply.choices[0].message.tool_calls
        # As llama.cpp's, vLLM's and LM Studio's clients send it: the thought apart.
        turn = {"role": "assistant", "content": "", "tool_calls": [call.model_dump()],
                **({sent: thought} if sent else {})}
        resent = api.chat.completions.create(
            model="m", max_tokens=1, tools=[WEATHER], messages=[
                *asked, turn, {"role": "tool", "tool_call_id": call.id, "content": "Sunny"}])
        cached[sent] = resent.usage.prompt_tokens_details.cached_tokens
    # Before, the field was dropped: the prompt parted from what the model wrote at
    # the thought, and the call after it was read again.
    assert cached["reasoning_content"] >= cached[None] + len(tokenizer.encode(thought))


def test_an_anthropic_thinking_block_sent_back_is_read_from_the_cache(
        thinking: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = load_tokenizer(Path(thinking.bridge.info.path))
    thought = "They want the weather in Paris, so I look it up."
    monkeypatch.setattr(sampling, "build_logits_processors", scripted_processors(
        tokenizer, f"<think>\n{thought}\n</think>\n\n{CALL}"))
    api = anthropic.Anthropic(base_url=thinking.url, api_key=thinking.key, max_retries=0)
    cached = {}
    for sent in (True, False):
        asked = [{"role": "user", "content": f"Weather in Paris? ({sent})"}]
        reply = api.messages.create(model="m", max_tokens=200, messages=asked,
                                    tools=[ANTHROPIC_WEATHER])
        use = next(b for b in reply.content if b.type == "tool_use")
        blocks = [{"type": "thinking", "thinking": thought, "signature": "s"}] if sent else []
        turn = {"role": "assistant", "content": [
            *blocks, {"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}]}
        resent = api.messages.create(model="m", max_tokens=1, tools=[ANTHROPIC_WEATHER],
                                     messages=[*asked, turn, {"role": "user", "content": [
                                         {"type": "tool_result", "tool_use_id": use.id,
                                          "content": "Sunny"}]}])
        cached[sent] = resent.usage.cache_read_input_tokens
    # Before, the engine's worker dropped the thought the server rendered: it read
    # another prompt than the server counted, and the call after the thought again.
    assert cached[True] >= cached[False] + len(tokenizer.encode(thought))
