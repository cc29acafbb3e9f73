"""Every field of each API's request schema, as the official clients define it, is
listed by the server as honoured, accepted (no effect here, and why) or refused; a
refused value is a 400 naming the field, and an honoured or accepted one is read.

The schemas come from the installed SDKs, so a field a new SDK adds fails here
until the server says what it does with it.
"""

from __future__ import annotations

from collections.abc import Callable

import ollama._types as ollama_types
import pytest
from anthropic.types import message_count_tokens_params, message_create_params
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_params
from openai.types.responses import response_create_params

from engine.server import fields, ollama, protocol, responses
from engine.server.errors import BadRequest
from engine.server.fields import Field

USER = [{"role": "user", "content": "Hello"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SCHEMA = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}


def _read(reader: Callable[[dict], object], base: dict) -> Callable[[dict], object]:
    return lambda extra: reader({**base, **extra})


def _ollama_options(extra: dict) -> object:
    return ollama.chat_request({"model": "m", "messages": USER, "options": extra}, 4096)


# Per API: its schema's fields, the server's table, a reader of a body, and sample
# values: an ordinary one for fields honoured or accepted, one it refuses otherwise.
APIS = {
    "chat": (chat_params.CompletionCreateParamsStreaming.__annotations__, fields.CHAT,
             _read(lambda b: protocol.openai_chat(b, 16), {"messages": USER})),
    "completions": (completion_create_params.CompletionCreateParamsStreaming.__annotations__,
                    fields.COMPLETIONS,
                    _read(lambda b: protocol.openai_completion(b, 16), {"prompt": "Hi"})),
    "messages": (message_create_params.MessageCreateParamsStreaming.__annotations__,
                 fields.MESSAGES,
                 _read(protocol.anthropic_messages, {"max_tokens": 5, "messages": USER})),
    "count_tokens": (message_count_tokens_params.MessageCountTokensParams.__annotations__,
                     fields.COUNT_TOKENS,
                     _read(lambda b: protocol.anthropic_messages(b, counting=True),
                           {"messages": USER})),
    "responses": (response_create_params.ResponseCreateParamsStreaming.__annotations__,
                  responses.FIELDS, _read(responses.read, {"input": "Hi"})),
    "ollama chat": (ollama_types.ChatRequest.model_fields, ollama.CHAT,
                    _read(lambda b: ollama.chat_request(b, 4096),
                          {"model": "m", "messages": USER})),
    "ollama generate": (ollama_types.GenerateRequest.model_fields, ollama.GENERATE,
                        _read(lambda b: ollama.generate_request(b, 4096),
                              {"model": "m", "prompt": "Hi"})),
    "ollama options": (ollama_types.Options.model_fields, ollama.OPTIONS, _ollama_options),
}

ORDINARY = {
    "messages": USER, "model": "demo", "max_tokens": 8, "max_completion_tokens": 8,
    "max_output_tokens": 8, "temperature": 0.5, "top_p": 0.9, "top_k": 5, "seed": 3,
    "stop": ["x"], "stop_sequences": ["x"], "stream": True,
    "stream_options": {"include_usage": True}, "tools": [TOOL], "tool_choice": "auto",
    "parallel_tool_calls": False, "logprobs": True, "top_logprobs": 2,
    "logit_bias": {"5": 1.0}, "presence_penalty": 0.5, "frequency_penalty": 0.5,
    "metadata": {"k": "v"}, "user": "u", "safety_identifier": "s", "moderation": None,
    "service_tier": "auto", "prompt_cache_key": "k", "prompt_cache_options": None,
    "prompt_cache_retention": "24h", "reasoning_effort": "low", "verbosity": "low",
    "prompt": "Hi", "echo": True, "system": "Be brief.", "thinking": {"type": "adaptive"},
    "cache_control": {"type": "ephemeral"}, "speed": "standard", "user_profile_id": "p",
    "workspace_id": "w", "inference_geo": "us", "diagnostics": None,
    "input": "Hi", "instructions": "Be brief.", "max_tool_calls": 2, "reasoning": {
        "effort": "low"}, "access_programs": None, "keep_alive": "5m", "think": False,
    "options": {"temperature": 0}, "raw": True, "num_ctx": 2048, "num_predict": 8,
    "repeat_penalty": 1.1, "min_p": 0.05, "numa": False, "num_batch": 512, "num_gpu": 1,
    "main_gpu": 0, "low_vram": False, "use_mmap": True, "use_mlock": False,
    "num_thread": 4, "f16_kv": True, "num_keep": 4, "response_format": SCHEMA,
    "output_config": {"effort": "low", "format": {"type": "json_schema",
                                                  "schema": {"type": "object"}}},
    "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}},
    "format": "json",
}
REFUSED = {
    "n": 2, "best_of": 2, "response_format": {"type": "json_object"}, "audio": {"voice": "x"},
    "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"},
    "web_search_options": {}, "functions": [{"name": "f"}], "function_call": "auto",
    "store": True, "suffix": "tail", "output_config": {"format": SCHEMA},
    "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]},
    "container": "c", "mcp_servers": [{"url": "x"}], "previous_response_id": "r",
    "conversation": "c", "background": True, "background_options": {}, "include": [
        "message.output_text.logprobs"], "text": {"format": SCHEMA}, "truncation": "auto",
    "top_logprobs": 2, "prompt": {"id": "p"}, "image": {}, "format": "json",
    "logprobs": True, "template": "{{ .Prompt }}", "context": [1, 2], "images": ["x"],
    "width": 64, "height": 64, "steps": 4, "repeat_last_n": 32, "mirostat": 2,
    "mirostat_tau": 5.0, "mirostat_eta": 0.1, "tfs_z": 0.5, "typical_p": 0.5,
    "penalize_newline": False, "logits_all": True, "vocab_only": True,
    "embedding_only": True,
}


