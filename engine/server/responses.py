"""OpenAI's Responses API (``POST /v1/responses``): request bodies read into the
engine's plain inputs, and the response objects and streamed events written.

Codex speaks only this API: ``input`` items (messages with ``input_text``
parts, ``function_call`` and ``function_call_output``), flat function tools,
``store: false`` and the whole conversation resent each turn, so prefix reuse
works as it does for chat completions. No response is kept: a
``previous_response_id`` is a 400 that says to resend the conversation.
No MLX here.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.server import fields, protocol, structured
from engine.server.errors import BadRequest
from engine.server.fields import BOOKKEEPING, accepted, honoured, refused
from engine.server.protocol import ChatRequest

# Tools the hosted API runs itself: this server runs none, so the model is not
# told of them (Codex always lists web_search, switched off).
HOSTED_TOOLS = ("web_search", "web_search_preview", "web_search_2025_08_26",
                "web_search_preview_2025_03_11", "file_search", "code_interpreter",
                "image_generation", "computer_use_preview", "computer", "mcp",
                "local_shell", "shell", "apply_patch", "tool_search")
# ``include`` values that ask for parts of items this server never returns.
HARMLESS_INCLUDES = ("reasoning.encrypted_content", "web_search_call.action.sources",
                     "web_search_call.results", "file_search_call.results",
                     "code_interpreter_call.outputs", "computer_call_output.output.image_url",
                     "message.input_image.image_url")

FIELDS = {
    "input": honoured("a string, or message, function_call and function_call_output "
                      "items (reasoning items are dropped)"),
    "instructions": honoured("the system prompt"),
    "model": fields.MODEL,
    "max_output_tokens": fields.LIMIT,
    "temperature": fields.TEMPERATURE,
    "top_p": fields.SAMPLING,
    "stream": fields.STREAM,
    "stream_options": honoured("include_obfuscation is not needed on a local connection"),
    "tools": honoured("function tools (and those inside namespaces) go to the chat "
                      "template; hosted tools (web_search, file_search…) are left out: "
                      "this server runs none"),
    "tool_choice": honoured("auto, none, required or a named function (decoded to "
                            "the call where a grammar writes the model's syntax); see "
                            "tool_choice_met"),
    "parallel_tool_calls": honoured("false keeps the answer's first call only"),
    "max_tool_calls": honoured("the answer's first calls only"),
    "store": refused("responses are not kept: send store false and the whole "
                     "conversation each time", lambda v: v is False),
    "previous_response_id": refused("responses are not kept here (store is always "
                                    "false): send the whole conversation as 'input'"),
    "conversation": refused("conversations are not kept here: send the whole "
                            "conversation as 'input'"),
    "background": refused("responses run in the foreground only", lambda v: v is False),
    "background_options": refused("responses run in the foreground only"),
    "include": refused("only includes of items this server never returns "
                       f"({', '.join(HARMLESS_INCLUDES)})",
                       lambda v: isinstance(v, list) and set(v) <= set(HARMLESS_INCLUDES)),
    "reasoning": fields.ADVICE,
    "text": fields.STRUCTURED,
    "truncation": refused("a conversation too long is refused, not cut", lambda v: v ==
                          "disabled"),
    "top_logprobs": refused("log probabilities are not on /v1/responses yet: use "
                            "/v1/chat/completions", lambda v: v == 0),
    "prompt": refused("stored prompt templates are not kept here: send the text"),
    "context_management": refused("server-side compaction is not supported",
                                  lambda v: v in ([], {})),
    "image": refused("this server reads text only"),
    "access_programs": BOOKKEEPING,
    **fields.OPENAI_HOSTED,
}
# Codex's own, not in the API's schema: read by nothing.
FIELDS["client_metadata"] = accepted("Codex's bookkeeping")


@dataclass(frozen=True)
class ResponsesRequest:
    """A Responses request in the engine's terms, and what its answer echoes back."""

    chat: ChatRequest
    instructions: str | None
    tools: list[dict]  # the request's tools as sent, echoed in the response
    namespaces: dict[str, str] = field(default_factory=dict)  # function -> namespace
    max_calls: int | None = None
    # tool_choice, text and max_output_tokens as sent (OpenAI's defaults where not):
    # the response echoes the request, not the engine's reading of it.
    echoed: dict[str, Any] = field(default_factory=dict)


