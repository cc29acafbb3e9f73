"""Reading OpenAI and Anthropic request bodies into the engine's plain inputs.

Every field of each API's own schema is honoured or refused (``fields``);
fields no API defines are ignored (real clients send many). A supported field
with a bad value raises ``BadRequest`` with a message a developer can act on.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, overload

from engine.cache.modes import MODES, KvMode, parse_mode
from engine.errors import EngineError
from engine.server import fields, structured
from engine.server.errors import BadRequest
from engine.session import speculative
from engine.session.sampling import MAX_TOP_LOGPROBS, SamplingParams

__all__ = ["BadRequest", "ChatRequest"]

MAX_STOPS = 16
MAX_TOOLS = 128
TOOL_ERROR = "The tool call failed:\n"  # before the text of a result marked is_error
MAX_LOGIT_BIAS = 300  # OpenAI's own limit on logit_bias entries
COMPLETION_TOP_LOGPROBS = 5  # /v1/completions' limit on logprobs
# An image in a message or a tool's result (Anthropic's, OpenAI chat's and the
# Responses API's block types): the model reads this in its place.
IMAGE_KINDS = ("image", "image_url", "input_image")
IMAGE_OMITTED = "[image omitted: this model reads text only]"


@dataclass(frozen=True)
class ChatRequest:
    """One chat request in the engine's terms."""

    messages: list[dict[str, str]]
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    mode: KvMode | None
    model: str
    tools: list[dict] | None = None
    template: bool = True  # False: a text completion, the prompt read as plain text
    echo: bool = False  # a text completion's answer starts with its prompt
    # "auto", "required" (any call), "named" (tool_name's) or "none": the tools are
    # still rendered (the prompt an agent's cache holds stays the same), no call is read.
    tool_choice: str = "auto"
    tool_name: str | None = None
    # The client named "speculative" itself: on a pipeline "lookup" is refused then,
    # and left to the default it is off (Session.chat).
    speculative_asked: bool = False
    max_calls: int | None = None  # the answer's first calls kept (1: parallel refused)
    anthropic: bool = False  # errors worded as Anthropic's API words them
    context: int | None = None  # a context smaller than the model's (Ollama's num_ctx)
    format_param: str = "response_format"  # the field a response format came in


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise BadRequest(f"'{name}' must be a number from {low} to {high} (got {value!r}).",
                         name)
    return float(value)


@overload
def integer(body: dict, names: tuple[str, ...], default: int, low: int) -> int: ...


@overload
def integer(body: dict, names: tuple[str, ...], default: None, low: int) -> int | None: ...


def integer(body: dict, names: tuple[str, ...], default: int | None,
            low: int) -> int | None:
    for name in names:
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise BadRequest(f"'{name}' must be an integer >= {low} (got {value!r}).", name)
        return value
    return default


def stops(value: Any, name: str) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) \
            or len(stops) > MAX_STOPS:
        raise BadRequest(f"'{name}' must be a non-empty string or a list of at most "
                         f"{MAX_STOPS} non-empty strings.", name)
    return tuple(stops)


