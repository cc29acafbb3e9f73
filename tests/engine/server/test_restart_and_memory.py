"""The server's stored KV across a restart, and a prompt too big for memory refused
(507, before anything is allocated) with the server still answering."""

from __future__ import annotations

import dataclasses
import re
import time
from collections.abc import Callable

import anthropic
import httpx
import openai
import pytest

from engine.cache.modes import MODES
from engine.events import RankShare
from tests.engine.read_only import make_read_only
from tests.engine.server.conftest import Served, start_server
from tests.engine.server.test_openai_api import conversation
from tests.engine.tinymodels import make_tiny_model_dir


def test_a_resent_conversation_reuses_stored_kv_after_a_restart(tmp_path) -> None:
    folder, kv = make_tiny_model_dir(tmp_path, "llama"), tmp_path / "kv"
    running, stop = start_server(folder, kv)
    try:
        api = openai.OpenAI(base_url=running.url + "/v1", api_key=running.key, max_retries=0)
        first = api.chat.completions.create(model="m", messages=conversation(4),
                                            max_tokens=3, temperature=0)
        answer = first.choices[0].message.content
    finally:
        stop()  # the held session is stored as a snapshot on the way out
    assert any(kv.iterdir())
    running, stop = start_server(folder, kv)
    try:
        api = openai.OpenAI(base_url=running.url + "/v1", api_key=running.key, max_retries=0)
        resent = [*conversation(4), {"role": "assistant", "content": answer},
                  {"role": "user", "content": "One more thing?"}]
        again = api.chat.completions.create(model="m", messages=resent, max_tokens=3,
                                            temperature=0)
    finally:
        stop()
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.prompt_tokens - 1
    assert cached >= 0.95 * again.usage.prompt_tokens


def test_a_read_only_kv_folder_after_a_restart_answers_from_it(tmp_path, monkeypatch) -> None:
    folder, kv = make_tiny_model_dir(tmp_path, "llama"), tmp_path / "kv"
    running, stop = start_server(folder, kv)
    try:
        api = openai.OpenAI(base_url=running.url + "/v1", api_key=running.key, max_retries=0)
        first = api.chat.completions.create(model="m", messages=conversation(4),
                                            max_tokens=3, temperature=0)
    finally:
        stop()
    # The data folder is on a read-only disk now: reopening cannot stamp "last used",
    # and nothing new can be stored (was: a 500 on every request reusing it).
    make_read_only(kv, monkeypatch)
    running, stop = start_server(folder, kv)
    try:
        api = openai.OpenAI(base_url=running.url + "/v1", api_key=running.key, max_retries=0)
        again = api.chat.completions.create(model="m", messages=conversation(4),
                                            max_tokens=3, temperature=0)
    finally:
        stop()
    assert again.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens - 1


def _budget(served: Served, budget: int | None, fits: bool) -> None:
    """Set the KV budget and wait until the worker has published it."""
    served.bridge.worker.configure(budget_bytes=budget, chunk_size=512, read_share=0.5)
    deadline = time.monotonic() + 60
    while served.bridge.fit(2000).for_mode("fp16").fits != fits:
        assert time.monotonic() < deadline, "the budget was not applied"
        time.sleep(0.05)


