"""Tool calls in a streamed answer: the model's markers found, their text parsed.

A model whose tokenizer defines tool calling (mlx-lm's ``TokenizerWrapper``:
``tool_call_start``, ``tool_call_end``, ``tool_parser``, picked from the chat
template by mlx-lm) writes each call between two markers, e.g. Qwen's
``<tool_call>`` … ``</tool_call>``. ``ToolCallReader`` reads the answer's text as
it streams: text outside the markers passes through, text inside is held and
parsed by mlx-lm's own parser when the end marker (or the answer's end) comes.
No MLX here: it runs on the server's event loop.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

# Mistral's templates refuse a call id that is not 9 letters and digits (their
# own ids): a call from another server, or one of ours, must be written so.
SHORT_ID = 9
# The check as those templates write it: ``tool_call.id|length != 9``.
SHORT_ID_CHECK = re.compile(r"\|\s*length\s*!=\s*9\b")


@dataclass(frozen=True)
class ToolCall:
    """One parsed call: ``arguments`` is its JSON text (as OpenAI sends it)."""

    id: str
    name: str
    arguments: str

    def input(self) -> dict:
        """The arguments as an object (Anthropic's ``tool_use.input``); the reader
        makes only calls whose arguments are one."""
        value: dict = json.loads(self.arguments)
        return value


@dataclass(frozen=True)
class ToolSyntax:
    """How a model marks and writes its calls (from its tokenizer)."""

    start: str
    end: str
    parser: Any  # mlx-lm's parse_tool_call(text, tools) -> dict or list of dicts
    short_ids: bool = False  # call ids must be SHORT_ID letters and digits
    kind: str = ""  # mlx-lm's name for the parser ("json_tools", "qwen3_coder", …)
    thought: tuple[str, str] | None = None  # a thinking model's markers
    # The markers that are one added token, by id (``_marker_tokens``).
    marker_tokens: dict[str, int] = field(default_factory=dict, hash=False)

    @classmethod
    def of(cls, tokenizer: Any) -> ToolSyntax | None:
        """The syntax of ``tokenizer``, or None where it defines no tool calling."""
        if not getattr(tokenizer, "has_tool_calling", False):
            return None
        parser = tokenizer.tool_parser
        module = getattr(parser, "__module__", "")
        template = getattr(tokenizer, "chat_template", None)
        short = module.endswith(".mistral") or (
            isinstance(template, str) and SHORT_ID_CHECK.search(template) is not None)
        start, end = tokenizer.tool_call_start, tokenizer.tool_call_end or ""
        thought = (tokenizer.think_start, tokenizer.think_end) \
            if getattr(tokenizer, "has_thinking", False) else None
        markers = (start, end, *(thought or ()))
        return cls(start, end, parser, short, module.rsplit(".", 1)[-1], thought,
                   _marker_tokens(tokenizer, markers))


def _marker_tokens(tokenizer: Any, markers: tuple[str, ...]) -> dict[str, int]:
    """Which of ``markers`` are one added token of ``tokenizer`` (Qwen's ``<tool_call>``,
    ``<think>``), by id: the grammar engine reads every added token as special, a
    token whose text is none of the bytes it matches."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    found = {}
    for marker in markers:
        ids = tokenizer.encode(marker, add_special_tokens=False) if marker else []
        if len(ids) == 1 and ids[0] in added:
            found[marker] = ids[0]
    return found


def short_id(ident: str) -> str:
    """``ident`` as SHORT_ID letters and digits: itself where it is so already, else
    a hash of it, the same every time, so a call and its result still pair up."""
    if len(ident) == SHORT_ID and ident.isascii() and ident.isalnum():
        return ident
    return hashlib.sha256(ident.encode()).hexdigest()[:SHORT_ID]


def with_short_ids(messages: list[dict]) -> list[dict]:
    """``messages`` with every call id and result's ``tool_call_id`` made ``short_id``s."""
    out = []
    for message in messages:
        if message.get("tool_calls"):
            message = {**message, "tool_calls": [
                {**call, "id": short_id(str(call.get("id") or ""))}
                for call in message["tool_calls"]]}
        if "tool_call_id" in message:
            message = {**message, "tool_call_id": short_id(message["tool_call_id"])}
        out.append(message)
    return out


class ToolCallReader:
    """Splits streamed text into plain text and ``ToolCall``s.

    Args:
        syntax: the model's markers and parser.
        tools: the request's tools as the template got them (some parsers read
            the parameter types from them).
    """

    def __init__(self, syntax: ToolSyntax, tools: list[dict] | None) -> None:
        self.syntax = syntax
        self.tools = tools
        self.held = ""  # text that may be the start of a marker
        self.call: str | None = None  # the text of the call being read, if inside one
        self.calls = 0

    def feed(self, text: str) -> list[str | ToolCall]:
        """The pieces ``text`` completes (text held back may start a marker)."""
        self.held += text
        out: list[str | ToolCall] = []
        while self.held:
            marker = self.syntax.end if self.call is not None else self.syntax.start
            if not marker:  # a format whose calls run to the answer's end
                self.call = (self.call or "") + self.held
                self.held = ""
                break
            found = self.held.find(marker)
            if found < 0:
                keep = _partial_suffix(self.held, marker)
                self._emit(out, self.held[:len(self.held) - keep])
                self.held = self.held[len(self.held) - keep:]
                break
            self._emit(out, self.held[:found])
            self.held = self.held[found + len(marker):]
            if self.call is None:
                self.call = ""
            else:
                out.extend(self._parsed(self.call, closed=True))
                self.call = None
        return out

    def finish(self) -> list[str | ToolCall]:
        """What is left at the answer's end: a call cut short is parsed if it can be."""
        out: list[str | ToolCall] = []
        if self.call is not None:
            call, self.call = self.call + self.held, None
            self.held = ""
            out.extend(self._parsed(call, closed=False))
        elif self.held:
            out.append(self.held)
            self.held = ""
        return out

    def _emit(self, out: list[str | ToolCall], text: str) -> None:
        if not text:
            return
        if self.call is not None:
            self.call += text
        else:
            out.append(text)

    def _parsed(self, text: str, closed: bool) -> list[str | ToolCall]:
        """``text``'s calls; text no parser can read comes back as it was written,
        with the end marker only when the model wrote it (``closed``)."""
        try:
            parsed = self.syntax.parser(text, self.tools)
            calls = parsed if isinstance(parsed, list) else [parsed]
            if not calls:
                raise ValueError("no call in it")
            found: list[str | ToolCall] = [self._call(call, self.syntax.short_ids)
                                           for call in calls]
        except Exception as error:
            # mlx-lm's parsers raise what their input makes them raise (RecursionError
            # for deep nesting, OverflowError for "inf" as an integer…): whatever it
            # is, nothing the model wrote is lost, an unreadable call stays text.
            log.warning("tool call not parsed (%s: %s)", type(error).__name__,
                        str(error)[:200])
            return [self.syntax.start + text + (self.syntax.end if closed else "")]
        self.calls += len(found)
        return found

    @staticmethod
    def _call(parsed: dict, short: bool) -> ToolCall:
        name = parsed["name"]
        if not isinstance(name, str) or not name:
            raise ValueError("a tool call without a name")
        arguments = _arguments(parsed.get("arguments"))
        ident = str(parsed.get("id") or f"call_{uuid.uuid4().hex[:24]}")
        return ToolCall(short_id(ident) if short else ident, name, arguments)


def _arguments(value: Any) -> str:
    """A call's arguments as the JSON text of an object; none written ("", null) is {}.

    Clients parse them and send them back, and the server reads them back as an
    object: anything else would make every later turn of the conversation fail.

    Raises:
        ValueError: they are not an object, or hold a number JSON cannot write
            (inf, nan), which no client could read.
    """
    text = value if isinstance(value, str) else None
    if text is not None:
        value = json.loads(text, parse_constant=_no_constant) if text.strip() else None
    if value is None:
        return "{}"
    if not isinstance(value, dict):
        raise ValueError(f"arguments that are not an object: {str(value)[:80]}")
    return text if text is not None else json.dumps(value, ensure_ascii=False,
                                                    allow_nan=False)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is no JSON number a client can read")


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of ``text`` that starts ``marker``."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
