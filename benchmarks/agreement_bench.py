"""How far each quantized KV mode's greedy answer follows the fp16 one, at one long prompt.

Engine only: every mode runs ``Session.chat`` on the same rendered prompt (the
public-domain passage of ``generate_bench``), greedy, exactly ``max_tokens`` steps,
and its token ids are compared with the fp16 session's. This is the number a user
choosing q8/q6/q4 for a long document wants: not the raw attention error, but
whether the answer changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from benchmarks.generate_bench import agreement, prompt_messages, run_engine
from benchmarks.report import machine_lines, table
from engine.cache.kvquant import MODES
from engine.cache.modes import REFERENCE, KvMode


@dataclass(frozen=True)
class AgreementBenchConfig:
    """Sizes of one ``benchmarks agreement`` run."""

    model: str = "demo"
    prompt: int = 6144
    modes: tuple[KvMode, ...] = tuple(MODES)
    max_tokens: int = 64


QUICK = AgreementBenchConfig(prompt=512, max_tokens=16)


def run_agreement_bench(
    config: AgreementBenchConfig, progress: Callable[[str], None] = print
) -> dict[str, Any]:
    """One greedy answer per mode at ``config.prompt`` tokens; plain-value results."""
    from engine.models.loader import load_model

    loaded = load_model(config.model)
    render = partial(loaded.tokenizer.apply_chat_template, add_generation_prompt=True)
    messages = prompt_messages(loaded.tokenizer, config.prompt, render)
    modes = tuple(dict.fromkeys((REFERENCE, *config.modes)))
    rows = []
    for mode in modes:
        progress(f"agreement: {mode}")
        run = run_engine(loaded, mode, messages, config.max_tokens)
        run["text"] = loaded.tokenizer.decode(run["tokens"])
        rows.append({"mode": mode, "engine": run})
    return {
        "config": dataclasses.asdict(config),
        "model": loaded.info.name,
        "rows": rows,
    }


def _cell_text(text: str, limit: int = 70) -> str:
    flat = " ".join(text.split()).replace("|", "\\|")
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def render_agreement_report(
    results: dict[str, Any], info: dict[str, Any], command: str, load_after: str
) -> str:
    """The Markdown body of the agreement benchmark's section."""
    config, rows = results["config"], results["rows"]
    reference = next(r["engine"]["tokens"] for r in rows if r["mode"] == "fp16")
    cells = [
        (
            row["engine"]["prompt_tokens"],
            row["mode"],
            agreement(row["engine"]["tokens"], reference),
            _cell_text(row["engine"]["text"]),
        )
        for row in rows
    ]
    lines = [
        "## Greedy agreement with fp16 at one long prompt (`python -m benchmarks agreement`)",
        "",
        f"Command: `{command}`",
        "",
        *machine_lines(info, load_after),
        "",
        f"Model: {results['model']}. One user message of Thoreau's *Walden* (public domain) "
        f"rendered with the chat template to about {config['prompt']} tokens, then greedy "
        f"decoding of exactly {config['max_tokens']} tokens (end-of-turn ignored) through the "
        "engine's `Session.chat` in each mode. Agreement counts positions whose token id "
        "equals the fp16 session's; after the first difference the two answers continue "
        "from different text, so later positions rarely line up again.",
        "",
        "### Token ids equal to fp16",
        "",
        *table(("prompt tokens", "mode", "token ids equal to fp16", "answer begins"), cells),
    ]
    return "\n".join(lines) + "\n"
