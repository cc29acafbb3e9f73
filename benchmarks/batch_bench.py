"""Batched decoding: aggregate tokens per second at 1, 2, 4 and 8 streams.

Both sides decode the same conversations (one user message each, of slightly
different lengths, so no two rows are the same length) greedily, for exactly
``max_tokens`` tokens a stream (end-of-turn tokens do not stop a run):

- engine: ``engine.session.batch.BatchDecoder`` over one ``Session`` a
  conversation, in ``mode`` (each conversation's own paged cache, no padding);
- mlx-lm: ``mlx_lm.generate.BatchGenerator`` with its ``KVCache`` per
  conversation (in the model's compute dtype: float32 on the CPU backend, where
  the loader computes in float32; the report names it), merged into its
  left-padded ``BatchKVCache``.

Each conversation is read in once per side, before any timing: the engine's
sessions keep their pages between stream counts (each run trims back to the
prompt), mlx-lm is handed a copy of its prefilled cache each run. Timed: the
decode steps after every stream's first token, tokens made over wall seconds.

Each engine run's peak MLX memory, less the weights and what mlx-lm holds
meanwhile, is set against every open session's pages plus one decode step's
transient for its streams (``PrefillFacts.step_transient_bytes``, what the
batch's admission counts; the issue's goal: within 10 %).

Then a short question joins a batch while the first conversation is read in
(after ``document_chunks`` of its chunks): its first token, in seconds and in
the document's chunk times (the issue's goal: within 2); then its answer's pace
over whole turns of the document's read beside it and with nothing read, and the
read's rate, once as the engine schedules reads (turns by time) and once with a
chunk at every step (the schedule before).

Last, what a Mac would launch: the kernels one full-attention layer of the seed's
shape runs for a decode step of each stream count under the GPU schedule, by the
graph counter (``benchmarks.graph_count``).
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import mlx.core as mx

from benchmarks.generate_bench import prompt_messages
from benchmarks.report import fmt_ratio, machine_lines, ratio, table
from engine.cache.modes import parse_mode


@dataclass(frozen=True)
class BatchBenchConfig:
    """Sizes of one ``benchmarks batch`` run."""

    model: str = "demo"
    streams: tuple[int, ...] = (1, 2, 4, 8)
    prompt_tokens: int = 4096
    mode: str = "q6"
    max_tokens: int = 32
    # The first token of a short question asked while a document is read in:
    # the document's chunks read before the question comes, and the chunk size.
    document_chunks: int = 2
    chunk: int = 512
    # The question's answer is timed beside this many of the document's chunks (whole
    # turns of the read and the decoding), then for this many tokens with nothing read.
    pace_chunks: int = 3
    pace_tokens: int = 16


QUICK = BatchBenchConfig(streams=(1, 2, 4), prompt_tokens=256, max_tokens=8, chunk=64,
                         pace_chunks=1, pace_tokens=4)
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# Enough for the question to answer through its timed turns, its wait for the
# document's read to stop, and its timed tokens with nothing read.
QUESTION_TOKENS = 1000
# Conversation i is this many tokens shorter than conversation i - 1.
LENGTH_STEP = 13
# The engine's peak may pass its pages plus one step's transient by this much.
PEAK_GOAL = 1.10


def conversations(tokenizer: Any, count: int, target: int,
                  render: Callable) -> list[list[dict[str, str]]]:
    """``count`` different conversations of about ``target`` tokens each."""
    out = []
    for index in range(count):
        messages = prompt_messages(tokenizer, max(32, target - LENGTH_STEP * index), render)
        messages[0]["content"] = f"Conversation {index + 1}. " + messages[0]["content"]
        out.append(messages)
    return out


def _sampling(max_tokens: int) -> Any:
    from engine.session.sampling import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, speculative="off")


def engine_sessions(loaded: Any, mode: str, chats: list[list[dict[str, str]]]) -> list[Any]:
    """One session a conversation, each holding its conversation read in."""
    from engine.session.session import Session

    sessions = []
    for index, messages in enumerate(chats):
        session = Session(f"bench-{index}", loaded, parse_mode(mode))
        session.end_ids = frozenset()  # decode exactly max_tokens steps, as mlx-lm below
        answer = session.start_answer(messages, _sampling(1), request_id=index,
                                      cancel=threading.Event(), emit=lambda _: None,
                                      tick=lambda: None)
        answer.stream.flush()
        sessions.append(session)
    return sessions


def run_engine(sessions: list[Any], chats: list[list[dict[str, str]]],
               max_tokens: int) -> dict[str, Any]:
    """Decode the first ``len(sessions)`` conversations together."""
    from engine.session.batch import BatchDecoder

    batch = BatchDecoder(sessions[0].model)
    for index, (session, messages) in enumerate(zip(sessions, chats, strict=False)):
        batch.join(session, messages, _sampling(max_tokens), request_id=index,
                   cancel=threading.Event(), emit=lambda _: None, tick=lambda: None)
    mx.clear_cache()
    mx.reset_peak_memory()
    resident = mx.get_active_memory()  # weights, every cache held: mlx-lm's too
    started: set[int] = set()
    while len(started) < len(sessions):  # until every stream's first token
        started.update(row.request_id for row in batch.step() if row.token is not None)
    start = time.perf_counter()
    made = 0
    while not batch.idle:
        made += sum(row.token is not None for row in batch.step())
    seconds = time.perf_counter() - start
    return {**_rates(len(sessions), made, seconds), "resident_bytes": resident}


def pages_bytes(sessions: list[Any]) -> int:
    """Bytes of pages every open session holds (answering or not, all stay held)."""
    return sum(int(session.stats().bytes_allocated) for session in sessions)


def memory_bound(sessions: list[Any], streams: int, pages_before: int,
                 ours: dict[str, Any]) -> dict[str, int]:
    """The engine's decode peak and what it should stay within: every open
    session's pages and one step's transient for ``streams`` rows, as the batch's
    admission counts it, both above the weights.

    The peak MLX reports counts mlx-lm's prefilled caches too (held for its side
    of the run): what was resident when the steps began, less the weights and the
    engine's pages then, is taken off it."""
    facts = sessions[0].prefill_facts
    others = ours["resident_bytes"] - facts.weights_bytes - pages_before
    return {"engine_peak_bytes": ours["peak_bytes"] - others - facts.weights_bytes,
            "pages_bytes": pages_bytes(sessions),
            "transient_bytes": facts.step_transient_bytes(streams)}


