"""Speculative decoding from the chat's own text: decode tok/s with and without.

One session per KV mode reads a document of a few thousand tokens once; each
question is then answered greedily with speculation off and on, back to back, on
the same held document (the answer's own tokens are trimmed before the next), so
the two runs see the same machine load as nearly as a busy machine allows. The
report gives both rates, their ratio, the acceptance, whether the answers agree
up to their first divergence, and what the acceptance would buy where a
verification costs about one decode step (Metal).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.cache.modes import FP16, Q6, KvMode
from engine.errors import EngineError
from engine.events import TokenChunk

# Batch noise is the tests' yardstick too: both judge a divergence by it.
from tests.engine.session.batch_noise import batch_noise, first_divergence

if TYPE_CHECKING:
    from engine.session.sampling import SamplingParams
    from engine.session.session import Session

ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = {
    # {start}: the opening words of a paragraph the cut document holds (quote_start).
    "quote": 'Quote, word for word, the paragraph of the document above that begins "{start}".',
    "summarize": "Summarize the document above in five sentences.",
    "unrelated": "What is the boiling point of water on top of Mount Everest, and why?",
}
# The quoted paragraph: the last one of plain prose with at least this many words
# (else the longest), named by this many of its first words.
QUOTE_MIN_WORDS = 30
QUOTE_START_WORDS = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    """What the benchmark runs."""

    model: str = "demo"
    modes: tuple[KvMode, ...] = (FP16, Q6)
    document_tokens: int = 5000
    max_tokens: int = 96
    questions: tuple[str, ...] = tuple(QUESTIONS)
    # Off/on pairs per question. One answer's rate moves by tens of percent on a
    # shared CPU while its tokens and drafts stay the same, so a verdict needs
    # several pairs; their order alternates so neither side always runs second.
    pairs: int = 3


QUICK = SpeculativeConfig(modes=(FP16,), document_tokens=1200, max_tokens=32, pairs=1)


def document(tokenizer: Any, tokens: int) -> str:
    """The repository's own docs (English prose and code), cut to about ``tokens`` tokens."""
    text = "\n\n".join((ROOT / name).read_text(encoding="utf-8")
                       for name in ("docs/architecture.md", "README.md"))
    ids = tokenizer.encode(text)
    while len(ids) < tokens:
        ids = ids + ids
    return tokenizer.decode(ids[:tokens])


def quote_start(doc: str) -> str:
    """The first words of the document's last prose paragraph (what the quote question names).

    Taken from the document as cut, so the paragraph is always in it: a fixed
    section title can fall past the cut.
    """
    prose = [p for p in doc.split("\n\n") if p.strip()[:1].isalpha() and "```" not in p]
    if not prose:
        raise EngineError("The benchmark document has no paragraph of prose to quote.")
    long = [p for p in prose if len(p.split()) >= QUOTE_MIN_WORDS]
    chosen = long[-1] if long else max(prose, key=lambda p: len(p.split()))
    return " ".join(chosen.split()[:QUOTE_START_WORDS])


def question(name: str, doc: str) -> str:
    """The text of question ``name`` about ``doc``."""
    return QUESTIONS[name].format(start=quote_start(doc)) if name == "quote" else QUESTIONS[name]


def _answer(session: Session, messages: list[dict], sampling: SamplingParams) -> dict[str, Any]:
    events: list[object] = []
    reason, stats = session.chat(messages, sampling, request_id=1, cancel=threading.Event(),
                                 emit=events.append, tick=lambda: None)
    ids = [i for e in events if isinstance(e, TokenChunk) for i in e.token_ids]
    return {"reason": reason, "ids": ids, "decode_tps": stats.decode_tps,
            "draft_tokens": stats.draft_tokens, "accepted_tokens": stats.accepted_tokens,
            "steps": stats.decode_steps}


def blas_library() -> str:
    """The BLAS library this process loaded (Linux; MLX's matmuls on the CPU go through it)."""
    try:
        maps = Path("/proc/self/maps").read_text(encoding="utf-8")
    except OSError:
        return "?"
    names = {Path(line.split()[-1]).name for line in maps.splitlines()
             if "blas" in line.rsplit("/", 1)[-1].lower()}
    return ", ".join(sorted(names)) or "?"


