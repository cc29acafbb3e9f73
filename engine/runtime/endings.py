"""How a request ends, as an event, from what stopped it: said once for the
answers run alone and those run in the batch."""

from __future__ import annotations

from engine.errors import Cancelled, EngineError
from engine.events import Failed, Finished, GenerationStats


def read_cancelled(request_id: int, stop: Cancelled, reused: int) -> Finished:
    """How an answer ends that was stopped while its conversation was read in:
    no answer, the chunks read stay held (``stop`` says how many)."""
    stats = GenerationStats(stop.total_tokens or 0, 0, None, 0.0, 0.0, reused_tokens=reused)
    return Finished(request_id, "cancelled", stats, stop.kept_tokens, stop.total_tokens)


def failed(request_id: int, error: EngineError) -> Failed:
    """How a request ends that ``error`` stopped, in the error's own words."""
    return Failed(request_id, str(error), type(error).__name__, error.kept_tokens,
                  error.total_tokens)
