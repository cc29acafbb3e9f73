"""Reading OpenAI and Anthropic request bodies into the engine's plain inputs.

Unknown fields are ignored (real clients send many); a supported field with a
bad value raises ``BadRequest`` with a message a developer can act on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.cache import kvquant
from engine.cache.modes import MODES
from engine.errors import EngineError
from engine.session import speculative
from engine.session.sampling import SamplingParams

MAX_STOPS = 16
MAX_TOOLS = 128


class BadRequest(EngineError):
    """A request body the server cannot honour; ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass(frozen=True)
class ChatRequest:
    """One chat request in the engine's terms."""

    messages: list[dict[str, str]]
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    mode: str | None
    model: str
    tools: list[dict] | None = None
    template: bool = True  # False: a text completion, the prompt read as plain text
    echo: bool = False  # a text completion's answer starts with its prompt
    tool_choice: str = "auto"  # "auto", "required" (any call) or "named" (tool_name's)
    tool_name: str | None = None
    # The client named "speculative" itself: on a pipeline "lookup" is refused then,
    # and left to the default it is off (Session.chat).
    speculative_asked: bool = False


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise BadRequest(f"'{name}' must be a number from {low} to {high} (got {value!r}).",
                         name)
    return float(value)


def _integer(body: dict, names: tuple[str, ...], default: int | None,
             low: int) -> int | None:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise BadRequest(f"'{name}' must be an integer >= {low} (got {value!r}).", name)
        return value
    return default


def _stops(value: Any, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) \
            or len(stops) > MAX_STOPS:
        raise BadRequest(f"'{name}' must be a non-empty string or a list of at most "
                         f"{MAX_STOPS} non-empty strings.", name)
    return tuple(stops)


def _text(content: Any, where: str) -> str:
    """A message's text: a string, or text blocks joined (OpenAI parts, Anthropic blocks)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} content must be a string or a list of text blocks.",
                         "messages")
    parts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text" \
                or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise BadRequest(f"{where} has a content block of type {kind!r}; this server "
                             "reads text blocks only.", "messages")
        parts.append(block["text"])
    return "".join(parts)


def mode_from(model: str, body: dict) -> str | None:
    """The KV mode a request asks for: ``"kv_mode"`` or the model id's ``@mode`` suffix."""
    mode = body.get("kv_mode")
    if mode is None and "@" in model:
        mode = model.rsplit("@", 1)[1]
        if mode not in MODES:
            raise BadRequest(f"The model id suffix '@{mode}' is not a KV mode; use one of "
                             + ", ".join(f"@{m}" for m in MODES) + ".", "model")
    if mode is None:
        return None
    if not isinstance(mode, str):
        raise BadRequest("'kv_mode' must be a string: fp16, q8, q6 or q4.", "kv_mode")
    try:
        return kvquant.normalize_mode(mode)
    except (EngineError, ValueError) as error:
        raise BadRequest(str(error), "kv_mode") from error


def _arguments(value: Any, where: str) -> dict:
    """A tool call's arguments as an object (templates render them as JSON)."""
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError as error:
            raise BadRequest(f"{where} arguments are not valid JSON: {error}.",
                             "messages") from error
    if not isinstance(value, dict):
        raise BadRequest(f"{where} arguments must be a JSON object.", "messages")
    return value


def _call(ident: Any, name: Any, arguments: dict, where: str) -> dict:
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{where} needs a function name.", "messages")
    return {"id": str(ident or ""), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def _openai_message(message: dict, index: int) -> dict:
    where = f"messages[{index}]"
    role = message["role"]
    content = message.get("content")
    out: dict = {"role": role, "content": "" if content is None else _text(content, where)}
    if role == "assistant" and message.get("tool_calls") is not None:
        calls = message["tool_calls"]
        if not isinstance(calls, list):
            raise BadRequest(f"{where}.tool_calls must be a list.", "messages")
        out["tool_calls"] = []
        for number, call in enumerate(calls):
            spot = f"{where}.tool_calls[{number}]"
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict):
                raise BadRequest(f"{spot} must be an object with a 'function'.", "messages")
            out["tool_calls"].append(_call(call.get("id"), function.get("name"),
                                           _arguments(function.get("arguments", {}), spot),
                                           spot))
    if role == "tool":
        ident = message.get("tool_call_id")
        if ident is not None:
            out["tool_call_id"] = str(ident)
    return out