def _pairs(
    session: Session, messages: list[dict], plain: SamplingParams, pairs: int, mode: KvMode,
    name: str, progress: Callable[[str], None],
) -> tuple[dict, dict, list[float], bool]:
    """``pairs`` off/on answers in alternating order; each side's median-rate answer.

    Returns the off and on answers whose rates are the medians, the on/off ratio of
    each pair, and whether every repeat of a side gave the same tokens and drafts.
    """
    lookup = dataclasses.replace(plain, speculative="lookup")
    answers: dict[str, list[dict]] = {"off": [], "lookup": []}
    for pair in range(pairs):
        order = ("off", "lookup") if pair % 2 == 0 else ("lookup", "off")
        for side in order:
            progress(f"speculative {mode} {name}: {side} ({pair + 1} of {pairs})")
            answers[side].append(_answer(session, messages,
                                         plain if side == "off" else lookup))
    ratios = [on["decode_tps"] / off["decode_tps"] if off["decode_tps"] else 0.0
              for off, on in zip(answers["off"], answers["lookup"], strict=True)]
    same = all(_same_work(runs[0], run) for runs in answers.values() for run in runs)
    return _median_rate(answers["off"]), _median_rate(answers["lookup"]), ratios, same


def metal_estimate(off: dict, on: dict) -> float:
    """The speed-up where a verification costs one decode step: tokens per forward
    pass, on against off.

    Each side's passes include its first (the prompt's last token) and, for an
    answer that ends itself, the pass queued past its end, so an answer that
    drafted nothing estimates 1.0 whatever its length.
    """
    if not (on["steps"] and off["steps"] and off["ids"]):
        return 0.0
    return (len(on["ids"]) / on["steps"]) / (len(off["ids"]) / off["steps"])


def _same_work(a: dict, b: dict) -> bool:
    keys = ("ids", "draft_tokens", "accepted_tokens", "steps")
    return all(a[key] == b[key] for key in keys)


