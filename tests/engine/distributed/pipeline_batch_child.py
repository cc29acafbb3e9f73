"""One rank of two chats answering together through the engine worker (run by mlx.launch).

Usage: ``python pipeline_batch_child.py MODEL_DIR OUT_DIR``. Rank 0 drives an
``EngineWorker`` on its pipeline group: chat "a" (q8) gets a question of a few
chunks, and once its read alone has begun chat "b" (q6) a short one, so "a"
pauses and both go on in one batch; then a follow-up each, "b"'s once "a"'s
answer alone has begun; then another each, sent together.
Rank 0 records each answer's tokens, the most answers it saw decoding at once and
whether a read went on beside an answer; every other rank only follows
rank 0's commands (``engine.distributed.follower.follow``) and reports the tokens
it held at each request's end. Each rank writes ``rank<N>.json``. Run without
the launcher it is the single-process reference.
"""

from __future__ import annotations

import json
import queue
import sys
import threading
from pathlib import Path

import mlx.core as mx

from engine.distributed.follower import follow
from engine.distributed.rank_commands import Pipeline
from engine.events import Failed, Finished, IngestProgress, TokenChunk
from engine.runtime.worker import EngineWorker
from engine.session import session as session_module
from engine.session.sampling import SamplingParams

QUESTIONS = {"a": "Count the sheep in the meadow, one by one, slowly. " * 3,
             "b": "Name a colour."}
FOLLOW_UPS = {"a": "And the goats?", "b": "Another one, please."}  # the same each turn
MAX_TOKENS = {"a": 16, "b": 40}
CHUNK = 16


# A token "b"'s first answer says partway, as its end of turn: an answer that ends
# on one while another goes on (the tiny model never writes its own).
END_OF_TURN = 146


def main(model_dir: str, out_dir: str) -> None:
    group = mx.distributed.init()
    if group.rank() == 0:  # only rank 0 samples
        ends = session_module.end_of_turn_ids
        session_module.end_of_turn_ids = lambda tokenizer: ends(tokenizer) | {END_OF_TURN}
    report = follow(model_dir, group) if group.rank() != 0 else lead(model_dir, group)
    Path(out_dir, f"rank{group.rank()}.json").write_text(json.dumps(report))


def lead(model_dir: str, group: mx.distributed.Group) -> dict:
    ended: queue.Queue = queue.Queue()
    tokens: dict[int, list[int]] = {}
    texts: dict[int, str] = {}
    seen = {"answering": 0, "beside": 0}
    talks = {chat: [{"role": "user", "content": text}] for chat, text in QUESTIONS.items()}
    sent: dict[str, int] = {}
    cue: list[type] = []  # the event of "a"'s that sends "b" (none: sent together)
    worker: EngineWorker

    def send(chat: str) -> None:
        sampling = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS[chat])
        sent[chat] = worker.chat(chat, talks[chat], sampling, threading.Event())

    def on_event(event: object) -> None:  # on the worker thread
        if cue and isinstance(event, cue[0]) and event.request_id == sent["a"]:
            cue.clear()
            send("b")  # "a" runs alone: it pauses and goes on beside "b"
        if isinstance(event, TokenChunk):
            tokens.setdefault(event.request_id, []).extend(event.token_ids)
            texts[event.request_id] = texts.get(event.request_id, "") + event.text
        elif isinstance(event, Finished | Failed):
            ended.put(event)
        counts = worker.streams()
        seen["answering"] = max(seen["answering"], counts.answering)
        seen["beside"] = max(seen["beside"], min(counts.answering, counts.reading))

    worker = EngineWorker(on_event, chunk_size=CHUNK,
                          pipeline=Pipeline(group) if group.size() > 1 else None)
    worker.start()
    rounds: list[dict[str, list[int]]] = []
    reasons: list[str] = []
    try:
        worker.load_model(model_dir)
        ended.get(timeout=200)
        for chat, mode in (("a", "q8"), ("b", "q6")):
            worker.open_session(chat, mode, 16)
            ended.get(timeout=200)
        # "b" while "a" is read in alone, while "a" answers alone, then both at once.
        for when in (IngestProgress, TokenChunk, None):
            sent.clear()
            cue[:] = [] if when is None else [when]
            send("a")
            if when is None:
                send("b")
            for _ in range(2):
                event = ended.get(timeout=200)
                reasons.append(event.reason if isinstance(event, Finished) else event.message)
            rounds.append({chat: tokens.get(request, []) for chat, request in sent.items()})
            for chat, request in sent.items():
                talks[chat] = [*talks[chat], {"role": "assistant", "content": texts[request]},
                               {"role": "user", "content": FOLLOW_UPS[chat]}]
    finally:
        worker.shutdown(timeout=30.0)
    return {"rank": 0, "rounds": rounds, "reasons": reasons, **seen}


if __name__ == "__main__":
    main(*sys.argv[1:])
