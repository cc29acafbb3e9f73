"""How far batching moves a model's logits, and where two greedy answers part.

A verification feeds several tokens a pass where plain decoding feeds one; the
logits differ by the batch size's rounding, so greedy answers may part at a
near-tie. The speculative tests and ``python -m benchmarks speculative`` judge
a divergence against this noise.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

from engine.cache import adapter
from engine.errors import EngineError


@dataclass(frozen=True)
class BatchNoise:
    """How far an answer's logits move when its positions are batched, as in a verification.

    Attributes:
        margins: top-1 minus top-2 logit of each position, fed one token a step.
        deltas: the largest logit difference of each position between one row a
            step and ``rows`` rows a pass.
        flips: positions whose top token differs between the two.
    """

    margins: tuple[float, ...]
    deltas: tuple[float, ...]
    flips: tuple[int, ...]

    @property
    def threshold(self) -> float:
        """The margin below which batching can flip the top token: twice the largest shift.

        A flip needs top-1 to fall and top-2 to rise by a margin in total, and no
        logit moved by more than ``max(deltas)``.
        """
        return 2 * max(self.deltas, default=0.0)


def _logits(session: Any, ids: list[int]) -> np.ndarray:
    adapter.ensure_capacity(session.cache, len(ids))
    out = session.model(mx.array(ids)[None], cache=session.cache)[0].astype(mx.float32)
    session.tokens.extend(ids)
    return np.array(out)


def batch_noise(session: Any, prompt: list[int], answer: list[int], rows: int) -> BatchNoise:
    """Plain decoding's own batch-size noise on ``answer`` (greedy, after ``prompt``).

    Feeds the answer after the prompt twice, teacher-forced: one token a pass (plain
    decoding) and ``rows`` tokens a pass (a verification of ``rows - 1`` drafts), and
    compares the logits of every position, the one after the answer's last token
    included (where the answer chose to stop). The session is left holding
    ``prompt`` but its last token.
    """
    base = len(prompt) - 1
    kept = session.sync(prompt, keep_last=True)
    session.prefill(prompt[kept:-1], request_id=0, cancel=threading.Event(),
                    emit=lambda _: None, tick=lambda: None)
    session.checkpoint(boundary=True)
    fed = [prompt[-1], *answer]
    single = np.concatenate([_logits(session, [token]) for token in fed])
    session.trim_to(base)
    if len(session.tokens) != base:
        raise EngineError("The cache could not go back to the prompt to measure batch noise.")
    batched = np.concatenate([_logits(session, fed[i:i + rows])
                              for i in range(0, len(fed), rows)])
    session.trim_to(base)
    top2 = np.sort(single, axis=-1)[:, -2:]
    return BatchNoise(
        margins=tuple(float(m) for m in top2[:, 1] - top2[:, 0]),
        deltas=tuple(float(d) for d in np.abs(single - batched).max(axis=-1)),
        flips=tuple(int(i) for i in np.flatnonzero(single.argmax(-1) != batched.argmax(-1))),
    )


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first index where two answers differ (None: they are the same).

    Where one answer is a prefix of the other, they differ where the shorter one
    ended: there one decoding chose to stop and the other a token.
    """
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if first is None and len(a) != len(b):
        return min(len(a), len(b))
    return first
