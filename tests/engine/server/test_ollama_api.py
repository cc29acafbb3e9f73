"""Ollama's API on the same port, through the official ``ollama`` Python client,
against a live server: listing, chat and generate (streamed NDJSON and not),
options, a tool round trip, and a clear answer to a pull."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import ollama
import pytest
from mlx_lm.utils import load_tokenizer

from engine.events import GenerationStats
from engine.server import ollama as ollama_api
from engine.server.errors import BadRequest
from engine.session import sampling
from tests.engine.server.conftest import Served, start_server
from tests.engine.server.tool_models import make_tool_model_dir, scripted_processors

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
GREEDY = {"temperature": 0, "num_predict": 6}


def client(served: Served) -> ollama.Client:
    return ollama.Client(host=served.url, headers={"Authorization": f"Bearer {served.key}"})


def test_version_tags_show_and_ps(served: Served) -> None:
    api = client(served)
    version = httpx.get(served.url + "/api/version",
                        headers={"x-api-key": served.key}).json()["version"]
    assert tuple(int(part) for part in version.split(".")) >= (0, 5, 0)
    (model,) = api.list().models
    assert model.model == f"{served.bridge.model_id}:latest"
    assert model.details.family == "llama" and model.details.format == "mlx"
    shown = api.show(model.model)
    assert shown.modelinfo["llama.context_length"] == served.bridge.max_context
    assert "completion" in shown.capabilities and "<|im_start|>" in shown.template
    (running,) = api.ps().models
    assert running.context_length == served.bridge.max_context
    # Unified memory: all of the model is in the GPU's memory, as Ollama says on a Mac.
    assert running.size_vram == running.size == model.size > 0


@pytest.mark.parametrize("endpoint", ["chat", "generate"])
def test_streamed_matches_not_streamed(served: Served, endpoint: str) -> None:
    api = client(served)
    if endpoint == "chat":
        ask = {"messages": [{"role": "user", "content": "Tell me a story"}]}
        text_of = lambda part: part.message.content  # noqa: E731
    else:
        ask = {"prompt": "Tell me a story", "system": "Be brief."}
        text_of = lambda part: part.response  # noqa: E731
    call = getattr(api, endpoint)
    whole = call(model="anything", options=GREEDY, stream=False, **ask)
    parts = list(call(model="anything", options=GREEDY, stream=True, **ask))
    assert "".join(text_of(p) or "" for p in parts) == text_of(whole)
    assert [p.done for p in parts][-1] is True and not any(p.done for p in parts[:-1])
    final = parts[-1]
    assert final.done_reason == whole.done_reason and final.done_reason in ("stop", "length")
    assert final.eval_count == whole.eval_count and 0 < final.eval_count <= 6
    # Ollama counts the prompt tokens it evaluated: the second read the cache.
    assert 0 < final.prompt_eval_count < whole.prompt_eval_count


def test_durations_split_reading_the_prompt_from_generating(served: Served) -> None:
    api = client(served)
    messages = [{"role": "user", "content": "Tell me a long story " * 20}]
    for stream in (False, True):
        final = api.chat(model="m", messages=messages, options=GREEDY, stream=stream)
        if stream:
            *_, final = final
        assert final.prompt_eval_duration > 0 and final.eval_duration > 0
        assert final.prompt_eval_duration + final.eval_duration <= final.total_duration
        messages[0]["content"] += "!"  # the next one reads the prompt again too
    # The engine's rates, as counts over durations: a client's tokens per second.
    stats = GenerationStats(prompt_tokens=120, generated_tokens=5, time_to_first_token=0.3,
                            prefill_tps=400.0, decode_tps=50.0, prefill_tokens=100)
    line = ollama_api.final_line("m", "stop", 100, 5, 1.0, stats, chat=True)
    assert line["prompt_eval_duration"] == 250_000_000  # 100 tokens at 400 a second
    assert line["eval_duration"] == 100_000_000  # 5 tokens at 50 a second
    assert line["total_duration"] == 1_000_000_000
    # An answer of one token has no decode rate: the time after the reading is its own.
    one = replace(stats, generated_tokens=1, decode_tps=0.0)
    line = ollama_api.final_line("m", "stop", 100, 1, 1.0, one, chat=True)
    assert line["eval_duration"] == 750_000_000


def test_options_are_honoured(served: Served) -> None:
    api = client(served)
    messages = [{"role": "user", "content": "Say many things"}]
    free = api.chat(model="m", messages=messages,
                    options={"temperature": 0, "num_predict": 12}).message.content
    assert len(free) > 3
    stop = free[2:4]
    cut = api.chat(model="m", messages=messages,
                   options={"temperature": 0, "num_predict": 12, "stop": [stop]})
    assert cut.message.content == free[:free.index(stop)]
    seeded = [api.chat(model="m", messages=messages, options={
        "temperature": 1.5, "top_p": 0.9, "seed": 7, "num_predict": 8}).message.content
        for _ in range(2)]
    assert seeded[0] == seeded[1]
    # -1 is Ollama's default seed, meaning none: every draw is its own.
    for seed, read in ((-1, None), (7, 7)):
        body = {"messages": messages, "options": {"seed": seed}}
        assert ollama_api.chat_request(body, 64).sampling.seed == read
    with pytest.raises(ollama.ResponseError) as raised:
        api.chat(model="m", messages=[{"role": "user", "content": "word " * 200}],
                 options={"num_ctx": 64})
    assert raised.value.status_code == 400 and "64" in raised.value.error
    with pytest.raises(ollama.ResponseError) as raised:
        api.chat(model="m", messages=messages, options={"mirostat": 2})
    assert "options.mirostat" in raised.value.error
    with pytest.raises(ollama.ResponseError) as raised:
        api.chat(model="m", messages=messages, format={"$ref": "#/nowhere"})
    assert "format" in raised.value.error and "nowhere" in raised.value.error


# What Ollama's api.DefaultOptions() sets of the options that change nothing here.
OLLAMA_DEFAULTS = {"num_keep": 4, "repeat_last_n": 64, "mirostat": 0, "mirostat_tau": 5.0,
                   "mirostat_eta": 0.1, "penalize_newline": True}


def test_options_at_values_that_change_nothing_are_read(served: Served) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    answer = client(served).chat(model="m", messages=messages,
                                 options={**OLLAMA_DEFAULTS, **GREEDY})
    assert answer.done and answer.eval_count > 0

    def read(**options: object) -> None:
        ollama_api.chat_request({"messages": messages, "options": options}, 64)
    # No prompt is ever cut here, so there is never anything to keep.
    read(num_keep=100)
    # Mirostat's settings are idle while it is off.
    read(mirostat_tau=3.0, mirostat_eta=0.5)
    read(mirostat=0, mirostat_tau=3.0)
    # The window and the newline's penalty are idle with no penalty to apply.
    read(repeat_last_n=16, penalize_newline=False)
    read(repeat_penalty=1.0, repeat_last_n=-1, presence_penalty=0)
    # With a penalty they would change the answer: refused, by name.
    for options, name in (({"repeat_penalty": 1.1, "repeat_last_n": 16}, "repeat_last_n"),
                          ({"presence_penalty": 0.5, "penalize_newline": False},
                           "penalize_newline"),
                          ({"mirostat_tau": 3.0, "mirostat": 2}, "mirostat_tau")):
        with pytest.raises(BadRequest) as raised:
            read(**options)
        assert raised.value.param == f"options.{name}"
        assert "not supported by this server" in str(raised.value)


def test_a_resent_chat_reads_the_cache(served: Served) -> None:
    api = client(served)
    messages = [{"role": "system", "content": "You answer briefly. " * 20},
                {"role": "user", "content": "Remember: " + "pine needle " * 30}]
    first = api.chat(model="m", messages=messages, options=GREEDY)
    resent = [*messages, {"role": "assistant", "content": first.message.content},
              {"role": "user", "content": "Which?"}]
    again = api.chat(model="m", messages=resent, options=GREEDY)
    # Ollama's counts say how many were evaluated: the cached prefix is not.
    assert again.prompt_eval_count <= 0.1 * first.prompt_eval_count


def test_pull_says_how_longleaf_gets_models(served: Served) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        client(served).pull("llama3.2")
    assert "--model" in raised.value.error and raised.value.status_code == 501


def test_a_request_with_nothing_to_answer_preloads_as_in_ollama(served: Served) -> None:
    api = client(served)
    chat = api.chat(model="m", messages=[])
    assert chat.done and chat.done_reason == "load" and chat.message.content == ""
    # As Ollama's documentation loads one (curl and other clients): no messages at all.
    raw = httpx.post(served.url + "/api/chat", json={"model": "m"},
                     headers={"x-api-key": served.key})
    assert raw.status_code == 200, raw.text
    assert raw.json()["done_reason"] == "load" and raw.json()["message"]["content"] == ""
    generated = api.generate(model="m", prompt="")
    assert generated.done and generated.done_reason == "load" and generated.response == ""


def test_keep_alive_zero_with_nothing_to_answer_unloads_what_it_can(served: Served) -> None:
    api = client(served)
    messages = [{"role": "user", "content": "Hello"}]
    for unload in (lambda: api.generate(model="m", keep_alive=0),
                   lambda: api.chat(model="m", messages=[], keep_alive="0s")):
        api.chat(model="m", messages=messages, options=GREEDY)
        assert served.bridge._sessions  # the KV of the answer, held for the next
        done = unload()
        assert done.done and done.done_reason == "unload"
        # The KV held for past requests is freed; the model, the server's for its
        # life, stays loaded and says so.
        assert not served.bridge._sessions
        assert [m.model for m in api.ps().models] == [f"{served.bridge.model_id}:latest"]
    assert api.chat(model="m", messages=messages, options=GREEDY).done
    # An answer running when another client unloads goes on to its end.
    running = api.chat(model="m", messages=messages, stream=True,
                       options={"temperature": 0, "num_predict": 400})
    next(running)
    assert api.generate(model="m", keep_alive=0).done_reason == "unload"
    *_, last = running
    assert last.done_reason == "length" and last.eval_count == 400
    for keep in (0.5, "5m", -1):  # any other keep_alive is a load
        assert api.generate(model="m", keep_alive=keep).done_reason == "load"


def test_a_raw_prompt_with_a_system_prompt_is_refused_as_in_ollama(served: Served) -> None:
    with pytest.raises(ollama.ResponseError) as raised:
        client(served).generate(model="m", prompt="Hi", system="Be terse.", raw=True)
    assert raised.value.status_code == 400 and "'system'" in raised.value.error


@pytest.fixture(scope="module")
def tooled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("ollama-tools")
    running, stop = start_server(make_tool_model_dir(root), root / "kv")
    yield running
    stop()


def test_a_tool_round_trip(tooled: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    tokenizer = load_tokenizer(Path(tooled.bridge.info.path))

    def force(text: str) -> None:
        monkeypatch.setattr(sampling, "build_logits_processors",
                            scripted_processors(tokenizer, text))
    force(CALL)
    api = client(tooled)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    reply = api.chat(model="m", messages=messages, tools=[WEATHER], stream=False,
                     options={"num_predict": 100})
    (call,) = reply.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    streamed = [p for p in api.chat(model="m", messages=messages, tools=[WEATHER],
                                    stream=True, options={"num_predict": 100})]
    assert [c.function.arguments for p in streamed for c in (p.message.tool_calls or [])] \
        == [{"city": "Paris"}]
    force("It is sunny.")
    follow = [*messages, reply.message,
              {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"}]
    answer = api.chat(model="m", messages=follow, tools=[WEATHER],
                      options={"num_predict": 100})
    assert answer.message.content == "It is sunny." and answer.done_reason == "stop"


def test_an_image_in_a_message_is_a_note_not_a_refusal() -> None:
    """As on the other APIs: a history resent with a screenshot in it was a 400 at
    every later turn; the model now reads that an image was left out."""
    from engine.server.protocol import IMAGE_OMITTED

    body = {"model": "m", "messages": [
        {"role": "user", "content": "What is this?", "images": ["aGVsbG8="]},
        {"role": "user", "images": ["aGVsbG8=", "aGVsbG8="]}]}
    first, second = ollama_api.chat_request(body, 4096).messages[-2:]
    assert first["content"] == f"What is this?\n\n{IMAGE_OMITTED}"
    assert second["content"] == f"{IMAGE_OMITTED}\n\n{IMAGE_OMITTED}"


def test_an_assistant_turns_thinking_sent_back_goes_to_the_template() -> None:
    chat = ollama_api.chat_request({"model": "m", "messages": [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello", "thinking": "A greeting."},
        {"role": "user", "content": "Again"}]}, 64)
    assert chat.messages[1] == {"role": "assistant", "content": "Hello",
                                "reasoning_content": "A greeting."}
    with pytest.raises(BadRequest, match=r"messages\[1\].thinking"):
        ollama_api.chat_request({"model": "m", "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello", "thinking": 3}]}, 64)
