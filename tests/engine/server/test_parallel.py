"""Requests sent together answer together, up to ``parallel``; the queue limit beyond."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from sse_starlette.sse import AppStatus

from tests.engine.server.conftest import Served, health_of, start_server
from tests.engine.tinymodels import make_tiny_model_dir

ASKED = {"a": "Tell me about the quick brown fox and the lazy dog.",
         "b": "What is the capital of France, and why is it there?",
         "c": "Count the colours of the rainbow, one by one please."}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Never ends its turn by itself, and writes a token a chunk: streams overlap.
    return make_tiny_model_dir(tmp_path_factory.mktemp("parallel"), "llama", endless=True,
                               seed=1)


@pytest.fixture
def serve(folder: Path, tmp_path: Path) -> Iterator:
    stops = []

    def start(**bridge_args) -> Served:
        running, stop = start_server(folder, tmp_path / "kv", **bridge_args)
        stops.append(stop)
        return running
    yield start
    for stop in stops:
        stop()


def _client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=served.key, max_retries=0)


def _stream(served: Served, name: str, max_tokens: int, arrivals: list[tuple[str, str]],
            results: dict[str, object]) -> None:
    """Stream one answer, noting each content chunk's arrival in ``arrivals``."""
    try:
        stream = _client(served).chat.completions.create(
            model="m", messages=[{"role": "user", "content": ASKED[name]}],
            max_tokens=max_tokens, temperature=0, stream=True)
        text = ""
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                arrivals.append((name, "token"))
        arrivals.append((name, "end"))
        results[name] = text
    except openai.RateLimitError as error:
        results[name] = error.status_code
    except openai.APIError as error:  # kept, so a failure says what came back
        results[name] = repr(error)


def _together(served: Served, names: str, max_tokens: int
              ) -> tuple[list[tuple[str, str]], dict[str, object]]:
    arrivals: list[tuple[str, str]] = []
    results: dict[str, object] = {}
    threads = [threading.Thread(target=_stream, args=(served, name, max_tokens, arrivals,
                                                      results)) for name in names]
    for sent, thread in enumerate(threads, 1):
        thread.start()
        # In this order: the next one is sent once the server holds this one (or
        # has answered it, a 429), whatever the machine's load.
        deadline = time.monotonic() + 120
        while thread.is_alive() and _in_flight(served) < sent and time.monotonic() < deadline:
            time.sleep(0.01)
    for thread in threads:
        thread.join(300)
    return arrivals, results


def _in_flight(served: Served) -> int:
    return int(health_of(served).json()["streams"]["in_flight"])


def _alone(served: Served, name: str, max_tokens: int) -> str:
    reply = _client(served).chat.completions.create(
        model="m", messages=[{"role": "user", "content": ASKED[name]}],
        max_tokens=max_tokens, temperature=0)
    return reply.choices[0].message.content or ""


def test_requests_sent_together_answer_together_and_as_alone(serve) -> None:
    served = serve(parallel=2, max_sessions=4)
    health = health_of(served).json()
    assert health["streams"] == {"decoding": 0, "reading": 0, "waiting_for_memory": 0,
                                 "parallel": 2, "in_flight": 0, "queue_limit": 16}
    alone = {name: _alone(served, name, 300) for name in "ab"}
    arrivals, results = _together(served, "ab", 300)
    assert results == alone
    # B's first token came while A still streamed, not after A's end.
    assert arrivals.index(("b", "token")) < arrivals.index(("a", "end"))


def test_health_counts_the_requests_decoding(serve) -> None:
    served = serve(parallel=2)
    arrivals: list[tuple[str, str]] = []
    results: dict[str, object] = {}
    threads = [threading.Thread(target=_stream, args=(served, name, 3000, arrivals, results))
               for name in "ab"]
    for thread in threads:
        thread.start()
    seen = 0
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and seen < 2 and len(results) < 2:
        seen = max(seen, health_of(served).json()["streams"]["decoding"])
    for thread in threads:
        thread.join(300)
    assert seen == 2, (seen, results)


def test_beyond_parallel_a_request_waits_and_beyond_the_queue_it_is_told_to_retry(
        serve) -> None:
    served = serve(parallel=1, queue_limit=1)  # one answers, one waits, one is told
    # Long enough that the first still answers when the third is sent.
    arrivals, results = _together(served, "abc", 1500)
    assert list(results.values()).count(429) == 1, results
    answered = [name for name in "abc" if isinstance(results[name], str)]
    assert len(answered) == 2
    first, second = answered
    # One at a time: the second began after the first ended.
    assert arrivals.index((first, "end")) < arrivals.index((second, "token"))


