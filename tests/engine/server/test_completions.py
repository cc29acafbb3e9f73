"""``POST /v1/completions`` (plain text, as editors' autocompletion uses it) through the
official ``openai`` SDK, against a live server."""

from __future__ import annotations

from pathlib import Path

import openai
import pytest
from mlx_lm.utils import load_tokenizer

from engine.session import sampling
from tests.engine.server.conftest import Served
from tests.engine.server.tool_models import scripted_processors

PROMPT = "def attention(queries, keys, values, scale):\n    scores = "


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=served.key, max_retries=0)


def test_completion_reads_the_prompt_as_plain_text(served: Served) -> None:
    reply = client(served).completions.create(model="m", prompt=PROMPT, max_tokens=6,
                                              temperature=0)
    choice = reply.choices[0]
    assert reply.object == "text_completion" and reply.model == served.bridge.model_id
    assert choice.finish_reason in ("stop", "length")
    assert 0 < reply.usage.completion_tokens <= 6
    tokenizer = load_tokenizer(Path(served.bridge.info.path))
    # No chat template around it: exactly the prompt's own tokens.
    assert reply.usage.prompt_tokens == len(tokenizer.encode(PROMPT))


def test_streamed_matches_not_streamed_and_echo(served: Served) -> None:
    api = client(served)
    whole = api.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0)
    chunks = list(api.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0,
                                         stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == \
        whole.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    echoed = api.completions.create(model="m", prompt=PROMPT, max_tokens=8, temperature=0,
                                    echo=True)
    assert echoed.choices[0].text == PROMPT + whole.choices[0].text


def test_a_longer_prompt_reads_the_cache(served: Served) -> None:
    api = client(served)
    code = "".join(f"def f{i}(x):\n    return x * {i} + 1\n" for i in range(30))
    first = api.completions.create(model="m", prompt=code, max_tokens=2, temperature=0)
    again = api.completions.create(model="m", prompt=code + "def g(x):\n    return ",
                                   max_tokens=2, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 2
    assert cached >= 0.95 * again.usage.prompt_tokens


def test_stop_and_unknown_fields(served: Served) -> None:
    api = client(served)
    free = api.completions.create(model="m", prompt=PROMPT, max_tokens=12,
                                  temperature=0).choices[0].text
    assert len(free) > 3
    stop = free[2:4]
    cut = api.completions.create(model="m", prompt=PROMPT, max_tokens=12, temperature=0,
                                 stop=stop, user="someone", extra_body={"suffix_whatever": 1})
    assert cut.choices[0].text == free[:free.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("body, param", [
    ({"prompt": ""}, "prompt"),
    ({"prompt": [1, 2, 3]}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": "x", "n": 2}, "n"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ({"prompt": "x", "echo": "yes"}, "echo"),
    ({"prompt": "word " * 6000}, "prompt"),
])
def test_bad_completions_are_400(served: Served, body: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client(served).completions.create(model="m", **body)
    assert raised.value.body["param"] == param


@pytest.fixture
def forced(served: Served, monkeypatch: pytest.MonkeyPatch):
    """Make every answer write ``text`` (then end its turn)."""
    tokenizer = load_tokenizer(Path(served.bridge.info.path))

    def force(text: str) -> None:
        monkeypatch.setattr(sampling, "build_logits_processors",
                            scripted_processors(tokenizer, text))
    return force


@pytest.mark.parametrize("stream", [False, True])
def test_a_continuation_keeps_its_first_space(served: Served, forced, stream: bool) -> None:
    forced(" Paris.")
    reply = client(served).completions.create(model="m", prompt="The capital of France is",
                                              max_tokens=8, temperature=0, stream=stream)
    chunks = list(reply) if stream else [reply]
    assert "".join(c.choices[0].text for c in chunks if c.choices) == " Paris."


def test_a_cut_inside_a_character_never_ends_with_a_replacement(served: Served,
                                                                forced) -> None:
    tokenizer = load_tokenizer(Path(served.bridge.info.path))
    forced("Trees 🌲")
    ids = tokenizer.encode("Trees 🌲", add_special_tokens=False)
    cut = next(n for n in range(len(ids), 0, -1)
               if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    for stream in (False, True):
        reply = client(served).completions.create(model="m", prompt="Name it:",
                                                  max_tokens=cut, temperature=0,
                                                  stream=stream)
        chunks = list(reply) if stream else [reply]
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        assert text == "Trees " and chunks[-1].choices[0].finish_reason == "length"


def test_logprobs_of_a_completion(served: Served) -> None:
    api = client(served)
    reply = api.completions.create(model="m", prompt=PROMPT, max_tokens=6, temperature=0,
                                   logprobs=2)
    scores = reply.choices[0].logprobs
    assert "".join(scores.tokens) == reply.choices[0].text
    assert len(scores.token_logprobs) == len(scores.tokens) == reply.usage.completion_tokens
    for token, logprob, top in zip(scores.tokens, scores.token_logprobs, scores.top_logprobs,
                                   strict=True):
        assert logprob <= 0 and len(top) <= 2
        assert top[token] == pytest.approx(logprob)  # greedy: the most likely one
        assert logprob == pytest.approx(max(top.values()))
    assert scores.text_offset[0] == 0
    streamed = list(api.completions.create(model="m", prompt=PROMPT, max_tokens=6,
                                           temperature=0, logprobs=2, stream=True))
    tokens = [t for c in streamed if c.choices and c.choices[0].logprobs
              for t in c.choices[0].logprobs.tokens]
    assert tokens == scores.tokens


def test_logprobs_of_tokens_holding_part_of_a_character(served: Served, forced) -> None:
    text = "héllo 日本語 ok"
    forced(text)
    api = client(served)
    completion = api.completions.create(model="m", prompt="Say it:", max_tokens=40,
                                        temperature=0, logprobs=0)
    choice = completion.choices[0]
    assert choice.text == text
    # Each token starts where its first character does, split characters included.
    tokenizer = load_tokenizer(Path(served.bridge.info.path))
    ids = tokenizer.encode(text, add_special_tokens=False)
    starts = [len(tokenizer.decode(ids[:n]).rstrip("\ufffd")) for n in range(len(ids))]
    assert "\ufffd" in "".join(choice.logprobs.tokens)  # the text splits characters
    assert choice.logprobs.text_offset == starts
    chat = api.chat.completions.create(model="m", messages=[{"role": "user", "content": "?"}],
                                       max_tokens=40, temperature=0, logprobs=True,
                                       top_logprobs=1)
    scored = chat.choices[0].logprobs.content
    assert bytes(b for token in scored for b in token.bytes).decode("utf-8") == text
    assert all(token.top_logprobs[0].bytes == token.bytes for token in scored)  # greedy


def test_a_continued_assistant_message_keeps_its_first_space(served: Served, forced) -> None:
    """The app's Continue and Anthropic's prefill: the answer goes on after the text."""
    forced(" Paris.")
    messages = [{"role": "user", "content": "Capital of France?"},
                {"role": "assistant", "content": "The capital of France is"}]
    chat = openai.OpenAI(base_url=served.url + "/v1", api_key=served.key, max_retries=0)
    reply = chat.chat.completions.create(model="m", messages=messages, max_tokens=8,
                                         temperature=0)
    assert reply.choices[0].message.content == " Paris."
