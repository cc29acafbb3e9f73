"""Ollama's API on the same port: request bodies read into the engine's plain
inputs, and the model listing and NDJSON answer lines written.

Editors and web UIs that speak only Ollama (``/api/chat``, ``/api/generate``,
``/api/tags``…) reach the loaded model this way; any model name serves it, as on
the other APIs. Answers stream by default, one JSON object a line, as Ollama's
do. No MLX here.
"""

from __future__ import annotations

import datetime
import hashlib
import re
from typing import TYPE_CHECKING, Any

from engine.server import fields, protocol, structured
from engine.server.errors import BadRequest
from engine.server.fields import accepted, honoured, refused
from engine.server.protocol import ChatRequest
from engine.session.sampling import REPETITION_CONTEXT, SamplingParams

if TYPE_CHECKING:
    from engine.events import GenerationStats
    from engine.models.info import ModelInfo

# The Ollama API version this server answers as (clients check for a recent one).
VERSION = "0.12.6"
RANDOM_SEED = -1  # Ollama's default seed: draw at random, as with no seed
HARDWARE = accepted("how Ollama's runner uses the hardware; the engine plans its own")
# A keep_alive of zero, as Go's time.ParseDuration reads one ("0", "0s", "0m"…):
# Ollama's "unload now".
ZERO_DURATION = re.compile(r"[+-]?(0+(\.0*)?(ns|us|µs|μs|ms|s|m|h)?)+")
PULL_REFUSAL = ("Longleaf does not pull models from Ollama's library. It serves the model "
                "it was started with: `python -m engine serve --model demo` or "
                "`--model /path/to/an/mlx-lm/folder`, or the model loaded in the app "
                "(Models… finds, downloads and converts MLX models).")

OPTIONS = {
    "num_ctx": honoured("the request's context: a longer prompt is a 400"),
    "num_predict": honoured(f"the answer's token limit ({fields.DEFAULT_MAX_TOKENS:,} by "
                            "default; -1, -2: up to the context)"),
    "temperature": fields.TEMPERATURE,
    "top_p": fields.SAMPLING,
    "top_k": fields.SAMPLING,
    "min_p": fields.SAMPLING,
    "seed": honoured("the same seed, the same answer"),
    "stop": fields.STOP,
    "repeat_penalty": honoured(f"mlx-lm's repetition penalty over the last "
                               f"{REPETITION_CONTEXT} tokens"),
    "presence_penalty": fields.PENALTY,
    "frequency_penalty": fields.PENALTY,
    "repeat_last_n": refused(f"the penalties look at the last {REPETITION_CONTEXT} tokens",
                             lambda v: v == REPETITION_CONTEXT),
    "mirostat": refused("mirostat sampling is not supported", lambda v: v == 0),
    "mirostat_tau": refused("mirostat sampling is not supported"),
    "mirostat_eta": refused("mirostat sampling is not supported"),
    "tfs_z": refused("tail-free sampling is not supported", lambda v: v == 1),
    "typical_p": refused("typical sampling is not supported", lambda v: v == 1),
    "penalize_newline": refused("newlines are penalized as every token is",
                                lambda v: v is True),
    # Ollama keeps these tokens when it cuts a prompt too long for the context;
    # here such a prompt is a 400, never cut, so there is nothing to keep.
    "num_keep": accepted("a prompt too long is refused, never cut: nothing is kept"),
    "logits_all": refused("the API returns no logits"),
    "vocab_only": refused("the model is loaded whole", lambda v: v is False),
    "embedding_only": refused("this server answers; it does not embed", lambda v: v is False),
    "f16_kv": accepted("the KV cache's precision is the request's kv_mode or the "
                       "server's --kv"),
    **{name: HARDWARE for name in ("numa", "num_batch", "num_gpu", "main_gpu", "low_vram",
                                   "use_mmap", "use_mlock", "num_thread")},
}


