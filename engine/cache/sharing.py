"""Pages shared between sessions' caches: one document held once in memory.

A cache made by ``engine.cache.adapter.make_cache`` joins another's page group and
points its block tables at that cache's first pages (reference-counted slots in
the same stores, see ``engine.cache.pages``); it gives them back when it trims,
resets or closes. Nothing is copied until a cache writes into a shared page.
"""

from __future__ import annotations

from typing import Any

from engine.cache.paged_cache import PagedKVCache


def _paged(cache: list[Any]) -> list[PagedKVCache]:
    return [c for c in cache if isinstance(c, PagedKVCache)]


def can_share(cache: list[Any], donor: list[Any]) -> bool:
    """Whether ``cache`` (holding nothing) can point at ``donor``'s pages."""
    mine, theirs = _paged(cache), _paged(donor)
    return (
        bool(mine) and len(mine) == len(theirs)
        and all(c.store is not None for c in [*mine, *theirs])
        and all(a.layer == b.layer for a, b in zip(mine, theirs, strict=True))
        and mine[0].pool.can_join(theirs[0].pool)
    )


def share_pages(cache: list[Any], donor: list[Any], tokens: int) -> None:
    """Make ``cache``'s paged layers hold ``donor``'s first ``tokens`` tokens, shared.

    Other layers are the caller's (copied states or checkpoints).
    """
    mine, theirs = _paged(cache), _paged(donor)
    mine[0].pool.join(theirs[0].pool)
    for layer, source in zip(mine, theirs, strict=True):
        layer.share_prefix(source, tokens)


def same_group(cache: list[Any], other: list[Any]) -> bool:
    """Whether two caches point into the same page stores (they may share pages)."""
    mine, theirs = _paged(cache), _paged(other)
    return bool(mine and theirs) and mine[0].pool.group is theirs[0].pool.group


def release_pages(cache: list[Any]) -> None:
    """Give back every page ``cache`` holds and leave its page group."""
    paged = _paged(cache)
    for layer in paged:
        layer.release()
    if paged:
        paged[0].pool.leave()


def shared_bytes(cache: list[Any]) -> tuple[int, int, int]:
    """(bytes of held pages other chats hold too, bytes with each shared page divided
    among its holders, other chats in the page group)."""
    shared, once = 0, 0.0
    for layer in _paged(cache):
        pages, share = layer.shared_pages
        page_bytes = layer.store.layout.page_bytes if layer.store is not None else 0
        shared += pages * page_bytes
        once += share * page_bytes
    paged = _paged(cache)
    others = len(paged[0].pool.group) - 1 if paged and shared else 0
    return shared, int(once), others
