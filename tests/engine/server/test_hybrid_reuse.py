"""A hybrid model (tiny qwen3_next: linear attention + full attention) behind the server:
a resent conversation with one more turn reads only the new turn."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from mlx_lm.utils import load_tokenizer

from engine.session import sampling
from engine.session.prompt_ids import common_prefix
from tests.engine.server.conftest import Served, start_server
from tests.engine.server.tool_models import scripted_processors
from tests.engine.tinymodels import make_tiny_model_dir


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("server-hybrid")
    running, stop = start_server(make_tiny_model_dir(root, "qwen3_next"), root / "kv")
    yield running
    stop()


def test_resent_hybrid_conversation_prefills_only_the_new_turn(hybrid: Served) -> None:
    api = openai.OpenAI(base_url=hybrid.url + "/v1", api_key=hybrid.key, max_retries=0)
    messages = [{"role": "system", "content": "Be brief. " * 40},
                {"role": "user", "content": "Summarize this: " + "a long text " * 60}]
    first = api.chat.completions.create(model="m", messages=messages, max_tokens=4,
                                        temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "Shorter?"}]
    again = api.chat.completions.create(model="m", messages=messages, max_tokens=4,
                                        temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    # Everything of the first prompt but the token the answer was generated from
    # comes back from the linear-attention checkpoint and the pages.
    assert cached >= first.usage.prompt_tokens - 1
    assert again.usage.prompt_tokens - cached <= again.usage.prompt_tokens - \
        first.usage.prompt_tokens + 1
    assert cached >= 0.95 * again.usage.prompt_tokens


def test_resent_hybrid_answer_is_not_read_again(hybrid: Served,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that sends the answer back as it came reads only its new turn: the
    linear-attention state after the answer continues, no checkpoint before it."""
    tokenizer = load_tokenizer(Path(hybrid.bridge.info.path))
    answer = "It scales its input and adds one."
    monkeypatch.setattr(sampling, "build_logits_processors",
                        scripted_processors(tokenizer, answer))
    api = openai.OpenAI(base_url=hybrid.url + "/v1", api_key=hybrid.key, max_retries=0)
    messages = [{"role": "system", "content": "Answer in one line. " * 30},
                {"role": "user", "content": "What does it do? " + "def f(x): return x " * 40}]
    first = api.chat.completions.create(model="m", messages=messages, max_tokens=40,
                                        temperature=0)
    assert first.choices[0].message.content == answer
    assert first.choices[0].finish_reason == "stop"
    generated = list(tokenizer.encode(answer, add_special_tokens=False))
    held = hybrid.bridge.render(messages) + generated + [tokenizer.eos_token_id]
    messages += [{"role": "assistant", "content": answer},
                 {"role": "user", "content": "And f(2)?"}]
    resent = hybrid.bridge.render(messages)
    shared = common_prefix(held, resent)
    # The answer's tokens come back from the template as they were generated.
    assert shared == len(held)
    again = api.chat.completions.create(model="m", messages=messages, max_tokens=40,
                                        temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert again.usage.prompt_tokens == len(resent)
    # Only the new turn is read: at most the end-of-turn token is read again.
    assert shared - 1 <= cached < len(resent)
