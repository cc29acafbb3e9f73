"""``serve --pipeline 2``: the API over two local ring ranks, and its fallback to one.

One pipeline server per module (a group start costs tens of seconds on a busy
CPU); the test that kills a rank runs last, since it leaves the server on this
machine alone.
"""

from __future__ import annotations

import io
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from engine import cli
from engine.server.pipeline import PipelineBridge
from tests.engine.distributed.test_pipeline_cache import LAUNCH
from tests.engine.distributed.test_remote_worker import PROMPT, _rank_pids
from tests.engine.server.conftest import Served, health_of, start_server
from tests.engine.tinymodels import make_tiny_model_dir

pytestmark = pytest.mark.skipif(not LAUNCH.exists(), reason="mlx.launch is not installed")
MESSAGES = [{"role": "user", "content": PROMPT}]
BOUND = 10.0  # the bound for the error after a rank dies
FALLBACK_WAIT = 120.0


def _openai(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=served.key, max_retries=0)


def _greedy(served: Served) -> str:
    reply = _openai(served).chat.completions.create(
        model="m", messages=MESSAGES, temperature=0.0, max_tokens=6)
    return reply.choices[0].message.content


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("models"), "qwen3_next", endless=True)


@pytest.fixture(scope="module")
def expected(model: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The in-process server's greedy answer."""
    running, stop = start_server(model, tmp_path_factory.mktemp("alone") / "kv")
    try:
        return _greedy(running)
    finally:
        stop()


@pytest.fixture(scope="module")
def pipeline(model: Path, expected: str,
             tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    running, stop = start_server(model, tmp_path_factory.mktemp("pipeline") / "kv",
                                 bridge_type=PipelineBridge, ranks=2, parallel=2)
    stopped = []

    def stop_once() -> None:
        if not stopped:
            stopped.append(True)
            stop()
    running.stop = stop_once  # the test that falls back stops it: its engine is new
    yield running
    stop_once()


def test_a_pipeline_server_answers_as_one_machine_and_says_where_it_runs(
        pipeline: Served, expected: str) -> None:
    assert health_of(pipeline).json()["machines"] == 2
    listed = _openai(pipeline).models.list().data
    assert [entry.model_extra["machines"] for entry in listed] == [2]

    stream = _openai(pipeline).chat.completions.create(
        model="m", messages=MESSAGES, temperature=0.0, max_tokens=6, stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == expected

    reply = anthropic.Anthropic(base_url=pipeline.url, api_key=pipeline.key,
                                max_retries=0).messages.create(
        model="m", messages=MESSAGES, max_tokens=6, extra_body={"temperature": 0.0})
    assert reply.content[0].text == expected

    # A client that leaves mid-answer cancels it on every rank: the next answer
    # does not wait behind a long one.
    stream = _openai(pipeline).chat.completions.create(
        model="m", messages=MESSAGES, temperature=0.0, max_tokens=100000, stream=True)
    chunks = iter(stream)
    while not next(chunks).choices[0].delta.content:
        pass
    stream.close()
    assert _openai(pipeline).with_options(timeout=120).chat.completions.create(
        model="m", messages=MESSAGES, temperature=0.0,
        max_tokens=6).choices[0].message.content == expected

    with pytest.raises(openai.BadRequestError, match="not available over a pipeline"):
        _openai(pipeline).chat.completions.create(
            model="m", messages=MESSAGES, max_tokens=6, extra_body={"speculative": "lookup"})


def test_requests_sent_together_decode_together_over_the_pipeline(
        pipeline: Served, expected: str) -> None:
    # The answer the test before cancelled ends once the server sees its client
    # gone (it polls for that), which may be after the answer that test read last.
    deadline = time.monotonic() + 60
    health = health_of(pipeline).json()
    while health["streams"]["decoding"] and time.monotonic() < deadline:
        time.sleep(0.05)
        health = health_of(pipeline).json()
    assert health["streams"]["parallel"] == 2 and health["streams"]["decoding"] == 0
    streams = [_openai(pipeline).chat.completions.create(
        model="m", messages=MESSAGES, temperature=0.0, max_tokens=100000, stream=True)
        for _ in range(2)]
    seen, deadline = 0, time.monotonic() + 120
    while seen < 2 and time.monotonic() < deadline:
        seen = max(seen, health_of(pipeline).json()["streams"]["decoding"])
        time.sleep(0.05)
    for stream in streams:  # both leave mid-answer: each is cancelled on every rank
        stream.close()
    assert seen == 2
    # The ranks still agree: the next answer is one machine's.
    assert _openai(pipeline).with_options(timeout=120).chat.completions.create(
        model="m", messages=MESSAGES, temperature=0.0,
        max_tokens=6).choices[0].message.content == expected


def test_a_lost_rank_ends_the_answer_naming_it_and_the_server_goes_on_alone(
        pipeline: Served, expected: str) -> None:
    stream = _openai(pipeline).chat.completions.create(
        model="m", messages=MESSAGES, temperature=0.0, max_tokens=100000, stream=True)
    chunks = iter(stream)
    while not next(chunks).choices[0].delta.content:  # the answer has begun
        pass
    os.kill(_rank_pids()[1], signal.SIGKILL)
    killed = time.monotonic()
    with pytest.raises(openai.APIError) as failed:
        for _ in chunks:
            pass
    took = time.monotonic() - killed
    assert took <= BOUND, f"the error came {took:.1f} s after the kill"
    assert "rank 1 (this machine)" in str(failed.value), failed.value
    assert "Restart the server" in str(failed.value)

    deadline = time.monotonic() + FALLBACK_WAIT
    while httpx.get(pipeline.url + "/health").status_code != 200:
        assert time.monotonic() < deadline, pipeline.bridge.load_error
        time.sleep(0.2)
    health = health_of(pipeline).json()
    assert health["machines"] == 1 and health["streams"]["parallel"] == 2  # as asked
    assert _greedy(pipeline) == expected
    pipeline.stop()


@pytest.mark.slow
def test_a_hostfile_of_this_machine_twice_serves_the_same_answer(
        model: Path, expected: str, tmp_path: Path) -> None:
    """``serve --hostfile FILE``: mlx.launch's hostfile path, rank 0 on 127.0.0.1."""
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps({"backend": "ring", "hosts": [
        {"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}] * 2}), encoding="utf-8")
    running, stop = start_server(model, tmp_path / "kv", bridge_type=PipelineBridge,
                                 hostfile=hostfile)
    try:
        assert health_of(running).json()["machines"] == 2
        assert _greedy(running) == expected
    finally:
        stop()


def test_serving_a_model_mlx_lm_cannot_split_is_refused_before_any_rank_starts(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    started = []
    monkeypatch.setattr("engine.server.pipeline.RemoteWorker",
                        lambda *a, **k: started.append(a))
    monkeypatch.setattr("engine.server.serve.uvicorn_server",
                        lambda *a, **k: started.append(a))
    assert cli.main(["serve", "--model", "demo", "--pipeline", "2"], io.StringIO()) == 1
    error = capsys.readouterr().err
    assert "cannot be split across machines" in error and "llama" in error
    assert started == []