def _no_penalty(options: dict) -> bool:
    return (options.get("repeat_penalty") in (None, 1)
            and not options.get("presence_penalty") and not options.get("frequency_penalty"))


def _no_mirostat(options: dict) -> bool:
    return not options.get("mirostat")


# Refused options that change nothing, whatever their value, while these hold of
# the other options: Ollama's clients send its defaults (mirostat_tau 5.0,
# repeat_last_n 64, ...) beside options that switch them off.
IDLE_WHEN = {"repeat_last_n": _no_penalty, "penalize_newline": _no_penalty,
             "mirostat_tau": _no_mirostat, "mirostat_eta": _no_mirostat}

_COMMON = {
    "model": honoured("any name serves the loaded model"),
    "stream": honoured("NDJSON lines, on by default"),
    "options": honoured("each option as listed in engine.server.ollama.OPTIONS"),
    "format": honoured("\"json\" or a JSON schema: the answer is decoded to it"),
    "keep_alive": honoured("0 with nothing to answer frees the KV held for past "
                           "requests (stored to disk); the model stays loaded while the "
                           "server runs"),
    "think": accepted("the model thinks as its template does; thinking comes back as text"),
    "logprobs": refused("log probabilities are not on Ollama's API here: use "
                        "/v1/chat/completions", lambda v: v is False),
    "top_logprobs": refused("log probabilities are not on Ollama's API here",
                            lambda v: v == 0),
}
CHAT = {**_COMMON,
        "messages": honoured("system, user, assistant (tool_calls) and tool messages"),
        "tools": fields.TOOLS}
GENERATE = {**_COMMON,
            "prompt": honoured("the user's message (in the chat template unless raw)"),
            "system": honoured("the system prompt"),
            "raw": honoured("true reads the prompt as plain text, no template"),
            "suffix": refused("fill-in-the-middle is not supported", lambda v: v == ""),
            "template": refused("the model's own chat template is used", lambda v: v == ""),
            "context": refused("the deprecated context ids are not read: send the "
                               "conversation to /api/chat", lambda v: v == []),
            "images": refused("this server reads text only", lambda v: v == []),
            "width": refused("this server makes no images"),
            "height": refused("this server makes no images"),
            "steps": refused("this server makes no images")}


def _options(body: dict) -> dict:
    options = body.get("options") or {}
    if not isinstance(options, dict):
        raise BadRequest("'options' must be an object.", "options")
    for name, value in options.items():
        field = OPTIONS.get(name)
        idle = IDLE_WHEN.get(name)
        if field is not None and field.refuses(value) and not (idle and idle(options)):
            raise BadRequest(f"options.{name} is not supported by this server: "
                             f"{field.note}.", f"options.{name}")
    return options


def _sampling(options: dict, context: int, body: dict) -> SamplingParams:
    """Ollama's options in the engine's terms."""
    predict = protocol.integer(options, ("num_predict",), fields.DEFAULT_MAX_TOKENS,
                               -2)
    if predict is None or predict < 1:
        predict = max(1, context)  # -1 and -2: as long as the context allows
    named = {"temperature": options.get("temperature", 0.8), "top_p": options.get("top_p"),
             "top_k": options.get("top_k"), "min_p": options.get("min_p"),
             "repetition_penalty": options.get("repeat_penalty"),
             "presence_penalty": options.get("presence_penalty"),
             "frequency_penalty": options.get("frequency_penalty")}
    grammar = structured.ollama_format(body.get("format"))
    seed = options.get("seed")
    if seed == RANDOM_SEED and not isinstance(seed, bool):
        seed = None
    return protocol.sampling_params({k: v for k, v in named.items() if v is not None},
                                    int(predict), seed, grammar=grammar)


