"""Which cache every mlx-lm text architecture runs on: ``python -m benchmarks.coverage``.

For each ``model_type`` mlx-lm ships (a module with ``Model`` and ``ModelArgs``)
a tiny config is built from its ``ModelArgs`` (small widths, 4 layers, a 128-token
vocabulary, class defaults for everything else, so default-on features such as
KV-shared layers stay on), the model gets mlx's random initial weights and
:func:`engine.models.probe.probe_model` decides: paged, mlx-lm's own cache, or
refused. Each architecture runs in its own process with a time limit, so a crash
or a hang is a row, not the end of the run. The table goes to ``docs/coverage.md``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# The tiny models are the probe tests' own: the table reports what those tests build.
from tests.engine.tiny_architectures import TINY_LAYERS, TINY_VOCAB, build_tiny, text_model_types

ROOT = Path(__file__).resolve().parents[1]
TIME_LIMIT_S = 120
NOT_BUILT = "not built"


@dataclasses.dataclass(frozen=True)
class Row:
    """One architecture's line in the table."""

    model_type: str
    verdict: str
    reason: str
    max_rel_diff: float | None = None
    seconds: float | None = None


def _load_refusal(model: Any) -> str:
    """What ``load_model`` refuses before any probe: a model with no KV cache to page."""
    from mlx_lm.models.cache import make_prompt_cache

    from engine.models.info import classify_layers

    kinds = classify_layers(make_prompt_cache(model))
    if kinds["full"] or kinds["sliding"]:
        return ""
    return "no attention layers, so no KV cache for Longleaf to page (the loader refuses it)"


def probe_one(model_type: str) -> Row:
    """Build ``model_type``'s tiny model and probe it (in this process)."""
    from engine.models import probe

    try:
        model = build_tiny(model_type)
    except Exception as error:  # any failure of a foreign class is the row's reason
        return Row(model_type, NOT_BUILT, f"could not build a tiny config: {_say(error)}")
    refusal = _load_refusal(model)
    if refusal:
        return Row(model_type, "refused", refusal)
    try:
        informative = probe.depends_on_context(model)
    except Exception:  # mlx-lm fails on this model: the probe below names how
        informative = True
    if not informative:
        return Row(model_type, NOT_BUILT, "the tiny model's logits do not depend on earlier "
                   "tokens, so comparing caches would show nothing")
    start = time.perf_counter()
    result = probe.probe_model(model)
    seconds = round(time.perf_counter() - start, 3)
    if result.verdict == "paged" and not probe.paged_layers_matter(model):
        return Row(model_type, NOT_BUILT, "zeroed pages leave the tiny model's logits as "
                   "they were, so the probe cannot see its paged layers")
    return Row(model_type, result.verdict, result.reason, result.max_rel_diff, seconds)


def probe_in_children(model_types: list[str], time_limit: float = TIME_LIMIT_S) -> list[Row]:
    """``probe_one`` for each type in a child interpreter, ``time_limit`` s per type.

    One child probes types in turn (importing mlx-lm once, not per type); when it
    crashes or overruns, the type in flight gets that row and a new child goes on.
    """
    rows: list[Row] = []
    while len(rows) < len(model_types):
        rows += _run_child(model_types[len(rows) :], time_limit)
    return rows


def _run_child(model_types: list[str], time_limit: float) -> list[Row]:
    command = [sys.executable, "-m", "benchmarks.coverage", "--batch", *model_types]
    # stderr to a file: a pipe nobody reads fills up and stalls a chatty child.
    with tempfile.TemporaryFile(mode="w+") as errors:
        # From the checkout's root, where ``benchmarks`` is importable (it is not installed).
        child = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=errors, text=True, bufsize=1, cwd=ROOT
        )
        lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=_pump, args=(child.stdout, lines), daemon=True).start()
        try:
            return _collect(model_types, lines, time_limit, child, errors)
        finally:
            child.kill()
            child.wait()


