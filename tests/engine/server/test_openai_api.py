"""The OpenAI endpoints through the official ``openai`` SDK, against a live server."""

from __future__ import annotations

import json
import math
import threading

import httpx
import openai
import pytest

from engine.server import protocol
from tests.engine.server.conftest import Served, health_of
from tests.engine.tokenizer_watch import watch_encodings


def client(served: Served, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.url + "/v1", api_key=served.key, max_retries=0,
                         **kwargs)


def conversation(turns: int) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "You answer briefly. " * 20}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"Question {turn}: " + "tell me more " * 30})
        messages.append({"role": "assistant", "content": f"Answer {turn} " * 10})
    messages.append({"role": "user", "content": "And now?"})
    return messages


def test_models_and_health(served: Served) -> None:
    models = client(served).models.list()
    assert [m.id for m in models.data] == [served.bridge.model_id]
    # Without the key: up, and nothing more (which model, which machines) to a device
    # on the network; with it, the details.
    for key in ("", "wrong"):
        anonymous = httpx.get(served.url + "/health", headers={"x-api-key": key})
        assert anonymous.status_code == 200 and anonymous.json() == {"status": "ok"}
    told = health_of(served).json()
    assert told["status"] == "ok" and told["model"] == served.bridge.model_id


def test_chat_not_streamed_with_usage(served: Served) -> None:
    reply = client(served).chat.completions.create(
        model="anything", messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=5, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens <= 5
    assert reply.usage.prompt_tokens > 0
    assert reply.model == served.bridge.model_id


def test_chat_streamed_matches_not_streamed(served: Served) -> None:
    messages = [{"role": "user", "content": "Count with me"}]
    whole = client(served).chat.completions.create(
        model="m", messages=messages, max_tokens=8, temperature=0)
    stream = client(served).chat.completions.create(
        model="m", messages=messages, max_tokens=8, temperature=0, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens


def test_resent_conversation_is_cached(served: Served) -> None:
    api = client(served)
    first = api.chat.completions.create(model="m@fp16", messages=conversation(3),
                                        max_tokens=3, temperature=0)
    resent = [*conversation(3), {"role": "assistant", "content": first.choices[0].message.content},
              {"role": "user", "content": "One more thing?"}]
    again = api.chat.completions.create(model="m@fp16", messages=resent,
                                        max_tokens=3, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens < again.usage.prompt_tokens
    assert cached >= first.usage.prompt_tokens - 1
    # The new turn is short: almost all of the resent prompt comes from the cache.
    assert cached >= 0.95 * again.usage.prompt_tokens


def test_stop_sequence_cuts_the_answer(served: Served) -> None:
    api = client(served)
    messages = [{"role": "user", "content": "Say many things"}]
    free = api.chat.completions.create(model="m", messages=messages, max_tokens=12,
                                       temperature=0).choices[0].message.content
    assert len(free) > 3
    stop = free[2:4]
    cut = api.chat.completions.create(model="m", messages=messages, max_tokens=12,
                                      temperature=0, stop=[stop])
    assert cut.choices[0].message.content == free[:free.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_cancelled_stream_then_good_request(served: Served) -> None:
    api = client(served)
    stream = api.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Go on and on"}],
        max_tokens=400, temperature=0, stream=True)
    for _ in zip(range(3), stream, strict=False):
        pass
    stream.close()
    reply = api.chat.completions.create(model="m", messages=[{"role": "user", "content": "Hi"}],
                                        max_tokens=3, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")


def test_concurrent_requests_are_queued(served: Served) -> None:
    results: list[object] = []

    def ask(index: int) -> None:
        try:
            reply = client(served).chat.completions.create(
                model="m", messages=[{"role": "user", "content": f"Number {index}"}],
                max_tokens=4, temperature=0)
            results.append(reply.choices[0].finish_reason)
        except openai.RateLimitError as error:
            results.append(error.status_code if error.response.headers.get("retry-after")
                           else "429 without Retry-After")
        except openai.APIError as error:  # kept, so a failure says what came back
            results.append(repr(error))

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    answered = [r for r in results if r in ("stop", "length")]
    assert len(results) == 6
    # The queue limit is 3: whoever came past it was told to retry, none was dropped.
    assert answered
    assert all(r in ("stop", "length", 429) for r in results), results


def test_a_new_session_never_evicts_one_answering(served: Served) -> None:
    """With every held session busy, a new request opens one more instead of closing
    (and so cancelling) the least recently used one mid-answer."""
    api = client(served)
    streams = [api.chat.completions.create(
        model="m", messages=[{"role": "user", "content": f"Go on and on, {name}"}],
        max_tokens=200, temperature=0, stream=True) for name in ("A", "B")]
    for stream in streams:
        next(iter(stream))  # both sessions hold a request now (the first one answering)
    other = api.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Something else"}], max_tokens=2,
        temperature=0)
    assert other.choices[0].finish_reason in ("stop", "length")
    for stream in streams:
        finishes = [c.choices[0].finish_reason for c in stream if c.choices]
        assert finishes[-1] in ("stop", "length")


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 2}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "extra_body": {"kv_mode": "q3"}},
     "kv_mode"),
])
def test_bad_fields_are_400(served: Served, body: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client(served).chat.completions.create(model="m", **body)
    assert raised.value.body["param"] == param


def test_json_nested_past_the_parser_is_a_400_in_each_apis_shape(served: Served) -> None:
    deep = b"[" * 100_000 + b"]" * 100_000  # was a 500 in text/plain and a traceback
    for path, auth in (("/v1/chat/completions", {"Authorization": f"Bearer {served.key}"}),
                       ("/v1/messages", {"x-api-key": served.key})):
        reply = httpx.post(served.url + path, content=deep, timeout=60,
                           headers={**auth, "Content-Type": "application/json"})
        assert reply.status_code == 400 and "nests its JSON deeper" in reply.text
        assert reply.headers["content-type"] == "application/json"
    assert reply.json()["type"] == "error"  # Anthropic's shape


def test_errors_have_the_documented_status(served: Served) -> None:
    url = served.url + "/v1/chat/completions"
    auth = {"Authorization": f"Bearer {served.key}"}
    assert httpx.post(url, content=b"{not json", headers=auth).status_code == 400
    assert httpx.post(url, json={}, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(served.url + "/v1/models").status_code == 401
    assert httpx.get(served.url + "/v1/models", headers={"x-api-key": served.key}).status_code \
        == 200
    # Claude Code sends both headers when its environment sets a key and a token:
    # either one may carry this server's key, and two wrong ones are refused.
    for x_key, bearer in ((served.key, "other"), ("other", served.key), ("other", "wrong")):
        models = httpx.get(served.url + "/v1/models", headers={
            "x-api-key": x_key, "Authorization": f"Bearer {bearer}"})
        assert models.status_code == (401 if served.key not in (x_key, bearer) else 200)
    big = b"{" + b" " * (33 * 2**20) + b"}"
    assert httpx.post(url, content=big, headers=auth).status_code == 413
    long = [{"role": "user", "content": "word " * 6000}]
    reply = httpx.post(url, json={"messages": long}, headers=auth, timeout=60)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "context_length_exceeded"
    assert "4,096" in reply.json()["error"]["message"]


def test_malformed_requests_leave_it_answering(served: Served) -> None:
    import random

    rng = random.Random(7)
    auth = {"Authorization": f"Bearer {served.key}"}
    values = [None, 1, -1, 1e308, "x", [], {}, [1], {"role": "user"}, True, "\udc80"]
    keys = ["messages", "max_tokens", "temperature", "top_p", "stop", "seed", "n", "stream",
            "stream_options", "model", "kv_mode", "max_completion_tokens"]
    for _ in range(150):
        body = {rng.choice(keys): rng.choice(values) for _ in range(rng.randint(0, 4))}
        body.setdefault("max_tokens", 1)
        raw = rng.choice([None, b"", b"[", b"\xff\xfe", b"null", b"123"])
        if raw is None:
            # json.dumps escapes the lone surrogate, as a careless client would send it.
            reply = httpx.post(served.url + "/v1/chat/completions",
                               content=json.dumps(body).encode(), headers=auth, timeout=60)
        else:
            reply = httpx.post(served.url + "/v1/chat/completions", content=raw,
                               headers=auth, timeout=60)
        assert reply.status_code in (200, 400), (body, reply.text)
    ok = client(served).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "still there?"}], max_tokens=2)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_model_suffix_and_kv_mode_pick_the_mode(served: Served) -> None:
    api = client(served)
    by_suffix = api.chat.completions.create(
        model="m@q6", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    by_field = api.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
        extra_body={"kv_mode": "q4"})
    default = api.chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)
    assert by_suffix.model_extra["kv_mode"] == "q6"
    assert by_field.model_extra["kv_mode"] == "q4"
    assert default.model_extra["kv_mode"] == served.bridge.kv_mode
    with pytest.raises(openai.BadRequestError):
        api.chat.completions.create(model="m@q3", messages=[{"role": "user", "content": "x"}])