def test_the_queue_limit_counts_only_the_requests_waiting_beyond_parallel(serve) -> None:
    # Two answer together and one waits: none is told to retry.
    served = serve(parallel=2, queue_limit=1)
    _, results = _together(served, "abc", 200)
    assert all(isinstance(text, str) for text in results.values()), results


def test_the_same_conversation_sent_twice_at_once_answers_twice(serve) -> None:
    # The second cannot continue the session the first answers on: it opens its
    # own and takes the shared prefix from the first's pages.
    served = serve(parallel=2)
    alone = _alone(served, "a", 120)
    arrivals: list[tuple[str, str]] = []
    results: dict[str, object] = {}
    threads = [threading.Thread(target=_stream, args=(served, "a", 120, arrivals, results))
               for _ in range(2)]
    texts: list[object] = []
    for thread in threads:
        thread.start()
        thread.join(300)
        texts.append(results.pop("a"))
    assert texts == [alone, alone]


def test_a_request_whose_client_left_while_it_waited_frees_its_place_at_once(
        tmp_path: Path) -> None:
    # One stream at a time: B waits behind A, which runs alone to its end. A long
    # context, so that A still answers however long B takes to come and go.
    long_context = make_tiny_model_dir(tmp_path / "model", "llama", endless=True, seed=1,
                                       max_position_embeddings=131072)
    served, stop = start_server(long_context, tmp_path / "kv", parallel=1, queue_limit=1,
                                keepalive=0.2)
    headers = {"authorization": f"Bearer {served.key}"}
    leave_a = threading.Event()
    a_ended = threading.Event()

    def long_a() -> None:
        # Greedy: sampled, the model may end its turn on its own before B leaves.
        body = {"model": "m", "messages": [{"role": "user", "content": ASKED["a"]}],
                "max_tokens": 100_000, "temperature": 0, "stream": True}
        with httpx.stream("POST", served.url + "/v1/chat/completions", headers=headers,
                          json=body, timeout=300) as reply:
            for _ in reply.iter_raw():
                if leave_a.is_set():
                    break
        a_ended.set()

    def in_flight() -> int:
        return health_of(served).json()["streams"]["in_flight"]

    thread = threading.Thread(target=long_a)
    try:
        thread.start()
        deadline = time.monotonic() + 60
        while in_flight() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        body = {"model": "m", "messages": [{"role": "user", "content": ASKED["b"]}],
                "max_tokens": 20, "stream": True}
        with httpx.stream("POST", served.url + "/v1/chat/completions", headers=headers,
                          json=body, timeout=60) as waiting:
            assert waiting.status_code == 200
            next(waiting.iter_raw())  # a keepalive: it waits behind A; then it leaves
        seen = [in_flight()]
        while seen[-1] > 1 and not a_ended.is_set() and time.monotonic() < deadline + 60:
            time.sleep(0.05)
            seen.append(in_flight())
        # Its place came free while A still answered, not when A ended.
        assert seen[-1] == 1 and not a_ended.is_set(), seen
    finally:
        leave_a.set()
        thread.join(300)
        stop()


