"""A hybrid model (tiny qwen3_next: linear attention + full attention) behind the server:
a resent conversation with one more turn reads only the new turn."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.engine.server.conftest import Served, start_server
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
