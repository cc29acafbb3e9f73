"""A hybrid model (tiny qwen3_next: linear attention + full attention) behind the server:
a resent conversation with one more turn prefills only the new turn."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest

from tests.engine.server.conftest import Served, start_server
from tests.engine.tinymodels import make_tiny_model_dir


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("hybrid-server")
    running, stop = start_server(make_tiny_model_dir(root, "qwen3_next"), root / "kv")
    yield running
    stop()


def test_hybrid_resent_conversation_prefills_only_the_new_turn(hybrid: Served) -> None:
    api = openai.OpenAI(base_url=hybrid.url + "/v1", api_key=hybrid.key, max_retries=0)
    messages = [{"role": "system", "content": "Answer briefly. " * 20},
                {"role": "user", "content": "Here is a long text: " + "the river bends " * 60}]
    first = api.chat.completions.create(model="m", messages=messages, max_tokens=4,
                                        temperature=0)
    resent = [*messages, {"role": "assistant", "content": first.choices[0].message.content},
              {"role": "user", "content": "And then?"}]
    again = api.chat.completions.create(model="m", messages=resent, max_tokens=4,
                                        temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert again.usage.prompt_tokens > first.usage.prompt_tokens
    assert cached >= 0.95 * again.usage.prompt_tokens, (cached, again.usage)