def text_of(content: Any, where: str, kinds: tuple[str, ...] = ("text",),
            param: str = "messages") -> str:
    """A message's text: a string, or text blocks joined (OpenAI parts, Anthropic blocks).

    ``kinds`` are the block types read as text (each carries a "text" string, a
    "refusal" block its "refusal" string); ``param`` is the field errors name. An
    image becomes ``IMAGE_OMITTED``: agents send back a screenshot a tool returned
    with every later turn, so refusing it would end the conversation.
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise BadRequest(f"{where} content must be a string or a list of text blocks.", param)
    parts = []
    for block in content:
        if isinstance(block, dict) and block.get("type") == "tool_reference" \
                and isinstance(block.get("tool_name"), str):
            # A tool search's result names a tool: every tool is in the prompt already.
            parts.append(f"Tool available: {block['tool_name']}\n")
            continue
        if isinstance(block, dict) and block.get("type") in IMAGE_KINDS:
            parts.append(IMAGE_OMITTED)
            continue
        kind = block.get("type") if isinstance(block, dict) else type(block).__name__
        key = "refusal" if kind == "refusal" else "text"
        if not isinstance(block, dict) or kind not in kinds \
                or not isinstance(block.get(key), str):
            raise BadRequest(f"{where} has a content block of type {kind!r}; this server "
                             "reads text blocks only (an image becomes a note that one was "
                             "left out).", param)
        parts.append(block[key])
    return "".join(parts)


def mode_from(model: str, body: dict) -> KvMode | None:
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
        raise BadRequest(f"'kv_mode' must be a string: {', '.join(MODES)}.", "kv_mode")
    try:
        return parse_mode(mode)
    except (EngineError, ValueError) as error:
        raise BadRequest(str(error), "kv_mode") from error


def arguments_of(value: Any, where: str) -> dict:
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


def call_of(ident: Any, name: Any, arguments: dict, where: str) -> dict:
    if not isinstance(name, str) or not name:
        raise BadRequest(f"{where} needs a function name.", "messages")
    return {"id": str(ident or ""), "type": "function",
            "function": {"name": name, "arguments": arguments}}


def tool_calls_of(calls: Any, where: str) -> list[dict]:
    """An assistant message's ``tool_calls`` (OpenAI's and Ollama's form) as template calls."""
    if not isinstance(calls, list):
        raise BadRequest(f"{where}.tool_calls must be a list.", "messages")
    read = []
    for number, call in enumerate(calls):
        spot = f"{where}.tool_calls[{number}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            raise BadRequest(f"{spot} must be an object with a 'function'.", "messages")
        read.append(call_of(call.get("id"), function.get("name"),
                            arguments_of(function.get("arguments", {}), spot), spot))
    return read


def _openai_message(message: dict, index: int) -> dict:
    where = f"messages[{index}]"
    role = message["role"]
    content = message.get("content")
    if role == "assistant":
        # A refusal the answer gave comes back as its text when the chat is resent.
        content = message.get("refusal") if content is None else content
        text = "" if content is None else text_of(content, where, ("text", "refusal"))
    else:
        text = "" if content is None else text_of(content, where)
    out: dict = {"role": role, "content": text}
    if role == "assistant" and message.get("tool_calls") is not None:
        out["tool_calls"] = tool_calls_of(message["tool_calls"], where)
    if role == "assistant":
        # llama.cpp's, vLLM's and LM Studio's field (and OpenRouter's "reasoning"):
        # templates that render an earlier turn's thought (Qwen3's, within a tool
        # loop) then render what the model wrote, and the cache holds it.
        reasoning_of(message, ("reasoning_content", "reasoning"), where, out)
    if role == "tool":
        ident = message.get("tool_call_id")
        if ident is not None:
            out["tool_call_id"] = str(ident)
    return out


def reasoning_of(message: dict, names: tuple[str, ...], where: str, out: dict) -> None:
    """An assistant message's thought, sent back in the first of ``names`` it has, as
    the template reads it (``reasoning_content``) in ``out``; nothing where it is
    empty or absent.

    Raises:
        BadRequest: the field is not a string.
    """
    for name in names:
        value = message.get(name)
        if value is None:
            continue
        if not isinstance(value, str):
            raise BadRequest(f"{where}.{name} must be a string.", "messages")
        if value:
            out["reasoning_content"] = value
        return


def _anthropic_message(message: dict, index: int) -> list[dict]:
    """One Anthropic message as template messages: tool results become "tool" turns."""
    where = f"messages[{index}]"
    role, content = message["role"], message.get("content", "")
    if not isinstance(content, list):
        return [{"role": role, "content": text_of(content, where)}]
    out: list[dict] = []
    text: list[dict] = []
    calls: list[dict] = []
    thoughts: list[str] = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "redacted_thinking":
            continue  # encrypted for the hosted model alone: nothing a template can read
        if kind == "thinking":
            # Templates that render reasoning read it as reasoning_content; others
            # leave it out, as Anthropic's API drops earlier turns' thinking.
            if isinstance(block.get("thinking"), str) and role == "assistant":
                thoughts.append(block["thinking"])
            continue
        if kind == "tool_use" and role == "assistant":
            calls.append(call_of(block.get("id"), block.get("name"),
                               arguments_of(block.get("input", {}), where), where))
        elif kind == "tool_result" and role == "user":
            result = text_of(block.get("content", ""), f"{where} tool_result")
            if block.get("is_error") is True:
                # Anthropic tells its model the call failed; a chat template has no
                # field for it, so the result's text says so.
                result = TOOL_ERROR + result
            out.append({"role": "tool", "content": result,
                        "tool_call_id": str(block.get("tool_use_id") or "")})
        else:
            text.append(block)
    if text or calls or thoughts or not out:
        turn: dict = {"role": role, "content": text_of(text, where)}
        if calls:
            turn["tool_calls"] = calls
        if thoughts:
            turn["reasoning_content"] = "\n\n".join(thoughts)
        out.append(turn)
    return out


