"""The endings a request's stop becomes, the same alone and in a batch."""

from __future__ import annotations

from engine.errors import Cancelled, ContextTooLong
from engine.events import Failed, Finished
from engine.runtime.endings import failed, read_cancelled


def test_a_read_cancelled_ends_cancelled_with_what_it_kept() -> None:
    stop = Cancelled("Stopped.").stopped_reading(32, 100)
    assert isinstance(stop, Cancelled)
    ending = read_cancelled(7, stop, reused=16)
    assert isinstance(ending, Finished) and ending.reason == "cancelled"
    assert (ending.kept_tokens, ending.total_tokens) == (32, 100)
    assert ending.stats is not None and ending.stats.generated_tokens == 0
    assert (ending.stats.prompt_tokens, ending.stats.reused_tokens) == (100, 16)


def test_a_failure_says_the_errors_words_and_kind() -> None:
    ending = failed(3, ContextTooLong("The conversation does not fit."))
    assert ending == Failed(3, "The conversation does not fit.", "ContextTooLong", None, None)
