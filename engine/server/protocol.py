"""Reading OpenAI and Anthropic request bodies into the engine's plain inputs.

Unknown fields are ignored (real clients send many); a supported field with a
bad value raises ``BadRequest`` with a message a developer can act on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.cache import kvquant
from engine.cache.modes import MODES
from engine.errors import EngineError
from engine.session import speculative
from engine.session.sampling import SamplingParams

MAX_STOPS = 16


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


def _messages(raw: Any, roles: tuple[str, ...], system: str | None) -> list[dict[str, str]]:
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
        messages.append({"role": role,
                         "content": _text(message.get("content", ""), f"messages[{index}]")})
    if messages[-1]["role"] == "assistant":
        raise BadRequest("The last message must be the user's: continuing an assistant "
                         "message is not supported.", "messages")
    return messages


def _model(body: dict) -> str:
    model = body.get("model", "")
    if not isinstance(model, str):
        raise BadRequest("'model' must be a string.", "model")
    return model


def _sampling(body: dict, max_tokens: int, seed: Any) -> SamplingParams:
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise BadRequest(f"'seed' must be an integer (got {seed!r}).", "seed")
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
        messages=_messages(body.get("messages"), ("system", "user", "assistant"), None),
        sampling=_sampling(body, int(max_tokens), body.get("seed")),
        stop=_stops(body.get("stop"), "stop"), stream=stream,
        include_usage=bool(options.get("include_usage", False)),
        mode=mode_from(model, body), model=model,
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
        messages=_messages(body.get("messages"), ("user", "assistant"), _system(body)),
        sampling=_sampling(body, max_tokens, None),
        stop=_stops(body.get("stop_sequences"), "stop_sequences"), stream=stream,
        include_usage=True, mode=mode_from(model, body), model=model,
    )