def done_at_once(body: Any, *, chat: bool) -> dict | None:
    """The one line answering a request with nothing to answer (no messages, no
    prompt), with which Ollama's clients load a model (``done_reason`` "load") or,
    with a keep_alive of zero, unload it ("unload"); None for a request with
    something to answer."""
    if not isinstance(body, dict) or body.get("messages" if chat else "prompt") not in (
            None, [], ""):
        return None
    keep = body.get("keep_alive")
    zero = (keep == 0 if isinstance(keep, int | float) and not isinstance(keep, bool)
            else isinstance(keep, str) and ZERO_DURATION.fullmatch(keep.strip()) is not None)
    empty = {"message": {"role": "assistant", "content": ""}} if chat else {"response": ""}
    return {"model": _name(body), "created_at": now(), **empty, "done": True,
            "done_reason": "unload" if zero else "load"}


def _stream(body: dict) -> bool:
    stream = body.get("stream", True)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be true or false.", "stream")
    return stream


def context_limit(body: dict) -> int | None:
    """``options.num_ctx``: the context this request may use (None: the model's)."""
    return protocol.integer(body.get("options") or {}, ("num_ctx",), None, 1)


def chat_request(body: Any, context: int) -> ChatRequest:
    """Read an ``/api/chat`` body; ``context`` is the model's context in tokens."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    fields.check(body, CHAT)
    options = _options(body)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise BadRequest("'messages' must be a non-empty list.", "messages")
    messages = protocol.continuable([_message(m, i) for i, m in enumerate(raw)])
    tools, choice, name = protocol.tools_of({"tools": body.get("tools")}, anthropic=False)
    return ChatRequest(
        messages=messages, sampling=_sampling(options, context, body),
        stop=protocol.stops(options.get("stop"), "options.stop"), stream=_stream(body),
        include_usage=True, mode=protocol.mode_from(_name(body), body), model=_name(body),
        tools=tools, tool_choice=choice, tool_name=name, context=context_limit(body),
        format_param="format")


def _message(message: Any, index: int) -> dict:
    where = f"messages[{index}]"
    if not isinstance(message, dict) or message.get("role") not in (
            "system", "user", "assistant", "tool"):
        raise BadRequest(f"{where} must be an object whose role is system, user, "
                         "assistant or tool.", "messages")
    content = message.get("content") or ""
    if not isinstance(content, str):
        raise BadRequest(f"{where}.content must be a string.", "messages")
    images = message.get("images") or []
    if not isinstance(images, list):
        raise BadRequest(f"{where}.images must be a list.", "messages")
    if images:
        # As on the other APIs: a client that resends a history with a screenshot in
        # it must not be refused at every later turn; the model reads that one was left.
        content = "\n\n".join([*([content] if content else []),
                                *[protocol.IMAGE_OMITTED] * len(images)])
    out: dict = {"role": message["role"], "content": content}
    calls = message.get("tool_calls")
    if message["role"] == "assistant" and calls:
        out["tool_calls"] = protocol.tool_calls_of(calls, where)
    if message["role"] == "assistant":  # Ollama's field for the turn's thought
        protocol.reasoning_of(message, ("thinking",), where, out)
    if message["role"] == "tool" and isinstance(message.get("tool_name"), str):
        out["name"] = message["tool_name"]
    return out


def generate_request(body: Any, context: int) -> ChatRequest:
    """Read an ``/api/generate`` body (an empty prompt is answered before this)."""
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    fields.check(body, GENERATE)
    options = _options(body)
    prompt = body.get("prompt")
    system = body.get("system")
    if not isinstance(prompt, str) or not prompt:
        raise BadRequest("'prompt' must be a non-empty string.", "prompt")
    if system is not None and not isinstance(system, str):
        raise BadRequest("'system' must be a string.", "system")
    raw = body.get("raw", False)
    if not isinstance(raw, bool):
        raise BadRequest("'raw' must be true or false.", "raw")
    if raw and system:
        # As Ollama refuses it: a raw prompt goes as written, with no template to
        # put a system prompt in.
        raise BadRequest("A 'raw' prompt is sent as written: it takes no 'system'.", "raw")
    messages = [{"role": "user", "content": prompt}]
    if system:
        messages.insert(0, {"role": "system", "content": system})
    return ChatRequest(
        messages=messages, sampling=_sampling(options, context, body),
        stop=protocol.stops(options.get("stop"), "options.stop"), stream=_stream(body),
        include_usage=True, mode=protocol.mode_from(_name(body), body), model=_name(body),
        template=not raw, context=context_limit(body))


def _name(body: dict) -> str:
    return protocol.model_name(body)


def tag(model_id: str) -> str:
    """A model id as Ollama names models: ``name:tag``."""
    return model_id if ":" in model_id else f"{model_id}:latest"


def model_entry(model_id: str, info: ModelInfo | None) -> dict:
    """One model of ``/api/tags`` and ``/api/ps``: the loaded one."""
    size = int(getattr(info, "num_parameters", 0) or 0)
    bits = getattr(info, "quantization_bits", None)
    digest = hashlib.sha256(str(getattr(info, "path", model_id)).encode()).hexdigest()
    return {
        "name": tag(model_id), "model": tag(model_id),
        "modified_at": datetime.datetime.now(datetime.UTC).isoformat(),
        "size": size * (bits or 16) // 8, "digest": digest,
        "details": {"parent_model": "", "format": "mlx",
                    "family": getattr(info, "architecture", ""),
                    "families": [getattr(info, "architecture", "")],
                    "parameter_size": _parameters(size),
                    "quantization_level": f"Q{bits}" if bits else "F16"},
    }


def _parameters(count: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if count >= scale:
            return f"{count / scale:.1f}{unit}"
    return str(count)


def show(model_id: str, info: ModelInfo | None, template: str, tools: bool) -> dict:
    """``/api/show``'s answer for the loaded model."""
    entry = model_entry(model_id, info)
    arch = getattr(info, "architecture", "")
    return {"modelfile": "", "parameters": "", "template": template,
            "details": entry["details"], "modified_at": entry["modified_at"],
            "model_info": {"general.architecture": arch,
                           "general.parameter_count": getattr(info, "num_parameters", 0),
                           f"{arch}.context_length": getattr(info, "max_context", 0)},
            "capabilities": ["completion", *(["tools"] if tools else [])]}


