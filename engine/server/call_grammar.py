"""Tool calls as a grammar the answer is decoded to, each token checked by
llguidance's matcher (``engine.session.constraint``), as vLLM and llama.cpp keep
them: a forced ``tool_choice`` ("required", Anthropic's "any", a named function)
makes the answer one or more calls, and a response format beside tools makes it
either calls or the JSON the format asks for.

Calls are written as the model's template writes them, so the reader that parses
an unconstrained answer's calls parses these too, and the cache holds the same
tokens either way. Syntaxes with a grammar here: JSON calls between markers
(Qwen2.5, Qwen3, Hermes: mlx-lm's ``json_tools``) and Qwen3-Coder's XML calls
(Qwen3.5 and Qwen3-Next: ``qwen3_coder``). Another syntax, or a grammar the
matcher refuses, has none (the caller decides what then). A thinking model may
think first, as its template asks. No MLX here: it runs in the server (a grammar
is built on a thread beside its event loop).
"""

from __future__ import annotations

import functools
import json
import logging
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher

from engine.server.tools import ToolSyntax
from engine.session.constraint import GrammarError, json_schema_grammar

log = logging.getLogger(__name__)

# The reply's opening a template writes after the conversation (its role marker and a
# think marker) lies within this many of the prompt's last tokens.
THOUGHT_TAIL = 32
# Tokens a template writes after the think marker that opens a reply (line breaks).
_AFTER_THINK_MARKER = 2
# The name the answer's own grammar is referred to by.
_ANSWER = "answer"
# Any text, for the lazy rules that end at the first marker after it.
_ANY_TEXT = "TEXT: /(?s:.*)/"
# A name mlx-lm's qwen3_coder parser reads back whole.
_XML_NAME = re.compile(r"[^\s<>]+")
# A number as JSON writes it.
_NUMBER = "/-?[0-9]+(\\.[0-9]+)?([eE][-+]?[0-9]+)?/"
# A call's arguments written as the templates write JSON (``tojson``, Python's
# separators): one space after a colon or comma, none elsewhere.
_AS_TEMPLATES_WRITE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Calls:
    """The calls an answer may make: of ``tools``, at most one where parallel calls
    were refused."""

    tools: tuple[dict, ...]  # the functions' ``{"name", "parameters"}`` (``functions``)
    single: bool
    open_thought: bool  # the prompt ends inside a thought: the answer finishes it first


def functions(tools: Sequence[dict], name: str | None) -> tuple[dict, ...]:
    """The request's function tools (OpenAI's shape, or flat) the call may name."""
    found = []
    for tool in tools:
        function = tool.get("function", tool)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            continue
        if name is None or function["name"] == name:
            found.append(function)
    return tuple(found)


def opens_thought(tokenizer: Any, prompt: Sequence[int]) -> bool:
    """Whether ``prompt`` ends inside a thought of ``tokenizer``'s model (mlx-lm's
    wrapper): a thinking template's reply that starts with its think marker. The
    marker must end the prompt (a line break after it at most): one in the user's
    own words ("what does <think> do?") opens nothing.

    Reads the tokenizer without its render lock (decoding beside an encode on
    another thread is safe in the Rust tokenizer), so the event loop never waits
    for a long render.
    """
    if not getattr(tokenizer, "has_thinking", False):
        return False
    tail = list(prompt[-THOUGHT_TAIL:])
    opened = tokenizer.rfind_think_start(tail)
    if opened < 0:
        return False
    after = tail[opened + len(tokenizer.think_start_tokens):]
    return len(after) <= _AFTER_THINK_MARKER and not tokenizer.decode(after).strip()


def call_grammar(syntax: ToolSyntax, calls: Calls, answer: str | None = None) -> str | None:
    """The grammar of an answer that makes ``calls`` in ``syntax`` (or, given an
    ``answer`` grammar, such as a response format's, writes that answer instead);
    None where no grammar here writes that syntax (or these tools' names in it),
    or the matcher cannot take the one made.

    Slow for many tools or large schemas (each is compiled to check it): call it
    off the event loop.
    """
    writer = _WRITERS.get(syntax.kind)
    if writer is None or not calls.tools:
        return None
    tools = writer(syntax, calls.tools)
    if tools is None:
        return None
    grammar = _grammar(syntax, calls, tools, answer)
    refusal = _refusal(grammar)
    if refusal is not None:
        log.info("a tool call grammar was refused: %s", refusal)
        return None
    return grammar


@functools.lru_cache(maxsize=64)
def _refusal(grammar: str) -> str | None:
    """Why the matcher cannot take ``grammar`` (None: it can). An agent sends the same
    tools on every turn: each grammar is checked once."""
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    return (messages[0] if messages else "no reason given") if failed else None


def _grammar(syntax: ToolSyntax, calls: Calls, tools: list[str], answer: str | None) -> str:
    # The line breaks a template writes before a call (after a thought: two).
    rules = ["%llguidance {}", _ANY_TEXT, 'breaks: ("\\n" "\\n"?)?',
             " | ".join(f"call_{i}" for i in range(len(calls.tools))).join(("call: ", ""))]
    made = "call" if calls.single else 'call ("\\n"? call)*'
    if answer is not None:
        made = f"({made} | @{_ANSWER})"
    if syntax.thought is None:
        rules.append(f"start: breaks {made}")
    else:
        begin, end = (_literal(syntax, marker) for marker in syntax.thought)
        rules.append(f"thought{_lazy(syntax, syntax.thought[1])}: TEXT {end}")
        opening = "thought" if calls.open_thought else f"({begin} thought)?"
        rules.append(f"start: {opening} breaks {made}")
    lark = "\n".join(rules + tools) + "\n"
    if answer is None:
        return lark
    # The answer's grammar (llguidance's JSON form) joins as a named grammar.
    (inner,) = json.loads(answer)["grammars"]
    return json.dumps({"grammars": [{"lark_grammar": lark}, {**inner, "name": _ANSWER}]})