def mlx_lm_caches(model: Any, prompts: list[list[int]]) -> list[list[Any]]:
    """mlx-lm's caches (the model's dtype), each holding its prompt but the last token."""
    from mlx_lm.models.cache import make_prompt_cache

    caches = []
    for prompt in prompts:
        cache = make_prompt_cache(model)
        for start in range(0, len(prompt) - 1, 2048):  # mlx-lm's default prefill step
            model(mx.array(prompt[start:min(start + 2048, len(prompt) - 1)])[None], cache=cache)
            mx.eval([c.state for c in cache])
        caches.append(cache)
    return caches


def _copy(cache: list[Any]) -> list[Any]:
    from mlx_lm.models.cache import KVCache

    copies = []
    for layer in cache:
        copy = KVCache()
        copy.state = layer.state  # arrays are immutable: the run's writes make new ones
        copies.append(copy)
    return copies


def run_mlx_lm(model: Any, prompts: list[list[int]], caches: list[list[Any]],
               max_tokens: int) -> dict[str, Any]:
    """Decode the prompts together with mlx-lm's BatchGenerator."""
    from mlx_lm.generate import BatchGenerator

    streams = len(prompts)
    generator = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=streams,
                               prefill_batch_size=streams)
    try:
        generator.insert([p[-1:] for p in prompts], [max_tokens] * streams,
                         caches=[_copy(c) for c in caches])
        mx.clear_cache()
        mx.reset_peak_memory()
        seen: set[int] = set()
        start, made, done = 0.0, 0, 0
        while done < streams:
            responses = generator.next_generated()
            if not responses:
                break
            if len(seen) == streams:
                made += len(responses)
            seen.update(r.uid for r in responses)
            if len(seen) == streams and not start:
                start = time.perf_counter()
            done += sum(r.finish_reason is not None for r in responses)
        seconds = time.perf_counter() - start
    finally:
        generator.close()
    return _rates(streams, made, seconds)