# Values whose shape differs between the APIs.
ANTHROPIC_TOOL = {"name": "f", "input_schema": {"type": "object"}}
PER_API = {
    ("messages", "tools"): [ANTHROPIC_TOOL], ("count_tokens", "tools"): [ANTHROPIC_TOOL],
    ("messages", "tool_choice"): {"type": "auto"},
    ("count_tokens", "tool_choice"): {"type": "auto"},
    ("responses", "tools"): [{"type": "function", "name": "f", "parameters": {}}],
    ("chat", "logprobs"): True, ("completions", "logprobs"): 2,
}
HARMLESS = {"n": 1, "best_of": 1, "store": False, "suffix": "", "background": False,
            "truncation": "disabled", "top_logprobs": 0, "format": "", "logprobs": False,
            "template": "", "context": [], "images": [], "repeat_last_n": 64, "mirostat": 0,
            "tfs_z": 1, "typical_p": 1, "penalize_newline": True, "vocab_only": False,
            "embedding_only": False, "response_format": {"type": "text"},
            "modalities": ["text"], "output_config": {"effort": "low"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015"}]},
            "mcp_servers": [], "include": ["reasoning.encrypted_content"],
            "text": {"format": {"type": "text"}}}
HARMLESS_PER_API = {("responses", "context_management"): []}
# Ollama's options whose values matter only beside another option: refused there.
REFUSED_BESIDE = {"repeat_last_n": {"repeat_penalty": 1.1},
                  "penalize_newline": {"repeat_penalty": 1.1},
                  "mirostat_tau": {"mirostat": 2}, "mirostat_eta": {"mirostat": 2}}


def _cases() -> list[tuple[str, str, Field]]:
    return [(api, name, table[name]) for api, (schema, table, _) in APIS.items()
            for name in sorted(schema) if name in table]


@pytest.mark.parametrize("api", list(APIS))
def test_every_schema_field_is_listed(api: str) -> None:
    schema, table, _ = APIS[api]
    assert sorted(set(schema) - set(table)) == []
    for name in schema:
        assert table[name].kind in (fields.HONOURED, fields.ACCEPTED, fields.REFUSED)
        assert table[name].note


@pytest.mark.parametrize(("api", "name", "field"), _cases(),
                         ids=[f"{api}.{name}" for api, name, _ in _cases()])
def test_each_field_is_read_or_refused_by_name(api: str, name: str, field: Field) -> None:
    read = APIS[api][2]
    if field.kind == fields.REFUSED:
        with pytest.raises(BadRequest) as raised:
            read({name: REFUSED[name], **REFUSED_BESIDE.get(name, {})})
        assert raised.value.param is not None and name in raised.value.param
        if field.allows is not None:  # its harmless values are read
            read({name: HARMLESS_PER_API.get((api, name), HARMLESS[name])})
        return
    if api == "chat" and name == "top_logprobs":
        read({"logprobs": True, name: ORDINARY[name]})
        return
    read({name: PER_API.get((api, name), ORDINARY[name])})