@pytest.mark.parametrize("step", ["render", "fit"])
def test_a_slow_step_does_not_stall_other_connections(served: Served, monkeypatch,
                                                      step: str) -> None:
    """A request's slow steps run off the event loop: while one request's prompt is
    still being tokenized, or its fit checked (on a pipeline a question to rank 0's
    process, which a hung rank 0 answers only when the stall limit ends it), held
    here until released, the server answers others. Before, the fit check ran on
    the event loop, and /health waited."""
    entered, release = threading.Event(), threading.Event()
    original = getattr(served.bridge, step)

    def held(*args, **kwargs):
        entered.set()
        release.wait(60)
        return original(*args, **kwargs)

    monkeypatch.setattr(served.bridge, step, held)
    results: list[object] = []
    slow = threading.Thread(target=lambda: results.append(client(served).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "A long one"}], max_tokens=2)))
    slow.start()
    try:
        assert entered.wait(60)
        assert httpx.get(served.url + "/health", timeout=20).status_code == 200
        assert client(served).models.list().data
    finally:
        release.set()
        slow.join(120)
    assert results and results[0].choices[0].finish_reason in ("stop", "length")


def test_other_requests_are_answered_while_a_long_prompt_is_tokenized(served: Served,
                                                                      monkeypatch) -> None:
    """A prompt of megabytes takes the tokenizer seconds. Asked once that tokenizing
    began, /health and Ollama's /api/show are answered, and a short chat request gets
    as far as its own render, before it ends: the tokenizer lets go of the
    interpreter's lock, and the handlers never wait for the lock a render holds
    (before, one 6 MB prompt held every other request for about 10 s)."""
    watched = watch_encodings(served.bridge._tokenizer, monkeypatch)
    render_later = served.bridge.render_later
    queued: list[bool] = []  # per render asked for: whether the long one had ended

    def noted(*args, **kwargs):
        queued.append(watched.finished.is_set())
        return render_later(*args, **kwargs)

    monkeypatch.setattr(served.bridge, "render_later", noted)
    headers = {"Authorization": f"Bearer {served.key}"}
    long = "Longleaf pines grow on sandy soil in the south-east. " * 60_000  # ~3 MB

    def chat(content: str, results: list[httpx.Response]) -> threading.Thread:
        thread = threading.Thread(target=lambda: results.append(httpx.post(
            served.url + "/v1/chat/completions", timeout=300, headers=headers,
            json={"model": "m", "max_tokens": 2,
                  "messages": [{"role": "user", "content": content}]})))
        thread.start()
        return thread

    answers: list[httpx.Response] = []
    short: list[httpx.Response] = []
    threads = [chat(long, answers)]
    try:
        assert watched.started.wait(120)
        health = httpx.get(served.url + "/health", timeout=120)
        show = httpx.post(served.url + "/api/show", timeout=120, headers=headers,
                          json={"model": "m"})
        threads.append(chat("A short one", short))
        while len(queued) < 2 and threads[1].is_alive():
            threads[1].join(0.05)
        answered_first = not watched.finished.is_set()
    finally:
        for thread in threads:
            thread.join(300)
    assert health.status_code == 200 and show.status_code == 200
    assert answered_first, "the other requests waited for the long prompt's tokenizing"
    assert queued == [False, False]
    # Both get their answers: the long prompt is more than the model's context.
    assert answers[0].status_code == 400
    assert answers[0].json()["error"]["code"] == "context_length_exceeded"
    assert short[0].status_code == 200