def _checked(raw: Any, roles: tuple[str, ...]) -> list[dict]:
    """``raw`` as a list of message objects whose roles are among ``roles``."""
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list.", "messages")
    out = []
    for index, message in enumerate(raw):
        if not isinstance(message, dict):
            raise BadRequest(f"messages[{index}] must be an object.", "messages")
        role = message.get("role")
        role = "system" if role == "developer" else role
        if role not in roles:
            raise BadRequest(f"messages[{index}].role must be one of {', '.join(roles)} "
                             f"(got {role!r}).", "messages")
        out.append({**message, "role": role})
    return out


def continuable(messages: list[dict]) -> list[dict]:
    """``messages``, checked that a last assistant message can be continued.

    A conversation that ends with an assistant message is answered by going on
    with that message (Anthropic's prefill): the answer is what comes after it.
    A call of a tool cannot be continued: its result comes first.
    """
    last = messages[-1]
    if last["role"] == "assistant" and last.get("tool_calls"):
        raise BadRequest("The last message is an assistant's tool call: send the tool's "
                         "result after it to get the next answer.", "messages")
    return messages


def _openai_messages(raw: Any) -> list[dict]:
    turns = _checked(raw, ("system", "user", "assistant", "tool"))
    return continuable([_openai_message(m, i) for i, m in enumerate(turns)])


def _with_text(message: dict, text: str, *, after: bool) -> dict:
    """``message`` with one more text block, after or before its own content."""
    content = message.get("content", "")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else \
        list(content) if isinstance(content, list) else content
    if not isinstance(blocks, list):
        return message  # a bad content: its own check names it
    has_text = any(isinstance(b, dict) and b.get("type") == "text" and b.get("text")
                   for b in blocks)
    gap = "\n\n" if has_text else ""
    block = {"type": "text", "text": gap + text if after else text + gap}
    return {**message, "content": [*blocks, block] if after else [block, *blocks]}


def fold_system(turns: list[dict]) -> tuple[list[str], list[tuple[int, dict]]]:
    """System messages inside an Anthropic conversation, folded where templates take them.

    Chat templates read a system prompt only first, so (as Claude Code's agents
    send them) a system message before any turn joins the system prompt; a later
    one joins the user turn right before it, or else the next user turn (a user
    turn of its own when none follows). The other turns keep their places, so
    a conversation resent with more turns renders the same prefix.

    Returns:
        The system texts for the system prompt, and the turns with their indexes.
    """
    head: list[str] = []
    out: list[tuple[int, dict]] = []
    waiting: list[str] = []
    for index, message in enumerate(turns):
        if message["role"] != "system":
            if waiting and message["role"] == "user":
                message = _with_text(message, "\n\n".join(waiting), after=False)
                waiting = []
            out.append((index, message))
            continue
        text = text_of(message.get("content", ""), f"messages[{index}]")
        if not out:
            head.append(text)
        elif out[-1][1]["role"] == "user" and not waiting:
            out[-1] = (out[-1][0], _with_text(out[-1][1], text, after=True))
        else:
            waiting.append(text)
    if waiting:
        out.append((len(turns) - 1, {"role": "user", "content": "\n\n".join(waiting)}))
    return head, out


def _anthropic_conversation(raw: Any, system: str | None) -> list[dict]:
    head, turns = fold_system(_checked(raw, ("user", "assistant", "system")))
    if not turns:
        raise BadRequest("'messages' needs a user message besides system messages.",
                         "messages")
    prompt = "\n\n".join(text for text in (system, *head) if text)
    messages = [{"role": "system", "content": prompt}] if prompt else []
    for index, message in turns:
        messages.extend(_anthropic_message(message, index))
    return continuable(messages)


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
        name = function.get("name") if kind and isinstance(function, dict) else None
    if kind not in kinds or (kinds[kind] == "named" and (not isinstance(name, str) or not name)):
        raise BadRequest(f"'tool_choice' must be {shape} (got {value!r}).", "tool_choice")
    return kinds[kind], name