def test_a_request_answering_when_the_engine_stops_is_told_and_health_says_so(
        serve, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.engine.runtime.test_answering import broken_step

    broken = broken_step(monkeypatch)
    served = serve(parallel=2)
    arrivals: list[tuple[str, str]] = []
    results: dict[str, object] = {}
    threads = [threading.Thread(target=_stream, args=(served, name, 2000, arrivals, results))
               for name in "ab"]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while not {("a", "token"), ("b", "token")} <= set(arrivals) and time.monotonic() < deadline:
        time.sleep(0.02)
    broken.set()  # while the two answer together
    for thread in threads:
        thread.join(60)
    # Each stream ends with the error, rather than waiting for an end that cannot come.
    assert all("a bug past" in str(results[name]) for name in "ab"), results
    health = health_of(served)
    assert health.status_code == 503 and health.json()["status"] == "error"
    assert "restart the server" in health.json()["message"]
    # A request after that is refused at once (503, the engine's words), not queued
    # where nothing takes it; again and again, without filling the queue.
    client = _client(served).with_options(max_retries=0, timeout=30)
    for _ in range(3):
        with pytest.raises(openai.APIStatusError) as refused:
            client.chat.completions.create(model="m", max_tokens=4, messages=[
                {"role": "user", "content": "Still there?"}])
        assert refused.value.status_code == 503
        assert "The engine stopped on an unexpected error" in str(refused.value)


@pytest.mark.parametrize("how", ["model switch", "server stopping", "server signalled"])
def test_answers_the_server_stops_end_as_errors_not_as_finished_answers(
        folder: Path, tmp_path: Path, how: str) -> None:
    """An answer the server cuts (its sessions closed for a model switch, or the
    server turned off or interrupted) ends as an error in its API's shape, streamed
    or not, never a finished answer nor a connection cut mid-body."""
    served, stop = start_server(folder, tmp_path / "kv", parallel=3)

    def signalled() -> None:
        # What uvicorn's signal handler (Ctrl-C), as sse-starlette patches it, sets;
        # the answers then take a while to end (a long chunk of a prompt, a machine
        # of a pipeline that hangs). Before, every stream ended within half a
        # second of the signal, cut with no error: it looked finished.
        AppStatus.should_exit = True
        time.sleep(1.5)
        stop()

    try:
        _cut_answers(served, {"model switch": None, "server stopping": stop,
                              "server signalled": signalled}[how])
    finally:
        stop()
        AppStatus.should_exit = False


def _cut_answers(served: Served, stop: Callable[[], None] | None) -> None:
    # Greedy: the model then never ends its turn, so each answer is cut by the close.
    started: set[str] = set()
    ends: dict[str, object] = {}

    def whole() -> None:  # waits behind the three streams: cancelled as it waits
        try:
            ends["whole"] = _client(served).chat.completions.create(
                model="m", messages=[{"role": "user", "content": ASKED["a"] + "?"}],
                max_tokens=3000, temperature=0)
        except openai.APIError as error:
            ends["whole"] = error

    def with_openai() -> None:
        try:
            for chunk in _client(served).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": ASKED["a"]}],
                    max_tokens=3000, temperature=0, stream=True):
                started.add("openai")
                if chunk.choices and chunk.choices[0].finish_reason:
                    ends["openai"] = chunk.choices[0].finish_reason
        except openai.APIError as error:
            ends["openai"] = error

    def with_anthropic() -> None:
        client = anthropic.Anthropic(base_url=served.url, api_key=served.key, max_retries=0)
        try:
            with client.messages.stream(model="m", max_tokens=3000, messages=[
                    {"role": "user", "content": ASKED["b"]}],
                    extra_body={"temperature": 0}) as stream:
                for _ in stream.text_stream:
                    started.add("anthropic")
                ends["anthropic"] = stream.get_final_message().stop_reason
        except anthropic.APIError as error:
            ends["anthropic"] = error

    def with_ollama() -> None:
        with httpx.stream("POST", served.url + "/api/chat", timeout=60,
                          headers={"authorization": f"Bearer {served.key}"},
                          json={"model": "m", "options": {"num_predict": 3000,
                                                          "temperature": 0},
                                "messages": [{"role": "user", "content": ASKED["c"]}]}) as r:
            for line in r.iter_lines():
                started.add("ollama")
                ends["ollama"] = json.loads(line)

    threads = [threading.Thread(target=run) for run in (with_openai, with_anthropic,
                                                         with_ollama)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 60
    while len(started) < 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    threads.append(threading.Thread(target=whole))
    threads[-1].start()
    while served.bridge.in_flight < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    if stop is not None:
        stop()
    else:
        for name in list(served.bridge._sessions):  # as the app's server does on a switch
            served.bridge.worker.close_session(name, store=True)
    for thread in threads:
        thread.join(60)
    said = "The server stopped this answer before its end"
    assert isinstance(ends.get("openai"), openai.APIError), ends
    assert isinstance(ends.get("anthropic"), anthropic.APIError), ends
    assert said in str(ends["openai"]) and said in str(ends["anthropic"]), ends
    assert said in ends["ollama"].get("error", ""), ends  # type: ignore[union-attr]
    assert isinstance(ends.get("whole"), openai.APIStatusError), ends
    assert ends["whole"].status_code == 503 and said in str(ends["whole"]), ends
