"""The Starlette application: OpenAI and Anthropic endpoints over the engine bridge.

Every handler runs on the server's event loop and waits on the bridge's events;
nothing here touches MLX. Errors come back in the shape of the API asked.
"""

from __future__ import annotations

import asyncio
import codecs
import hmac
import json
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from engine.cache.modes import MODES, KvMode
from engine.errors import EngineError
from engine.events import Failed, Finished, GenerationStats, SessionOpened, TokenChunk, TokenLogprob
from engine.server import fields, ollama, protocol, responses
from engine.server.bridge import LOADING, NotReady, QueueFull, ServerBridge, Ticket
from engine.server.call_grammar import Calls, functions
from engine.server.protocol import BadRequest, ChatRequest
from engine.server.tools import ToolCall, ToolCallReader, ToolSyntax, with_short_ids

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 2**20
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
DISCONNECT_POLL = 0.2
# A stream with nothing to send for this long (a long read of the prompt, a wait
# behind other requests) sends an event that changes nothing: clients such as
# Claude Code end a stream after a while without events, and do not count
# SSE comments or Anthropic's ping events.
KEEPALIVE_SECONDS = 10.0
# How long ``engine serve``, stopping, waits for the requests it cancelled to end (a
# step or a prompt's chunk each) before the connections close.
STOP_WAIT_S = 10.0
MEMORY_ERRORS = ("InsufficientMemory", "MemoryPressure", "KvBudgetExceeded")
# A prompt longer than the model's context, or than memory (here or on another machine
# of a pipeline) holds now: a client's answer to either is a shorter conversation.
TOO_LONG_ERRORS = ("ContextTooLong", "MemoryShort", "MachineShort")
SPECULATIVE_REFUSAL = ("Speculative decoding is not available over a pipeline yet: send "
                       "\"speculative\": \"off\" or leave it out (answers decode plainly "
                       "there), or serve the model on one machine.")
SCHEMA_AFTER_PREFILL = ("A response format cannot continue a prefilled assistant message: "
                        "the schema holds a whole answer, so one written after the "
                        "prefill would not be valid. End the conversation with the user's "
                        "turn, or leave the format out.")
ENGINE_STOPPED = ("The engine stopped on an unexpected error (the server's log says which); "
                  "restart the server.")
STOPPED_BY_SERVER = ("The server stopped this answer before its end: its session was closed "
                     "(the model is changing, or the server is stopping). Send the request "
                     "again.")
STOPPED_FOR_MEMORY = ("Longleaf stopped this answer after {tokens} tokens to protect the "
                      "computer: system memory turned critical or free RAM ran out. Close "
                      "other apps or conversations, or use a smaller KV mode, then send the "
                      "request again.")
# Names a keyless server answers to: this computer's own (a web page that rebinds its
# own name to 127.0.0.1 still sends that name as the Host).
LOCAL_HOSTS = ("localhost", "127.0.0.1", "::1")
ANTHROPIC_ERRORS = ("invalid_request_error", "authentication_error", "permission_error",
                    "not_found_error", "request_too_large", "rate_limit_error", "api_error",
                    "overloaded_error")


