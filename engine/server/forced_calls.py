"""A forced tool call (``tool_choice`` "required", or a named function) as a grammar
the answer is decoded to: one or more calls in the model's own syntax, each token
checked by llguidance's matcher (``engine.session.constraint``), as vLLM and
llama.cpp keep a forced choice.

The call is written as the model's template writes calls, so the reader that
parses an unforced answer's calls parses it too, and the cache holds the same
tokens either way. Syntaxes with a grammar here: JSON calls between markers
(Qwen2.5, Qwen3, Hermes: mlx-lm's ``json_tools``) and Qwen3-Coder's XML calls
(Qwen3.5 and Qwen3-Next: ``qwen3_coder``). Another syntax, or a grammar the
matcher refuses, leaves decoding free: the answer then says whether it made the
call (``tool_choice_met``). A thinking model may think first, as its template asks.
No MLX here: it runs on the server's event loop.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from llguidance import LLMatcher

from engine.server.tools import ToolSyntax

log = logging.getLogger(__name__)

# The reply's opening a template writes after the conversation (its role marker and a
# think marker) lies within this many of the prompt's last tokens.
THOUGHT_TAIL = 32
# Any text, for the lazy rules that end at the first marker after it.
_ANY_TEXT = "TEXT: /(?s:.*)/"
# A parameter of a tool whose schema names none.
_ANY_PARAMETER = '"<parameter=" /[^\\s<>]+/ ">\\n"'
# A call's arguments written as the templates write JSON (``tojson``, Python's
# separators): one space after a colon or comma, none elsewhere.
_AS_TEMPLATES_WRITE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Forced:
    """What the answer must be: calls of ``names`` (all the tools' when the choice
    named none), at most one where parallel calls were refused."""

    tools: tuple[dict, ...]  # the functions' ``{"name", "parameters"}``
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
    wrapper): a thinking template's reply that starts with its think marker."""
    if not getattr(tokenizer, "has_thinking", False):
        return False
    tail = list(prompt[-THOUGHT_TAIL:])
    opened = tokenizer.rfind_think_start(tail)
    return bool(opened >= 0 and tokenizer.rfind_think_end(tail) < opened)


def call_grammar(syntax: ToolSyntax, forced: Forced) -> str | None:
    """The grammar of an answer that makes the forced call in ``syntax``; None where
    no grammar here writes that syntax, or the matcher cannot take the one made."""
    writer = _WRITERS.get(syntax.kind)
    if writer is None or not forced.tools:
        return None
    for strict in (True, False):  # a tool whose schema the matcher refuses: any object
        grammar = _grammar(syntax, forced, writer, strict)
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
        if not failed:
            return grammar
        log.info("a forced call's grammar was refused (%s)%s", messages[0] if messages
                 else "no reason given", "; trying any object for its arguments"
                 if strict else "; decoding it free")
    return None


def _grammar(syntax: ToolSyntax, forced: Forced, writer: _Writer, strict: bool) -> str:
    # The line breaks a template writes before a call (after a thought: two).
    rules = ["%llguidance {}", _ANY_TEXT, 'breaks: ("\\n" "\\n"?)?']
    calls = "call" if forced.single else 'call ("\\n"? call)*'
    if syntax.thought is None:
        rules.append(f"start: breaks {calls}")
    else:
        begin, end = (_literal(syntax, marker) for marker in syntax.thought)
        rules.append(f"thought{_lazy(syntax, syntax.thought[1])}: TEXT {end}")
        opening = "thought" if forced.open_thought else f"({begin} thought)?"
        rules.append(f"start: {opening} breaks {calls}")
    rules.extend(writer(syntax, forced.tools, strict))
    return "\n".join(rules) + "\n"


_Writer = Callable[[ToolSyntax, tuple[dict, ...], bool], list[str]]


def _json_calls(syntax: ToolSyntax, tools: tuple[dict, ...], strict: bool) -> list[str]:
    """``<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>``."""
    schema = {"x-guidance": _AS_TEMPLATES_WRITE, "anyOf": [
        {"type": "object", "properties": {"name": {"const": tool["name"]},
                                          "arguments": _parameters(tool, strict)},
         "required": ["name", "arguments"], "additionalProperties": False}
        for tool in tools]}
    start, end = _literal(syntax, syntax.start), _literal(syntax, syntax.end)
    return [f'call: {start} "\\n" %json {json.dumps(schema)} "\\n" {end}']


def _xml_calls(syntax: ToolSyntax, tools: tuple[dict, ...], strict: bool) -> list[str]:
    """``<tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n…``.

    The values are the model's text (the parser reads them by the tools' types);
    the grammar holds the function's name and its parameters' names.
    """
    start, end = _literal(syntax, syntax.start), _literal(syntax, syntax.end)
    rules = ['value[lazy]: TEXT "\\n</parameter>"',
             " | ".join(f"function_{i}" for i in range(len(tools))).join(("call: ", ""))]
    for i, tool in enumerate(tools):
        names = sorted(_parameters(tool, strict).get("properties") or {})
        param = " | ".join(json.dumps(f"<parameter={name}>\n") for name in names) \
            or _ANY_PARAMETER
        rules.append(f"param_{i}: ({param}) value \"\\n\"")
        opening = json.dumps(f"\n<function={tool['name']}>\n")
        rules.append(f'function_{i}: {start} {opening} param_{i}* "</function>\\n" {end}')
    return rules


_WRITERS: dict[str, _Writer] = {"json_tools": _json_calls, "qwen3_coder": _xml_calls}


def _parameters(tool: dict, strict: bool) -> dict:
    """The tool's parameter schema (any object where it gives none, or not ``strict``)."""
    schema = tool.get("parameters")
    return schema if strict and isinstance(schema, dict) and schema else {"type": "object"}


def _literal(syntax: ToolSyntax, marker: str) -> str:
    """``marker`` in the grammar: an added token by its id (the grammar engine does
    not match its text), other text as itself."""
    ident = syntax.marker_tokens.get(marker)
    return f"<[{ident}]>" if ident is not None else json.dumps(marker)


def _lazy(syntax: ToolSyntax, end: str) -> str:
    """A rule up to a marker ends at its first one: lazily for text; an added token
    is none of the text's bytes, so the text can only end there."""
    return "" if end in syntax.marker_tokens else "[lazy]"
