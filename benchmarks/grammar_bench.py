"""Time per token with a JSON-schema grammar against without, on the demo model.

``python -m benchmarks.grammar_bench [--answers N] [--max-tokens N]``: the same
prompts answered greedily through an engine ``Session`` (the worker's code path),
once held to a schema (``SamplingParams.grammar``, llguidance's mask each step)
and once free, both decoding one token a pass; prints each side's decode
seconds per token and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import threading
from typing import TYPE_CHECKING, Any

from benchmarks.report import load_average, machine_info, machine_lines
from engine.cache.modes import FP16

if TYPE_CHECKING:
    from engine.models.loader import LoadedModel

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40},
    "height_m": {"type": "integer", "minimum": 0, "maximum": 60},
    "kind": {"enum": ["pine", "oak", "fir"]},
    "facts": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 3}},
    "required": ["name", "height_m", "kind", "facts"], "additionalProperties": False}
TOPICS = ("a longleaf pine", "an oak in winter", "a fir on a mountain", "a burned forest",
          "a pine cone", "a seedling after a fire")


def _answer(
    loaded: LoadedModel, topic: str, grammar: str | None, max_tokens: int
) -> tuple[int, float]:
    """One greedy answer; its generated tokens and decode seconds per token."""
    from engine.session.sampling import SamplingParams
    from engine.session.session import Session

    session = Session("bench", loaded, FP16)
    messages = [{"role": "user", "content": f"Describe {topic} as JSON with name, "
                                            "height_m, kind and facts."}]
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, speculative="off",
                              grammar=grammar)
    _, stats = session.chat(messages, sampling, request_id=1, cancel=threading.Event(),
                            emit=lambda event: None, tick=lambda: None)
    session.close()
    per_token = 1 / stats.decode_tps if stats.decode_tps else float("nan")
    return stats.generated_tokens, per_token


def run(answers: int, max_tokens: int) -> dict[str, Any]:
    """Time ``answers`` prompts with and without the grammar; plain-value results."""
    from engine.models.loader import load_model
    from engine.session.constraint import json_schema_grammar

    loaded = load_model("demo")
    grammar = json_schema_grammar(SCHEMA)
    _answer(loaded, TOPICS[0], grammar, 8)  # warm: kernels, llguidance's tokenizer
    timed = []
    for topic in (TOPICS * answers)[:answers]:
        free = _answer(loaded, topic, None, max_tokens)
        held = _answer(loaded, topic, grammar, max_tokens)
        timed.append((topic, free, held))
    free_s = statistics.median(free[1] for _, free, _ in timed)
    held_s = statistics.median(held[1] for _, _, held in timed)
    rows = [{"topic": topic, "free": free, "grammar": held} for topic, free, held in timed]
    return {"rows": rows, "free_s_per_token": free_s, "grammar_s_per_token": held_s,
            "ratio": held_s / free_s}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--answers", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    info = machine_info()
    result = run(args.answers, args.max_tokens)
    for line in machine_lines(info, load_average()):
        print(line)
    for row in result["rows"]:
        print(f"{row['topic']:<26} free {row['free'][0]:>3} tok "
              f"{row['free'][1] * 1000:6.1f} ms/tok   grammar {row['grammar'][0]:>3} tok "
              f"{row['grammar'][1] * 1000:6.1f} ms/tok")
    print(f"median ms/token: free {result['free_s_per_token'] * 1000:.1f}, grammar "
          f"{result['grammar_s_per_token'] * 1000:.1f}, ratio {result['ratio']:.2f}x")


if __name__ == "__main__":
    main()