def _median_rate(answers: list[dict]) -> dict:
    ranked = sorted(answers, key=lambda answer: answer["decode_tps"])
    return ranked[(len(ranked) - 1) // 2]


def run_speculative_bench(config: SpeculativeConfig, progress: Callable[[str], None],
                          partial_results: Callable[[dict], None] | None = None) -> dict:
    """Every mode x question, off and on in pairs; plain-value results."""
    from engine.models.loader import load_model
    from engine.session.sampling import SamplingParams
    from engine.session.session import Session
    from engine.session.speculative import MAX_DRAFT

    loaded = load_model(config.model)
    doc = document(loaded.tokenizer, config.document_tokens)
    rows: list[dict[str, Any]] = []
    results = {"config": dataclasses.asdict(config), "model": loaded.info.name, "rows": rows,
               "blas": blas_library(), "quote_question": question("quote", doc)}
    plain = SamplingParams(temperature=0.0, max_tokens=config.max_tokens, speculative="off")
    for mode in config.modes:
        session = Session("bench", loaded, mode)
        for name in config.questions:
            messages = [{"role": "user", "content": f"{doc}\n\n{question(name, doc)}"}]
            off, on, pair_ratios, repeats_agree = _pairs(session, messages, plain,
                                                         config.pairs, mode, name, progress)
            generated = len(on["ids"])
            first = first_divergence(off["ids"], on["ids"])
            prompt = session.prompt(messages, add_generation_prompt=True).ids
            progress(f"speculative {mode} {name}: batch noise")
            noise = batch_noise(session, prompt, off["ids"], MAX_DRAFT + 1)
            rows.append({
                "mode": mode, "question": name, "tokens": generated,
                "off_tokens": len(off["ids"]), "positions": len(noise.margins),
                "off_tps": off["decode_tps"], "on_tps": on["decode_tps"],
                "ratio": float(np.median(pair_ratios)), "pair_ratios": pair_ratios,
                "repeats_agree": repeats_agree,
                "draft_tokens": on["draft_tokens"], "accepted_tokens": on["accepted_tokens"],
                "steps": on["steps"], "off_steps": off["steps"],
                "tokens_per_step": generated / on["steps"] if on["steps"] else 0.0,
                "metal_estimate": metal_estimate(off, on),
                "first_divergence": first,
                "divergence_margin": None if first is None else noise.margins[first],
                "noise_threshold": noise.threshold,
                "noise_flips": len(noise.flips),
                "flip_margin": max((noise.margins[i] for i in noise.flips), default=None),
                "min_margin": min(noise.margins, default=None),
            })
            if partial_results is not None:
                partial_results(results)
        session.close()
    return results


def render_report(results: dict, info: dict, command: str, load: str) -> str:
    """The docs/benchmark-runs.md section."""
    lines = [
        "## Speculative decoding from the chat's own text",
        "",
        f"`{command}` on {results['model']}, greedy, a "
        f"{results['config']['document_tokens']}-token document (the repo's docs), "
        f"{results['config']['max_tokens']} tokens per answer; "
        f"{results['config'].get('pairs', 1)} off/on pair(s) per question in alternating "
        "order on the same held document (tok/s: each side's median; on/off: the median "
        f"of the pairs' ratios, every pair's listed). Load average at the end: {load} "
        f"(MLX {info.get('mlx', '?')}, {info.get('platform', '?')}); BLAS loaded: "
        f"{results.get('blas', '?')}.",
        "",
        f"Questions: quote: {results.get('quote_question', '?')} summarize: "
        f"{QUESTIONS['summarize']} unrelated: {QUESTIONS['unrelated']}",
        "",
        "| mode | question | tokens | off tok/s | on tok/s | on/off | pairs | drafted | accepted "
        "| tokens/step | Metal estimate | first divergence (margin) | batch noise: "
        "threshold, flips (largest flip margin) |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---|---|",
    ]
    for row in results["rows"]:
        div = ("none" if row["first_divergence"] is None
               else f"{row['first_divergence']} ({row['divergence_margin']:.3f})")
        flips = row.get("noise_flips", 0)
        noise = (f"{row.get('noise_threshold', 0.0):.3f}, {flips}"
                 + (f" ({row['flip_margin']:.3f})" if flips else ""))
        off_tokens = row.get("off_tokens", row["tokens"])
        tokens = (str(row["tokens"]) if off_tokens == row["tokens"]
                  else f"{off_tokens} off, {row['tokens']} on")
        pairs = " ".join(f"{r:.2f}" for r in row.get("pair_ratios", [row["ratio"]]))
        if not row.get("repeats_agree", True):
            pairs += " (repeats differ)"
        lines.append(
            f"| {row['mode']} | {row['question']} | {tokens} | {row['off_tps']:.1f} "
            f"| {row['on_tps']:.1f} | {row['ratio']:.2f}x | {pairs} | {row['draft_tokens']} "
            f"| {row['accepted_tokens']} | {row['tokens_per_step']:.2f} "
            f"| {row['metal_estimate']:.2f}x | {div} | {noise} |")
    lines += [
        "",
        "Metal estimate: where verifying k tokens costs about one decode step (decode is "
        "bound by reading the weights and the KV once), the speed-up is the ratio of "
        "tokens per forward pass, on against off (plain decoding's passes include the "
        "first and, for an answer that ends itself, one queued past its end, so it can "
        "take more passes than tokens); on this CPU a (k+1)-token pass costs more than "
        "one step, so the measured ratio is lower.",
        "",
        "Pairs: every repeat of a side is the same greedy answer with the same drafts "
        "(else marked \"repeats differ\"), so the pairs' ratios differ by timing alone.",
        "",
        "Batch noise: the plain answer fed again one token a pass and "
        "MAX_DRAFT + 1 tokens a pass; threshold = twice the largest logit shift "
        "between the two (a flip needs a top-1/top-2 margin below it); a first "
        "divergence's margin is plain decoding's top-1 minus top-2 logit there.",
    ]
    return "\n".join(lines)
