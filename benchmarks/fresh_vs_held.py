"""``python -m benchmarks.fresh_vs_held [MODE ...]``: a fresh read vs a held (reopened) one.

A chat's second turn, read two ways with the demo model: by the session that
answered the first turn (what a reopened KV snapshot holds too: reopening restores
its pages byte for byte, ``tests/engine/snapshots/test_snapshot.py``), whose answer
tokens went in one decoding step at a time and whose follow-up is read from where
it stood; and by a fresh session that reads the whole conversation along the
chunk plan. Same chunk setting, so the difference is the mode's own rounding of
rows computed in different batches. Prints a Markdown table: the largest logit
difference after the second prompt relative to the largest logit, whether the
next token agrees, and how many tokens the greedy second answers share.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, cast

import mlx.core as mx

from engine.cache.modes import MODES, KvMode, parse_mode
from engine.models.loader import LoadedModel
from engine.session.sampling import SamplingParams
from engine.session.session import Session

DOCUMENT = " ".join(
    f"Longleaf pine stand {i} grows on sandy soil; fire every {2 + i % 5} years keeps it open."
    for i in range(40))
# The held answer goes in one decoding step at a time (see above), not in verifications.
ANSWER = SamplingParams(temperature=0.0, max_tokens=32, speculative="off")
QUIET: dict[str, Any] = {"request_id": 0, "emit": lambda event: None, "tick": lambda: None}


def _chat(session: Session, messages: list[dict[str, str]]) -> list[int]:
    before = len(session.tokens)
    session.chat(messages, ANSWER, cancel=threading.Event(), **QUIET)
    prompt = session.render(messages, add_generation_prompt=True)
    return session.tokens[max(before, len(prompt)):]


def _next_logits(session: Session, prompt: list[int]) -> mx.array:
    kept = session.sync(prompt, keep_last=True)
    session.prefill(prompt[kept:-1], cancel=threading.Event(), **QUIET)
    logits = session.model(mx.array(prompt[-1:])[None], cache=session.cache)[0, -1]
    mx.eval(logits)
    return logits.astype(mx.float32)


def measure(loaded: LoadedModel, mode: KvMode, chunk: int = 128) -> dict[str, float]:
    """The second turn's difference between a held and a fresh read, in ``mode``."""
    first = [{"role": "user", "content": DOCUMENT + "\n\nHow often do fires come?"}]
    held = Session("held", loaded, mode, chunk_size=chunk)
    answer = held.tokenizer.decode(_chat(held, first))
    second = [*first, {"role": "assistant", "content": answer},
              {"role": "user", "content": "And what soil do they like?"}]
    prompt = held.render(second, add_generation_prompt=True)
    fresh = Session("fresh", loaded, mode, chunk_size=chunk)
    a, b = _next_logits(held, prompt), _next_logits(fresh, prompt)
    # Both logits are float32 (_next_logits), so the item is a Python float.
    relative = cast(float, (mx.abs(a - b).max() / mx.abs(b).max()).item())
    top_agrees = int(mx.argmax(a).item() == mx.argmax(b).item())
    held.close()
    fresh.close()
    # The answers as the user gets them: the held session after its first answer,
    # a fresh one reading everything.
    held = Session("held", loaded, mode, chunk_size=chunk)
    _chat(held, first)
    from_held = _chat(held, second)
    from_fresh = _chat(Session("fresh", loaded, mode, chunk_size=chunk), second)
    shared = next((i for i, (x, y) in enumerate(zip(from_held, from_fresh, strict=False))
                   if x != y), min(len(from_held), len(from_fresh)))
    return {"tokens": len(prompt), "relative": relative, "top": top_agrees,
            "shared": shared, "answer": len(from_fresh)}


def main(argv: list[str]) -> None:
    """Print the table for the modes in ``argv`` (default fp16 q8 q6 q4)."""
    from engine.models.loader import load_model

    loaded = load_model("demo")
    print("| mode | second prompt tokens | max logit diff / max logit | next token agrees "
          "| greedy answer tokens shared |")
    print("|---|---:|---:|---|---:|")
    for mode in [parse_mode(name) for name in argv] or list(MODES):
        row = measure(loaded, mode)
        print(f"| {mode} | {row['tokens']} | {row['relative']:.4f} | "
              f"{'yes' if row['top'] else 'no'} | {row['shared']} of {row['answer']} |")


if __name__ == "__main__":
    main(sys.argv[1:])