def test_a_model_by_its_id(served: Served) -> None:
    api = client(served)
    model = api.models.retrieve(served.bridge.model_id)
    assert model.id == served.bridge.model_id and model.context_length > 0
    assert api.models.retrieve(served.bridge.model_id + "@q8").id.endswith("@q8")
    with pytest.raises(openai.NotFoundError) as raised:
        api.models.retrieve("gpt-4o")
    assert raised.value.body["code"] == "model_not_found"


@pytest.mark.parametrize("path, method, status", [
    ("/v1/nowhere", "GET", 404), ("/v1/embeddings", "POST", 404),
    ("/v1/chat/completions", "GET", 405)])
def test_unknown_routes_answer_json(served: Served, path: str, method: str,
                                    status: int) -> None:
    reply = httpx.request(method, served.url + path, headers={"x-api-key": served.key})
    assert reply.status_code == status
    assert reply.headers["content-type"] == "application/json"
    assert path in reply.json()["error"]["message"]
    other = httpx.get(served.url + "/v1/messages/nowhere", headers={"x-api-key": served.key})
    assert other.json()["type"] == "error" and \
        other.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_of_a_chat_answer(served: Served, stream: bool) -> None:
    reply = client(served).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Tell me"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=3, stream=stream)
    if stream:
        chunks = [c for c in reply if c.choices]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        content = [t for c in chunks if c.choices[0].logprobs
                   for t in c.choices[0].logprobs.content]
    else:
        text, content = reply.choices[0].message.content, reply.choices[0].logprobs.content
    assert content and "".join(t.token for t in content) == text
    for token in content:
        assert len(token.top_logprobs) == 3
        assert token.top_logprobs[0].logprob == pytest.approx(token.logprob)  # greedy
        assert token.top_logprobs[0].token == token.token
        assert bytes(token.bytes).decode() == token.token


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_of_an_answer_held_to_json_list_only_tokens_it_could_take(
        served: Served, stream: bool) -> None:
    # The grammar rules most tokens out (a log probability of minus infinity):
    # not JSON, and no alternative the answer had.
    reply = client(served).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Give me JSON"}], max_tokens=6,
        temperature=0, logprobs=True, top_logprobs=20, stream=stream,
        response_format={"type": "json_object"})
    if stream:
        content = [t for c in reply if c.choices and c.choices[0].logprobs
                   for t in c.choices[0].logprobs.content]
    else:
        content = reply.choices[0].logprobs.content
    assert content
    for token in content:
        assert token.top_logprobs and all(
            math.isfinite(alt.logprob) for alt in token.top_logprobs)


