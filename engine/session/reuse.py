"""Reuse what another open chat already read: one document is read once.

Chats of the same model, KV mode, page size and rotation that start with the same
token ids (one document dropped into several chats, a chat reopened in the same
mode or duplicated to branch) would store the same pages for that prefix. A
session about to read a prompt takes the longest such prefix from another held
session instead of reading it again, pointing at the same pages
(``engine.cache.sharing``), under the rules a snapshot reopen follows: paged
layers can stop at any token; linear-attention and sliding-window layers only
where the other session holds a checkpoint (``engine.session.checkpoints``) or at its
full length, their state copied.

On a pipeline, rank 0's session decides and each other rank's session takes the
same prefix of its own layers' pages (``SessionLink.adopt``).

Every function here runs MLX and must be called from the engine worker thread.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from engine.cache import adapter, sharing
from engine.cache.paged_cache import PagedKVCache, cache_tokens
from engine.session import checkpoints
from engine.session.prompt_ids import common_prefix

if TYPE_CHECKING:
    from engine.session.session import Session


@dataclass(frozen=True)
class Offer:
    """A prefix another session can hand over.

    Attributes:
        donor: the ``engine.session.session.Session`` that holds it.
        tokens: how many of its first tokens to take.
        states: the donor's checkpoint at ``tokens`` for its non-paged layers, or
            None: copy their current state (the donor holds exactly ``tokens``), or
            the model's layers are all paged.
    """

    donor: Session
    tokens: int
    states: checkpoints.Checkpoint | None = None


def _paged(cache: list[Any]) -> list[PagedKVCache]:
    return [c for c in cache if isinstance(c, PagedKVCache)]


def _layout(session: Session) -> tuple:
    """What must match for two sessions' pages to be interchangeable."""
    return tuple(
        (c.layer, getattr(c.rotation, "format_id", None),
         None if c.store is None else (c.store.layout.kv_heads, c.store.layout.head_dim))
        for c in _paged(session.cache)
    )


def compatible(session: Session, donor: Session) -> bool:
    """Whether ``donor``'s pages can serve ``session`` as they are."""
    return (
        donor is not session
        and donor.loaded is session.loaded
        and (donor.mode, donor.page_size) == (session.mode, session.page_size)
        and donor.cache_kind == session.cache_kind == "paged"
        and len(donor.cache) == len(session.cache)
        and _layout(donor) == _layout(session)
        and all(c.store is not None for c in _paged(session.cache))
    )


def offer(donor: Session, keep: int) -> Offer | None:
    """What ``donor`` can hand over of its first ``keep`` tokens (None: nothing)."""
    if keep <= 0:
        return None
    # Its state as it stands is its tokens' only while no pass is queued past them
    # (an answer in a batch): else it too comes from a checkpoint.
    whole = keep == len(donor.tokens) == cache_tokens(donor.cache)
    if whole or not donor.needs_checkpoints:
        return Offer(donor, keep)
    # Linear-attention and wrapped window state cannot rewind: stop at the newest
    # checkpoint the donor took at or before the point where the prompts part.
    taken = donor.checkpoints.at_most(keep)
    if taken is None or taken.tokens <= 0:
        return None
    return Offer(donor, taken.tokens, taken)


def best_offer(
    session: Session, others: Iterable[Session], prompt: Sequence[int], *, keep_last: bool
) -> Offer | None:
    """The longest prefix another session can give ``session``, when it beats what
    ``session`` holds by at least one page."""
    most = len(prompt) - 1 if keep_last else len(prompt)
    held = min(common_prefix(session.tokens, prompt), most)
    if most - held < session.page_size:
        return None  # nothing another chat could add is worth a page
    best: Offer | None = None
    for donor in others:
        if not donor.tokens or not compatible(session, donor):
            continue
        keep = min(common_prefix(donor.tokens, prompt), most)
        if keep < held + session.page_size:
            continue
        found = offer(donor, keep)
        if found is not None and found.tokens >= held + session.page_size and (
            best is None or found.tokens > best.tokens
        ):
            best = found
    return best


def adopt(session: Session, found: Offer) -> int:
    """Make ``session`` hold ``found``'s prefix; returns the tokens it now holds.

    Whatever ``session`` held is dropped first (the offer beats it). The paged
    layers point at the donor's pages (``engine.cache.sharing``): no page is copied
    until one of the two writes into a shared one.
    """
    donor, tokens = found.donor, found.tokens
    session.reset()
    if not sharing.can_share(session.cache, donor.cache):
        return 0
    sharing.share_pages(session.cache, donor.cache, tokens)
    # Before the checkpoints: a new token list drops those past what it shares
    # with the old one, which is nothing after the reset.
    session.tokens = [int(t) for t in donor.tokens[:tokens]]
    if donor.needs_checkpoints:
        # Its layers hold exactly ``tokens`` when no checkpoint was needed.
        states = found.states or checkpoints.take(donor.cache, tokens, boundary=True)
        for index, state in states.states:
            session.cache[index].state = checkpoints.copy_state(state)
        for kept in [*donor.checkpoints.kept, states]:
            if kept.tokens <= tokens:
                session.checkpoints.add(kept)  # frozen, and copied again on every use
    mx.eval(adapter.eval_targets(session.cache))
    followers = getattr(session, "followers", None)
    if followers is not None and not followers.adopt(donor.followers, tokens):
        # A pipeline's other ranks could not take the same prefix of their layers:
        # none is taken anywhere, and the prompt is read.
        session.reset()
        return 0
    return tokens