def read(body: Any) -> ResponsesRequest:
    """Read a ``/v1/responses`` body.

    Raises:
        BadRequest: a field this server cannot honour, or a bad value (named).
    """
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    fields.check(body, FIELDS)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false.", "stream")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise BadRequest("'instructions' must be a string.", "instructions")
    tools, namespaces = _tools(body.get("tools"))
    choice, name = _tool_choice(body.get("tool_choice"), tools)
    model = protocol.model_name(body)
    max_tokens = protocol.integer(body, ("max_output_tokens",), fields.DEFAULT_MAX_TOKENS,
                                  1)
    calls = protocol.integer(body, ("max_tool_calls",), None, 1)
    if body.get("parallel_tool_calls") is False:
        calls = 1
    offered = tools or None  # hosted tools left out
    chat = ChatRequest(
        messages=_messages(body.get("input"), instructions),
        sampling=protocol.sampling_params(body, int(max_tokens), None,
                                          grammar=structured.responses_format(
                                              body.get("text"))),
        speculative_asked="speculative" in body, stop=(), stream=stream,
        include_usage=True, mode=protocol.mode_from(model, body), model=model,
        tools=offered,
        tool_choice=choice, tool_name=name,
        max_calls=calls, format_param="text")
    echoed = {"tool_choice": body.get("tool_choice", "auto"),
              "text": body.get("text") or {"format": {"type": "text"}},
              "max_output_tokens": body.get("max_output_tokens")}
    return ResponsesRequest(chat, instructions, body.get("tools") or [], namespaces, calls,
                            echoed)


def _tools(raw: Any) -> tuple[list[dict], dict[str, str]]:
    """The function tools as chat templates read them, and each namespaced one's namespace."""
    if raw is None:
        return [], {}
    if not isinstance(raw, list) or len(raw) > protocol.MAX_TOOLS:
        raise BadRequest(f"'tools' must be a list of at most {protocol.MAX_TOOLS} tools.",
                         "tools")
    out: list[dict] = []
    namespaces: dict[str, str] = {}
    for index, tool in enumerate(raw):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind in HOSTED_TOOLS:
            continue
        if kind == "namespace" and isinstance(tool.get("tools"), list):
            for inner in tool["tools"]:
                out.append(_function(inner, f"tools[{index}].tools"))
                namespaces[out[-1]["function"]["name"]] = str(tool.get("name") or "")
            continue
        if kind != "function":
            raise BadRequest(f"tools[{index}] is of type {kind!r}: this server calls "
                             "function tools only.", "tools")
        out.append(_function(tool, f"tools[{index}]"))
    return out, namespaces