def now() -> str:
    """Ollama's ``created_at``."""
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


def durations(prompt: int, completion: int, seconds: float,
              stats: GenerationStats | None) -> tuple[float, float]:
    """Seconds of ``seconds`` spent reading the ``prompt`` tokens evaluated and
    generating the ``completion``: each count over the engine's rate, so a client's
    count / duration is the rate the engine measured. Without a decode rate (an
    answer of one token) the time after the reading is generating; without
    timings at all, the whole request."""
    if stats is None:
        return 0.0, seconds
    reading = (prompt / stats.prefill_tps if stats.prefill_tps
               else stats.time_to_first_token or 0.0)
    reading = min(reading, seconds)
    generating = completion / stats.decode_tps if stats.decode_tps else seconds - reading
    return reading, max(0.0, min(generating, seconds - reading))


def final_line(model: str, finish: str, prompt: int, completion: int, seconds: float,
               stats: GenerationStats | None, *, chat: bool) -> dict:
    """The last NDJSON line (``done: true``) with Ollama's counts and durations (in
    nanoseconds); the model was loaded before the request, so none went to loading."""
    reading, generating = durations(prompt, completion, seconds, stats)
    line: dict = {"model": model, "created_at": now(), "done": True,
                  "done_reason": "length" if finish == "length" else "stop",
                  "total_duration": _nanos(seconds), "load_duration": 0,
                  "prompt_eval_count": prompt, "prompt_eval_duration": _nanos(reading),
                  "eval_count": completion, "eval_duration": _nanos(generating)}
    if chat:
        line["message"] = {"role": "assistant", "content": ""}
    else:
        line["response"] = ""
    return line


def _nanos(seconds: float) -> int:
    return int(seconds * 1e9)
