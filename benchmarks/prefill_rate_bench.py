"""``python -m benchmarks.prefill_rate_bench [LEARN PREDICT [MODE [CHUNK]]]``: read times.

The app estimates how long a read takes from a line, ``a + b·context`` seconds a
token, fitted to the chunk timings of earlier reads (``engine.memory.prefill_rate``).
This reads a ``LEARN``-token document once on the demo model, fits the line to
its chunks, then reads a ``PREDICT``-token document in a fresh session and
compares, against that read's measured seconds: the line's estimate of the
whole read and of what is left at a quarter of it (the live ETA), and the
constant rate the app used before (the first read's average tokens per second).
Prints a Markdown table.
"""

from __future__ import annotations

import sys
import threading

from benchmarks.render_bench import document
from engine.cache.modes import Q8, KvMode, parse_mode
from engine.events import IngestProgress
from engine.memory.prefill_rate import ChunkTiming, least_squares_rate
from engine.models.loader import LoadedModel
from engine.session.session import Session


def _read(loaded: LoadedModel, mode: KvMode, chunk: int, tokens: int) -> list[IngestProgress]:
    session = Session("bench", loaded, mode, chunk_size=chunk)
    events: list[object] = []
    text = document(session.tokenizer, tokens)
    session.ingest([{"role": "user", "content": text}], request_id=1,
                   cancel=threading.Event(), emit=events.append, tick=lambda: None)
    session.close()
    return [e for e in events if isinstance(e, IngestProgress)]


def _timings(progress: list[IngestProgress]) -> list[ChunkTiming]:
    return [ChunkTiming(p.chunk_tokens, p.chunk_start, p.chunk_seconds) for p in progress]


def measure(
    loaded: LoadedModel, mode: KvMode, chunk: int, learn: int, predict: int
) -> dict[str, float]:
    """Seconds estimated and measured for a ``predict``-token read after a ``learn`` one."""
    _read(loaded, mode, chunk, 512)  # warm-up: compiled kernels, caches
    learned = _read(loaded, mode, chunk, learn)
    rate = least_squares_rate(_timings(learned))
    assert rate is not None
    constant = learned[-1].tokens_done / sum(p.chunk_seconds for p in learned)
    read = _read(loaded, mode, chunk, predict)
    seconds = [p.chunk_seconds for p in read]
    total = read[-1].tokens_done
    quarter = next(i for i, p in enumerate(read) if p.tokens_done >= total // 4)
    at = read[quarter].chunk_start + read[quarter].chunk_tokens
    return {
        "a_ms": rate.a * 1e3, "b_us": rate.b * 1e6, "tokens": total,
        "measured": sum(seconds), "line": rate.seconds(0, total), "constant": total / constant,
        "left": sum(seconds[quarter + 1:]), "left_line": rate.seconds(at, total),
        "left_constant": (total - read[quarter].tokens_done) / constant,
    }


def main(argv: list[str]) -> None:
    """Print the table for ``LEARN PREDICT MODE CHUNK`` (default 2048 6144 q8 512)."""
    from engine.models.loader import load_model

    learn, predict = (int(argv[0]), int(argv[1])) if len(argv) >= 2 else (2048, 6144)
    mode = parse_mode(argv[2]) if len(argv) >= 3 else Q8
    chunk = int(argv[3]) if len(argv) >= 4 else 512
    row = measure(load_model("demo"), mode, chunk, learn, predict)
    print(f"Line fitted on a {learn:,}-token read: a = {row['a_ms']:.3f} ms, "
          f"b = {row['b_us']:.4f} µs per token of context ({mode}, chunks of {chunk}).\n")
    print("| estimate of a {:,}-token read | whole read (s) | left at a quarter (s) |"
          .format(int(row["tokens"])))
    print("|---|---:|---:|")
    print(f"| measured | {row['measured']:.1f} | {row['left']:.1f} |")
    print(f"| a + b·context line | {row['line']:.1f} | {row['left_line']:.1f} |")
    print(f"| constant rate (before) | {row['constant']:.1f} | {row['left_constant']:.1f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