def tools_of(body: dict, anthropic: bool) -> tuple[list[dict] | None, str, str | None]:
    """The request's tools in the form chat templates read (OpenAI's function tools),
    with its tool choice; a choice of one tool must name a listed one."""
    tools = body.get("tools")
    choice, name = _tool_choice(body, anthropic)
    if tools is None or tools == []:
        if choice not in ("auto", "none"):
            raise BadRequest("'tool_choice' asks for a tool call but the request lists no "
                             "'tools'.", "tool_choice")
        return None, "auto", None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise BadRequest(f"'tools' must be a list of at most {MAX_TOOLS} tools.", "tools")
    out: list[dict[str, Any]] = []
    for index, tool in enumerate(tools):
        function = tool if anthropic else (tool.get("function") if isinstance(tool, dict)
                                           else None)
        kind = tool.get("type", "custom") if anthropic and isinstance(tool, dict) else None
        if kind not in (None, "custom"):
            # Anthropic's own tools (web search, code execution, bash, …) are run by
            # its servers or defined by its models; offered here as a bare name the
            # model would call something nobody runs.
            raise BadRequest(f"tools[{index}] is Anthropic's {kind!r} tool, which this "
                             "server does not run: offer it as a custom tool with an "
                             "'input_schema', or leave it out.", "tools")
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            shape = "a 'name'" if anthropic else "a 'function' with a 'name'"
            raise BadRequest(f"tools[{index}] must be an object with {shape}.", "tools")
        schema = function.get("input_schema" if anthropic else "parameters", {})
        if not isinstance(schema, dict):
            raise BadRequest(f"tools[{index}]'s parameter schema must be an object.", "tools")
        entry: dict[str, Any] = {"name": function["name"], "parameters": schema}
        if isinstance(function.get("description"), str):
            entry["description"] = function["description"]
        out.append({"type": "function", "function": entry})
    if name is not None and name not in {tool["function"]["name"] for tool in out}:
        raise BadRequest(f"'tool_choice' names the tool {name!r}, which is not in 'tools'.",
                         "tool_choice")
    return out, choice, name


def _tool_fields(body: dict, anthropic: bool) -> dict:
    tools, choice, name = tools_of(body, anthropic)
    if anthropic:
        value = body.get("tool_choice")
        single = isinstance(value, dict) and value.get("disable_parallel_tool_use") is True
    else:
        single = body.get("parallel_tool_calls") is False
    return {"tools": tools, "tool_choice": choice, "tool_name": name,
            "max_calls": 1 if single else None}


def model_name(body: dict) -> str:
    model = body.get("model", "")
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string.", "model")
    return model


def _seed(seed: Any) -> int | None:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not -2**63 <= seed < 2**64):
        raise BadRequest(f"'seed' must be a 64-bit integer (got {seed!r}).", "seed")
    return None if seed is None else seed % 2**64  # MLX seeds are unsigned


def logit_bias(value: Any, name: str = "logit_bias") -> tuple[tuple[int, float], ...]:
    """OpenAI's ``{"token id": bias}`` (bias from -100 to 100) as (id, bias) pairs."""
    if value is None:
        return ()
    if not isinstance(value, dict) or len(value) > MAX_LOGIT_BIAS:
        raise BadRequest(f"'{name}' must be an object of at most {MAX_LOGIT_BIAS} "
                         "token ids (as strings) to biases.", name)
    pairs = []
    for key, bias in value.items():
        # isdecimal, not isdigit: "²" is a digit that int() refuses.
        ident = key if isinstance(key, int) else int(key) if str(key).isdecimal() else None
        if ident is None or isinstance(bias, bool) or not isinstance(bias, int | float) \
                or not -100 <= bias <= 100:
            raise BadRequest(f"'{name}' maps token ids (digits) to numbers from -100 to "
                             f"100 (got {key!r}: {bias!r}).", name)
        pairs.append((ident, float(bias)))
    return tuple(pairs)