def test_logit_bias_is_applied(served: Served) -> None:
    api = client(served)
    messages = [{"role": "user", "content": "Say anything"}]
    free = api.chat.completions.create(model="m", messages=messages, max_tokens=5,
                                       temperature=0, logprobs=True)
    first = free.choices[0].logprobs.content[0].token
    token_id = served.bridge.vocab_size - 1
    while served.bridge.token_texts([token_id])[0] in (first, "") or \
            "<|" in served.bridge.token_texts([token_id])[0]:
        token_id -= 1
    biased = api.chat.completions.create(model="m", messages=messages, max_tokens=5,
                                         temperature=0, logit_bias={str(token_id): 100})
    assert biased.choices[0].message.content == served.bridge.token_texts([token_id])[0] * 5
    with pytest.raises(openai.BadRequestError) as raised:
        api.chat.completions.create(model="m", messages=messages, max_tokens=1,
                                    logit_bias={str(10**6): 5})
    assert raised.value.body["param"] == "logit_bias"


def test_a_chat_without_a_limit_answers_as_long_as_on_the_other_apis(
        served: Served) -> None:
    # One token favoured over all: the answer never ends of itself, so only the
    # server's default limit (the Responses and Ollama APIs' 4,096) stops it.
    token_id = served.bridge.vocab_size - 1
    while served.bridge.token_texts([token_id])[0] == "" or \
            "<|" in served.bridge.token_texts([token_id])[0]:
        token_id -= 1
    text = served.bridge.token_texts([token_id])[0]
    stream = client(served).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "Go on"}], stream=True,
        logit_bias={str(token_id): 100})
    answer, finish = "", None
    with stream:
        for chunk in stream:
            if chunk.choices:
                answer += chunk.choices[0].delta.content or ""
                finish = chunk.choices[0].finish_reason
            if finish or len(answer) > 600 * len(text):
                break  # past where 512 tokens ended it before: enough
    assert finish is None and len(answer) > 600 * len(text)


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"$ref": "#/nowhere"}}}}, "response_format"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"logit_bias": {"²": 5}}, "logit_bias"),  # a digit int() cannot read
    ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     "tools"),
])
def test_fields_it_cannot_honour_are_400(served: Served, body: dict, param: str) -> None:
    with pytest.raises(openai.BadRequestError) as raised:
        client(served).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "x"}], max_tokens=1,
            extra_body=body)
    assert raised.value.body["param"] == param


def test_an_image_part_is_a_note_that_it_was_left_out() -> None:
    # Before: a 400 "this server reads text blocks only" for the whole conversation.
    chat = protocol.openai_chat({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this? "},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}]}, 5)
    assert chat.messages == [{"role": "user",
                              "content": "What is this? " + protocol.IMAGE_OMITTED}]


def test_an_assistant_turns_thought_sent_back_goes_to_the_template() -> None:
    def read(turn: dict) -> dict:
        return protocol.openai_chat({"messages": [
            {"role": "user", "content": "Hi"}, turn,
            {"role": "user", "content": "Again"}]}, 5).messages[1]

    assert read({"role": "assistant", "content": "Hello", "reasoning_content": "A greeting."}) \
        == {"role": "assistant", "content": "Hello", "reasoning_content": "A greeting."}
    assert read({"role": "assistant", "content": "Hello", "reasoning": "Short."})[
        "reasoning_content"] == "Short."
    assert "reasoning_content" not in read({"role": "assistant", "content": "Hello",
                                            "reasoning_content": ""})
    with pytest.raises(protocol.BadRequest, match=r"messages\[1\].reasoning_content"):
        read({"role": "assistant", "content": "Hello", "reasoning_content": ["no"]})