def _anthropic_message(message: dict, index: int) -> list[dict]:
    """One Anthropic message as template messages: tool results become "tool" turns."""
    where = f"messages[{index}]"
    role, content = message["role"], message.get("content", "")
    if not isinstance(content, list):
        return [{"role": role, "content": _text(content, where)}]
    out: list[dict] = []
    text: list[dict] = []
    calls: list[dict] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "tool_use" and role == "assistant":
            calls.append(_call(block.get("id"), block.get("name"),
                               _arguments(block.get("input", {}), where), where))
        elif kind == "tool_result" and role == "user":
            result = block.get("content", "")
            out.append({"role": "tool", "content": _text(result, f"{where} tool_result"),
                        "tool_call_id": str(block.get("tool_use_id") or "")})
        else:
            text.append(block)
    if text or calls or not out:
        turn: dict = {"role": role, "content": _text(text, where)}
        if calls:
            turn["tool_calls"] = calls
        out.append(turn)
    return out


def _messages(raw: Any, roles: tuple[str, ...], system: str | None, *,
              anthropic: bool = False) -> list[dict]:
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list.", "messages")
    messages = [] if not system else [{"role": "system", "content": system}]
    for index, message in enumerate(raw):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{index}] must be an object.", "messages")
        role = message.get("role")
        role = "system" if role == "developer" else role
        if role not in roles:
            raise BadRequest(f"messages[{index}].role must be one of {', '.join(roles)} "
                             f"(got {role!r}).", "messages")
        message = {**message, "role": role}
        if anthropic:
            messages.extend(_anthropic_message(message, index))
        else:
            messages.append(_openai_message(message, index))
    if messages[-1]["role"] == "assistant":
        raise BadRequest("The last message must be the user's: continuing an assistant "
                         "message is not supported.", "messages")
    return messages


def _tool_choice(body: dict, anthropic: bool) -> tuple[str, str | None]:
    """The request's ``tool_choice`` as ("none" | "auto" | "required" | "named", name).

    OpenAI sends "none" / "auto" / "required" or ``{"type": "function",
    "function": {"name": N}}``; Anthropic ``{"type": "none" | "auto" | "any" |
    "tool", "name": N}``.
    """
    value = body.get("tool_choice")
    if value is None:
        return "auto", None
    if anthropic:
        kind = value.get("type") if isinstance(value, dict) else None
        kinds = {"none": "none", "auto": "auto", "any": "required", "tool": "named"}
        shape = ('an object {"type": "auto" | "any" | "none"} or {"type": "tool", '
                 '"name": NAME}')
        name = value.get("name") if kind == "tool" else None
    elif isinstance(value, str):
        kind, name = value, None
        kinds = {"none": "none", "auto": "auto", "required": "required"}
        shape = '"none", "auto", "required" or {"type": "function", "function": {"name": NAME}}'
    else:
        function = value.get("function") if isinstance(value, dict) else None
        kind = "function" if isinstance(value, dict) and value.get("type") == "function" \
            and isinstance(function, dict) else None
        kinds = {"function": "named"}
        shape = '"none", "auto", "required" or {"type": "function", "function": {"name": NAME}}'
        name = function.get("name") if kind else None
    if kind not in kinds or (kinds[kind] == "named" and (not isinstance(name, str) or not name)):
        raise BadRequest(f"'tool_choice' must be {shape} (got {value!r}).", "tool_choice")
    return kinds[kind], name


def _tools(body: dict, anthropic: bool) -> tuple[list[dict] | None, str, str | None]:
    """The request's tools in the form chat templates read (OpenAI's function tools),
    with its tool choice: "none" offers no tools; a choice of one tool must name a
    listed one."""
    tools = body.get("tools")
    choice, name = _tool_choice(body, anthropic)
    if choice == "none":
        return None, "auto", None
    if tools is None or tools == []:
        if choice != "auto":
            raise BadRequest("'tool_choice' asks for a tool call but the request lists no "
                             "'tools'.", "tool_choice")
        return None, "auto", None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadRequest(f"'tools' must be a list of at most {MAX_TOOLS} tools.", "tools")
    out = []
    for index, tool in enumerate(tools):
        function = tool if anthropic else (tool.get("function") if isinstance(tool, dict)
                                           else None)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            shape = "a 'name'" if anthropic else "a 'function' with a 'name'"
            raise BadRequest(f"tools[{index}] must be an object with {shape}.", "tools")
        schema = function.get("input_schema" if anthropic else "parameters", {})
        if not isinstance(schema, dict):
            raise BadRequest(f"tools[{index}]'s parameter schema must be an object.", "tools")
        entry = {"name": function["name"], "parameters": schema}
        if isinstance(function.get("description"), str):
            entry["description"] = function["description"]
        out.append({"type": "function", "function": entry})
    if name is not None and name not in {tool["function"]["name"] for tool in out}:
        raise BadRequest(f"'tool_choice' names the tool {name!r}, which is not in 'tools'.",
                         "tool_choice")
    return out, choice, name


