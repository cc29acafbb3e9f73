"""The server's ``Run``: an answer's text and its tokens' log probabilities, cut
at a stop sequence, without a model; and what a chat template's refusal answers."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import anthropic
import ollama
import openai
import pytest

from engine.events import Finished, TokenChunk, TokenLogprob
from engine.server.app import Run
from engine.server.bridge import Ticket
from tests.engine.server.conftest import Served
from tests.engine.server.tool_models import REFUSING_TEMPLATE, serve_templated

REFUSED = ("The model's chat template refused this conversation: This template refuses "
           "that message.")


def _chunk(text: str, token: int) -> TokenChunk:
    return TokenChunk(1, text, (token,), (TokenLogprob(token, -0.5, ()),))


async def _answer(events: list[object], stops: tuple[str, ...]
                  ) -> tuple[str, list[int]]:
    """The text a run hands on, and the tokens whose log probabilities come with it."""
    ticket = Ticket(asyncio.get_running_loop())
    ticket.chat_id = 1
    run = Run(None, ticket, threading.Event(), stops, 3)  # type: ignore[arg-type]
    for event in events:
        ticket.queue.put_nowait(event)
    text, tokens = "", []
    async for piece in run.pieces():
        if isinstance(piece, str):
            text += piece
        tokens += [scored.token_id for scored in run.take_logprobs()]
    return text, tokens


def test_the_tokens_of_a_stop_sequence_give_no_log_probabilities() -> None:
    events = [_chunk("Hello", 1), _chunk(" wor", 2), _chunk("ld\n\nUs", 3), _chunk("er:", 4),
              _chunk(" more", 5), Finished(1, "stop")]
    text, tokens = asyncio.run(_answer(events, ("\n\nUser:",)))
    assert text == "Hello world"
    # Token 3 holds the end of the text too; 4 is the stop sequence's own.
    assert tokens == [1, 2, 3]


def test_without_a_stop_every_token_comes_with_its_text() -> None:
    events = [_chunk("Hello", 1), _chunk(" world", 2), Finished(1, "length")]
    assert asyncio.run(_answer(events, ("\n\nUser:",))) == ("Hello world", [1, 2])


def test_a_prompt_too_long_for_memory_or_another_machine_is_a_context_error() -> None:
    """Past the model's context, past what memory holds now, or past what another
    machine of a pipeline holds: each is a 400 ``context_length_exceeded`` an agent
    answers by shortening the conversation, never a 500."""
    from engine.events import Failed
    from engine.server.app import _engine_error

    for kind in ("ContextTooLong", "MemoryShort", "MachineShort"):
        error = _engine_error(Failed(1, "This conversation needs 9,000 tokens …", kind))
        assert (error.status, error.code) == (400, "context_length_exceeded"), kind


@pytest.fixture(scope="module")
def refusing(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    yield from serve_templated(tmp_path_factory, "tiny-llama-refusing", REFUSING_TEMPLATE)


def test_a_template_that_refuses_a_conversation_is_a_400_in_each_api(refusing: Served) -> None:
    # Before: the template's exception escaped as a bare 500, in no API's shape.
    said = [{"role": "user", "content": "refuse me"}]
    chat = openai.OpenAI(base_url=refusing.url + "/v1", api_key=refusing.key, max_retries=0)
    with pytest.raises(openai.BadRequestError) as openai_error:
        chat.chat.completions.create(model="m", messages=said, max_tokens=3)
    assert openai_error.value.body["message"] == REFUSED
    with pytest.raises(openai.BadRequestError) as responses_error:
        chat.responses.create(model="m", input="refuse me", max_output_tokens=3, store=False)
    assert responses_error.value.body["message"] == REFUSED
    claude = anthropic.Anthropic(base_url=refusing.url, api_key=refusing.key, max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as anthropic_error:
        claude.messages.create(model="m", max_tokens=3, messages=said)
    assert anthropic_error.value.body["error"] == {
        "type": "invalid_request_error", "message": REFUSED}
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.count_tokens(model="m", messages=said)
    local = ollama.Client(host=refusing.url, headers={"Authorization": f"Bearer {refusing.key}"})
    with pytest.raises(ollama.ResponseError) as ollama_error:
        local.chat(model="m", messages=said)
    assert (ollama_error.value.status_code, ollama_error.value.error) == (400, REFUSED)