def _function(tool: Any, where: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" \
            or not isinstance(tool.get("name"), str) or not tool["name"]:
        raise BadRequest(f"{where} must be a function tool with a 'name'.", "tools")
    schema = tool.get("parameters") or {}
    if not isinstance(schema, dict):
        raise BadRequest(f"{where}'s parameters must be a JSON schema object.", "tools")
    entry = {"name": tool["name"], "parameters": schema}
    if isinstance(tool.get("description"), str):
        entry["description"] = tool["description"]
    return {"type": "function", "function": entry}


def _tool_choice(value: Any, tools: list[dict]) -> tuple[str, str | None]:
    names = {tool["function"]["name"] for tool in tools}
    if value is None or value == "auto":
        return "auto", None
    if value in ("none", "required"):
        choice, name = value, None
    elif isinstance(value, dict) and value.get("type") == "function" \
            and isinstance(value.get("name"), str):
        choice, name = "named", value["name"]
    else:
        raise BadRequest("'tool_choice' must be \"auto\", \"none\", \"required\" or "
                         f'{{"type": "function", "name": NAME}} (got {value!r}).',
                         "tool_choice")
    if choice != "none" and not tools:
        raise BadRequest("'tool_choice' asks for a tool call but the request lists no "
                         "function 'tools'.", "tool_choice")
    if name is not None and name not in names:
        raise BadRequest(f"'tool_choice' names the tool {name!r}, which is not in 'tools'.",
                         "tool_choice")
    return choice, name


def _messages(raw: Any, instructions: str | None) -> list[dict]:
    """``input`` (a string or items) as template messages, system turns folded."""
    if isinstance(raw, str):
        raw = [{"role": "user", "content": raw}]
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'input' must be a non-empty string or list of items.", "input")
    turns: list[dict] = []
    for index, item in enumerate(raw):
        turns.extend(_item(item, index, turns))
    head, folded = protocol.fold_system(turns)
    prompt = "\n\n".join(text for text in (instructions, *head) if text)
    messages = [{"role": "system", "content": prompt}] if prompt else []
    messages += [turn for _, turn in folded]
    if not folded:
        raise BadRequest("'input' needs a user message besides instructions.", "input")
    return protocol.continuable(messages)


def _item(item: Any, index: int, turns: list[dict]) -> list[dict]:
    """One input item as template messages (a call may join the turn before it)."""
    where = f"input[{index}]"
    if not isinstance(item, dict):
        raise BadRequest(f"{where} must be an object.", "input")
    kind = item.get("type", "message" if "role" in item else None)
    if kind == "message":
        role = item.get("role")
        role = "system" if role == "developer" else role
        if role not in ("system", "user", "assistant"):
            raise BadRequest(f"{where}.role must be one of user, assistant, system, "
                             f"developer (got {role!r}).", "input")
        text = protocol.text_of(item.get("content", ""), where,
                                ("input_text", "output_text", "text", "refusal"), "input")
        return [{"role": role, "content": text}]
    if kind == "function_call":
        call = protocol.call_of(item.get("call_id") or item.get("id"), item.get("name"),
                              protocol.arguments_of(item.get("arguments", {}), where), where)
        last = turns[-1] if turns else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)  # the text before the call
            return []
        return [{"role": "assistant", "content": "", "tool_calls": [call]}]
    if kind == "function_call_output":
        output = item.get("output", "")
        text = output if isinstance(output, str) else protocol.text_of(
            output, where, ("input_text", "output_text", "text"), "input")
        return [{"role": "tool", "content": text,
                 "tool_call_id": str(item.get("call_id") or "")}]
    if kind == "reasoning":
        return []  # the hosted model's own (encrypted) reasoning: nothing to render
    raise BadRequest(f"{where} is of type {kind!r}: this server reads message, "
                     "function_call and function_call_output items.", "input")


