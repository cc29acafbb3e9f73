"""Speculative decoding from the chat's own text: drafts looked up in the token ids held.

Answers about a document quote it, restate its names and numbers and repeat the
conversation's phrasing. :class:`ContextIndex` maps every recent n-gram (1 to
``MAX_NGRAM`` tokens) of the session's ids to the latest place it occurred, so the
longest suffix of the tokens so far that occurred before proposes the tokens that
followed it there (prompt lookup decoding).

:class:`Drafter` decides whether a proposal is worth a verification and how many of
its tokens to verify. A proposal's match length is how far back the text before it
agrees with the text before its source (the n-gram looked up, extended backwards):
it grows by one with every token a quote or a loop copies, and the chance that the
next token is copied too grows with it. The drafter keeps an estimate of that
chance per band of match lengths, learnt token by token from verified drafts and,
while it does not draft, from scoring the proposals plain decoding's own tokens
would have accepted (free: a lookup per token). A draft is verified only when the
expected tokens per pass beat plain decoding's one by a margin, with a
verification's extra rows priced at a fixed share of a step per backend. Every
decision comes from token counts and that constant, never from timing, so the same
chat takes the same passes on a busy machine.

Verification (in :class:`engine.session.sampling.AnswerStream`) runs one forward
pass over the last token and the draft and keeps the longest prefix the sampler
would have produced; :func:`accepted_prefix` is that rule.

Memory: the index is two numpy arrays, the ids and a table of positions (a few
tens of bytes per held token, see docs/benchmarks.md), built once per session and
extended by the new tokens only.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

# Longest and shortest n-gram looked up (longest first).
MAX_NGRAM = 4
MIN_NGRAM = 1
# Longest draft verified in one pass.
MAX_DRAFT = 8
# What verifying each drafted token adds to a pass, as a share of one plain step.
# On Metal a step is bound by reading the weights and the KV once, so extra query
# rows cost little; on a CPU they cost compute (see docs/benchmark-runs.md).
ROW_COST = {"gpu": 0.05, "cpu": 0.2}
# A draft is verified only when its expected tokens per unit of cost beat plain
# decoding's one token per step by this factor.
GAIN_MARGIN = 1.1
# Match lengths are measured back this far; a longer match counts as this long.
MAX_MATCH = 8
# The bands of match lengths that learn apart: the shortest length of each band.
# Short matches are told apart one by one (a one-token match is chance, a four-token
# one is a phrase); a long match is a quote or a loop whatever its exact length, so
# one band holds them all and a copy learns in one estimate as it goes on.
MATCH_BANDS = (1, 2, 3, 4, 5, MAX_MATCH)
# Prior acceptance per band and its weight in tokens: a longer match predicts more
# often. Up to three tokens the priors are low enough that a CPU verifies nothing
# blind: such matches abound in text that does not repeat the context, where every
# blind draft is a cost. A match of four tokens or more, which such text rarely
# makes, drafts one token at once; scoring the skipped proposals corrects every
# band within a few tokens.
PRIOR_ACCEPTANCE = (0.1, 0.2, 0.3, 0.35, 0.4, 0.55)
PRIOR_WEIGHT = 2.0
# Each proposed token judged (accepted, or the first rejected) scales its band's
# older counts by this factor: the estimate follows the last ten or so, as the text
# moves between quoting and paraphrasing.
DECAY = 0.9
# The index's table has at least this many slots per n-gram it holds, so most
# n-grams keep their own slot (a collision only loses the older entry: every
# lookup checks the ids).
SLOTS_PER_ENTRY = 2
MIN_SLOTS = 1 << 12
MODES = ("off", "lookup")
# Multiplicative hashing (Knuth): the top bits of the product are the slot.
_HASH_SEED = 0x9E3779B97F4A7C15
_HASH_MUL = np.uint64(0xBF58476D1CE4E5B9)
# The table is filled this many n-gram ends at a time, so a whole document's first
# indexing has a bounded transient.
_INDEX_BLOCK = 1 << 16


def _table_bits(tokens: int) -> int:
    """log2 of the table's size for ``tokens`` ids: the smallest power of two with
    ``SLOTS_PER_ENTRY`` slots per entry. A function of the length alone, so the same
    ids index the same way however they came."""
    wanted = max(MIN_SLOTS, SLOTS_PER_ENTRY * MAX_NGRAM * tokens)
    return (wanted - 1).bit_length()


def _slots(ids: np.ndarray, ends: np.ndarray, n: int, bits: int) -> np.ndarray:
    """The table slot of each n-gram ``ids[end - n:end]`` (one definition for all)."""
    h = np.full(ends.shape, (_HASH_SEED * n) % 2**64, dtype=np.uint64)
    for j in range(n, 0, -1):
        h = (h ^ ids[ends - j].astype(np.uint64)) * _HASH_MUL
    return (h >> np.uint64(64 - bits)).astype(np.int64)


class Proposal(NamedTuple):
    """Tokens looked up for what comes next, and the length of the match (at most
    ``MAX_MATCH``): how many tokens before them agree with the text so far."""

    tokens: list[int]
    match_length: int


def band(match_length: int) -> int:
    """The index in ``MATCH_BANDS`` of the band that holds ``match_length``."""
    return bisect.bisect_right(MATCH_BANDS, match_length) - 1


NO_PROPOSAL = Proposal([], 0)


class ContextIndex:
    """The latest position after every n-gram of a token sequence, extended as it grows.

    Two numpy arrays: the ids (int32) and a hash table of int32 positions, one
    slot per n-gram of 1 to ``MAX_NGRAM`` tokens holding the index of the token
    that followed its latest occurrence. A lookup checks the ids at that
    position, so a collision or a stale slot costs a miss, never a wrong draft.
    Memory: 4 bytes per id (a buffer that doubles) and a table of 4-byte slots,
    between one and two times ``SLOTS_PER_ENTRY x MAX_NGRAM`` per id (it doubles
    too, rebuilt from the ids in one vectorized pass).
    """

    def __init__(self) -> None:
        self._ids = np.zeros(MIN_SLOTS, dtype=np.int32)
        self._len = 0
        self._bits = MIN_SLOTS.bit_length() - 1
        self._table = np.full(MIN_SLOTS, -1, dtype=np.int32)

    def __len__(self) -> int:
        return self._len

    @property
    def ids(self) -> np.ndarray:
        """The indexed ids (a view: valid until the next change)."""
        return self._ids[:self._len]

    @property
    def nbytes(self) -> int:
        """Bytes the index holds (ids buffer and table)."""
        return self._ids.nbytes + self._table.nbytes

    def sync(self, ids: Sequence[int]) -> None:
        """Make the index describe ``ids``: keep the common prefix, index the rest.

        After a cut the table is rebuilt from the kept ids (one vectorized pass,
        once per answer that follows a cut): the cut tokens' n-grams had replaced
        the kept ids' entries (an answer quoting the document points the document's
        n-grams at itself), and emptying their slots would lose the document's.
        """
        target = np.asarray(ids, dtype=np.int32)
        limit = min(self._len, len(target))
        held = self._ids[:limit]
        differ = np.flatnonzero(held != target[:limit])
        keep = int(differ[0]) if differ.size else limit
        if keep < self._len:
            self._len = keep
            self._resize(keep)
        self.extend(target[keep:])

    def extend(self, new: Sequence[int] | np.ndarray) -> None:
        """Append ``new`` ids; O(len(new) x MAX_NGRAM)."""
        new = np.asarray(new, dtype=np.int32)
        if not new.size:
            return
        start, end = self._len, self._len + new.size
        if end > self._ids.size:
            grown = np.zeros(max(end, 2 * self._ids.size), dtype=np.int32)
            grown[:start] = self._ids[:start]
            self._ids = grown
        self._ids[start:end] = new
        self._len = end
        if _table_bits(end) != self._bits:
            self._resize(end)
        else:
            self._index(start, end)

    def _resize(self, tokens: int) -> None:
        self._bits = _table_bits(tokens)
        self._table = np.full(1 << self._bits, -1, dtype=np.int32)
        self._index(0, tokens)

    def _index(self, start: int, end: int) -> None:
        """Point the n-grams that end at positions ``start..end-1`` at those positions."""
        for block in range(start, end, _INDEX_BLOCK):
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                self._index_block(np.arange(max(block, n), min(end, block + _INDEX_BLOCK)), n)

    def _index_block(self, ends: np.ndarray, n: int) -> None:
        if ends.size:
            slots = _slots(self._ids, ends, n, self._bits)
            # The latest position wins a slot, whatever the n-gram's length, so the
            # table is the same however the ids came (at once, token by token, or
            # after a cut): the last occurrence of each slot in this block, then
            # the later of it and what the slot holds.
            last = slots.size - 1 - np.unique(slots[::-1], return_index=True)[1]
            held = self._table[slots[last]]
            self._table[slots[last]] = np.maximum(held, ends[last])

    def propose(self, pending: Sequence[int], count: int) -> Proposal:
        """The ``count`` ids that followed the longest suffix seen before.

        The sequence is the indexed ids followed by ``pending`` (the few tokens
        not indexed yet). ``NO_PROPOSAL`` when no suffix of ``MIN_NGRAM`` to
        ``MAX_NGRAM`` tokens occurred before. A match close to the end (the text repeating
        itself) continues the repetition past the end of what is known.
        """
        if count < 1:
            return NO_PROPOSAL
        ids = self.ids
        tail = np.concatenate([ids[-MAX_MATCH:], np.asarray(pending, dtype=np.int32)])
        for n in range(min(MAX_NGRAM, tail.size), MIN_NGRAM - 1, -1):
            at = int(self._table[_slots(tail, np.array([tail.size]), n, self._bits)[0]])
            if at < n or at >= self._len or not np.array_equal(ids[at - n:at], tail[-n:]):
                continue  # never seen, a collision, or emptied
            known = ids[at:at + count].tolist()
            if len(known) < count:
                # The match runs into the last tokens: the text repeats itself with
                # period ``len(whole)``, so the repetition goes on.
                whole = [*ids[at:].tolist(), *pending]
                known = [whole[i % len(whole)] for i in range(count)]
            return Proposal(known, _match_length(ids[max(0, at - MAX_MATCH):at], tail))
        return NO_PROPOSAL


def _match_length(before: np.ndarray, tail: np.ndarray) -> int:
    """How many last tokens of ``before`` equal the last tokens of ``tail``, at most
    ``MAX_MATCH``."""
    n = min(before.size, tail.size, MAX_MATCH)
    differ = np.flatnonzero(before[before.size - n:][::-1] != tail[tail.size - n:][::-1])
    return int(differ[0]) if differ.size else n


class Drafter:
    """Whether to verify a proposal and how much of it (token counts only).

    Args:
        row_cost: what each drafted token adds to a pass, as a share of a plain
            step (``ROW_COST`` of the backend).
    """

    def __init__(self, row_cost: float) -> None:
        self.row_cost = row_cost
        # Per band of match lengths: accepted proposed tokens, and rejections.
        self.hits = [p * PRIOR_WEIGHT for p in PRIOR_ACCEPTANCE]
        self.misses = [(1 - p) * PRIOR_WEIGHT for p in PRIOR_ACCEPTANCE]
        self._watched: Proposal = NO_PROPOSAL
        self._matched = 0

    def acceptance(self, match_length: int) -> float:
        """The estimated chance that a token proposed after a match this long is kept."""
        i = band(match_length)
        return self.hits[i] / (self.hits[i] + self.misses[i])

    def draft_size(self, proposal: Proposal, room: int) -> int:
        """How many of ``proposal``'s tokens to verify, at most ``room``; 0: decode plainly.

        The size that maximizes the expected tokens per unit of cost,
        ``(1 + p1 + p1 p2 + ...) / (1 + row_cost * k)``, where ``p1`` is the
        acceptance at the proposal's match length and each accepted token makes
        the match one longer (a draft is kept up to its first rejection),
        provided that beats plain decoding by ``GAIN_MARGIN``.
        """
        limit = min(len(proposal.tokens), room, MAX_DRAFT)
        best, best_gain, expected, term = 0, GAIN_MARGIN, 1.0, 1.0
        for k in range(1, limit + 1):
            term *= self.acceptance(proposal.match_length + k - 1)
            expected += term
            gain = expected / (1 + self.row_cost * k)
            if gain > best_gain:
                best, best_gain = k, gain
        return best

    def record(self, match_length: int, drafted: int, accepted: int) -> None:
        """Learn from one judged draft (verified, or scored by ``watch``) of
        ``drafted`` tokens after a match of ``match_length``, ``accepted`` kept.

        Each accepted token counts at the match length it was proposed at, which
        grows along the draft; the first rejected one (if any) at the next.
        """
        for i in range(accepted):
            self._judge(match_length + i, True)
        if accepted < drafted:
            self._judge(match_length + accepted, False)
        self._watched = NO_PROPOSAL  # stale: the verified tokens moved the text on

    def _judge(self, match_length: int, kept: bool) -> None:
        i = band(match_length)
        self.hits[i] = self.hits[i] * DECAY + kept
        self.misses[i] = self.misses[i] * DECAY + (not kept)

    def watch(self, token: int, index: ContextIndex) -> None:
        """Score the proposal plain decoding left unverified against its next ``token``.

        Called for each token plain decoding holds, after ``index`` holds it too.
        Each token is judged as it comes, so a quote's first copied tokens already
        raise the estimate for the longer match that follows. A new proposal is
        looked up when the watched one missed or ran out, before any later token
        is indexed, exactly as a verification would have proposed it.
        """
        watched, at = self._watched, self._matched
        if watched.tokens:
            kept = token == watched.tokens[at]
            self._judge(watched.match_length + at, kept)
            if kept and at + 1 < len(watched.tokens):
                self._matched += 1
                return
        self._watched = index.propose([], MAX_DRAFT)
        self._matched = 0

    def _rest(self) -> Proposal:
        """What the watched proposal still predicts, at the match length it has reached."""
        watched, at = self._watched, self._matched
        return Proposal(watched.tokens[at:], min(MAX_MATCH, watched.match_length + at))

    def wants_draft(self) -> bool:
        """Whether the rest of the proposal being watched is worth verifying now."""
        return self.draft_size(self._rest(), MAX_DRAFT) > 0

    def continuation(self, pending: int) -> Proposal:
        """The rest of the watched proposal after ``pending``, if it predicted ``pending``.

        Plain decoding pauses when the watched proposal is worth verifying; the
        token it was computing when it paused may already be a fresh, shorter
        match, so the draft goes on from the proposal that earned the pause.
        """
        rest = self._rest()
        if rest.tokens[:1] == [pending]:
            return Proposal(rest.tokens[1:], min(MAX_MATCH, rest.match_length + 1))
        return NO_PROPOSAL


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
