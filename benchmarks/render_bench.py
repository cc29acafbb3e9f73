"""``python -m benchmarks.render_bench [TOKENS ...]``: tokenizer time per turn.

A turn of a long conversation (a document, an answer, a follow-up) as the engine
read it before and after the prompt was rendered once per request, with the demo
model's tokenizer: before, ``HeldSessions.restore`` and ``Session.chat`` each
rendered and tokenized the conversation and a checkpoint model tokenized the
conversation again per message boundary; now one ``render_prompt`` and the
boundaries from its offsets. Also the attach-time cut of a document longer than
the room: up to ten tokenizations before, one now. Prints a Markdown table.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any

from engine.session.prompt_ids import (
    message_boundaries,
    render_conversation,
    render_prompt,
    token_ends,
)

SENTENCE = ("Longleaf pine {i} grows on sandy soil from Virginia to Texas; its needles "
            "reach {j} cm, and fire keeps the understory open. ")
MOST = 2  # boundaries a checkpoint model looks for (checkpoints.MAX_BOUNDARIES - 1)


def document(tokenizer: Any, tokens: int) -> str:
    """A text of about ``tokens`` tokens under ``tokenizer``."""
    sample = "".join(SENTENCE.format(i=i, j=i % 40) for i in range(200))
    per_char = len(tokenizer.encode(sample, add_special_tokens=False)) / len(sample)
    count = int(tokens / per_char / len(sample) * 200) + 1
    return "".join(SENTENCE.format(i=i, j=i % 40) for i in range(count))


def _seconds(work: Callable[[], object]) -> float:
    start = time.perf_counter()
    work()
    return time.perf_counter() - start


def _old_fitting_prefix(text: str, max_tokens: int, count: Callable[[str], int]) -> str:
    """The attach-time cut as it was: tokenize the text, then prefixes, up to 8 more times."""
    total = count(text)
    if total <= max_tokens:
        return text
    cut = int(len(text) * max_tokens / total)
    for _ in range(8):
        if cut <= 0 or count(text[:cut]) <= max_tokens:
            break
        cut = int(cut * 0.95)
    count(text[:cut])  # the part's own count
    return text[:cut]


def measure(tokenizer: Any, tokens: int) -> dict[str, float]:
    """Seconds of each way of reading one turn of a ``tokens``-token conversation."""
    doc = document(tokenizer, tokens)
    first = [{"role": "user", "content": doc + "\n\nSummarize this."}]
    messages = [*first, {"role": "assistant", "content": "It is about longleaf pines."},
                {"role": "user", "content": "Where do they grow?"}]
    held = len(render_conversation(tokenizer, first, add_generation_prompt=True))

    def before() -> None:
        render_conversation(tokenizer, messages, add_generation_prompt=True)  # restore
        prompt = render_conversation(tokenizer, messages, add_generation_prompt=True)  # chat
        message_boundaries(tokenizer, messages, prompt, after=held, most=MOST)

    def after() -> None:
        prompt = render_prompt(tokenizer, messages, add_generation_prompt=True)
        prompt.boundaries(tokenizer, after=held, most=MOST)

    def count(text: str) -> int:
        return len(tokenizer.encode(text, add_special_tokens=False))

    room = tokens * 3 // 4  # the document is longer than the room left
    total = len(render_conversation(tokenizer, messages, add_generation_prompt=True))
    return {
        "tokens": total,
        "before": _seconds(before),
        "after": _seconds(after),
        "attach_before": _seconds(lambda: _old_fitting_prefix(doc, room, count)),
        "attach_after": _seconds(lambda: token_ends(tokenizer, doc)),
    }


def main(argv: list[str]) -> None:
    """Print the table for the token counts in ``argv`` (default 100k and 262k)."""
    from mlx_lm.tokenizer_utils import load as load_tokenizer

    from engine.models.demo import ensure_demo_model

    sizes = [int(a) for a in argv] or [100_000, 262_144]
    tokenizer = load_tokenizer(ensure_demo_model())
    print("| conversation tokens | per turn before (s) | per turn after (s) | after / before "
          "| attach cut before (s) | attach cut after (s) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for size in sizes:
        row = measure(tokenizer, size)
        print(f"| {row['tokens']:,} | {row['before']:.2f} | {row['after']:.2f} | "
              f"{row['after'] / row['before']:.2f} | {row['attach_before']:.2f} | "
              f"{row['attach_after']:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