def _tool_fields(body: dict, anthropic: bool) -> dict:
    tools, choice, name = _tools(body, anthropic)
    return {"tools": tools, "tool_choice": choice, "tool_name": name}


def _model(body: dict) -> str:
    model = body.get("model", "")
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string.", "model")
    return model


def _sampling(body: dict, max_tokens: int, seed: Any) -> SamplingParams:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not -2**63 <= seed < 2**64):
        raise BadRequest(f"'seed' must be a 64-bit integer (got {seed!r}).", "seed")
    if seed is not None:
        seed %= 2**64  # MLX seeds are unsigned; a negative one still picks one stream
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0:
        raise BadRequest("'top_p' must be greater than 0.", "top_p")
    return SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_p=top_p,
        top_k=int(_integer(body, ("top_k",), 0, 0) or 0), max_tokens=max_tokens,
        seed=seed, speculative=_speculative(body),
    )


def _speculative(body: dict) -> str:
    """Longleaf's extension: ``"speculative": "off" | "lookup"`` (the engine's default)."""
    value = body.get("speculative", SamplingParams.speculative)
    if value not in speculative.MODES:
        raise BadRequest(f"'speculative' must be one of {', '.join(speculative.MODES)} "
                         f"(got {value!r}).", "speculative")
    return value


def openai_chat(body: Any, default_max: int) -> ChatRequest:
    """Read an OpenAI ``/v1/chat/completions`` body."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    n = _integer(body, ("n",), 1, 1)
    if n != 1:
        raise BadRequest("'n' > 1 is not supported: ask for one choice per request.", "n")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false.", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object.", "stream_options")
    model = _model(body)
    max_tokens = _integer(body, ("max_completion_tokens", "max_tokens"), default_max, 1)
    return ChatRequest(
        messages=_messages(body.get("messages"), ("system", "user", "assistant", "tool"),
                           None),
        sampling=_sampling(body, int(max_tokens), body.get("seed")),
        speculative_asked="speculative" in body,
        stop=_stops(body.get("stop"), "stop"), stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        mode=mode_from(model, body), model=model, **_tool_fields(body, anthropic=False),
    )


def openai_completion(body: Any, default_max: int) -> ChatRequest:
    """Read an OpenAI ``/v1/completions`` body (a plain text prompt, no chat template)."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string (batches of prompts and token "
                         "ids are not supported: send one request per prompt).", "prompt")
    for name in ("n", "best_of"):
        if _integer(body, (name,), 1, 1) != 1:
            raise BadRequest(f"'{name}' > 1 is not supported: ask for one choice per "
                             "request.", name)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false.", "stream")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise BadRequest("'echo' must be true or false.", "echo")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object.", "stream_options")
    model = _model(body)
    max_tokens = _integer(body, ("max_tokens",), default_max, 1)
    return ChatRequest(
        messages=[{"role": "user", "content": prompt}],
        sampling=_sampling(body, int(max_tokens), body.get("seed")),
        speculative_asked="speculative" in body,
        stop=_stops(body.get("stop"), "stop"), stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        mode=mode_from(model, body), model=model, template=False, echo=echo,
    )


def _system(body: dict) -> str | None:
    system = body.get("system")
    if system is None:
        return None
    return _text(system, "system")


def anthropic_messages(body: Any, *, counting: bool = False) -> ChatRequest:
    """Read an Anthropic ``/v1/messages`` (or ``count_tokens``) body."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    model = _model(body)
    max_tokens = _integer(body, ("max_tokens",), 1 if counting else None, 1)
    if max_tokens is None:
        raise BadRequest("'max_tokens' is required.", "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false.", "stream")
    return ChatRequest(
        messages=_messages(body.get("messages"), ("user", "assistant"), _system(body),
                           anthropic=True),
        sampling=_sampling(body, max_tokens, None),
        speculative_asked="speculative" in body,
        stop=_stops(body.get("stop_sequences"), "stop_sequences"), stream=stream,
        include_usage=True, mode=mode_from(model, body), model=model,
        **_tool_fields(body, anthropic=True),
    )
