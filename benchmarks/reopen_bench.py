"""Reopening a saved chat from its KV snapshot vs reading it again.

Engine only, on ``Session`` objects as the worker drives them: a chat about a
long passage is answered (full ingest), its cache is saved as a snapshot, and
one more short question is answered three ways: by the same session
(uninterrupted), by a new session that reads the whole conversation again, and
by a new session reopened from the snapshot. Greedy, so the reopened answer must
equal the uninterrupted one token for token.
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

from benchmarks.generate_bench import prompt_messages
from benchmarks.report import machine_lines, ratio, table
from engine.cache.modes import Q8, KvMode

if TYPE_CHECKING:
    from engine.events import GenerationStats
    from engine.models.loader import LoadedModel
    from engine.session.session import Session
    from engine.snapshots import SnapshotStore

FOLLOW_UP = "In one short sentence: who wrote the passage?"
SPEEDUP_GOAL = 20.0  # time to first token, re-read / reopen, at the longest prompt
DISK_GOAL = 1.02  # bytes on disk / KV bytes held


@dataclass(frozen=True)
class ReopenBenchConfig:
    """Sizes of one ``benchmarks reopen`` run."""

    model: str = "demo"
    prompts: tuple[int, ...] = (2048, 7168)
    mode: KvMode = Q8
    max_tokens: int = 16  # first answer
    follow_up_tokens: int = 8


QUICK = ReopenBenchConfig(prompts=(512,), max_tokens=8, follow_up_tokens=4)


def _answer(
    session: Session, messages: list[dict], max_tokens: int
) -> tuple[list[int], GenerationStats]:
    from engine.session.sampling import SamplingParams

    tokens: list[int] = []

    def collect(event: object) -> None:
        tokens.extend(getattr(event, "token_ids", ()) or ())

    # One token a pass, as in the runs recorded before speculation was the default.
    plain = SamplingParams(temperature=0.0, max_tokens=max_tokens, speculative="off")
    _, stats = session.chat(
        messages, plain, request_id=1,
        cancel=threading.Event(), emit=collect, tick=lambda: None,
    )
    return tokens, stats


def _first_token_seconds(stats: GenerationStats) -> float:
    if stats.time_to_first_token is None:
        raise RuntimeError("The reopened session answered without a first token to time.")
    return stats.time_to_first_token


def _session(loaded: LoadedModel, mode: KvMode) -> Session:
    from engine.session.session import Session

    # The snapshot's model fingerprint reads the folder from the session's info.
    return Session("bench", loaded, mode)


def run_one(
    loaded: LoadedModel, config: ReopenBenchConfig, prompt: int, store: SnapshotStore,
    progress: Callable[[str], None],
) -> dict[str, Any]:
    """One prompt length: answer, save, then the follow-up three ways."""
    import mlx.core as mx

    render = partial(loaded.tokenizer.apply_chat_template, add_generation_prompt=True)
    first = prompt_messages(loaded.tokenizer, prompt, render)
    progress(f"reopen {prompt}: first answer (full ingest)")
    original = _session(loaded, config.mode)
    answer, first_stats = _answer(original, first, config.max_tokens)
    name = f"bench-{prompt}"
    began = time.perf_counter()
    store.save(original, name)
    save_seconds = time.perf_counter() - began
    stored = store.info(name)
    if stored is None:
        raise RuntimeError(f"The snapshot {name!r} was saved, yet its store does not list it.")
    kv_held = original.stats().bytes_used
    follow = [*first, {"role": "assistant", "content": loaded.tokenizer.decode(answer)},
              {"role": "user", "content": FOLLOW_UP}]
    follow_ids = original.render(follow, add_generation_prompt=True)
    progress(f"reopen {prompt}: follow-up, uninterrupted")
    uninterrupted, _ = _answer(original, follow, config.follow_up_tokens)
    original.close()
    progress(f"reopen {prompt}: follow-up after a full re-read")
    reread = _session(loaded, config.mode)
    reread_tokens, reread_stats = _answer(reread, follow, config.follow_up_tokens)
    reread_ingested = reread.tokens_ingested
    reread.close()
    mx.clear_cache()
    progress(f"reopen {prompt}: follow-up after reopening the snapshot")
    reopened = _session(loaded, config.mode)
    began = time.perf_counter()
    reused = store.load(reopened, name, follow_ids)
    load_seconds = time.perf_counter() - began
    reopen_tokens, reopen_stats = _answer(reopened, follow, config.follow_up_tokens)
    reopened.close()
    return {
        "prompt_tokens": first_stats.prompt_tokens,
        "follow_up_prompt_tokens": len(follow_ids),
        "reused_tokens": reused,
        # chat feeds the prompt's last token with the first decode step
        "reopen_ingested": reopened.tokens_ingested + 1,
        "reread_ingested": reread_ingested + 1,
        "save_seconds": save_seconds,
        "load_seconds": load_seconds,
        "reopen_ttft": load_seconds + _first_token_seconds(reopen_stats),
        "reread_ttft": reread_stats.time_to_first_token,
        "first_ttft": first_stats.time_to_first_token,
        "disk_bytes": stored.disk_bytes,
        "kv_bytes_held": kv_held,
        "uninterrupted": uninterrupted,
        "reopened": reopen_tokens,
        "reread": reread_tokens,
    }


def run_reopen_bench(
    config: ReopenBenchConfig, progress: Callable[[str], None] = print,
    partial_results: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Every prompt length of ``config``; snapshots go to a temporary folder."""
    from engine.cache.modes import parse_mode
    from engine.models.loader import load_model
    from engine.snapshots import SnapshotStore

    config = dataclasses.replace(config, mode=parse_mode(config.mode))
    loaded = load_model(config.model)
    folder = tempfile.mkdtemp(prefix="longleaf-reopen-")
    results: dict[str, Any] = {
        "config": dataclasses.asdict(config), "model": loaded.info.name, "rows": [],
    }
    try:
        store = SnapshotStore(folder, budget_bytes=2**40)
        for prompt in config.prompts:
            results["rows"].append(run_one(loaded, config, prompt, store, progress))
            if partial_results is not None:
                partial_results(results)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return results


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _verdict(met: bool) -> str:
    return "**met**" if met else "**NOT met**"