def run_first_token(loaded: Any, config: BatchBenchConfig, document: list[dict[str, str]],
                    *, turns: bool = True) -> dict[str, Any]:
    """The first token of a short question that joins while ``document`` is read in,
    in seconds and in the document's chunk times; then the pace of its answer
    beside the read and with nothing read, and the read's rate beside it.

    ``turns``: the batch's reads take turns with its decoding by time (what the
    engine does); else a chunk is read at every step (a clock that stands still).
    """
    from engine.events import IngestProgress
    from engine.session.batch import BatchDecoder
    from engine.session.session import Session

    chunk_seconds: list[float] = []
    read: list[int] = [0]  # the document's tokens read so far

    def progress(event: object) -> None:
        if isinstance(event, IngestProgress):
            chunk_seconds.append(event.chunk_seconds)
            read[0] = event.tokens_done

    mode = parse_mode(config.mode)
    reader = Session("document", loaded, mode, chunk_size=config.chunk)
    asker = Session("question", loaded, mode, chunk_size=config.chunk)
    asker.end_ids = frozenset()  # answers exactly its tokens, as the streams above
    batch = (BatchDecoder(loaded.model) if turns
             else BatchDecoder(loaded.model, clock=lambda: 0.0))
    stop = threading.Event()
    batch.join(reader, document, _sampling(1), request_id=1, cancel=stop, emit=progress,
               tick=lambda: None)
    while len(chunk_seconds) < config.document_chunks and 1 in batch.reading_ids:
        batch.step()
    asked = time.perf_counter()
    done = threading.Event()
    batch.join(asker, QUESTION, _sampling(QUESTION_TOKENS), request_id=2,
               cancel=done, emit=lambda _: None, tick=lambda: None)
    while not _answered(batch.step()):
        pass
    seconds = time.perf_counter() - asked
    still_reading = 1 in batch.reading_ids
    # Whole turns: from a chunk's read to the one ``pace_chunks`` later.
    while len(chunk_seconds) == config.document_chunks and 1 in batch.reading_ids:
        batch.step()
    chunks = len(chunk_seconds) + config.pace_chunks
    beside = _pace(batch, lambda: len(chunk_seconds) < chunks and 1 in batch.reading_ids,
                   read)
    stop.set()  # the document's read ends at its next turn; the answer goes on alone
    while 1 in batch.reading_ids:
        batch.step()
    tokens = [0]
    alone = _pace(batch, lambda: tokens[0] < config.pace_tokens and not batch.idle, read,
                  tokens)
    done.set()  # timed enough
    while not batch.idle:
        batch.step()
    reader.close()
    asker.close()
    # A chunk time is one read alone: the engine times no chunk read beside answers
    # (its time holds a decode pass too).
    timed = sorted(seconds for seconds in chunk_seconds if seconds > 0)
    chunk = timed[len(timed) // 2] if timed else 0.0
    return {"seconds": seconds, "chunk_seconds": chunk,
            "chunks": seconds / chunk if chunk > 0 else None,
            "document_still_reading": still_reading,
            "answer_tps_beside_read": beside["answer_tps"], "answer_tps_alone": alone["answer_tps"],
            "read_tps_beside_answer": beside["read_tps"]}


def _answered(results: list[Any]) -> int:
    """Tokens the question (request 2) got in a step's results."""
    return sum(row.request_id == 2 and row.token is not None for row in results)


def _pace(batch: Any, going: Callable[[], bool], read: list[int],
          made: list[int] | None = None) -> dict[str, float]:
    """The question's tokens per second over the steps while ``going`` holds, and
    the document's read meanwhile (``read``: its tokens read so far); ``made``
    counts the question's tokens as they come."""
    made = [0] if made is None else made
    began, read_before = time.perf_counter(), read[0]
    while going():
        made[0] += _answered(batch.step())
    seconds = max(time.perf_counter() - began, 1e-9)
    return {"answer_tps": made[0] / seconds, "read_tps": (read[0] - read_before) / seconds}


def _rates(streams: int, made: int, seconds: float) -> dict[str, Any]:
    return {"streams": streams, "tokens": made, "seconds": seconds,
            "tps": made / seconds if seconds > 0 else 0.0, "peak_bytes": mx.get_peak_memory()}


def run_batch_bench(
    config: BatchBenchConfig,
    progress: Callable[[str], None] = print,
    partial_results: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Aggregate decode rates of both sides at every stream count; plain values."""
    from engine.models.loader import load_model

    loaded = load_model(config.model)
    info = loaded.info
    rows: list[dict[str, Any]] = []
    results: dict[str, Any] = {
        "config": dataclasses.asdict(config),
        "model": {"name": info.name, "layers": info.num_layers, "kv_heads": info.kv_heads,
                  "head_dim": info.head_dim},
        "rows": rows,
    }
    render = partial(loaded.tokenizer.apply_chat_template, add_generation_prompt=True)
    most = max(config.streams)
    chats = conversations(loaded.tokenizer, most, config.prompt_tokens, render)
    prompts = [list(render(messages)) for messages in chats]
    results["prompt_tokens"] = [len(p) for p in prompts]
    progress(f"reading {most} conversations in ({config.mode})")
    sessions = engine_sessions(loaded, config.mode, chats)
    progress(f"reading {most} conversations in (mlx-lm)")
    caches = mlx_lm_caches(loaded.model, prompts)
    results["mlx_lm_kv_dtype"] = str(caches[0][0].keys.dtype).removeprefix("mlx.core.")
    run_engine(sessions[:1], chats, 2)  # compile and warm up, untimed
    run_mlx_lm(loaded.model, prompts[:1], caches[:1], 2)
    for streams in config.streams:
        progress(f"{streams} streams: engine")
        before = pages_bytes(sessions)
        ours = run_engine(sessions[:streams], chats, config.max_tokens)
        ours.update(memory_bound(sessions, streams, before, ours))
        progress(f"{streams} streams: mlx-lm")
        theirs = run_mlx_lm(loaded.model, prompts[:streams], caches[:streams],
                            config.max_tokens)
        rows.append({"streams": streams, "engine": ours, "mlx_lm": theirs})
        if partial_results is not None:
            partial_results(results)
    for session in sessions:
        session.close()
    progress("a short question while a document is read in")
    results["first_token"] = run_first_token(loaded, config, chats[0])
    progress("the same, a chunk read at every step (the schedule before reads took turns)")
    results["first_token_every_step"] = run_first_token(loaded, config, chats[0], turns=False)
    results["layer_kernels"] = {str(streams): layer_kernels(config.mode, streams)
                                for streams in config.streams}
    return results


def layer_kernels(mode: str, rows: int, context: int = 512) -> int:
    """Kernels one full-attention layer of the seed's shape (``KernelsConfig``'s
    heads) launches for a decode step of ``rows`` rows in ``mode`` under the GPU
    schedule: its page writes and its attention, by the graph counter. The count
    does not depend on the context; each row holds a different length."""
    from benchmarks import graph_count
    from benchmarks.kernels_bench import KernelsConfig
    from engine.cache import adapter
    from engine.cache.attention import schedule
    from engine.cache.batched import PagedRows
    from engine.cache.paged_cache import PagedKVCache
    from engine.cache.pages import PagePool
    from engine.cache.rotation import HadamardRotation

    shape = KernelsConfig()
    kv_mode = parse_mode(mode)
    layers = []
    for row in range(rows):
        layer = PagedKVCache(PagePool(kv_mode, shape.page_size), shape.kv_heads, shape.head_dim)
        if adapter.rotates_by_default(kv_mode):
            layer.rotation = HadamardRotation(shape.head_dim)
        filled = mx.zeros((1, shape.kv_heads, context + row, shape.head_dim), mx.float16)
        layer.update_and_fetch(filled, filled)
        mx.eval([part for part in layer.held_store.parts if part is not None])
        layers.append(layer)

    def step(q: mx.array, k: mx.array, v: mx.array) -> tuple[mx.array, ...]:
        batch = PagedRows(layers, mx.array([layer.offset for layer in layers]))
        batch.make_mask(1)
        keys, values = batch.update_and_fetch(k, v)
        out = adapter.attend_rows(q, keys, values, batch, shape.head_dim ** -0.5)
        # The pages go out too: a write nothing reads later is still work.
        return (out, *[part for layer in layers for part in layer.held_store.parts
                       if part is not None])

    q = mx.zeros((rows, shape.q_heads, 1, shape.head_dim), mx.float16)
    new = mx.zeros((rows, shape.kv_heads, 1, shape.head_dim), mx.float16)
    with schedule.forced(schedule.GPU):
        return graph_count.tally(*graph_count.trace(step, q, new, new)).kernels


HEADERS = ("streams", "engine tok/s", "engine ×1 stream", "mlx-lm tok/s", "mlx-lm ×1 stream",
           "engine / mlx-lm", "peak MLX memory engine / mlx-lm (MiB)",
           "engine peak over weights / pages + step transient (MiB)",
           "transient measured / counted (MiB)")


def _against_bound(ours: dict[str, Any]) -> str:
    """The engine's peak above its weights against pages + one step's transient."""
    if "pages_bytes" not in ours:
        return "—"
    over = ours["engine_peak_bytes"]
    bound = ours["pages_bytes"] + ours["transient_bytes"]
    return (f"{over / 2**20:.1f} / {bound / 2**20:.1f} "
            f"({fmt_ratio(ratio(over, bound), PEAK_GOAL)})")


def _transient(ours: dict[str, Any]) -> str:
    """The step's transient as measured (the peak above weights and pages) beside
    the one admission counts."""
    if "pages_bytes" not in ours:
        return "—"
    measured = ours["engine_peak_bytes"] - ours["pages_bytes"]
    return f"{measured / 2**20:.1f} / {ours['transient_bytes'] / 2**20:.1f}"


def _beside_lines(results: dict[str, Any]) -> list[str]:
    """How the question's answer and the document's read shared the steps."""
    turns, every = results.get("first_token"), results.get("first_token_every_step")
    if not turns or not every or "answer_tps_alone" not in turns:
        return []

    def shares(run: dict[str, Any]) -> str:
        return (f"the answer {run['answer_tps_beside_read']:.1f} tok/s beside the read against "
                f"{run['answer_tps_alone']:.1f} with nothing read "
                f"({fmt_ratio(ratio(run['answer_tps_beside_read'], run['answer_tps_alone']))}), "
                f"the document read at {run['read_tps_beside_answer']:.0f} tok/s beside it")

    config = results["config"]
    reads = ratio(turns["read_tps_beside_answer"], every["read_tps_beside_answer"])
    return ["", f"That question's answer, timed over {config['pace_chunks']} of the "
                f"document's chunks read beside it, then for {config['pace_tokens']} tokens "
                "with nothing read. Reads taking turns with the "
                f"decoding by time (the engine): {shares(turns)}. A chunk read at every "
                f"step (the schedule before, same run): {shares(every)}. Over the same "
                "chunks, the read with turns against a chunk every step: "
                f"{fmt_ratio(reads)}"
                " (the document's first chunks, read before the question came, are "
                "at a shorter context: their rate is no baseline)."]


def render_batch_report(results: dict[str, Any], info: dict[str, Any], command: str,
                        load_after: str) -> str:
    """The Markdown body of the batch benchmark's section."""
    config, model, rows = results["config"], results["model"], results["rows"]
    base = rows[0] if rows else None
    lines = []
    for row in rows:
        ours, theirs = row["engine"], row["mlx_lm"]
        lines.append((
            row["streams"],
            f"{ours['tps']:.1f}",
            fmt_ratio(ratio(ours["tps"], base["engine"]["tps"])) if base else "—",
            f"{theirs['tps']:.1f}",
            fmt_ratio(ratio(theirs["tps"], base["mlx_lm"]["tps"])) if base else "—",
            fmt_ratio(ratio(ours["tps"], theirs["tps"])),
            f"{ours['peak_bytes'] / 2**20:.0f} / {theirs['peak_bytes'] / 2**20:.0f}",
            _against_bound(ours),
            _transient(ours),
        ))
    prompts = results.get("prompt_tokens", [])
    out = [
        "## Batched decoding: engine vs mlx-lm's BatchGenerator (`python -m benchmarks batch`)",
        "",
        f"Command: `{command}`",
        "",
        *machine_lines(info, load_after),
        "",
        f"Model: {model['name']} ({model['layers']} layers, {model['kv_heads']} KV heads of "
        f"{model['head_dim']}). Conversations of {min(prompts, default=0)} to "
        f"{max(prompts, default=0)} tokens; greedy, {config['max_tokens']} tokens a stream. "
        f"Engine: `BatchDecoder`, every conversation's own paged cache in {config['mode']}; "
        f"mlx-lm: `BatchGenerator`, {_kv_dtype(results)}`KVCache`s merged left-padded. "
        "Aggregate tokens per "
        "second over the steps after every stream's first token. The last column sets the "
        "engine's peak less its weights (and less mlx-lm's caches, held meanwhile) against "
        "every open conversation's pages plus one decode step's transient for the streams "
        "(`PrefillFacts.step_transient_bytes`, what admission counts); the goal is at most "
        "1.10×.",
        "",
        *table(HEADERS, lines),
    ]
    first = results.get("first_token")
    if first is not None:
        chunks = "n/a" if first["chunks"] is None else f"{first['chunks']:.2f}"
        out += [
            "",
            f"A short question joining while a {max(prompts, default=0)}-token conversation "
            f"is read in ({config['chunk']}-token chunks, in {config['mode']}): first token "
            f"after {first['seconds']:.2f} s, {chunks} of the document's chunk "
            f"times ({first['chunk_seconds']:.2f} s, median); the document was "
            f"{'still' if first['document_still_reading'] else 'no longer'} being read.",
        ]
    out += _beside_lines(results)
    kernels = results.get("layer_kernels")
    if kernels:
        counts = " / ".join(str(count) for count in kernels.values())
        streams = " / ".join(kernels)
        out += [
            "",
            f"Kernels one full-attention layer of the seed's shape (4 KV heads of 256) "
            f"launches for a decode step in {config['mode']} under the GPU schedule (graph "
            f"counter): {counts} at {streams} streams.",
        ]
    return "\n".join(out) + "\n"


def _kv_dtype(results: dict[str, Any]) -> str:
    """mlx-lm's cache dtype as the report says it ("" where a run did not record it)."""
    dtype = results.get("mlx_lm_kv_dtype")
    return f"{dtype} (the model's compute dtype here) " if dtype else ""
