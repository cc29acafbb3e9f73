"""Structured output: each API's way of asking for JSON, as one grammar the engine
enforces while it decodes (``engine.session.constraint``).

OpenAI's ``response_format`` (chat) and ``text.format`` (Responses), Anthropic's
``output_config.format`` and Ollama's ``format`` all come down to a JSON schema
(``json_object`` and Ollama's ``"json"``: any object). A schema the grammar
engine cannot take is a 400 whose message names the part.
"""

from __future__ import annotations

from typing import Any

from engine.server.errors import BadRequest
from engine.session.constraint import GrammarError, json_schema_grammar

ANY_OBJECT = {"type": "object"}


def grammar(schema: Any, param: str) -> str:
    """The grammar of ``schema``; a 400 on ``param`` when it cannot be used."""
    if not isinstance(schema, dict):
        raise BadRequest(f"'{param}' must give a JSON schema object.", param)
    try:
        return json_schema_grammar(schema)
    except GrammarError as error:
        raise BadRequest(f"'{param}': {error}", param) from error


def openai_format(value: Any, param: str = "response_format") -> str | None:
    """Chat's ``response_format`` (``text.format`` on the Responses API, flat)."""
    if value is None:
        return None
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return grammar(ANY_OBJECT, param)
    if kind == "json_schema":
        # Chat nests the schema in json_schema; the Responses API writes it flat.
        spec = value.get("json_schema", value)
        return grammar(spec.get("schema") if isinstance(spec, dict) else None, param)
    raise BadRequest(f"'{param}' must be of type text, json_object or json_schema "
                     f"(got {kind!r}).", param)


def responses_format(text: Any) -> str | None:
    """The Responses API's ``text`` (its ``format``)."""
    if text is None:
        return None
    if not isinstance(text, dict):
        raise BadRequest("'text' must be an object.", "text")
    return openai_format(text.get("format"), "text")


def anthropic_format(config: Any) -> str | None:
    """Anthropic's ``output_config`` (its ``format``: ``{"type": "json_schema", "schema"}``)."""
    if config is None:
        return None
    if not isinstance(config, dict):
        raise BadRequest("'output_config' must be an object.", "output_config")
    value = config.get("format")
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") != "json_schema":
        raise BadRequest("'output_config.format' must be {\"type\": \"json_schema\", "
                         "\"schema\": {...}}.", "output_config")
    return grammar(value.get("schema"), "output_config")


def ollama_format(value: Any) -> str | None:
    """Ollama's ``format``: "json" or a JSON schema."""
    if value in (None, ""):
        return None
    if value == "json":
        return grammar(ANY_OBJECT, "format")
    return grammar(value, "format")
