"""One rank of a two-request session through the engine worker (run by mlx.launch).

Usage: ``python pipeline_worker_child.py MODEL_DIR OUT_DIR``. Rank 0 drives an
``EngineWorker`` on its pipeline group: a long prompt cancelled after its first
prefill chunk, then the same prompt answered in full, then the same prompt in a
second chat, which takes the first chat's pages instead of reading it; every
other rank only follows rank 0's commands (``engine.distributed.follower.follow``).
Rank 0 also records its last stats sample and a fit check after the second
request (every machine's share of the cache). Each rank writes ``rank<N>.json``.
Run without the launcher it is the single-process reference.
"""

from __future__ import annotations

import dataclasses
import json
import queue
import sys
import threading
from pathlib import Path

import mlx.core as mx

from engine.distributed.follower import follow
from engine.distributed.rank_commands import Pipeline
from engine.events import Failed, Finished, IngestProgress, Notice, TokenChunk
from engine.runtime.worker import EngineWorker
from engine.session.sampling import SamplingParams

PROMPT = "Count the sheep in the meadow, one by one, slowly. " * 24
CHUNK = 16


def main(model_dir: str, out_dir: str) -> None:
    group = mx.distributed.init()
    report = follow(model_dir, group) if group.rank() != 0 else lead(model_dir, group)
    Path(out_dir, f"rank{group.rank()}.json").write_text(json.dumps(report))


def lead(model_dir: str, group: object) -> dict:
    ended: queue.Queue = queue.Queue()
    cancel = threading.Event()
    tokens: list[int] = []
    notices: list[str] = []

    def on_event(event: object) -> None:
        if isinstance(event, Notice):
            notices.append(event.message)
        elif isinstance(event, IngestProgress):
            cancel.set()  # on the worker thread, between two chunks
        elif isinstance(event, TokenChunk):
            tokens.extend(event.token_ids)
        elif isinstance(event, Finished | Failed):
            ended.put(event)

    worker = EngineWorker(on_event, chunk_size=CHUNK,
                          pipeline=Pipeline(group) if group.size() > 1 else None)
    worker.start()
    try:
        worker.load_model(model_dir)
        ended.get(timeout=200)
        worker.open_session("s", "q8", 16)
        ended.get(timeout=200)
        messages = [{"role": "user", "content": PROMPT}]
        sampling = SamplingParams(temperature=0.0, max_tokens=6)
        worker.chat("s", messages, sampling, cancel)
        first = ended.get(timeout=200)
        worker.chat("s", messages, sampling, threading.Event())
        second = ended.get(timeout=200)
        sample = worker.latest_stats()
        report = worker.fit_check("s", sample.tokens_in_context)
        answered = len(tokens)
        worker.open_session("t", "q8", 16)
        ended.get(timeout=200)
        worker.chat("t", messages, sampling, threading.Event())
        third = ended.get(timeout=200)
    finally:
        worker.shutdown(timeout=30.0)
    return {"kv_bytes": sample.kv_bytes_used, "pages": sample.pages_in_use,
            "layers": [layer.layer for layer in sample.layers],
            "sample_ranks": [dataclasses.asdict(share) for share in sample.ranks],
            "fit_ranks": [dataclasses.asdict(share) for share in report.ranks],
            "max_context": report.max_context,
            "pool": {mode: report.pool_tokens(mode) for mode in ("fp16", "q8", "q6", "q4")},
            "tight": {mode: getattr(report.tight_machine(mode), "rank", None)
                      for mode in ("fp16", "q8", "q6", "q4")},
            "own_fit": {m.mode: m.tokens_fit for m in report.modes},
            "rank": 0, "first": [first.reason, first.kept_tokens, first.total_tokens],
            "second": second.reason, "tokens": tokens[:answered],
            "prefill_tokens": second.stats.prefill_tokens if second.stats else None,
            "third": [third.reason, third.stats.prefill_tokens if third.stats else None],
            "third_tokens": tokens[answered:], "notices": notices}


if __name__ == "__main__":
    main(*sys.argv[1:])
