"""The server's ``Run``: an answer's text and its tokens' log probabilities, cut
at a stop sequence, without a model."""

from __future__ import annotations

import asyncio
import threading

from engine.events import Finished, TokenChunk, TokenLogprob
from engine.server.app import Run
from engine.server.bridge import Ticket


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
