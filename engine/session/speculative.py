"""Speculative decoding from the chat's own text: drafts looked up in the token ids held.

Answers about a document quote it, restate its names and numbers and repeat the
conversation's phrasing. :class:`ContextIndex` maps every recent n-gram (1 to
``MAX_NGRAM`` tokens) of the session's ids to the latest place it occurred, so the
longest suffix of the tokens so far that occurred before proposes the tokens that
followed it there (prompt lookup decoding). :class:`Drafter` decides how many to
propose from how many of its recent proposals were accepted, and stops proposing
for a while when few are: every decision comes from token counts, never from
timing, so the same chat gives the same answer on a busy machine.

Verification (in :class:`engine.session.sampling.AnswerStream`) runs one forward
pass over the last token and the draft and keeps the longest prefix the sampler
would have produced; :func:`accepted_prefix` is that rule.

Memory: the index holds one entry per n-gram length per token (about 100 bytes of
Python objects each, see docs/benchmarks.md), built once per session and extended
by the new tokens only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

# Longest and shortest n-gram looked up (longest first).
MAX_NGRAM = 4
MIN_NGRAM = 1
# Draft lengths the drafter moves between.
MIN_DRAFT = 2
MAX_DRAFT = 8
# Acceptance is judged over this many recent verifications.
WINDOW = 8
# Below this fraction of drafted tokens accepted (with at least WINDOW_TOKENS of
# them drafted), drafting pauses for a cool-down, doubling each time it recurs.
LOW_ACCEPTANCE = 0.15
WINDOW_TOKENS = 16
FIRST_COOLDOWN = 16
MAX_COOLDOWN = 256
# Token ids are packed into one int key per n-gram; below any real vocabulary's size.
_ID_BITS = 24
MODES = ("off", "lookup")


def _key(ids: Sequence[int]) -> int:
    key = len(ids)
    for token in ids:
        key = (key << _ID_BITS) | token
    return key


class ContextIndex:
    """The latest position after every n-gram of a token sequence, extended as it grows.

    ``position(ngram)`` is the index of the token that followed the n-gram's latest
    occurrence whose follower is known, so a lookup never finds the suffix itself.
    """

    def __init__(self) -> None:
        self.ids: list[int] = []
        self._after: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self.ids)

    def sync(self, ids: Sequence[int]) -> None:
        """Make the index describe ``ids``: keep the common prefix, index the rest.

        Entries past a cut are left in place and checked on lookup, so a cut costs
        nothing and the next tokens overwrite them.
        """
        keep = 0
        limit = min(len(self.ids), len(ids))
        # The held ids usually extend the indexed ones: check the end first.
        if self.ids[:limit] == list(ids[:limit]):
            keep = limit
        else:
            while keep < limit and self.ids[keep] == ids[keep]:
                keep += 1
        del self.ids[keep:]
        if not keep:
            self._after.clear()  # a new conversation: drop the old one's entries
        self.extend(ids[keep:])

    def extend(self, new: Sequence[int]) -> None:
        """Append ``new`` ids; O(len(new) x MAX_NGRAM)."""
        ids, after = self.ids, self._after
        for token in new:
            end = len(ids)  # the n-grams ending just before ``token`` now have a follower
            for n in range(MIN_NGRAM, min(MAX_NGRAM, end) + 1):
                after[_key(ids[end - n:end])] = end
            ids.append(token)

    def propose(self, pending: Sequence[int], count: int) -> list[int]:
        """The ``count`` ids that followed the longest suffix seen before.

        The sequence is the indexed ids followed by ``pending`` (the few tokens
        not indexed yet). Empty when no suffix of ``MIN_NGRAM`` to ``MAX_NGRAM``
        tokens occurred before.
        """
        if count < 1:
            return []
        ids = self.ids
        tail = ids[-MAX_NGRAM:] + list(pending)
        for n in range(min(MAX_NGRAM, len(tail)), MIN_NGRAM - 1, -1):
            suffix = tail[len(tail) - n:]
            at = self._after.get(_key(suffix))
            if at is None or at > len(ids) or at < n or ids[at - n:at] != suffix:
                continue  # never seen, or an entry past a cut (see ``sync``)
            found = ids[at:at + count]
            if len(found) < count:
                # The match runs into the pending tokens (a loop): they follow on.
                found = (found + list(pending))[:count]
            if found:
                return found
        return []


class Drafter:
    """How many tokens to propose, from the recent acceptance (token counts only)."""

    def __init__(self) -> None:
        self.size = MIN_DRAFT * 2
        self.recent: deque[tuple[int, int]] = deque(maxlen=WINDOW)
        self.cooling = 0
        self._next_cooldown = FIRST_COOLDOWN

    def draft_size(self, room: int) -> int:
        """Tokens to propose now, at most ``room`` (0 while cooling down)."""
        if self.cooling > 0:
            self.cooling -= 1
            return 0
        return max(0, min(self.size, room))

    def record(self, drafted: int, accepted: int) -> None:
        """Learn from one verification of ``drafted`` tokens, ``accepted`` of them kept."""
        if drafted < 1:
            return
        self.recent.append((drafted, accepted))
        total = sum(d for d, _ in self.recent)
        kept = sum(a for _, a in self.recent)
        rate = kept / total
        wanted = round(MIN_DRAFT + rate * (MAX_DRAFT - MIN_DRAFT))
        self.size = max(MIN_DRAFT, min(MAX_DRAFT, wanted))
        if total >= WINDOW_TOKENS and rate < LOW_ACCEPTANCE:
            # The text is not repeating itself: stop paying for verifications a while.
            self.cooling = self._next_cooldown
            self._next_cooldown = min(MAX_COOLDOWN, self._next_cooldown * 2)
            self.recent.clear()
            self.size = MIN_DRAFT
        elif rate >= 2 * LOW_ACCEPTANCE:
            self._next_cooldown = FIRST_COOLDOWN


def accepted_prefix(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """How many draft tokens to keep: the longest prefix the sampler reproduced.

    ``sampled[i]`` is the token the sampler drew at draft position ``i`` (after the
    same processors as plain decoding). Greedy, that is the argmax test. With
    temperature it is the speculative-sampling rule for a deterministic draft
    (q one-hot on ``t``): a draw ``x ~ p`` equals ``t`` with probability ``p(t)``
    (accept), and otherwise is a draw from ``p`` with ``t`` removed and renormalized
    (the resampled token), so the answer's distribution is plain decoding's.
    """
    n = 0
    while n < len(draft) and sampled[n] == draft[n]:
        n += 1
    return n
