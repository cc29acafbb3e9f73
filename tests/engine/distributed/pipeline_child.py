"""One rank of a pipelined greedy run through the paged cache (run by mlx.launch).

Usage: ``python pipeline_child.py MODEL_DIR MODE OUT_DIR``. With ``mlx.launch -n 2
--backend ring`` every rank loads the tiny model, keeps its pipeline stage's
layers (mlx-lm's ``pipeline``), reads the prompt in chunks and decodes greedily;
each rank writes ``rank<N>.json`` with the tokens and its paged layers. Run
without the launcher it is the single-process reference.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import mlx.core as mx
from mlx_lm import load

from engine.cache import adapter

PROMPT = list(range(5, 5 + 45))
CHUNK = 16
NEW_TOKENS = 8


def main(model_dir: str, mode: str, out_dir: str) -> None:
    group = mx.distributed.init()
    model, _ = load(model_dir)
    if group.size() > 1:
        model.model.pipeline(group)
    cache = adapter.make_cache(model, mode, page_size=16)
    ids = mx.array(PROMPT)
    for start in range(0, len(PROMPT) - 1, CHUNK):
        model(ids[None, start : min(start + CHUNK, len(PROMPT) - 1)], cache=cache)
        mx.eval(adapter.eval_targets(cache))
    token = ids[-1:]
    tokens = []
    for _ in range(NEW_TOKENS):
        logits = model(token[None], cache=cache)[:, -1]
        token = mx.argmax(logits, axis=-1)
        mx.eval(token)
        tokens.append(int(token.item()))
    paged = [c for c in cache if isinstance(c, adapter.PagedKVCache)]
    report = {
        "rank": group.rank(),
        "tokens": tokens,
        "layers": [c.layer for c in paged],
        "kv_bytes": sum(c.nbytes for c in paged),
        "rotations": [getattr(c.rotation, "layer", None) for c in paged],
    }
    Path(out_dir, f"rank{group.rank()}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main(*sys.argv[1:])