def _goal_lines(rows: list[dict[str, Any]]) -> list[str]:
    longest = max(rows, key=lambda r: r["prompt_tokens"])
    speedup = ratio(longest["reread_ttft"], longest["reopen_ttft"]) or 0.0
    disk = [ratio(r["disk_bytes"], r["kv_bytes_held"]) or 0.0 for r in rows]
    only_new = all(r["reopen_ingested"] == r["follow_up_prompt_tokens"] - r["reused_tokens"]
                   and r["reused_tokens"] >= r["prompt_tokens"] for r in rows)
    identical = all(r["reopened"] == r["uninterrupted"] for r in rows)
    cells = [
        ("reopen ingests only the new turn", _verdict(only_new),
         ", ".join(f"{r['reopen_ingested']} of {r['follow_up_prompt_tokens']}" for r in rows)),
        (f"first token ≥ {SPEEDUP_GOAL:.0f}× sooner than a re-read at "
         f"{longest['prompt_tokens']} tokens", _verdict(speedup >= SPEEDUP_GOAL),
         f"{speedup:.1f}×"),
        (f"bytes on disk ≤ {DISK_GOAL}× KV bytes held", _verdict(max(disk) <= DISK_GOAL),
         "worst " + f"{max(disk):.4f}×"),
        ("reopened answer token-identical to the uninterrupted one (greedy)",
         _verdict(identical), f"{sum(r['reopened'] == r['uninterrupted'] for r in rows)}"
         f"/{len(rows)}"),
    ]
    return table(("goal", "verdict", "measured"), cells)


def render_reopen_report(
    results: dict[str, Any], info: dict[str, Any], command: str, load_after: str
) -> str:
    """The Markdown body of the reopen benchmark's section."""
    config, rows = results["config"], results["rows"]
    mib = 2**20
    cells = [
        (
            r["prompt_tokens"], r["follow_up_prompt_tokens"], r["reused_tokens"],
            r["reopen_ingested"], r["reread_ingested"],
            f"{r['reopen_ttft']:.2f} (load {r['load_seconds']:.2f})", f"{r['reread_ttft']:.1f}",
            _seconds(r.get("first_ttft")), f"{ratio(r['reread_ttft'], r['reopen_ttft']):.1f}×",
            f"{r['save_seconds']:.2f}",
            f"{r['disk_bytes'] / mib:.2f}", f"{r['kv_bytes_held'] / mib:.2f}",
            f"{ratio(r['disk_bytes'], r['kv_bytes_held']):.4f}×",
            "yes" if r["reopened"] == r["uninterrupted"] else "no",
        )
        for r in rows
    ]
    lines = [
        "## Reopening a chat from its KV snapshot (`python -m benchmarks reopen`)",
        "",
        f"Command: `{command}`",
        "",
        *machine_lines(info, load_after),
        "",
        f"Model: {results['model']}, KV mode {config['mode']}. A user message of *Walden* "
        f"(public domain) rendered to about the given length is answered greedily "
        f"({config['max_tokens']} tokens) by a fresh `Session`, whose cache is then saved with "
        "`engine.snapshots` (sha256 of the data written and checked). A short follow-up "
        f"question ({config['follow_up_tokens']} tokens) is then answered by a new session "
        "after a full re-read, and by a new session reopened from the snapshot "
        "(`load_snapshot`, checksum verified, then `Session.chat`). Time to first token of "
        "the reopen includes loading and verifying the snapshot; neither includes loading "
        "the model. KV bytes held: the pages the saved session held (page-granular).",
        "",
        "### Goals",
        "",
        *_goal_lines(rows),
        "",
        "### Measurements",
        "",
        *table(
            ("first prompt tokens", "follow-up prompt tokens", "reused tokens",
             "ingested on reopen", "ingested on re-read", "reopen first token (s)",
             "re-read first token (s)", "first answer's first token (s)", "re-read / reopen",
             "save (s)", "on disk (MiB)",
             "KV held (MiB)", "disk / KV", "same answer as uninterrupted"),
            cells,
        ),
    ]
    return "\n".join(lines) + "\n"