# The rules ``call_0`` … of each tool, in a syntax; None: these tools cannot be written.
_Writer = Callable[[ToolSyntax, tuple[dict, ...]], "list[str] | None"]


def _json_calls(syntax: ToolSyntax, tools: tuple[dict, ...]) -> list[str]:
    """``<tool_call>\n{"name": …, "arguments": {…}}\n</tool_call>``: each tool's
    arguments a JSON document of their own (a ``$ref`` in them resolves against
    the tool's parameters, as the tool means it)."""
    start, end = _literal(syntax, syntax.start), _literal(syntax, syntax.end)
    rules = []
    for i, tool in enumerate(tools):
        head = json.dumps(f'\n{{"name": {json.dumps(tool["name"])}, "arguments": ')
        schema = {**_parameters(tool), "x-guidance": _AS_TEMPLATES_WRITE}
        rules.append(f'call_{i}: {start} {head} %json {json.dumps(schema)} "}}\\n" {end}')
    return rules


def _xml_calls(syntax: ToolSyntax, tools: tuple[dict, ...]) -> list[str] | None:
    """``<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n…``.

    Each parameter once, in the schema's order, the required ones present; a value
    as mlx-lm's parser reads it by the parameter's type (``_xml_value``). Names
    the parser would misread (spaces, angle brackets) cannot be written.
    """
    start, end = _literal(syntax, syntax.start), _literal(syntax, syntax.end)
    rules = ['value[lazy]: VALUE "\\n</parameter>"',
             "VALUE: /(?s:.*)/ & ~/(?s:.*<\\/parameter>.*)/"]
    for i, tool in enumerate(tools):
        schema = _parameters(tool)
        properties = schema.get("properties", {})
        if not _XML_NAME.fullmatch(tool["name"]) or not isinstance(properties, dict):
            return None
        if any(not _XML_NAME.fullmatch(name) for name in properties):
            return None
        required = set(schema.get("required") or ())
        params = []
        for j, (name, value) in enumerate(properties.items()):
            opening = json.dumps(f"<parameter={name}>\n")
            rules.append(f'param_{i}_{j}: {opening} {_xml_value(value)} "\\n"')
            params.append(f"param_{i}_{j}" + ("" if name in required else "?"))
        if not properties:  # a tool that names no parameters: any, by any name
            params.append('("<parameter=" /[^\\s<>]+/ ">\\n" value "\\n")*')
        opening = json.dumps(f"\n<function={tool['name']}>\n")
        rules.append(f'call_{i}: {start} {opening} {" ".join(params)} "</function>\\n" {end}')
    return rules


def _xml_value(schema: Any) -> str:
    """A parameter's value and the line that closes it: what mlx-lm's qwen3_coder
    parser turns into the parameter's type; text for a string (and what has no
    one type), never holding the closing tag, which would cut it short."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    typed = {"integer": "/-?[0-9]+/", "number": _NUMBER, "boolean": '("true" | "false")',
             "null": '"null"'}.get(kind) if isinstance(kind, str) else None
    if kind in ("object", "array"):
        typed = f"%json {json.dumps({**_checked(schema), 'x-guidance': _AS_TEMPLATES_WRITE})}"
    enum = schema.get("enum") if isinstance(schema, dict) else None
    if typed is None and isinstance(enum, list) and enum \
            and all(isinstance(v, str) and "</parameter>" not in v for v in enum):
        typed = "(" + " | ".join(json.dumps(v) for v in enum) + ")"
    return "value" if typed is None else f'{typed} "\\n</parameter>"'


_WRITERS: dict[str, _Writer] = {"json_tools": _json_calls, "qwen3_coder": _xml_calls}


def _parameters(tool: dict) -> dict:
    """The tool's parameter schema, checked (``_checked``); any object where it
    gives none."""
    schema = tool.get("parameters")
    return _checked(schema) if isinstance(schema, dict) and schema else {"type": "object"}


def _checked(schema: dict) -> dict:
    """``schema`` where the grammar engine takes it on its own, else any value of
    its type: a tool whose schema it refuses (a ``$ref`` it cannot resolve) can
    still be called, its arguments unchecked, and the other tools keep theirs."""
    try:
        _compiles(json.dumps(schema, sort_keys=True))
    except GrammarError as error:
        log.info("a tool's schema is not held to in its calls: %s", error)
        kind = schema.get("type")
        return {"type": kind} if kind in ("object", "array") else {"type": "object"}
    return schema


@functools.lru_cache(maxsize=256)
def _compiles(schema: str) -> None:
    """Raises ``GrammarError`` where the grammar engine cannot take ``schema``
    (an agent sends the same tools on every turn: each is checked once)."""
    json_schema_grammar(json.loads(schema))


def _literal(syntax: ToolSyntax, marker: str) -> str:
    """``marker`` in the grammar: an added token by its id (the grammar engine does
    not match its text), other text as itself."""
    ident = syntax.marker_tokens.get(marker)
    return f"<[{ident}]>" if ident is not None else json.dumps(marker)


def _lazy(syntax: ToolSyntax, end: str) -> str:
    """A rule up to a marker ends at its first one: lazily for text; an added token
    is none of the text's bytes, so the text can only end there."""
    return "" if end in syntax.marker_tokens else "[lazy]"