def test_a_prompt_too_big_for_memory_is_507_before_any_allocation(served: Served) -> None:
    api = openai.OpenAI(base_url=served.url + "/v1", api_key=served.key, max_retries=0)
    # Room for a few hundred fp16 tokens of this tiny model's KV, not for 2,000.
    _budget(served, 2**19, fits=False)
    try:
        held = dict(served.bridge._sessions)
        big = [{"role": "user", "content": "word " * 1000}]
        reply = httpx.post(served.url + "/v1/chat/completions", timeout=120,
                           headers={"Authorization": f"Bearer {served.key}"},
                           json={"model": "m@fp16", "messages": big, "max_tokens": 2})
        assert reply.status_code == 507
        error = reply.json()["error"]
        assert error["code"] == "insufficient_memory" and "fit" in error["message"]
        claude = anthropic.Anthropic(base_url=served.url, api_key=served.key, max_retries=0)
        try:
            claude.messages.create(model="m@fp16", max_tokens=2, messages=big)
        except anthropic.APIStatusError as refused:
            # Anthropic's API has one answer for a prompt that does not fit, the one
            # Claude Code compacts on; M is what the memory holds.
            assert refused.status_code == 400
            assert refused.body["error"]["type"] == "invalid_request_error"
            found = re.fullmatch(r"prompt is too long: (\d+) tokens > (\d+) maximum",
                                 refused.body["error"]["message"])
            assert found and int(found[1]) > int(found[2])
            assert int(found[2]) + 1 == served.bridge.fit(int(found[1])).for_mode(
                "fp16").tokens_fit
        else:
            raise AssertionError("the Anthropic request was not refused")
        assert served.bridge._sessions == held  # no session opened for them
        small = api.chat.completions.create(
            model="m@fp16", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
        assert small.choices[0].finish_reason in ("stop", "length")
    finally:
        _budget(served, None, fits=True)
    assert httpx.get(served.url + "/health").status_code == 200


def test_a_prompt_another_machine_cannot_hold_is_507_naming_it(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    # A pipeline's report for a new conversation (as rank 0 builds it from every
    # follower's answer), here with rank 1 short of memory for this prompt.
    worker = served.bridge.worker
    plain = worker.fit_check

    def two_machines(session_id, token_count):
        report = plain(session_id, token_count)
        own = RankShare(0, "studio", (2, 4), 0, 0, 2**34, (4096,) * len(MODES))
        small = RankShare(1, "macbook-air", (0, 2), 0, 0, 2**30, (300,) * len(MODES))
        return dataclasses.replace(report, ranks=(own, small))

    monkeypatch.setattr(worker, "fit_check", two_machines)
    held = dict(served.bridge._sessions)
    reply = httpx.post(served.url + "/v1/chat/completions", timeout=120,
                       headers={"Authorization": f"Bearer {served.key}"},
                       json={"model": "m@q8", "max_tokens": 2,
                             "messages": [{"role": "user", "content": "word " * 400}]})
    assert reply.status_code == 507
    error = reply.json()["error"]
    assert error["code"] == "insufficient_memory"
    assert error["message"].startswith(
        "This won't fit in q8: rank 1 (macbook-air) holds only 300 tokens for its layers.")
    assert served.bridge._sessions == held
    short = openai.OpenAI(base_url=served.url + "/v1", api_key=served.key, max_retries=0)
    assert short.chat.completions.create(
        model="m@q8", messages=[{"role": "user", "content": "Hi"}],
        max_tokens=2).choices[0].finish_reason in ("stop", "length")


class _Squeeze:
    """The guard's check while work runs, turned critical after ``after`` checks."""

    def __init__(self, poll: Callable[[str | None], str | None], after: int) -> None:
        self.poll, self.left = poll, after

    def __call__(self, key: str | None) -> str | None:
        self.left -= 1
        return self.poll(key) if self.left >= 0 else "system memory is critically low"


def test_an_answer_memory_stopped_is_an_error_not_a_length_limit(served: Served) -> None:
    guard = served.bridge.worker.guard
    poll, interval = guard.poll, guard.check_interval
    story = [{"role": "user", "content": "Tell me a long story."}]
    api = openai.OpenAI(base_url=served.url + "/v1", api_key=served.key, max_retries=0)
    claude = anthropic.Anthropic(base_url=served.url, api_key=served.key, max_retries=0)
    said = r"stopped this answer after [1-9]"
    guard.check_interval = 0.0  # a check every step
    try:
        guard.poll = _Squeeze(poll, 8)  # type: ignore[method-assign]
        with pytest.raises(openai.APIStatusError, match=said) as whole:
            api.chat.completions.create(model="m@fp16", messages=story, max_tokens=400,
                                        temperature=0)
        assert whole.value.status_code == 507
        guard.poll = _Squeeze(poll, 8)  # type: ignore[method-assign]
        with pytest.raises(openai.APIError, match=said):
            for _ in api.chat.completions.create(model="m@fp16", messages=story,
                                                 max_tokens=400, temperature=0, stream=True):
                pass
        guard.poll = _Squeeze(poll, 8)  # type: ignore[method-assign]
        # Greedy, as the others: a sampled answer may end its turn before the squeeze.
        with pytest.raises(anthropic.APIError, match=said), claude.messages.stream(
                model="m@fp16", max_tokens=400, messages=story,
                extra_body={"temperature": 0}) as stream:
            stream.until_done()
    finally:
        guard.poll, guard.check_interval = poll, interval  # type: ignore[method-assign]
    small = api.chat.completions.create(model="m@fp16", max_tokens=2,
                                        messages=[{"role": "user", "content": "Hi"}])
    assert small.choices[0].finish_reason in ("stop", "length")
