"""What the server does with every field of each API's request body.

Each API's own fields (the official SDKs' request parameters) are listed here,
each either honoured (the answer follows it, or it asks for something this
server does anyway), accepted with no effect and the reason (bookkeeping for a
hosted service: ``user``, ``metadata``, ``service_tier``), or refused: a value
this server cannot honour is a 400 that names the field, never dropped in
silence. Fields no API defines (other servers' extensions) are ignored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.server.errors import BadRequest

HONOURED, ACCEPTED, REFUSED = "honoured", "accepted", "refused"
# An answer's token limit where the request sets none, the same on every API
# (never past the context). Anthropic's API has no default: max_tokens is
# required there; /v1/completions keeps OpenAI's own default of 16.
DEFAULT_MAX_TOKENS = 4096


@dataclass(frozen=True)
class Field:
    """One request field.

    Attributes:
        kind: ``HONOURED``, ``ACCEPTED`` (no effect here; ``note`` says why) or
            ``REFUSED`` (a value other than the harmless ones is a 400).
        note: how it is honoured, why it has no effect, or why it is refused.
        allows: for a refused field, whether a value is harmless (e.g. null, or
            ``n: 1``); None refuses every value but null.
    """

    kind: str
    note: str
    allows: Callable[[Any], bool] | None = None

    def refuses(self, value: Any) -> bool:
        """Whether ``value`` of this field is answered with a 400."""
        if self.kind != REFUSED or value is None:
            return False
        return not (self.allows is not None and self.allows(value))


def honoured(note: str) -> Field:
    return Field(HONOURED, note)


def accepted(note: str) -> Field:
    return Field(ACCEPTED, note)


def refused(note: str, allows: Callable[[Any], bool] | None = None) -> Field:
    return Field(REFUSED, note, allows)


def _false(value: Any) -> bool:
    return value is False


def _empty(value: Any) -> bool:
    return value in ([], {}, "", False)


BOOKKEEPING = accepted("bookkeeping for a hosted service; nothing here reads it")
CACHING = honoured("prefix reuse is automatic: every request reuses the longest "
                   "cached prefix")
TIER = accepted("one local engine: there is no other tier or region to pick")
MODEL = honoured("any name serves the loaded model; a suffix @fp16/@q8/@q6/@q4 picks "
                 "the KV mode")
STREAM = honoured("server-sent events")
TEMPERATURE = honoured("0 is greedy")
SAMPLING = honoured("mlx-lm's sampler")
PENALTY = honoured("over the last 64 tokens, the prompt's included (mlx-lm's processors)")
LIMIT = honoured(f"the answer's token limit ({DEFAULT_MAX_TOKENS:,} by default; never "
                 "past the context)")
STOP = honoured("the answer ends before the first one")
TOOLS = honoured("function tools go to the model's chat template (a 400 when it has "
                 "no tool calling)")
ADVICE = accepted("advice for a reasoning model; the model reasons as its template does")
STRUCTURED = honoured("JSON (json_object) or a JSON schema (json_schema): the answer is "
                      "decoded to it, every token checked by llguidance's grammar; beside "
                      "tools, to the model's calls or it")

# What OpenAI's chat and responses requests carry for its hosted service alone.
OPENAI_HOSTED = {
    "metadata": BOOKKEEPING,
    "user": BOOKKEEPING,
    "safety_identifier": BOOKKEEPING,
    "moderation": BOOKKEEPING,
    "service_tier": TIER,
    "prompt_cache_key": CACHING,
    "prompt_cache_options": CACHING,
    "prompt_cache_retention": CACHING,
}

CHAT = {
    "messages": honoured("system/developer, user, assistant (a last one is continued) "
                         "and tool messages; text parts"),
    "model": MODEL,
    "max_tokens": LIMIT,
    "max_completion_tokens": honoured("as max_tokens"),
    "temperature": TEMPERATURE,
    "top_p": SAMPLING,
    "seed": honoured("the same seed, the same answer"),
    "stop": STOP,
    "stream": STREAM,
    "stream_options": honoured("include_usage adds the usage chunk; include_obfuscation "
                               "is not needed on a local connection"),
    "tools": TOOLS,
    "tool_choice": honoured("auto, none, required or a named function (decoded to "
                            "the call where a grammar writes the model's syntax); see "
                            "tool_choice_met"),
    "parallel_tool_calls": honoured("false keeps the answer's first call only"),
    "logprobs": honoured("each token's log probability"),
    "top_logprobs": honoured("up to 20 alternatives per token"),
    "logit_bias": honoured("added to those token ids' logits"),
    "presence_penalty": PENALTY,
    "frequency_penalty": PENALTY,
    "n": refused("one choice per request: send n requests", lambda v: v == 1),
    "response_format": STRUCTURED,
    "audio": refused("this server reads and writes text only"),
    "modalities": refused("this server writes text only",
                          lambda v: isinstance(v, list) and set(v) <= {"text"}),
    "prediction": refused("predicted outputs are not supported; speculative decoding "
                          "drafts from the conversation itself"),
    "web_search_options": refused("this server has no web search"),
    "functions": refused("the legacy functions field is not supported: send them as "
                         "'tools'"),
    "function_call": refused("the legacy function_call field is not supported: send "
                             "'tool_choice'"),
    "store": refused("completions are not stored for later retrieval here", _false),
    **OPENAI_HOSTED,
    "reasoning_effort": ADVICE,
    "verbosity": ADVICE,
}

COMPLETIONS = {
    "prompt": honoured("one string, read as plain text (no chat template)"),
    "model": MODEL,
    "max_tokens": honoured("the answer's token limit (16 by default)"),
    "temperature": TEMPERATURE,
    "top_p": SAMPLING,
    "seed": honoured("the same seed, the same answer"),
    "stop": STOP,
    "stream": STREAM,
    "stream_options": honoured("include_usage adds the usage chunk"),
    "echo": honoured("the answer starts with the prompt"),
    "logprobs": honoured("each token's log probability and up to 5 alternatives"),
    "logit_bias": honoured("added to those token ids' logits"),
    "presence_penalty": PENALTY,
    "frequency_penalty": PENALTY,
    "n": refused("one choice per request: send n requests", lambda v: v == 1),
    "best_of": refused("one choice per request", lambda v: v == 1),
    "suffix": refused("fill-in-the-middle is not supported: send the text before the "
                      "cursor as the prompt", lambda v: v == ""),
    "user": BOOKKEEPING,
}

_MESSAGES_COMMON = {
    "messages": honoured("user and assistant turns (a last assistant turn is continued), "
                         "system messages folded into the nearest user turn, text, "
                         "tool_use, tool_result, thinking (given to the template as "
                         "reasoning) and redacted_thinking (dropped) blocks"),
    "model": MODEL,
    "system": honoured("the system prompt"),
    "tools": TOOLS,
    "tool_choice": honoured("auto, any, none or a named tool (decoded to the call where "
                            "a grammar writes the model's syntax); "
                            "disable_parallel_tool_use keeps the first call only"),
    "thinking": accepted("a permission to think, not a demand: the model thinks as its "
                         "template does and this server returns no thinking blocks"),
    "output_config": honoured("format (a json_schema) is decoded to, every token checked "
                              "by llguidance's grammar; effort is advice"),
    "cache_control": CACHING,
    "speed": TIER,
    "user_profile_id": BOOKKEEPING,
    "workspace_id": BOOKKEEPING,
}

MESSAGES = {
    **_MESSAGES_COMMON,
    "max_tokens": honoured("the answer's token limit (never past the context)"),
    "stream": STREAM,
    "stop_sequences": STOP,
    "temperature": TEMPERATURE,
    "top_p": SAMPLING,
    "top_k": SAMPLING,
    "metadata": BOOKKEEPING,
    "service_tier": TIER,
    "inference_geo": TIER,
    "diagnostics": BOOKKEEPING,
    "context_management": refused(
        "only clear_thinking edits, which this server does anyway: thinking blocks "
        "never stay in the prompt",
        lambda v: isinstance(v, dict) and all(
            isinstance(e, dict) and str(e.get("type", "")).startswith("clear_thinking")
            for e in v.get("edits") or [])),
    "container": refused("this server runs no code containers"),
    "mcp_servers": refused("this server connects to no MCP servers: give the tools in "
                           "'tools'", _empty),
}
COUNT_TOKENS = dict(_MESSAGES_COMMON)


def check(body: dict, table: dict[str, Field]) -> None:
    """Refuse the first field of ``body`` whose value ``table`` refuses.

    Raises:
        BadRequest: naming the field and why.
    """
    for name, value in body.items():
        field = table.get(name)
        if field is not None and field.refuses(value):
            raise BadRequest(f"'{name}' is not supported by this server: {field.note}.",
                             name, "unsupported_field")
