"""A tiny model folder with a tool-aware (Qwen2.5 / Hermes-style) chat template, and a
logits double that forces the model to write a scripted answer."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx

from tests.engine.tinymodels import make_tiny_model_dir

# Qwen2.5's tool template, cut to what these tests render: the tools listed in
# the system turn, calls as <tool_call> JSON, results as <tool_response> turns.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n\n{% endif %}"
    "# Tools\n\nYou are provided with function signatures within <tools></tools> XML tags:\n"
    "<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% elif messages[0]['role'] == 'system' %}<|im_start|>system\n"
    "{{ messages[0]['content'] }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}\n{% endif %}"
    "{% for tool_call in message.tool_calls %}"
    "{% if tool_call.function is defined %}{% set tool_call = tool_call.function %}{% endif %}"
    '<tool_call>\n{"name": "{{ tool_call.name }}", "arguments": '
    "{{ tool_call.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n"
    "{{ message.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Mistral-7B-Instruct-v0.3's tool template, cut to its calls and results: mlx-lm
# reads "[TOOL_CALLS]" in it and picks its mistral parser; the id checks are its own.
MISTRAL_TEMPLATE = (
    "{{- bos_token }}{%- for message in messages %}"
    "{%- if message['role'] == 'user' %}{{- '[INST] ' + message['content'] + '[/INST]' }}"
    "{%- elif message.tool_calls is defined and message.tool_calls is not none %}"
    "{{- '[TOOL_CALLS] [' }}{%- for tool_call in message.tool_calls %}"
    "{%- set out = tool_call.function|tojson %}{{- out[:-1] }}"
    "{%- if not tool_call.id is defined or tool_call.id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}{{- ', \"id\": \"' + tool_call.id + '\"}' }}"
    "{%- if not loop.last %}{{- ', ' }}{%- else %}{{- ']' + eos_token }}{%- endif %}"
    "{%- endfor %}"
    "{%- elif message['role'] == 'assistant' %}{{- ' ' + message['content']|trim + eos_token}}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '[TOOL_RESULTS] {\"content\": ' + message.content|string + ', ' }}"
    "{%- if not message.tool_call_id is defined or message.tool_call_id|length != 9 %}"
    "{{- raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}"
    "{%- endif %}{{- '\"call_id\": \"' + message.tool_call_id + '\"}[/TOOL_RESULTS]' }}"
    "{%- else %}{{- raise_exception('Only user and assistant roles are supported, with "
    "the exception of an initial optional system message!') }}"
    "{%- endif %}{%- endfor %}"
)
# A template with a rule of its own: a message that says "refuse me" is refused.
REFUSING_TEMPLATE = (
    "{% for message in messages %}{% if message.content == 'refuse me' %}"
    "{{ raise_exception('This template refuses that message.') }}{% endif %}{% endfor %}"
    + TOOL_TEMPLATE
)


# An agent CLI's system prompt and tools run to tens of thousands of tokens, and its
# answers are scripted (``Turns``): the tests are about the protocol, so its model
# attends with one layer of two heads sharing one KV head: on a CPU a 35k-token
# read then takes about a tenth of the time it takes with the tiny llama's two
# layers of four, and nothing these tests check depends on the model.
AGENT_MODEL: dict[str, Any] = {"num_hidden_layers": 1, "num_attention_heads": 2,
                               "num_key_value_heads": 1}


def make_tool_model_dir(root: Path, **overrides: Any) -> Path:
    """A tiny llama folder whose tokenizer_config holds ``TOOL_TEMPLATE``.

    ``overrides`` replace ``config.json`` keys (e.g. a longer
    ``max_position_embeddings`` for an agent's long system prompt).
    """
    base = make_tiny_model_dir(root, "llama", **overrides)
    name = f"tiny-llama-tools-{base.name.rsplit('-', 1)[1]}" if overrides \
        else "tiny-llama-tools"
    return make_templated_model_dir(root, name, TOOL_TEMPLATE, **overrides)


def make_templated_model_dir(root: Path, name: str, template: str,
                             **overrides: Any) -> Path:
    """A tiny llama folder ``root / name`` whose tokenizer_config holds ``template``."""
    base = make_tiny_model_dir(root, "llama", **overrides)
    folder = root / name
    if not folder.exists():
        shutil.copytree(base, folder)
        config_path = folder / "tokenizer_config.json"
        config = json.loads(config_path.read_text())
        config["chat_template"] = template
        config_path.write_text(json.dumps(config, indent=2))
    return folder


# How many of the prompt's last tokens mark where an answer starts.
ANCHOR = 4


def scripted_processors(tokenizer: Any, text: str) -> Callable[[Any], list[Callable]]:
    """A ``build_logits_processors`` double: every answer writes ``text``, then ends its turn.

    The token forced at each position follows from the tokens before it, as a
    model's would: the answer so far is what came after the prompt's last tokens.
    So a speculative verification judges its drafts as it would the model's, and
    the tokens still go through the engine's real sampler, decode loop,
    detokenizer and server.
    """
    script = list(tokenizer.encode(text, add_special_tokens=False))
    end = tokenizer.eos_token_id

    def build(_params: Any) -> list[Callable]:
        anchor: list[int] = []  # the prompt's last tokens, seen by the first call

        def force(history: mx.array, logits: mx.array) -> mx.array:
            seen = history.tolist()
            if not anchor:
                anchor.extend(seen[-ANCHOR:])
            written = _written(seen, anchor, script)
            token = script[written] if written is not None and written < len(script) else end
            return mx.where(mx.arange(logits.shape[-1])[None] == token, 0.0, -mx.inf)
        return [force]
    return build


def _written(seen: list[int], anchor: list[int], script: list[int]) -> int | None:
    """How much of ``script`` follows ``anchor`` in the tokens ``seen`` (None: not it).

    ``seen`` is the processors' window: it may have lost the prompt, or some of it.
    """
    for written in range(len(script) + 1):
        context = anchor + script[:written]
        shown = min(len(seen), len(context))
        if seen[len(seen) - shown:] == context[len(context) - shown:]:
            return written
    return None


class Turns:
    """Answers chosen per request: the first script for a conversation without a
    tool result, the second once a tool's result came back (as an agent's model
    would: call a tool, then answer from its result).

    ``install`` patches the bridge's ``submit`` to pick the script from the
    request's messages, and the sampler's processors to force it.
    """

    def __init__(self, tokenizer: Any, call: str, answer: str) -> None:
        self.tokenizer = tokenizer
        self.call, self.answer = call, answer
        self.current = call
        self.requests: list[list[dict]] = []

    def install(self, monkeypatch: Any, bridge_type: type) -> None:
        from engine.session import sampling

        original = bridge_type.submit

        def submit(bridge: Any, messages: list[dict], *args: Any, **kwargs: Any) -> Any:
            self.requests.append(messages)
            answered = any(m["role"] == "tool" for m in messages)
            self.current = self.answer if answered else self.call
            return original(bridge, messages, *args, **kwargs)

        monkeypatch.setattr(bridge_type, "submit", submit)
        monkeypatch.setattr(sampling, "build_logits_processors",
                            lambda params: scripted_processors(self.tokenizer,
                                                               self.current)(params))


def serve_templated(factory: Any, name: str, template: str) -> Iterator[Any]:
    """A module fixture's body: a server on a tiny llama whose chat template is
    ``template`` (``factory``: pytest's ``tmp_path_factory``); stopped after."""
    from tests.engine.server.conftest import start_server

    root = factory.mktemp(name)
    running, stop = start_server(make_templated_model_dir(root, name, template), root / "kv")
    yield running
    stop()


# Qwen3.5's way, cut down: calls in Qwen3-Coder's XML (mlx-lm reads
# "<tool_call>\n<function=" in it and picks its qwen3_coder parser), and a reply
# that opens a thought.
XML_THINKING_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for tool in tools %}\n"
    "{{ tool | tojson }}{% endfor %}\n</tools>\nCall a function so:\n<tool_call>\n"
    "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n"
    "</parameter>\n</function>\n</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}<|im_start|>{{ message.role }}\n"
    "{{ message.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
)


def make_tokenizer_dir(root: Path, name: str, template: str, added: tuple[str, ...] = (),
                       special: tuple[str, ...] = ()) -> Path:
    """A folder of the tiny tokenizer alone (no weights): ``template`` its chat
    template, ``added`` tokens of its own (as Qwen's ``<think>``) and ``special``
    ones (as a model whose call markers are special tokens)."""
    from tokenizers import AddedToken, Tokenizer

    base = make_templated_model_dir(root, f"{name}-base", template)
    folder = root / name
    folder.mkdir()
    for part in ("tokenizer_config.json", "config.json"):
        shutil.copy(base / part, folder / part)
    tokenizer = Tokenizer.from_str((base / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer.add_tokens([AddedToken(text, special=False) for text in added])
    tokenizer.add_special_tokens([AddedToken(text, special=True) for text in special])
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder
