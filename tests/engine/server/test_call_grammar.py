"""Tool calls as grammars: what each one lets an answer say, token by token,
through llguidance's matcher on the tiny tokenizer (real mlx-lm tokenizer wrappers)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from llguidance import LLMatcher
from mlx_lm.utils import load_tokenizer

from engine.server.call_grammar import Calls, call_grammar, functions, opens_thought
from engine.server.tools import ToolCall, ToolCallReader, ToolSyntax
from engine.session.constraint import _ll_tokenizer, json_schema_grammar
from tests.engine.server.tool_models import (
    TOOL_TEMPLATE,
    XML_THINKING_TEMPLATE,
    make_tokenizer_dir,
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"},
                                         "unit": {"enum": ["C", "F"]}},
        "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object",
                                       "properties": {"zone": {"type": "string"}}}}}
TOOLS = [WEATHER, TIME]


def json_call(name: str, arguments: dict) -> str:
    # As the template writes a call: Python's separators (``tojson``).
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) \
        + "\n</tool_call>"


def xml_call(name: str, arguments: dict[str, str]) -> str:
    params = "".join(f"<parameter={key}>\n{value}\n</parameter>\n"
                     for key, value in arguments.items())
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


class Grammar:
    """A tokenizer folder's syntax and the matcher's view of its tokenizer."""

    def __init__(self, folder: Path) -> None:
        self.tokenizer = load_tokenizer(folder)
        syntax = ToolSyntax.of(self.tokenizer)
        assert syntax is not None
        self.syntax = syntax
        self.ll = _ll_tokenizer(self.tokenizer, frozenset(self.tokenizer.eos_token_ids))

    def of(self, name: str | None = None, single: bool = False,
           open_thought: bool = False, tools: list[dict] | None = None) -> str:
        grammar = call_grammar(self.syntax, Calls(functions(tools or TOOLS, name), single,
                                                   open_thought))
        assert grammar is not None
        return grammar

    def takes(self, grammar: str, text: str | list[int]) -> bool:
        """Whether an answer of ``text`` (and then its end of turn) is one ``grammar``
        allows."""
        matcher = LLMatcher(self.ll, grammar, log_level=0)
        ids = text if isinstance(text, list) else \
            self.tokenizer.encode(text, add_special_tokens=False)
        if matcher.validate_tokens(ids) != len(ids):
            return False
        matcher.consume_tokens(ids)
        return matcher.is_accepting()


@pytest.fixture(scope="module")
def qwen(tmp_path_factory: pytest.TempPathFactory) -> Grammar:
    return Grammar(make_tokenizer_dir(tmp_path_factory.mktemp("qwen"), "qwen", TOOL_TEMPLATE))


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Grammar:
    return Grammar(make_tokenizer_dir(tmp_path_factory.mktemp("xml"), "xml",
                                      XML_THINKING_TEMPLATE, added=("<think>", "</think>")))


def test_json_calls_as_the_template_writes_them_and_nothing_else(qwen: Grammar) -> None:
    assert qwen.syntax.kind == "json_tools" and qwen.syntax.thought is None
    paris = json_call("get_weather", {"city": "Paris"})
    required = qwen.of()
    assert qwen.takes(required, paris)
    assert qwen.takes(required, json_call("get_time", {}))
    assert qwen.takes(required, paris + "\n" + json_call("get_time", {"zone": "UTC"}))
    assert not qwen.takes(required, "I will look it up. " + paris)
    assert not qwen.takes(required, "No call.")
    assert qwen.takes(required, "\n" + paris) and not qwen.takes(required, "\n\n\n" + paris)
    assert not qwen.takes(required, paris.replace('": ', '":'))  # not the template's JSON
    assert not qwen.takes(required, json_call("get_weather", {"city": 7}))
    assert not qwen.takes(required, json_call("get_weather", {"unit": "C"}))  # city left out
    assert not qwen.takes(required, json_call("rm_rf", {}))
    assert not qwen.takes(required, paris[:-3])  # a call never closed is no answer
    single = qwen.of(single=True)
    assert qwen.takes(single, paris)
    assert not qwen.takes(single, paris + "\n" + paris)
    named = qwen.of("get_time")
    assert qwen.takes(named, json_call("get_time", {"zone": "UTC"}))
    assert not qwen.takes(named, paris)


def test_calls_the_grammar_takes_are_the_calls_the_reader_reads(qwen: Grammar) -> None:
    text = json_call("get_weather", {"city": "Paris", "unit": "C"}) + "\n" \
        + json_call("get_time", {})
    assert qwen.takes(qwen.of(), text)
    calls = [p for p in ToolCallReader(qwen.syntax, TOOLS).feed(text) if isinstance(p, ToolCall)]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "C"}), ("get_time", {})]


def test_xml_calls_after_the_thought_the_prompt_opened(thinking: Grammar) -> None:
    assert thinking.syntax.kind == "qwen3_coder"
    assert thinking.syntax.thought == ("<think>", "</think>")
    call = xml_call("get_weather", {"city": "Paris <b>and</b>\nOslo", "unit": "C"})
    opened = thinking.of(open_thought=True)
    assert thinking.takes(opened, "They want the weather.\n</think>\n\n" + call)
    assert not thinking.takes(opened, call)  # the thought is finished first
    assert not thinking.takes(opened, "Hm.</think>\n" + xml_call("rm_rf", {}))
    assert not thinking.takes(opened, "Hm.</think>\n" + xml_call("get_weather", {"town": "X"}))
    assert not thinking.takes(opened, "Hm.</think>\nLet me see. " + call)
    closed = thinking.of("get_weather")
    assert thinking.takes(closed, call)
    assert thinking.takes(closed, "<think>\nWeather.\n</think>\n\n" + call)
    assert not thinking.takes(closed, xml_call("get_time", {}))
    reader = ToolCallReader(thinking.syntax, [WEATHER])
    (parsed,) = [p for p in reader.feed(call) if isinstance(p, ToolCall)]
    assert json.loads(parsed.arguments) == {"city": "Paris <b>and</b>\nOslo", "unit": "C"}


def test_a_prompt_ends_inside_a_thought_only_after_its_think_marker(thinking: Grammar,
                                                                    qwen: Grammar) -> None:
    def ids(text: str) -> list[int]:
        return thinking.tokenizer.encode(text, add_special_tokens=False)

    assert opens_thought(thinking.tokenizer, ids("<|im_start|>assistant\n<think>\n"))
    assert not opens_thought(thinking.tokenizer,
                             ids("<|im_start|>assistant\n<think>\nNo.\n</think>\n\n"))
    assert not opens_thought(thinking.tokenizer, ids("<think>\n" + "and on " * 40))
    # The marker in the user's own words opens nothing.
    assert not opens_thought(thinking.tokenizer, ids(
        "<|im_start|>user\nWhat does <think> do?<|im_end|>\n<|im_start|>assistant\n"))
    assert not opens_thought(qwen.tokenizer, qwen.tokenizer.encode("<|im_start|>assistant\n"))


@pytest.mark.parametrize("special", [True, False])
def test_markers_of_one_added_token_are_matched_as_that_token(tmp_path: Path,
                                                             special: bool) -> None:
    markers = ("<tool_call>", "</tool_call>")
    added = Grammar(make_tokenizer_dir(tmp_path, "added", TOOL_TEMPLATE,
                                       **{"special" if special else "added": markers}))
    start, end = (added.syntax.marker_tokens[m] for m in markers)
    text = '\n{"name": "get_time", "arguments": {}}\n'
    body = added.tokenizer.encode(text, add_special_tokens=False)
    assert added.takes(added.of(), [start, *body, end])
    # Spelled in pieces, a marker is not what the model's template writes.
    spelled = [piece for marker in markers
               for piece in added.tokenizer.encode(marker[0]) + added.tokenizer.encode(
                   marker[1:])]
    assert not added.takes(added.of(), spelled[:len(spelled) // 2] + body
                           + spelled[len(spelled) // 2:])


@pytest.mark.parametrize("kind", ["pythonic", "mistral", ""])
def test_a_syntax_without_a_grammar_here_is_left_free(qwen: Grammar, kind: str) -> None:
    syntax: Any = ToolSyntax(qwen.syntax.start, qwen.syntax.end, qwen.syntax.parser,
                             kind=kind)
    assert call_grammar(syntax, Calls(functions(TOOLS, None), False, False)) is None


def test_the_functions_a_choice_names(qwen: Grammar) -> None:
    flat = {"name": "flat", "parameters": {"type": "object"}}
    assert [f["name"] for f in functions([WEATHER, flat, {"type": "web_search"}], None)] \
        == ["get_weather", "flat"]
    assert [f["name"] for f in functions(TOOLS, "get_time")] == ["get_time"]
    assert call_grammar(qwen.syntax, Calls(functions(TOOLS, "other"), False, False)) is None


def test_beside_a_format_the_answer_is_calls_or_that_format(qwen: Grammar,
                                                            thinking: Grammar) -> None:
    answer = json_schema_grammar({"type": "object", "properties": {"n": {"type": "integer"}},
                                  "required": ["n"]})
    calls = Calls(functions(TOOLS, None), False, False)
    grammar = call_grammar(qwen.syntax, calls, answer)
    assert grammar is not None
    assert qwen.takes(grammar, '{"n":3}')
    assert qwen.takes(grammar, json_call("get_time", {}))
    assert not qwen.takes(grammar, "Three.")
    assert not qwen.takes(grammar, '{"n":"three"}')
    assert not qwen.takes(grammar, json_call("get_time", {}) + '\n{"n":3}')
    opened = call_grammar(thinking.syntax, Calls(functions(TOOLS, None), False, True), answer)
    assert opened is not None
    assert thinking.takes(opened, "Count.</think>\n\n" + '{"n":3}')
    assert not thinking.takes(opened, '{"n":3}')


def test_a_tools_refs_resolve_against_its_own_parameters(qwen: Grammar) -> None:
    item = {"type": "function", "function": {"name": "add_item", "parameters": {
        "type": "object", "$defs": {"Item": {"type": "object", "properties": {
            "n": {"type": "integer"}}, "required": ["n"]}},
        "properties": {"item": {"$ref": "#/$defs/Item"}}, "required": ["item"]}}}
    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}}}}
    grammar = qwen.of(tools=[item, tree, WEATHER])
    assert qwen.takes(grammar, json_call("add_item", {"item": {"n": 2}}))
    assert not qwen.takes(grammar, json_call("add_item", {"item": {"n": "two"}}))
    assert qwen.takes(grammar, json_call("tree", {"kids": [{"kids": []}, {}]}))
    assert not qwen.takes(grammar, json_call("tree", {"kids": [{"kids": "none"}]}))
    assert not qwen.takes(grammar, json_call("get_weather", {"city": 7}))


def test_one_tool_the_matcher_refuses_leaves_the_others_checked(qwen: Grammar) -> None:
    broken = {"type": "function", "function": {"name": "odd", "parameters": {
        "type": "object", "properties": {"x": {"$ref": "#/$defs/missing"}}}}}
    grammar = qwen.of(tools=[broken, WEATHER])
    assert qwen.takes(grammar, json_call("odd", {"y": [1, 2]}))
    assert not qwen.takes(grammar, json_call("odd", 3))  # type: ignore[arg-type]
    assert not qwen.takes(grammar, json_call("get_weather", {"city": 7}))


def test_xml_values_are_what_the_parser_reads_as_their_types(thinking: Grammar) -> None:
    typed = {"type": "function", "function": {"name": "book", "parameters": {
        "type": "object", "properties": {
            "seats": {"type": "integer"}, "note": {"type": "string"},
            "late": {"type": "boolean"}, "tags": {"type": "array",
                                                  "items": {"type": "string"}}},
        "required": ["seats"]}}}
    grammar = thinking.of(tools=[typed])
    assert thinking.takes(grammar, xml_call("book", {
        "seats": "2", "note": "a <b>\nwindow", "late": "false", "tags": '["a", "b"]'}))
    assert thinking.takes(grammar, xml_call("book", {"seats": "-3"}))
    assert not thinking.takes(grammar, xml_call("book", {"seats": "two"}))
    assert not thinking.takes(grammar, xml_call("book", {"note": "no seats"}))
    assert not thinking.takes(grammar, xml_call("book", {"seats": "1", "late": "maybe"}))
    # The parser would cut the value at the closing tag.
    assert not thinking.takes(grammar, xml_call("book", {"seats": "1",
                                                        "note": "say </parameter> hi"}))
    twice = xml_call("book", {"seats": "1"}).replace(
        "</parameter>\n", "</parameter>\n<parameter=seats>\n2\n</parameter>\n", 1)
    assert not thinking.takes(grammar, twice)
    reader = ToolCallReader(thinking.syntax, [typed])
    text = xml_call("book", {"seats": "2", "tags": '["a"]'})
    (parsed,) = [p for p in reader.feed(text) if isinstance(p, ToolCall)]
    assert json.loads(parsed.arguments) == {"seats": 2, "tags": ["a"]}


def test_an_xml_tool_without_parameters_takes_any(thinking: Grammar) -> None:
    ping = {"type": "function", "function": {"name": "ping"}}
    grammar = thinking.of(tools=[ping, WEATHER])
    assert thinking.takes(grammar, xml_call("ping", {}))
    assert thinking.takes(grammar, xml_call("ping", {"host": "a.b"}))
    assert not thinking.takes(grammar, xml_call("get_weather", {"town": "X"}))


def test_xml_names_the_parser_would_misread_get_no_grammar(thinking: Grammar) -> None:
    spaced = {"type": "function", "function": {"name": "look up", "parameters": {
        "type": "object", "properties": {}}}}
    angled = {"type": "function", "function": {"name": "find", "parameters": {
        "type": "object", "properties": {"a>b": {"type": "string"}}}}}
    for tool in (spaced, angled):
        assert call_grammar(thinking.syntax, Calls(functions([tool], None), False,
                                                   False)) is None