def sampling_params(body: dict, max_tokens: int, seed: Any, *,
                    logprobs: int | None = None, grammar: str | None = None) -> SamplingParams:
    """The sampling fields every API shares (and the extensions other servers read:
    ``top_k``, ``min_p``, ``repetition_penalty``)."""
    top_p = _number(body, "top_p", 1.0, 0.0, 1.0)
    if top_p <= 0:
        raise BadRequest("'top_p' must be greater than 0.", "top_p")
    repetition = _number(body, "repetition_penalty", 1.0, 0.0, 10.0)
    if repetition <= 0:
        raise BadRequest("'repetition_penalty' must be greater than 0.", "repetition_penalty")
    return SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0), top_p=top_p,
        top_k=int(integer(body, ("top_k",), 0, 0) or 0),
        min_p=_number(body, "min_p", 0.0, 0.0, 0.999), repetition_penalty=repetition,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        logit_bias=logit_bias(body.get("logit_bias")), logprobs=logprobs, grammar=grammar,
        max_tokens=max_tokens, seed=_seed(seed), speculative=_speculative(body),
    )


def _chat_logprobs(body: dict) -> int | None:
    """Chat's ``logprobs`` (true/false) and ``top_logprobs`` as the engine's count."""
    wanted = body.get("logprobs")
    if wanted is not None and not isinstance(wanted, bool):
        raise BadRequest("'logprobs' must be true or false.", "logprobs")
    top = integer(body, ("top_logprobs",), None, 0)
    if top is not None and top > MAX_TOP_LOGPROBS:
        raise BadRequest(f"'top_logprobs' must be from 0 to {MAX_TOP_LOGPROBS}.",
                         "top_logprobs")
    if top is not None and not wanted:
        raise BadRequest("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
    return (top or 0) if wanted else None


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
    n = integer(body, ("n",), 1, 1)
    if n != 1:
        raise BadRequest("'n' > 1 is not supported: ask for one choice per request.", "n")
    fields.check(body, fields.CHAT)
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false.", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object.", "stream_options")
    model = model_name(body)
    max_tokens = integer(body, ("max_completion_tokens", "max_tokens"), default_max, 1)
    tool_fields = _tool_fields(body, anthropic=False)
    return ChatRequest(
        messages=_openai_messages(body.get("messages")),
        sampling=sampling_params(body, int(max_tokens), body.get("seed"),
                                 logprobs=_chat_logprobs(body),
                                 grammar=structured.openai_format(
                                     body.get("response_format"))),
        speculative_asked="speculative" in body,
        stop=stops(body.get("stop"), "stop"), stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        mode=mode_from(model, body), model=model, **tool_fields,
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
        if integer(body, (name,), 1, 1) != 1:
            raise BadRequest(f"'{name}' > 1 is not supported: ask for one choice per "
                             "request.", name)
    fields.check(body, fields.COMPLETIONS)
    logprobs = integer(body, ("logprobs",), None, 0)
    if logprobs is not None and logprobs > COMPLETION_TOP_LOGPROBS:
        raise BadRequest(f"'logprobs' must be from 0 to {COMPLETION_TOP_LOGPROBS}.",
                         "logprobs")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false.", "stream")
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise BadRequest("'echo' must be true or false.", "echo")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object.", "stream_options")
    model = model_name(body)
    max_tokens = integer(body, ("max_tokens",), default_max, 1)
    return ChatRequest(
        messages=[{"role": "user", "content": prompt}],
        sampling=sampling_params(body, int(max_tokens), body.get("seed"), logprobs=logprobs),
        speculative_asked="speculative" in body,
        stop=stops(body.get("stop"), "stop"), stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        mode=mode_from(model, body), model=model, template=False, echo=echo,
    )


def _system(body: dict) -> str | None:
    system = body.get("system")
    if system is None:
        return None
    return text_of(system, "system")


def anthropic_messages(body: Any, *, counting: bool = False) -> ChatRequest:
    """Read an Anthropic ``/v1/messages`` (or ``count_tokens``) body."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    fields.check(body, fields.COUNT_TOKENS if counting else fields.MESSAGES)
    model = model_name(body)
    max_tokens = integer(body, ("max_tokens",), 1 if counting else None, 1)
    if max_tokens is None:
        raise BadRequest("'max_tokens' is required.", "max_tokens")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false.", "stream")
    tool_fields = _tool_fields(body, anthropic=True)
    return ChatRequest(
        messages=_anthropic_conversation(body.get("messages"), _system(body)),
        sampling=sampling_params(body, max_tokens, None, grammar=None if counting else
                                 structured.anthropic_format(body.get("output_config"))),
        speculative_asked="speculative" in body,
        stop=stops(body.get("stop_sequences"), "stop_sequences"), stream=stream,
        include_usage=True, mode=mode_from(model, body), model=model, anthropic=True,
        format_param="output_config", **tool_fields,
    )