def _collect(
    model_types: list[str], lines: queue.Queue[str | None], time_limit: float,
    child: subprocess.Popen, errors: Any,
) -> list[Row]:
    rows: list[Row] = []
    for model_type in model_types:
        try:
            line = lines.get(timeout=time_limit)
        except queue.Empty:
            rows.append(Row(model_type, NOT_BUILT, f"the tiny model took over {time_limit:.0f} s"))
            return rows
        if line is None:
            code = child.wait()
            errors.seek(0)
            tail = (errors.read().strip().splitlines() or ["no output"])[-1]
            rows.append(Row(model_type, NOT_BUILT, f"the probe crashed (exit {code}): {tail}"))
            return rows
        rows.append(Row(**json.loads(line)))
        print(f"{model_type}: {rows[-1].verdict} {rows[-1].reason}", file=sys.stderr)
    return rows


def _pump(stream: Any, lines: queue.Queue[str | None]) -> None:
    for line in stream:
        if line.startswith("{"):
            lines.put(line)
    lines.put(None)


_VERDICT_WORDS = {"paged": "paged", "mlx-lm": "mlx-lm cache", "refused": "refused",
                  NOT_BUILT: NOT_BUILT}


def render(rows: list[Row], mlx_lm_version: str) -> str:
    """``docs/coverage.md``: a summary and one row per model_type."""
    counts = {word: sum(r.verdict == key for r in rows) for key, word in _VERDICT_WORDS.items()}
    summary = ", ".join(f"{count} {word}" for word, count in counts.items())
    lines = [
        "# Model coverage: which KV cache each mlx-lm architecture runs on",
        "",
        f"Generated by `python -m benchmarks.coverage` against mlx-lm {mlx_lm_version}: "
        f"{len(rows)} text architectures, {summary}.",
        "",
        "Each architecture gets a tiny config built from its `ModelArgs` (hidden 64, "
        f"{TINY_LAYERS} layers, 4 query and 2 KV heads, a {TINY_VOCAB}-token vocabulary, "
        "class defaults otherwise) and mlx's random initial weights, in float32 on the "
        "CPU. The load-time probe (`engine/models/probe.py`) then runs "
        "two prefill chunks and decode steps through the paged fp16 cache and through "
        "mlx-lm's own cache and compares the logits:",
        "",
        "- **paged**: the largest logit difference is within fp16 storage rounding "
        "(`MAX_REL_DIFF` of the largest logit); the column gives it. Each such row "
        "was also probed with pages that hold zeros and failed there, so the "
        "comparison does see the paged layers.",
        "- **mlx-lm cache**: the paged cache raised or gave other numbers while "
        "mlx-lm's cache works; the session runs on mlx-lm's cache and says why.",
        "- **refused**: mlx-lm's own cache fails on the tiny model too. This can be "
        "the tiny config's fault rather than the architecture's; the reason says what failed.",
        "- **not built**: no tiny model could be made from the class defaults; no "
        "claim is made either way.",
        "",
        "A row is only as good as its tiny config: a feature a real config turns on "
        "but the class default leaves off is not exercised here. The probe runs "
        "again on every real model at load, and its numbers decide there.",
        "",
        "| model_type | cache | max rel. logit diff | why |",
        "|---|---|---|---|",
    ]
    for row in rows:
        diff = "" if row.max_rel_diff is None else f"{row.max_rel_diff:.1e}"
        reason = row.reason.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{row.model_type}` | {_VERDICT_WORDS[row.verdict]} | {diff} | {reason} |")
    return "\n".join(lines) + "\n"


def _say(error: Exception) -> str:
    text = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {text}"[:200] if text else type(error).__name__


def main(argv: list[str] | None = None) -> int:
    """Probe every architecture (or ``--one``) and write the table."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.coverage")
    parser.add_argument("--batch", nargs="+", help="probe these here, one JSON row a line")
    parser.add_argument("--only", nargs="*", help="model_types to include (default: all)")
    parser.add_argument("--out", default="docs/coverage.md")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S)
    args = parser.parse_args(argv)
    if args.batch:
        for model_type in args.batch:
            print(json.dumps(dataclasses.asdict(probe_one(model_type))), flush=True)
        return 0
    import mlx_lm

    rows = probe_in_children(args.only or text_model_types(), args.time_limit)
    Path(args.out).write_text(render(rows, mlx_lm.__version__), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
