"""Speculative decoding through the local server: streamed, cancelled, refused when unknown."""

from __future__ import annotations

import openai
import pytest

from engine.session.sampling import AnswerStream
from tests.engine.server.conftest import Served
from tests.engine.tinymodels import CORPUS

SPECULATIVE = {"speculative": "lookup"}
REPEAT = [{"role": "user", "content": CORPUS + "\nRepeat the text above."}]


def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=served.key, max_retries=0)


@pytest.fixture
def verifications(monkeypatch: pytest.MonkeyPatch, always_draft: None) -> list[int]:
    """How many tokens each verification pass proposed (the server runs in this process)."""
    drafted: list[int] = []
    verify = AnswerStream._verify

    def counting(self, pending, draft):
        drafted.append(len(draft))
        return verify(self, pending, draft)

    monkeypatch.setattr(AnswerStream, "_verify", counting)
    return drafted


def test_streamed_speculative_answer_matches_the_whole_one(served: Served,
                                                           verifications: list[int]) -> None:
    api = client(served)
    whole = api.chat.completions.create(model="m", messages=REPEAT, max_tokens=24,
                                        temperature=0, extra_body=SPECULATIVE)
    assert sum(verifications) > 0  # drafts were proposed and verified
    stream = api.chat.completions.create(
        model="m", messages=REPEAT, max_tokens=24, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body=SPECULATIVE)
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_cancelled_speculative_stream_then_good_request(served: Served,
                                                        verifications: list[int]) -> None:
    api = client(served)
    stream = api.chat.completions.create(model="m", messages=REPEAT, max_tokens=400,
                                         temperature=0, stream=True, extra_body=SPECULATIVE)
    for _ in zip(range(3), stream, strict=False):
        pass
    stream.close()
    assert verifications
    reply = api.chat.completions.create(model="m", messages=REPEAT, max_tokens=6,
                                        temperature=0, extra_body=SPECULATIVE)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 6


def test_unknown_speculative_mode_is_400(served: Served) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client(served).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}],
            extra_body={"speculative": "fast"})
    assert raised.value.body["param"] == "speculative"
    assert "lookup" in raised.value.body["message"]