class ResponseWriter:
    """The response object and its streamed events, built as the answer comes.

    Args:
        request: the request read.
        model: the model name to report.
    """

    def __init__(self, request: ResponsesRequest, model: str) -> None:
        self.request = request
        self.model = model
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.output: list[dict] = []
        self.sequence = 0
        self.text: dict | None = None  # the message item being written

    def event(self, kind: str, **data: Any) -> dict:
        """One server-sent event, numbered."""
        self.sequence += 1
        return {"event": kind, "data": json.dumps(
            {"type": kind, "sequence_number": self.sequence, **data})}

    def response(self, status: str, *, usage: dict | None = None,
                 incomplete: str | None = None, error: dict | None = None,
                 extra: dict | None = None) -> dict:
        """The response object as it stands."""
        chat = self.request.chat
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": status, "model": self.model, "output": self.output,
            "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": self.request.instructions, "tools": self.request.tools,
            **self.request.echoed,
            "parallel_tool_calls": chat.max_calls != 1,
            "max_tool_calls": self.request.max_calls,
            "temperature": chat.sampling.temperature, "top_p": chat.sampling.top_p,
            "store": False, "metadata": {}, "truncation": "disabled", "usage": usage,
            **(extra or {}),
        }

    def started(self) -> list[dict]:
        """``response.created`` and ``response.in_progress``."""
        return [self.event("response.created", response=self.response("in_progress")),
                self.event("response.in_progress", response=self.response("in_progress"))]

    def waiting(self) -> dict:
        """An event that changes nothing, for a stream that waits on a long read."""
        return self.event("response.in_progress", response=self.response("in_progress"))

    def add_text(self, delta: str) -> list[dict]:
        """Events for more of the answer's text (a message item opens with the first)."""
        events = []
        text = self.text
        if text is None:
            text = self.text = {"type": "message", "id": f"msg_{uuid.uuid4().hex}",
                                "status": "in_progress", "role": "assistant", "content": []}
            self.output.append(text)
            events.append(self.event("response.output_item.added",
                                     output_index=len(self.output) - 1, item=text))
            text["content"].append({"type": "output_text", "text": "",
                                    "annotations": [], "logprobs": []})
            events.append(self.event("response.content_part.added", **self._at(text),
                                     part=text["content"][0]))
        text["content"][0]["text"] += delta
        events.append(self.event("response.output_text.delta", **self._at(text), delta=delta,
                                 logprobs=[]))
        return events

    def _at(self, text: dict) -> dict:
        return {"item_id": text["id"], "output_index": self.output.index(text),
                "content_index": 0}

    def close_text(self) -> list[dict]:
        """Events that end the message item being written, if one is."""
        text = self.text
        if text is None:
            return []
        part = text["content"][0]
        text["status"] = "completed"
        events = [self.event("response.output_text.done", **self._at(text), text=part["text"],
                             logprobs=[]),
                  self.event("response.content_part.done", **self._at(text), part=part),
                  self.event("response.output_item.done",
                             output_index=self.output.index(text), item=text)]
        self.text = None
        return events

    def add_call(self, ident: str, name: str, arguments: str) -> list[dict]:
        """Events for one whole function call."""
        events = self.close_text()
        item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": ident,
                "name": name, "arguments": "", "status": "in_progress"}
        if name in self.request.namespaces:
            item["namespace"] = self.request.namespaces[name]
        self.output.append(item)
        index = len(self.output) - 1
        events.append(self.event("response.output_item.added", output_index=index,
                                 item=dict(item)))
        events.append(self.event("response.function_call_arguments.delta",
                                 item_id=item["id"], output_index=index, delta=arguments))
        item.update(arguments=arguments, status="completed")
        events.append(self.event("response.function_call_arguments.done",
                                 item_id=item["id"], output_index=index, name=name,
                                 arguments=arguments))
        events.append(self.event("response.output_item.done", output_index=index, item=item))
        return events

    def finished(self, finish: str, usage: dict, extra: dict) -> list[dict]:
        """The events that end the response: completed, or incomplete at its limit."""
        # Nothing written: one empty message, as the response not streamed has.
        events = [] if self.output else self.add_text("")
        events += self.close_text()
        if finish == "length":
            events.append(self.event("response.incomplete", response=self.response(
                "incomplete", usage=usage, incomplete="max_output_tokens", extra=extra)))
        else:
            events.append(self.event("response.completed", response=self.response(
                "completed", usage=usage, extra=extra)))
        return events

    def failed(self, message: str, code: str | None) -> dict:
        """The event that ends a response the engine could not finish."""
        return self.event("response.failed", response=self.response(
            "failed", error={"code": code or "server_error", "message": message}))

    def whole(self, text: str, calls: list[tuple[str, str, str]], finish: str, usage: dict,
              extra: dict) -> dict:
        """The response object of an answer not streamed."""
        if text or not calls:
            self.add_text(text)
            self.close_text()
        for call in calls:
            self.add_call(*call)
        status = "incomplete" if finish == "length" else "completed"
        return {**self.response(status, usage=usage, extra=extra,
                                incomplete="max_output_tokens" if finish == "length" else None),
                "output_text": text}


def usage(prompt: int, cached: int, completion: int) -> dict:
    """The Responses API's usage object."""
    return {"input_tokens": prompt,
            "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
            "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + completion}