class ApiError(Exception):
    """An HTTP error answered in the shape of the API the request used."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code, self.headers = param, code, headers or {}


class KeepAlive:
    """Nothing came from the engine for a while: a stream sends a harmless event."""


KEEPALIVE = KeepAlive()


@dataclass
class Outcome:
    """How one generation ended."""

    finish: str
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    mode: KvMode
    tool_choice_met: bool | None = None  # None: the request forced no call
    stats: GenerationStats | None = None  # the engine's timings, where it sent them


def cors_origins(values: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """The allowed origins, checked: each a ``scheme://host[:port]``, never a wildcard.

    Raises:
        EngineError: an origin is a wildcard or not an origin.
    """
    origins = []
    for value in values or ():
        origin = value.strip().rstrip("/")
        if "*" in origin:
            raise EngineError("Name each allowed origin (e.g. http://localhost:3000): a "
                              "wildcard would let any web page use the model.")
        scheme, _, rest = origin.partition("://")
        if scheme not in ("http", "https") or not rest or "/" in rest:
            raise EngineError(f"{value!r} is not an origin: write scheme://host[:port], "
                              "e.g. http://localhost:3000.")
        origins.append(origin)
    return tuple(origins)


def host_names(values: list[str] | tuple[str, ...] | None) -> tuple[str, ...]:
    """Extra host names a keyless server answers to, checked: names, no ports or wildcards.

    Raises:
        EngineError: a value is a wildcard, a URL or holds a port.
    """
    names = []
    for value in values or ():
        name = value.strip().lower().rstrip(".")
        if name.startswith("[") and name.endswith("]"):
            name = name[1:-1]  # an IPv6 address as a URL writes it
        elif name.count(":") == 1:
            name = ""  # name:port
        if not name or "*" in name or "/" in name:
            raise EngineError(f"{value!r} is not a host name: give the name alone, e.g. "
                              "my-mac.local (no scheme, port or wildcard).")
        names.append(name)
    return tuple(names)


def _request_host(request: Request) -> str | None:
    """The name the request was addressed to (its Host header, without the port)."""
    host = request.headers.get("host", "").strip().lower()
    if not host:
        return None  # HTTP/1.0 without a Host: no browser sends such a request
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0].rstrip(".") if host.count(":") == 1 else host


def _is_anthropic(request: Request) -> bool:
    return request.url.path.startswith("/v1/messages")


def _is_ollama(request: Request) -> bool:
    return request.url.path.startswith("/api/")


def too_long(prompt_tokens: int, context: int, *, anthropic: bool, field: str = "messages",
             verb: str = "take") -> ApiError:
    """The 400 for a prompt the context cannot hold, worded as each API words it
    (Claude Code reads Anthropic's wording to compact the conversation)."""
    if anthropic:
        return ApiError(400, f"prompt is too long: {prompt_tokens} tokens > {context - 1} "
                             "maximum", param=field, code="context_length_exceeded")
    return ApiError(400, f"This model's maximum context length is {context:,} tokens; "
                         f"the {field} {verb} {prompt_tokens:,} tokens and the answer "
                         "needs at least one more.", param=field,
                    code="context_length_exceeded")


def error_response(request: Request, error: ApiError) -> JSONResponse:
    """``error`` as the OpenAI, the Anthropic or the Ollama error object."""
    body: dict
    if _is_ollama(request):
        body = {"error": error.message}
    elif _is_anthropic(request):
        kind = {401: "authentication_error", 403: "permission_error", 413: "request_too_large",
                429: "rate_limit_error", 404: "not_found_error"}.get(error.status, error.kind)
        if kind not in ANTHROPIC_ERRORS:  # its SDKs know these types only
            kind = "api_error" if error.status >= 500 else "invalid_request_error"
        body = {"type": "error", "error": {"type": kind, "message": error.message}}
    else:
        body = {"error": {"message": error.message, "type": error.kind,
                          "param": error.param, "code": error.code}}
    return JSONResponse(body, status_code=error.status, headers=error.headers)


class Server:
    """The routes, bound to one bridge and one optional API key.

    Without a key, any web page the user opens could send requests to a server
    on this computer: by renaming its own host to 127.0.0.1 (DNS rebinding), or
    with a cross-origin "simple" POST (a form, ``text/plain``) that a browser
    sends without asking. So a keyless server answers only requests addressed
    to ``LOCAL_HOSTS``, the address it listens on or ``allowed_hosts`` (403),
    and reads only bodies sent as ``application/json`` (415), which a page of
    another origin cannot send without the CORS approval it does not get.
    """

    def __init__(self, bridge: ServerBridge, api_key: str | None = None,
                 max_body_bytes: int = MAX_BODY_BYTES,
                 cors_origins: tuple[str, ...] = (), *, bind_host: str | None = None,
                 allowed_hosts: tuple[str, ...] = (),
                 keepalive: float = KEEPALIVE_SECONDS) -> None:
        self.bridge = bridge
        self.keepalive = keepalive
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.cors_origins = cors_origins
        named = (*LOCAL_HOSTS, *host_names([bind_host] if bind_host else []), *allowed_hosts)
        self.allowed_hosts = frozenset(named)

    def app(self) -> Starlette:
        """The ASGI application.

        Web pages of other origins may call it only from ``cors_origins``, each
        named: without any, no CORS headers are sent and browsers refuse them.
        """
        routes = [
            Route("/", self._wrap(self.root, auth=False), methods=["GET", "HEAD"]),
            Route("/health", self._wrap(self.health, auth=False), methods=["GET"]),
            Route("/v1/models", self._wrap(self.models), methods=["GET"]),
            Route("/v1/models/{model:path}", self._wrap(self.model), methods=["GET"]),
            Route("/v1/chat/completions", self._wrap(self.chat_completions), methods=["POST"]),
            Route("/v1/completions", self._wrap(self.completions), methods=["POST"]),
            Route("/v1/messages", self._wrap(self.messages), methods=["POST"]),
            Route("/v1/responses", self._wrap(self.responses), methods=["POST"]),
            Route("/api/version", self._wrap(self.ollama_version), methods=["GET"]),
            Route("/api/tags", self._wrap(self.ollama_tags), methods=["GET"]),
            Route("/api/ps", self._wrap(self.ollama_ps), methods=["GET"]),
            Route("/api/show", self._wrap(self.ollama_show), methods=["POST"]),
            Route("/api/chat", self._wrap(self.ollama_chat), methods=["POST"]),
            Route("/api/generate", self._wrap(self.ollama_generate), methods=["POST"]),
            Route("/api/pull", self._wrap(self.ollama_pull), methods=["POST"]),
            Route("/v1/messages/count_tokens", self._wrap(self.count_tokens),
                  methods=["POST"]),
        ]
        middleware = []
        if self.cors_origins:
            middleware.append(Middleware(
                CORSMiddleware, allow_origins=list(self.cors_origins),
                allow_methods=["GET", "POST"], allow_headers=["*"], max_age=600))
        # Starlette declares every handler as taking any Exception; the one for a
        # class gets that class, which its stubs cannot say.
        handlers = {HTTPException: self._http_error}
        return Starlette(routes=routes, middleware=middleware,
                         exception_handlers=handlers)  # type: ignore[arg-type]

    async def _http_error(self, request: Request, error: HTTPException) -> Response:
        """Starlette's own errors (no such route, a method it does not take) as JSON."""
        if error.status_code == 404:
            message = (f"There is no {request.url.path} here: this server answers "
                       "/v1/chat/completions, /v1/completions, /v1/responses, "
                       "/v1/messages, /v1/models and Ollama's /api.")
        else:
            message = f"{request.method} {request.url.path}: {error.detail}."
        return error_response(request, ApiError(error.status_code, message,
                                                headers=dict(error.headers or {})))

    # -- plumbing --------------------------------------------------------------

    def _wrap(self, handler: Callable[[Request], Awaitable[Response]], *,
              auth: bool = True) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            try:
                self._check_host(request)
                if auth:
                    self._check_key(request)
                return await handler(request)
            except ApiError as error:
                return error_response(request, error)
            except BadRequest as error:
                return error_response(request, ApiError(400, str(error), param=error.param,
                                                        code=error.code))
        return endpoint

    def _has_key(self, request: Request) -> bool:
        """Whether ``request`` carries the API key (True on a server without one)."""
        if self.api_key is None:
            return True
        # Either header may carry it: Claude Code sends both when its environment sets
        # an API key and an auth token, and one of them may be meant for another server.
        given = [request.headers.get("x-api-key", "")]
        bearer = request.headers.get("authorization", "")
        if bearer.lower().startswith("bearer "):
            given.append(bearer[7:].strip())
        expected = self.api_key.encode()
        return any([hmac.compare_digest(key.encode(), expected) for key in given])

    def _check_key(self, request: Request) -> None:
        if not self._has_key(request):
            raise ApiError(401, "Missing or wrong API key: send it as 'Authorization: "
                                "Bearer KEY' or 'x-api-key: KEY'.", "authentication_error",
                           code="invalid_api_key")

    def _check_host(self, request: Request) -> None:
        if self.api_key is not None:
            return
        host = _request_host(request)
        if host is not None and host not in self.allowed_hosts:
            raise ApiError(
                403, f"This server has no API key, so it answers only requests addressed to "
                f"this computer (localhost, 127.0.0.1, [::1]), not to {host!r}: a web page "
                "could reach it under that name. Use http://127.0.0.1 with the server's "
                f"port, allow the name (--allow-host {host}), or set an API key.",
                "permission_error", code="host_not_allowed")

    def _check_json(self, request: Request) -> None:
        if self.api_key is not None:
            return
        kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if kind != "application/json":
            raise ApiError(
                415, "Send the request body as JSON, with 'Content-Type: application/json' "
                f"(this one was {kind or 'not given'!r}): without an API key the server "
                "reads no other body, since any web page could send one.",
                code="unsupported_media_type")

    def _check_ready(self) -> None:
        if not self.bridge.ready.is_set():
            raise _not_ready(self.bridge.load_error or LOADING)

    async def _body(self, request: Request) -> object:
        self._check_json(request)
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise ApiError(413, f"The request body is over {self.max_body_bytes:,} bytes.")
        data = bytearray()
        try:
            async for chunk in request.stream():
                data += chunk
                if len(data) > self.max_body_bytes:
                    raise ApiError(413, f"The request body is over {self.max_body_bytes:,} "
                                        "bytes.")
        except ClientDisconnect:  # no one is left to read an answer: a plain 400 ends it
            raise ApiError(400, "The client left before its request body arrived.") from None
        try:
            return json.loads(bytes(data))
        except (ValueError, UnicodeDecodeError) as error:
            raise ApiError(400, f"The request body is not valid JSON: {error}.") from error
        except RecursionError:  # Python's parser recurses once per level
            raise ApiError(400, "The request body nests its JSON deeper than Python can "
                                "read (about 1,000 levels); no API request needs that.") from None

    # -- endpoints -------------------------------------------------------------

    async def root(self, request: Request) -> Response:
        """What a client that checks the server is up (Claude Code, Ollama's) asks first."""
        return PlainTextResponse("Longleaf is running")

    async def health(self, request: Request) -> JSONResponse:
        """Whether the server answers; with the API key (or on a keyless server, which
        only this computer reaches) also which model, machines and streams: a device
        on the network without the key learns no more than that it is up."""
        told = self._has_key(request)
        if not self.bridge.ready.is_set():
            status = "error" if self.bridge.load_error else "loading"
            return JSONResponse({"status": status, **({"message": self.bridge.load_error}
                                                      if told else {})}, status_code=503)
        if not self.bridge.worker.alive:
            return JSONResponse({"status": "error", **({"message": ENGINE_STOPPED}
                                                       if told else {})}, status_code=503)
        if not told:
            return JSONResponse({"status": "ok"})
        streams = self.bridge.worker.streams()
        return JSONResponse({"status": "ok", "model": self.bridge.model_id,
                             "machines": self.bridge.machines,
                             "streams": {"decoding": streams.answering,
                                         "reading": streams.reading,
                                         "waiting_for_memory": streams.waiting,
                                         "parallel": streams.limit,
                                         "in_flight": self.bridge.in_flight,
                                         "queue_limit": self.bridge.queue_limit}})

    def _model_entry(self) -> dict:
        return {"id": self.bridge.model_id, "object": "model", "created": 0,
                "owned_by": "longleaf", "context_length": self.bridge.max_context,
                "kv_mode": self.bridge.kv_mode, "machines": self.bridge.machines}

    async def models(self, request: Request) -> JSONResponse:
        self._check_ready()
        return JSONResponse({"object": "list", "data": [self._model_entry()]})

    async def model(self, request: Request) -> JSONResponse:
        self._check_ready()
        asked = request.path_params["model"]
        name, _, mode = asked.partition("@")
        if name != self.bridge.model_id or (mode and mode not in MODES):
            raise ApiError(404, f"The model {asked!r} does not exist here: this server "
                                f"serves {self.bridge.model_id!r} (add "
                                f"{', '.join(f'@{m}' for m in MODES)} for a KV mode).",
                           param="model", code="model_not_found")
        return JSONResponse({**self._model_entry(), "id": asked})

    async def count_tokens(self, request: Request) -> JSONResponse:
        self._check_ready()
        chat = self._for_template(protocol.anthropic_messages(await self._body(request),
                                                              counting=True))
        return JSONResponse({"input_tokens": len(await self._render(chat))})

    async def chat_completions(self, request: Request) -> Response:
        self._check_ready()
        chat = protocol.openai_chat(await self._body(request),
                                    fields.DEFAULT_MAX_TOKENS)
        run = await self._start(chat)
        created, ident = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        model = self._model_name(chat)
        logprobs = chat.sampling.logprobs is not None
        if not chat.stream:
            text, calls, outcome = await self._collect(request, run)
            message: dict = {"role": "assistant", "content": text if text or not calls else None}
            if calls:
                message["tool_calls"] = [_openai_call(call) for call in calls]
            return JSONResponse({
                "id": ident, "object": "chat.completion", "created": created, "model": model,
                "choices": [{"index": 0, "message": message, "finish_reason": outcome.finish,
                             "logprobs": self._chat_logprobs(run) if logprobs else None}],
                "usage": _openai_usage(outcome), "kv_mode": outcome.mode,
                **_choice_met(outcome),
            })

        def chunk(delta: dict, finish: str | None, **extra: Any) -> str:
            scores = self._chat_logprobs(run) if logprobs and "content" in delta else None
            return json.dumps({"id": ident, "object": "chat.completion.chunk",
                               "created": created, "model": model,
                               "choices": [{"index": 0, "delta": delta, "logprobs": scores,
                                            "finish_reason": finish}], **extra})

        async def events() -> AsyncIterator[dict]:
            yield {"data": chunk({"role": "assistant", "content": ""}, None)}
            calls = 0
            try:
                async for piece in _guarded(run):
                    if isinstance(piece, KeepAlive):
                        continue  # SSE comments (ping) keep this stream's clients waiting
                    if isinstance(piece, str):
                        yield {"data": chunk({"content": piece}, None)}
                    elif isinstance(piece, ToolCall):
                        # One delta per call, its arguments whole: the SDKs join deltas.
                        yield {"data": chunk({"tool_calls": [
                            {"index": calls, **_openai_call(piece)}]}, None)}
                        calls += 1
                    else:
                        yield {"data": chunk({}, piece.finish, **_choice_met(piece))}
                        if chat.include_usage:
                            yield {"data": json.dumps({
                                "id": ident, "object": "chat.completion.chunk",
                                "created": created, "model": model, "choices": [],
                                "usage": _openai_usage(piece), "kv_mode": piece.mode})}
            except ApiError as error:
                yield {"data": bytes(error_response(request, error).body).decode()}
            yield {"data": "[DONE]"}
        return _stream(events())

    def _chat_logprobs(self, run: Run) -> dict:
        """Chat's ``logprobs`` object for the tokens read since the last call."""
        taken = run.take_logprobs()
        pieces = self.bridge.token_pieces([t.token_id for t in taken])
        tops = self.bridge.token_pieces([i for t in taken for i, _ in t.top])
        content, at = [], 0
        for entry, piece in zip(taken, pieces, strict=True):
            alternatives = []
            for _, value in entry.top:
                alternatives.append(_scored(tops[at], value))
                at += 1
            content.append({**_scored(piece, entry.logprob), "top_logprobs": alternatives})
        return {"content": content, "refusal": None}

    def _completion_logprobs(self, run: Run, offset: int) -> dict:
        """/v1/completions' ``logprobs`` object; ``offset`` is where its text starts."""
        taken = run.take_logprobs()
        pieces = self.bridge.token_pieces([t.token_id for t in taken])
        tops = self.bridge.token_texts([i for t in taken for i, _ in t.top])
        # A token holding part of a character starts where that character does.
        characters, offsets, at = codecs.getincrementaldecoder("utf-8")("replace"), [], offset
        for _, raw in pieces:
            offsets.append(at)
            at += len(characters.decode(raw))
        texts = [text for text, _ in pieces]
        top_logprobs, at = [], 0
        for entry in taken:
            alternatives: dict[str, float] = {}
            for _, value in entry.top:
                alternatives.setdefault(tops[at], value)
                at += 1
            top_logprobs.append(alternatives)
        return {"tokens": texts, "token_logprobs": [t.logprob for t in taken],
                "top_logprobs": top_logprobs, "text_offset": offsets}

    async def completions(self, request: Request) -> Response:
        self._check_ready()
        chat = protocol.openai_completion(await self._body(request), COMPLETION_MAX_TOKENS)
        run = await self._start(chat)
        created, ident = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        model = self._model_name(chat)
        echoed = chat.messages[0]["content"] if chat.echo else ""
        logprobs = chat.sampling.logprobs is not None

        def body(text: str, finish: str | None, scores: dict | None = None) -> dict:
            return {"id": ident, "object": "text_completion", "created": created,
                    "model": model, "choices": [{"index": 0, "text": text, "logprobs": scores,
                                                 "finish_reason": finish}]}
        if not chat.stream:
            text, _, outcome = await self._collect(request, run)
            scores = self._completion_logprobs(run, len(echoed)) if logprobs else None
            return JSONResponse({**body(echoed + text, outcome.finish, scores),
                                 "usage": _openai_usage(outcome), "kv_mode": outcome.mode})

        async def events() -> AsyncIterator[dict]:
            if echoed:
                yield {"data": json.dumps(body(echoed, None))}
            written = len(echoed)
            try:
                async for piece in _guarded(run):
                    if isinstance(piece, KeepAlive):
                        continue
                    if isinstance(piece, str):
                        scores = self._completion_logprobs(run, written) if logprobs else None
                        written += len(piece)
                        yield {"data": json.dumps(body(piece, None, scores))}
                        continue
                    if isinstance(piece, ToolCall):  # a completion offers no tools: never
                        continue
                    yield {"data": json.dumps(body("", piece.finish))}
                    if chat.include_usage:
                        yield {"data": json.dumps({**body("", None), "choices": [],
                                                   "usage": _openai_usage(piece),
                                                   "kv_mode": piece.mode})}
            except ApiError as error:
                yield {"data": bytes(error_response(request, error).body).decode()}
            yield {"data": "[DONE]"}
        return _stream(events())

    async def messages(self, request: Request) -> Response:
        self._check_ready()
        chat = protocol.anthropic_messages(await self._body(request))
        run = await self._start(chat)
        ident, model = f"msg_{uuid.uuid4().hex}", self._model_name(chat)
        if not chat.stream:
            text, calls, outcome = await self._collect(request, run)
            content = [{"type": "text", "text": text}] if text or not calls else []
            content += [_anthropic_call(call) for call in calls]
            return JSONResponse({
                "id": ident, "type": "message", "role": "assistant", "model": model,
                "content": content,
                "stop_reason": _anthropic_stop(outcome, run.stopped_by),
                "stop_sequence": run.stopped_by, "usage": _anthropic_usage(outcome),
                "kv_mode": outcome.mode, **_choice_met(outcome),
            })
        return _stream(_anthropic_events(request, run, ident, model))

    async def responses(self, request: Request) -> Response:
        self._check_ready()
        asked = responses.read(await self._body(request))
        run = await self._start(asked.chat)
        writer = responses.ResponseWriter(asked, self._model_name(asked.chat))
        if not asked.chat.stream:
            text, calls, outcome = await self._collect(request, run)
            return JSONResponse(writer.whole(
                text, [(c.id, c.name, c.arguments) for c in calls], outcome.finish,
                _responses_usage(outcome), _extra(outcome)))
        return _stream(_responses_events(run, writer))

    # -- Ollama ----------------------------------------------------------------

    async def ollama_version(self, request: Request) -> JSONResponse:
        return JSONResponse({"version": ollama.VERSION})

    async def ollama_tags(self, request: Request) -> JSONResponse:
        self._check_ready()
        return JSONResponse({"models": [ollama.model_entry(self.bridge.model_id,
                                                           self.bridge.info)]})

    async def ollama_ps(self, request: Request) -> JSONResponse:
        self._check_ready()
        entry = ollama.model_entry(self.bridge.model_id, self.bridge.info)
        # Apple silicon's memory is unified: the whole model is in the GPU's
        # memory, as Ollama reports it there (0 would read as a CPU-only load).
        return JSONResponse({"models": [{**entry, "expires_at": "2999-01-01T00:00:00Z",
                                         "size_vram": entry["size"],
                                         "context_length": self.bridge.max_context}]})

    async def ollama_show(self, request: Request) -> JSONResponse:
        self._check_ready()
        body = await self._body(request)
        if not isinstance(body, dict) or not isinstance(body.get("model") or body.get("name"),
                                                        str):
            raise ApiError(400, "'model' must be a model name.", param="model")
        return JSONResponse(ollama.show(self.bridge.model_id, self.bridge.info,
                                        self.bridge.chat_template,
                                        self.bridge.tool_syntax is not None))

    async def ollama_pull(self, request: Request) -> JSONResponse:
        raise ApiError(501, ollama.PULL_REFUSAL)

    async def ollama_chat(self, request: Request) -> Response:
        self._check_ready()
        body = await self._body(request)
        if (done := ollama.done_at_once(body, chat=True)) is not None:
            return self._ollama_done(done)
        chat = ollama.chat_request(body, self.bridge.max_context)
        return await self._ollama_answer(request, chat, chat_api=True)

    async def ollama_generate(self, request: Request) -> Response:
        self._check_ready()
        body = await self._body(request)
        if (done := ollama.done_at_once(body, chat=False)) is not None:
            return self._ollama_done(done)
        chat = ollama.generate_request(body, self.bridge.max_context)
        return await self._ollama_answer(request, chat, chat_api=False)

    def _ollama_done(self, done: dict) -> JSONResponse:
        """Answer a request with nothing to answer: how Ollama's clients load a model
        (here it is loaded already) or unload it. The server serves one model for
        its life, so an unload frees what it holds beside the weights: the KV of
        past requests, stored to disk for a later one to take up."""
        if done["done_reason"] == "unload":
            self.bridge.release_idle()
        return JSONResponse(done)

    async def _ollama_answer(self, request: Request, chat: ChatRequest, *,
                             chat_api: bool) -> Response:
        started = time.perf_counter()
        run = await self._start(chat)
        model = chat.model or ollama.tag(self.bridge.model_id)

        def line(text: str, calls: Sequence[ToolCall] = ()) -> dict:
            if not chat_api:
                return {"model": model, "created_at": ollama.now(), "response": text,
                        "done": False}
            message: dict = {"role": "assistant", "content": text}
            if calls:
                message["tool_calls"] = [_ollama_call(call) for call in calls]
            return {"model": model, "created_at": ollama.now(), "message": message,
                    "done": False}

        def last(outcome: Outcome) -> dict:
            # Ollama counts the prompt tokens it evaluated: a cached prefix is not.
            return ollama.final_line(model, outcome.finish,
                                     outcome.prompt_tokens - outcome.cached_tokens,
                                     outcome.completion_tokens,
                                     time.perf_counter() - started, outcome.stats,
                                     chat=chat_api)
        if not chat.stream:
            text, calls, outcome = await self._collect(request, run)
            whole = {**last(outcome), **{k: v for k, v in line(text, calls).items()
                                        if k in ("message", "response")}}
            return JSONResponse(whole)

        async def lines() -> AsyncIterator[str]:
            try:
                async for piece in _guarded(run):
                    if isinstance(piece, KeepAlive | str):
                        text = piece if isinstance(piece, str) else ""
                        yield json.dumps(line(text)) + "\n"
                    elif isinstance(piece, ToolCall):
                        yield json.dumps(line("", [piece])) + "\n"
                    else:
                        yield json.dumps(last(piece)) + "\n"
            except ApiError as error:
                yield json.dumps({"error": error.message}) + "\n"
        return StreamingResponse(lines(), media_type="application/x-ndjson")

    # -- generation ------------------------------------------------------------

    def _model_name(self, chat: ChatRequest) -> str:
        return self.bridge.model_id

    async def _start(self, chat: ChatRequest) -> Run:
        chat = self._for_template(chat)
        mode = chat.mode or self.bridge.kv_mode
        if (chat.speculative_asked and chat.sampling.speculative == "lookup"
                and self.bridge.machines > 1):
            # The other ranks follow rank 0 one decode step at a time; a draft's
            # verification and rewind are not steps they know yet. Left to the
            # default, the answer decodes plainly there instead (Session.chat).
            raise ApiError(400, SPECULATIVE_REFUSAL, param="speculative")
        if (chat.sampling.grammar is not None and chat.template
                and chat.messages and chat.messages[-1]["role"] == "assistant"):
            raise ApiError(400, SCHEMA_AFTER_PREFILL)
        syntax = self._tool_syntax(chat)
        self._check_bias(chat)
        prompt = await self._render(chat)
        chat = await self._with_calls(chat, syntax, prompt)
        context = min(self.bridge.max_context, chat.context or self.bridge.max_context)
        if len(prompt) + 1 > context:
            field, verb = ("messages", "take") if chat.template else ("prompt", "takes")
            raise too_long(len(prompt), context, anthropic=chat.anthropic, field=field,
                           verb=verb)
        try:
            report = await asyncio.wrap_future(self.bridge.fit_later(len(prompt) + 1))
        except EngineError as error:
            raise ApiError(503, str(error), "server_error") from error
        fit = report.for_mode(mode)
        if not fit.supported:
            raise ApiError(400, f"KV mode {mode} cannot store this model's heads.",
                           param="kv_mode")
        # Rank 0's own limits first, then (on a pipeline) another machine's.
        why = report.message() if not fit.fits else report.machine_short(mode, len(prompt) + 1)
        if why is not None:
            if chat.anthropic:
                # Its API has no other answer for a prompt that does not fit, and
                # Claude Code compacts the conversation on this one.
                log.info("prompt of %d tokens refused: %s", len(prompt), why)
                fitting = min(fit.tokens_fit, report.pool_tokens(mode) or fit.tokens_fit)
                raise too_long(len(prompt), fitting, anthropic=True)
            raise ApiError(507, why, "insufficient_memory", code="insufficient_memory")
        cancel = threading.Event()
        sampling = chat.sampling
        if chat.context is not None:  # a request's own context bounds its answer too
            sampling = replace(sampling, max_tokens=min(sampling.max_tokens,
                                                        context - len(prompt)))
        try:
            ticket = self.bridge.submit(chat.messages, prompt, mode, sampling, cancel,
                                        asyncio.get_running_loop(), chat.tools,
                                        chat.template)
        except QueueFull as error:
            raise ApiError(429, str(error), "rate_limit_error",
                           headers={"Retry-After": "2"}) from error
        except NotReady as error:
            raise _not_ready(str(error)) from error
        reader = ToolCallReader(syntax, chat.tools) if syntax is not None else None
        wanted = None if chat.tool_choice in ("auto", "none") else chat.tool_name or ""
        return Run(self.bridge, ticket, cancel, chat.stop, len(prompt), reader, wanted,
                   keepalive=self.keepalive if chat.stream else 0.0, max_calls=chat.max_calls,
                   anthropic=chat.anthropic)

    async def _render(self, chat: ChatRequest) -> list[int]:
        """The request's prompt ids, rendered off the event loop (a long conversation
        takes a while to render and tokenize; other connections go on meanwhile)."""
        try:
            return await asyncio.wrap_future(
                self.bridge.render_later(chat.messages, chat.tools, chat.template))
        except EngineError as error:  # e.g. a template that drops the message to continue
            raise ApiError(400, str(error), param="messages") from error

    def _for_template(self, chat: ChatRequest) -> ChatRequest:
        """``chat`` with its call ids as the model's template demands them: ids made
        by other servers (``toolu_…``) or clients are mapped, call and result alike."""
        syntax = self.bridge.tool_syntax
        if syntax is None or not syntax.short_ids:
            return chat
        return replace(chat, messages=with_short_ids(chat.messages))

    def _tool_syntax(self, chat: ChatRequest) -> ToolSyntax | None:
        """How the model marks its calls, for a request with tools (None: no tools).

        Tools for a model whose chat template defines no tool calling are refused:
        the template would drop them, and the answer could never be read as a call.
        Under tool_choice "none" the tools are rendered but no call is read: a call
        the model writes anyway stays text.
        """
        if not chat.tools or chat.tool_choice == "none":
            return None
        syntax = self.bridge.tool_syntax
        if syntax is None:
            raise ApiError(400, f"'tools' were sent, but this model's chat template "
                                f"({self.bridge.model_id}) defines no tool calling: it "
                                "would never see them, and its answer could not be read "
                                "as a call. Serve a model with tool calling (Qwen2.5 or "
                                "later, Mistral, Gemma 4, GLM-4.7…), or leave 'tools' out "
                                "(tool_choice 'none' does).", param="tools",
                           code="tools_unsupported")
        return syntax

    async def _with_calls(self, chat: ChatRequest, syntax: ToolSyntax | None,
                          prompt: list[int]) -> ChatRequest:
        """``chat`` decoding to what its tools allow where it must (``call_grammar``):
        a forced ``tool_choice`` to the call, a response format beside tools to
        calls or that format. A forced call the model's syntax has no grammar for
        decodes free (``tool_choice_met`` says whether it came).

        Raises:
            ApiError: a response format beside tools for a model whose calls no
                grammar here writes: held to the format, it could never call one.
        """
        if syntax is None or chat.tool_choice == "none" or not chat.tools:
            return chat
        forced = chat.tool_choice in ("required", "named")
        answer = None if forced else chat.sampling.grammar
        if not forced and answer is None:
            return chat
        if chat.messages and chat.messages[-1]["role"] == "assistant":
            return chat  # an answer continued: its start is the client's, not a call's
        named = chat.tool_name if chat.tool_choice == "named" else None
        calls = Calls(functions(chat.tools, named), single=chat.max_calls == 1,
                      open_thought=self.bridge.opens_thought(prompt))
        grammar = await asyncio.wrap_future(
            self.bridge.call_grammar_later(syntax, calls, answer))
        if grammar is None and chat.sampling.grammar is not None:
            param = chat.format_param
            raise ApiError(400, f"'{param}' and 'tools' cannot be used together with this "
                                f"model ({self.bridge.model_id}): Longleaf holds an answer "
                                "to a format and the calls of JSON or Qwen3-Coder tool "
                                f"syntaxes together, not this model's ({syntax.kind}). "
                                f"Leave out '{param}' or the tools.", param=param)
        if grammar is None:
            return chat
        return replace(chat, sampling=replace(chat.sampling, grammar=grammar))

    def _check_bias(self, chat: ChatRequest) -> None:
        vocab = self.bridge.vocab_size
        for ident, _ in chat.sampling.logit_bias:
            if ident >= vocab:
                raise ApiError(400, f"'logit_bias' names token id {ident}, but this model's "
                                    f"tokenizer has {vocab:,} tokens (ids 0 to {vocab - 1}).",
                               param="logit_bias")

    async def _collect(self, request: Request,
                       run: Run) -> tuple[str, list[ToolCall], Outcome]:
        """The whole answer and its tool calls; a client that leaves cancels it."""
        watcher = asyncio.create_task(_watch_disconnect(request, run.cancel))
        try:
            parts: list[str] = []
            calls: list[ToolCall] = []
            async for piece in run.parts():
                if isinstance(piece, str):
                    parts.append(piece)
                elif isinstance(piece, ToolCall):
                    calls.append(piece)
                elif isinstance(piece, Outcome):
                    return "".join(parts), calls, piece
        finally:
            watcher.cancel()
        raise ApiError(500, "The engine ended the request without an answer.", "server_error")


async def _responses_events(run: Run, writer: responses.ResponseWriter) -> AsyncIterator[dict]:
    """A streamed response: ``response.created`` … ``response.completed``; while the
    engine reads a long prompt, ``response.in_progress`` now and then (Codex ends a
    stream that sends no event for a while)."""
    for event in writer.started():
        yield event
    try:
        async for piece in _guarded(run):
            if isinstance(piece, KeepAlive):
                yield writer.waiting()
            elif isinstance(piece, str):
                for event in writer.add_text(piece) if piece else ():
                    yield event
            elif isinstance(piece, ToolCall):
                for event in writer.add_call(piece.id, piece.name, piece.arguments):
                    yield event
            else:
                for event in writer.finished(piece.finish, _responses_usage(piece),
                                             _extra(piece)):
                    yield event
    except ApiError as error:
        yield writer.failed(error.message, error.code)


def _responses_usage(outcome: Outcome) -> dict:
    return responses.usage(outcome.prompt_tokens, outcome.cached_tokens,
                           outcome.completion_tokens)


def _extra(outcome: Outcome) -> dict:
    """Longleaf's own fields of a response: its KV mode and a forced choice's result."""
    return {"kv_mode": outcome.mode, **_choice_met(outcome)}


def _anthropic_event(kind: str, data: dict) -> dict:
    return {"event": kind, "data": json.dumps({"type": kind, **data})}


async def _anthropic_events(request: Request, run: Run, ident: str,
                            model: str) -> AsyncIterator[dict]:
    """A streamed Anthropic message: ``message_start`` … ``message_stop``.

    A text block opens with the first text: an answer that only calls a tool
    starts with its tool_use block, as Anthropic's own do. While the engine has
    nothing to say (reading a long prompt), an empty text delta goes out now and
    then: Claude Code ends a stream that sends no event but ``ping`` for a while.
    """
    event = _anthropic_event
    reused = run.ticket.reused
    yield event("message_start", {"message": {
        "id": ident, "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": None, "stop_sequence": None,
        "usage": {"input_tokens": run.prompt_tokens - reused, "output_tokens": 0,
                  "cache_read_input_tokens": reused, "cache_creation_input_tokens": 0}}})
    index, text_open = -1, False  # the last block opened, and whether it is text
    try:
        async for piece in _guarded(run):
            if isinstance(piece, str | KeepAlive):
                if isinstance(piece, str) and not piece:
                    continue
                if not text_open:
                    index, text_open = index + 1, True
                    yield event("content_block_start", {
                        "index": index, "content_block": {"type": "text", "text": ""}})
                text = piece if isinstance(piece, str) else ""
                yield event("content_block_delta", {"index": index, "delta": {
                    "type": "text_delta", "text": text}})
                continue
            if text_open:
                yield event("content_block_stop", {"index": index})
                text_open = False
            if isinstance(piece, ToolCall):
                index += 1
                yield event("content_block_start", {"index": index, "content_block": {
                    **_anthropic_call(piece), "input": {}}})
                yield event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": piece.arguments}})
                yield event("content_block_stop", {"index": index})
                continue
            if index < 0:  # nothing written: one empty text block, as not streamed
                index = 0
                yield event("content_block_start", {
                    "index": 0, "content_block": {"type": "text", "text": ""}})
                yield event("content_block_stop", {"index": 0})
            yield event("message_delta", {
                "delta": {"stop_reason": _anthropic_stop(piece, run.stopped_by),
                          "stop_sequence": run.stopped_by},
                "usage": _anthropic_usage(piece), **_choice_met(piece)})
            yield event("message_stop", {})
    except ApiError as error:
        body = json.loads(bytes(error_response(request, error).body))
        yield {"event": "error", "data": json.dumps(body)}


async def _guarded(run: Run) -> AsyncIterator[str | ToolCall | Outcome | KeepAlive]:
    """``run``'s parts; a stream cut off by its client cancels the engine request."""
    pieces = run.parts()
    try:
        async for piece in pieces:
            yield piece
    finally:
        run.cancel.set()
        await pieces.aclose()


def _stream(events: AsyncIterator[Any]) -> EventSourceResponse:
    """A streamed answer's Server-Sent Events (a ping each 15 s for proxies).

    On a signal (Ctrl-C) sse-starlette ends every stream at once, which cuts an
    answer with no error (it looks finished): the streams are given the time the
    server waits for its answers to end as errors (``STOP_WAIT_S``) first.
    """
    return EventSourceResponse(events, ping=15, shutdown_grace_period=STOP_WAIT_S)


async def _watch_disconnect(request: Request, cancel: threading.Event) -> None:
    while not cancel.is_set():
        if await request.is_disconnected():
            cancel.set()
            return
        await asyncio.sleep(DISCONNECT_POLL)


class Run:
    """One generation's pieces of text as they come, cut at the first stop sequence.

    Args:
        keepalive: seconds without an engine event after which ``parts`` yields
            ``KEEPALIVE`` (0: never).
        max_calls: keep the answer's first calls only (None: every call).
        anthropic: word a prompt that turns out too long as Anthropic's API does.
    """

    def __init__(self, bridge: ServerBridge, ticket: Ticket, cancel: threading.Event,
                 stops: tuple[str, ...], prompt_tokens: int,
                 reader: ToolCallReader | None = None, wanted: str | None = None, *,
                 keepalive: float = 0.0, max_calls: int | None = None,
                 anthropic: bool = False) -> None:
        self.bridge, self.ticket, self.cancel = bridge, ticket, cancel
        self.stops = stops
        self.reader = reader
        self.wanted = wanted  # a call the request forced: "" any, else that tool's name
        self.prompt_tokens = prompt_tokens
        self.stopped_by: str | None = None
        self.mode = ticket.mode
        self.keepalive = keepalive
        self.max_calls = max_calls
        self.anthropic = anthropic
        # Per token chunk read and not yet taken: where its text starts and ends in
        # the answer, and its tokens' log probabilities.
        self._scored: deque[tuple[int, int, list[TokenLogprob]]] = deque()
        self._read = 0  # characters of the answer read from the engine
        self._sent = 0  # characters of it handed on (the pieces yielded)

    def take_logprobs(self) -> list[TokenLogprob]:
        """The log probabilities of the tokens whose text was handed on since the
        last call (a stop sequence's tokens, cut from the text, are not among them)."""
        taken: list[TokenLogprob] = []
        while self._scored and self._scored[0][1] <= self._sent:
            taken.extend(self._scored.popleft()[2])
        return taken

    def _read_chunk(self, event: TokenChunk) -> None:
        start, self._read = self._read, self._read + len(event.text)
        self._scored.append((start, self._read, list(event.logprobs)))

    def _sent_text(self, text: str) -> str:
        self._sent += len(text)
        return text

    def _cut_at(self, end: int) -> None:
        """A stop sequence starts ``end`` characters into the answer: the tokens
        whose text starts there or later are no part of it."""
        self._scored = deque((start, min(stop, end), scored)
                             for start, stop, scored in self._scored if start < end)

    async def parts(self) -> AsyncGenerator[str | ToolCall | Outcome | KeepAlive, None]:
        """The answer's text and tool calls, then one ``Outcome``.

        Without a tool syntax (no tools asked, or a model that defines none) the
        text comes as the model wrote it. An answer that made a call and then
        ended its turn finishes with "tool_calls". A forced call the answer did not
        make (a syntax no grammar here writes, or one cut short) is said in
        ``Outcome.tool_choice_met``.
        """
        pieces = self.pieces()
        names: list[str] = []
        # Blank text that opens the answer or follows a call is held until text
        # follows it: before a call (the line break a template writes first) or
        # between two it is dropped, an item of its own in a stream (a text block)
        # and no part of what the answer says.
        blank = ""
        said = False
        try:
            async for piece in pieces:
                if self.reader is None or isinstance(piece, KeepAlive):
                    yield piece
                    continue
                parts = self.reader.feed(piece) if isinstance(piece, str) \
                    else self.reader.finish()
                for part in parts:
                    if isinstance(part, ToolCall):
                        if self.max_calls is not None and len(names) >= self.max_calls:
                            log.info("a tool call dropped: the request allows %d",
                                     self.max_calls)
                            continue
                        names.append(part.name)
                        blank = ""
                    elif (names or not said) and not (blank + part).strip():
                        blank += part
                        continue
                    else:
                        part, blank, said = blank + part, "", True
                    yield part
                if not isinstance(piece, str):
                    if blank and not names:  # an answer of blank text alone: as written
                        yield blank
                    yield self._ended(piece, names)
        finally:
            await pieces.aclose()

    def _ended(self, outcome: Outcome, names: list[str]) -> Outcome:
        if names and outcome.finish == "stop" and not self.stopped_by:
            outcome = replace(outcome, finish="tool_calls")
        if self.wanted is not None:
            met = bool(names) if not self.wanted else self.wanted in names
            if not met:
                log.info("the answer did not make the call tool_choice asked for")
            outcome = replace(outcome, tool_choice_met=met)
        return outcome

    async def _next_event(self) -> object:
        """The engine's next event for this request, or ``KEEPALIVE`` after a silence."""
        if not self.keepalive:
            return await self.ticket.queue.get()
        try:
            return await asyncio.wait_for(self.ticket.queue.get(), self.keepalive)
        except TimeoutError:
            return KEEPALIVE

    async def pieces(self) -> AsyncGenerator[str | Outcome | KeepAlive, None]:
        """Text deltas, then one ``Outcome``; raises ``ApiError`` for a failure."""
        held = ""  # text that may be the start of a stop sequence
        generated = 0
        keep = max((len(s) for s in self.stops), default=1) - 1
        try:
            while True:
                event = await self._next_event()
                if isinstance(event, KeepAlive):
                    yield event
                elif isinstance(event, SessionOpened):
                    self.mode = event.kv_mode
                elif isinstance(event, Failed):
                    raise self._failure(event)
                elif isinstance(event, TokenChunk) and self.stopped_by is None:
                    generated += len(event.token_ids)
                    self._read_chunk(event)
                    held += event.text  # it starts where the text handed on ends
                    cut = self._stop_at(held)
                    if cut is not None:
                        self.cancel.set()  # the engine stops within one token
                        self._cut_at(self._sent + cut)
                        if held[:cut]:
                            yield self._sent_text(held[:cut])
                        held = ""
                    elif len(held) > keep:
                        yield self._sent_text(held[:len(held) - keep])
                        held = held[len(held) - keep:]
                elif isinstance(event, Finished) and event.request_id == self.ticket.chat_id:
                    if held and self.stopped_by is None:
                        yield self._sent_text(held)
                    if event.reason == "cancelled" and self.stopped_by is None:
                        # Not by its client (gone, it reads nothing more) nor a stop
                        # sequence: the server closed its session (a model switch,
                        # the server stopping). A cut answer must not look finished.
                        raise _not_ready(STOPPED_BY_SERVER)
                    if event.reason == "memory" and self.stopped_by is None:
                        # Not a length limit: a client reading "length" would ask
                        # for more, into the same shortage.
                        raise ApiError(507, STOPPED_FOR_MEMORY.format(tokens=generated),
                                       "insufficient_memory", code="insufficient_memory")
                    yield self._outcome(event, generated)
                    return
        finally:
            self.cancel.set()  # a client gone mid-stream stops the engine

    def _failure(self, event: Failed) -> ApiError:
        if event.error_type in TOO_LONG_ERRORS and self.anthropic:
            log.info("prompt of %d tokens refused: %s", self.prompt_tokens, event.message)
            fitting = event.kept_tokens or self.prompt_tokens
            return too_long(self.prompt_tokens, fitting, anthropic=True)
        return _engine_error(event)

    def _stop_at(self, text: str) -> int | None:
        found = [(text.find(s), s) for s in self.stops if s in text]
        if not found:
            return None
        index, stop = min(found)
        self.stopped_by = stop
        return index

    def _outcome(self, event: Finished, generated: int) -> Outcome:
        stats = event.stats
        prompt = stats.prompt_tokens if stats and stats.prompt_tokens else self.prompt_tokens
        fed = stats.prefill_tokens if stats else prompt
        finish = "stop" if self.stopped_by or event.reason == "stop" else "length"
        return Outcome(finish, prompt, max(0, prompt - fed), generated, self.mode,
                       stats=stats)


def _not_ready(message: str) -> ApiError:
    return ApiError(503, message, "server_error", headers={"Retry-After": "5"})


def _engine_error(event: Failed) -> ApiError:
    if event.error_type in TOO_LONG_ERRORS:
        return ApiError(400, event.message, param="messages", code="context_length_exceeded")
    if event.error_type == "GroupLost":  # a machine of the pipeline is gone
        return _not_ready(event.message)
    if event.error_type in MEMORY_ERRORS:
        return ApiError(507, event.message, "insufficient_memory", code="insufficient_memory")
    if event.error_type in ("EngineError", "UnsupportedModeError"):
        return ApiError(400, event.message)
    return ApiError(500, event.message, "server_error")


def _choice_met(outcome: Outcome) -> dict:
    """Longleaf's field for a forced tool choice: whether the answer made that call."""
    if outcome.tool_choice_met is None:
        return {}
    return {"tool_choice_met": outcome.tool_choice_met}


def _scored(piece: tuple[str, bytes], logprob: float) -> dict:
    text, raw = piece
    return {"token": text, "logprob": logprob, "bytes": list(raw)}


def _ollama_call(call: ToolCall) -> dict:
    return {"function": {"name": call.name, "arguments": call.input()}}


def _openai_call(call: ToolCall) -> dict:
    return {"id": call.id, "type": "function",
            "function": {"name": call.name, "arguments": call.arguments}}


def _anthropic_call(call: ToolCall) -> dict:
    return {"type": "tool_use", "id": call.id, "name": call.name, "input": call.input()}


def _openai_usage(outcome: Outcome) -> dict:
    return {"prompt_tokens": outcome.prompt_tokens,
            "completion_tokens": outcome.completion_tokens,
            "total_tokens": outcome.prompt_tokens + outcome.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": outcome.cached_tokens}}


def _anthropic_usage(outcome: Outcome) -> dict:
    return {"input_tokens": outcome.prompt_tokens - outcome.cached_tokens,
            "output_tokens": outcome.completion_tokens,
            "cache_read_input_tokens": outcome.cached_tokens,
            "cache_creation_input_tokens": 0}


def _anthropic_stop(outcome: Outcome, stopped_by: str | None) -> str:
    if stopped_by is not None:
        return "stop_sequence"
    if outcome.finish == "tool_calls":
        return "tool_use"
    return "end_turn" if outcome.finish == "stop" else "max_tokens"
