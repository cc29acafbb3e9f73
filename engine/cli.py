"""Headless command line: ``python -m engine generate|models|info|serve``.

It drives the same ``EngineWorker`` the app uses, so a script, a benchmark or a
check sees exactly what the GUI would.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import socket
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from engine.cache import kvquant
from engine.cache.modes import DEFAULT_MODE, MODES, KvMode, parse_mode
from engine.distributed.launch import (
    join_group,
    launch,
    rank_report_dir,
    read_hostfile,
    write_rank_report,
)
from engine.errors import EngineError, UnsupportedModeError
from engine.events import (
    AnswerWaiting,
    Event,
    Failed,
    Finished,
    ModelLoaded,
    Notice,
    StatsSample,
    TokenChunk,
)
from engine.format import GB
from engine.interrupted import interrupted
from engine.memory.fit import facts_from_info
from engine.paths import models_dir
from engine.runtime.interface import Pipeline, Worker
from engine.runtime.worker import EngineWorker
from engine.session import speculative
from engine.session.batch import DEFAULT_READ_SHARE, check_read_share
from engine.session.sampling import SamplingParams
from engine.session.session import DEFAULT_CHUNK, DEFAULT_PAGE_SIZE, MAX_CHUNK, MAX_PAGE_SIZE
from engine.snapshots.files import check_name
from engine.snapshots.snapshot_store import SnapshotStore, default_snapshot_dir

if TYPE_CHECKING:
    from engine.models.info import ModelInfo

SESSION = "cli"
SESSION_PREFIX = "cli-"
REQUEST_TIMEOUT = 24 * 3600.0  # generation on a big prompt may take long; never hang forever


class ReaderGone(Exception):
    """The reader of the command's output left (``… | head``)."""


def _write(out: TextIO, text: str) -> None:
    """Write ``text`` to the command's output.

    Raises:
        ReaderGone: the pipe it goes to was closed.
    """
    try:
        out.write(text)
        out.flush()
    except BrokenPipeError as error:
        raise ReaderGone from error


class _Collector:
    """Receives worker events; wakes the main thread when a request ends.

    ``cancel`` stops the answer: set once nobody reads the streamed text any
    more (the reader of a pipe, e.g. ``head``, has gone). Notices (stored KV not
    used, a read waiting for memory) go to ``notify`` as they come, when given.
    """

    def __init__(self, stream: TextIO | None, notify: TextIO | None = None) -> None:
        self.stream = stream
        self.notify = notify
        self.cancel = threading.Event()
        self.ended = threading.Event()
        self.ending: Finished | Failed | None = None
        self.info: ModelInfo | None = None
        self.text: list[str] = []
        self.tokens: list[int] = []
        self.stats: StatsSample | None = None
        self.notices: list[str] = []  # e.g. why stored KV was not used
        self.rank_stats: dict[str, Any] = {}  # a pipeline rank 0's share of the cache

    def __call__(self, event: Event) -> None:
        if isinstance(event, TokenChunk):
            self.text.append(event.text)
            self.tokens.extend(event.token_ids)
            if self.stream is not None:
                try:
                    _write(self.stream, event.text)
                except ReaderGone:
                    self.stream = None
                    self.cancel.set()
        elif isinstance(event, StatsSample):
            self.stats = event
        elif isinstance(event, Notice | AnswerWaiting):
            text = event.message if isinstance(event, Notice) else event.reason
            self.notices.append(text)
            if self.notify is not None:
                with contextlib.suppress(OSError, ValueError):  # no terminal to say it on
                    print(text, file=self.notify, flush=True)
        elif isinstance(event, ModelLoaded):
            self.info = event.info
        elif isinstance(event, Finished | Failed):
            self.ending = event
            self.ended.set()

    def wait(self) -> Finished:
        self.ended.wait(REQUEST_TIMEOUT)
        ending, self.ending = self.ending, None
        self.ended.clear()
        if isinstance(ending, Failed):
            raise EngineError(ending.message)
        if ending is None:
            raise EngineError("The engine did not answer in time.")
        return ending


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file is None:
        return args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    try:
        return Path(args.prompt_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise EngineError(f"Cannot read the prompt file {args.prompt_file}: {error}") from error


def generate(args: argparse.Namespace, out: TextIO) -> int:
    """Run one prompt through a fresh session and print the answer."""
    report_dir = rank_report_dir()
    pipeline = args.pipeline > 1 or args.hostfile is not None
    if report_dir is None:  # the command as typed, not one of a launch's ranks
        if pipeline and args.speculative == "lookup":
            # The followers run rank 0's commands one decode step at a time; a
            # k-token verification and its rewind are not commands they know yet.
            # Left at its default, speculation is off on a pipeline (Session.chat).
            raise EngineError("Speculative decoding is not available over a pipeline yet: "
                              "run with --speculative off, or without --pipeline.")
        _check_pipeline(args)
    if pipeline and report_dir is None:
        return launch(args.argv, args.pipeline, args.seed, out, args.hostfile)
    if report_dir is None:
        result, collector = _run(args, None if args.json else out, pipeline=None)
        _write(out, json.dumps(result) + "\n" if args.json else "\n")
        return 0
    # One rank of a pipeline launch: the launcher prints what rank 0 reports.
    group = join_group(report_dir)
    if group.rank() != 0:
        # A follower: no prompt, no sampling; it does what rank 0's commands say.
        from engine.distributed.follower import follow

        snapshots = (Path(args.session_dir or default_snapshot_dir())
                     if args.session else None)
        write_rank_report(report_dir, group.rank(),
                          {"rank_stats": follow(args.model, group, snapshots, args.split)})
        return 0
    from engine.distributed.rank_commands import Pipeline

    result, collector = _run(args, None, pipeline=Pipeline(group, args.split))
    write_rank_report(report_dir, group.rank(), {
        "result": result if args.json else None,
        "text": "".join(collector.text),
        "rank_stats": collector.rank_stats,
    })
    return 0


def _run(args: argparse.Namespace, stream: TextIO | None,
         pipeline: Pipeline | None) -> tuple[dict[str, Any], _Collector]:
    prompt = _read_prompt(args)
    sampling = SamplingParams(
        temperature=args.temp, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, max_tokens=args.max_tokens,
        seed=args.seed, speculative=args.speculative or SamplingParams.speculative,
    )
    # The text goes to stdout; what the engine says about it, to stderr (``--json``
    # carries both).
    collector = _Collector(stream, notify=None if stream is None else sys.stderr)
    # Stored as "cli-<name>": the app names its chats' snapshots by a bare hex id,
    # so a CLI run on the same data folder never replaces or deletes a chat's KV.
    session = f"{SESSION_PREFIX}{args.session}" if args.session else SESSION
    snapshots = None
    if args.session:
        # The session's KV cache is stored when the worker shuts down and reused
        # for the longest matching prefix of the next run's prompt.
        snapshots = _session_store(args.session_dir)
    # A pipeline's ranks run the same steps in lock-step: the chunk plan, from token
    # positions and the chunk setting only, is the same on every rank.
    worker = EngineWorker(collector, chunk_size=args.chunk_size, snapshots=snapshots,
                          pipeline=pipeline)
    worker.start()
    try:
        worker.load_model(args.model)
        collector.wait()
        worker.open_session(session, args.kv, args.page_size)
        collector.wait()
        messages = [{"role": "user", "content": prompt}]
        worker.chat(session, messages, sampling, collector.cancel)
        ending = collector.wait()
        if pipeline is not None:
            collector.rank_stats = _rank_stats(worker, session, 0, collector)
    finally:
        worker.shutdown(timeout=10.0)
    stats = ending.stats
    sample = collector.stats
    result = {
        "text": "".join(collector.text),
        "tokens": collector.tokens,
        "prompt_tokens": stats.prompt_tokens if stats else 0,
        "prefill_tokens": stats.prefill_tokens if stats else 0,
        "reused_tokens": stats.reused_tokens if stats else 0,
        "kv_mode": args.kv,
        "kv_bytes": sample.kv_bytes_allocated if sample else 0,
        "kv_bytes_used": sample.kv_bytes_used if sample else 0,
        "pages_in_use": sample.pages_in_use if sample else 0,
        "pages_allocated": sample.pages_allocated if sample else 0,
        "peak_memory_bytes": sample.mlx_peak_bytes if sample else 0,
        "prefill_tps": stats.prefill_tps if stats else 0.0,
        "decode_tps": stats.decode_tps if stats else 0.0,
        "draft_tokens": stats.draft_tokens if stats else 0,
        "accepted_tokens": stats.accepted_tokens if stats else 0,
        "decode_steps": stats.decode_steps if stats else 0,
        "time_to_first_token": stats.time_to_first_token if stats else None,
        "finish_reason": ending.reason,
        "notices": collector.notices,
    }
    return result, collector


def _session_store(folder: Path | None) -> SnapshotStore:
    """The ``--session`` snapshots' store, made (user-only) in ``folder``.

    Raises:
        EngineError: the folder cannot be made or used, in words.
    """
    try:
        # The app's folder by default: a run evicts only the CLI's own sessions, never
        # a chat's stored KV (the app's budget, set in its Settings, is not known here).
        return SnapshotStore(folder, evictable=lambda name: name.startswith(SESSION_PREFIX))
    except OSError as error:
        where = Path(error.filename or folder or default_snapshot_dir())
        # The folder, or one it would be made in, may be a file.
        blocking = next((p for p in (where, *where.parents) if p.is_file()), None)
        why = (f"{blocking} is a file, not a folder" if blocking is not None
               else f"{error.strerror or error} ({where})")
        raise EngineError(f"--session-dir {folder or default_snapshot_dir()} cannot hold "
                          f"stored KV: {why}.") from error


def _rank_stats(worker: Worker, session: str, rank: int,
                collector: _Collector) -> dict[str, Any]:
    """Rank 0's share of the cache, as a follower reports its own."""
    sample = collector.stats
    tokens = len(collector.tokens)
    report = worker.fit_check(session, tokens)
    return {
        "rank": rank,
        "layers": [layer.layer for layer in sample.layers] if sample else [],
        "kv_bytes": sample.kv_bytes_allocated if sample else 0,
        "pages_in_use": sample.pages_in_use if sample else 0,
        "free_bytes": report.free_bytes,
        "tokens_fit": {m.mode: (m.tokens_fit if m.supported else None) for m in report.modes},
    }


def find_models() -> list[tuple[str, str]]:
    """Models Longleaf can open: (name, path), the embedded demo first."""
    from engine.models.demo import DEMO_NAME, demo_gguf_path
    from engine.models.discovery import discover_models

    found: list[tuple[str, str]] = []
    converted_demo = (models_dir() / DEMO_NAME).resolve()
    try:
        demo_gguf_path()
        found.append(("demo", f"demo ({DEMO_NAME}, embedded)"))
    except EngineError:
        pass
    found.extend(
        (model.name, str(model.path)) for model in discover_models().models
        if not (found and Path(model.path).resolve() == converted_demo)
    )
    return found


def models(args: argparse.Namespace, out: TextIO) -> int:
    """List the models found on this machine."""
    entries = find_models()
    if args.json:
        _write(out, json.dumps([{"name": n, "path": p} for n, p in entries]) + "\n")
        return 0
    if not entries:
        _write(out, "No models found. Put an mlx-lm model folder under "
                    f"{models_dir()} or pass --model DIR.\n")
    for name, path in entries:
        _write(out, f"{name}\t{path}\n")
    return 0


def kv_projection(info: ModelInfo) -> dict[str, int | None]:
    """KV bytes per mode for the model's full context (None: mode unsupported)."""
    facts = facts_from_info(info)
    projection: dict[str, int | None] = {}
    for mode in MODES:
        try:
            projection[mode] = kvquant.project_kv_bytes(
                facts.attention_layers, facts.kv_heads, facts.head_dim,
                facts.max_context, mode,
            )
        except (EngineError, ValueError):
            projection[mode] = None
    return projection


def _facts(info: ModelInfo) -> dict[str, Any]:
    return {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}


def info(args: argparse.Namespace, out: TextIO) -> int:
    """Print a model's facts and its KV size per mode at full context."""
    from engine.models.info import inspect_model_dir
    from engine.models.loader import resolve_model_path

    info_object = inspect_model_dir(resolve_model_path(args.model))
    facts = _facts(info_object)
    projection = kv_projection(info_object)
    if args.json:
        _write(out, json.dumps({"facts": facts, "kv_bytes_full_context": projection},
                               default=str) + "\n")
        return 0
    width = max(len(key) for key in facts)
    for key, value in facts.items():
        _write(out, f"{key:>{width}}: {value}\n")
    context = facts_from_info(info_object).max_context
    _write(out, f"\nKV cache at the full context ({context:,} tokens):\n")
    for mode, nbytes in projection.items():
        shown = "unsupported for this head_dim" if nbytes is None else _size(nbytes)
        _write(out, f"{mode:>{width}}: {shown}\n")
    return 0


def _size(nbytes: int) -> str:
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:.2f} GiB ({nbytes:,} bytes)"
    return f"{nbytes / 2**20:.1f} MiB ({nbytes:,} bytes)"


def serve(args: argparse.Namespace, out: TextIO) -> int:
    """Serve the OpenAI- and Anthropic-compatible HTTP API until interrupted."""
    from engine.server.app import cors_origins, host_names
    from engine.server.listen import bind

    if args.host not in ("127.0.0.1", "localhost", "::1") and not args.api_key:
        raise EngineError("Serving beyond this machine needs --api-key: anyone on the "
                          "network could otherwise use the model.")
    origins = cors_origins(args.cors_origin)
    allowed = host_names(args.allow_host)
    _check_pipeline(args)
    from engine.models import DEMO
    from engine.models.info import inspect_model_dir

    if args.model != DEMO:  # a folder that cannot be loaded, said before serving
        inspect_model_dir(args.model)
    for option, value in (("--parallel", args.parallel), ("--sessions", args.sessions),
                          ("--queue-limit", args.queue_limit)):
        if value is not None and value < 1:
            raise EngineError(f"{option} must be at least 1.")
    # Bound first: a port in use is said before the model loads, not after.
    sock = bind(args.host, args.port, name="the server", change="with --port")
    try:
        lost = _serve_on(sock, args, out, origins, allowed)
    finally:
        sock.close()
    if lost is None:
        out.write("Longleaf server stopped; its sessions are stored.\n")
    else:  # the sessions lived on the lost ranks: nothing of them could be stored
        out.write(f"Longleaf server stopped; the pipeline's sessions were lost with it. "
                  f"{lost}\n")
    return 0


def _serve_on(sock: socket.socket, args: argparse.Namespace, out: TextIO,
              origins: tuple[str, ...], allowed: tuple[str, ...]) -> str | None:
    """Load the model and serve on ``sock`` until interrupted; what ended the
    served model at the end (a pipeline lost), or None where it was served to the
    end."""
    from engine import paths
    from engine.server.bridge import ServerBridge
    from engine.server.serve import server_snapshot_dir, uvicorn_server

    # The app's stored KV counts against the same budget: one user, one disk.
    options = {"max_sessions": args.sessions, "queue_limit": args.queue_limit,
               "snapshot_budget": args.kv_disk_budget, "counted_with": (paths.snapshots_dir(),),
               "parallel": args.parallel, "read_share": args.read_share}
    where = ""
    if args.pipeline > 1 or args.hostfile is not None:
        from engine.server.pipeline import PipelineBridge

        bridge: ServerBridge = PipelineBridge(
            args.model, args.kv, server_snapshot_dir(), ranks=args.pipeline,
            hostfile=args.hostfile, split=args.split, **options)
        where = (f" over {bridge.machines} machines ({args.hostfile})" if args.hostfile
                 else f" over {bridge.machines} local ranks")
    else:
        bridge = ServerBridge(args.model, args.kv, server_snapshot_dir(), **options)
    host = f"[{args.host}]" if ":" in args.host else args.host
    port = sock.getsockname()[1]
    out.write(f"Longleaf serving {bridge.model_id}{where} on http://{host}:{port} "
              f"(OpenAI: http://{host}:{port}/v1)\n")
    out.flush()
    failed: list[str] = []

    def loaded(bridge: ServerBridge) -> None:
        if bridge.load_error is not None:  # nothing to serve: stop, and say why below
            failed.append(bridge.load_error)
            server.should_exit = True

    server = uvicorn_server(bridge, args.host, args.port, args.api_key, origins, allowed,
                            loaded=loaded)
    # uvicorn shuts down (sessions stored) and then raises Ctrl-C again for the
    # caller: here it is the asked-for way to stop, not an error.
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[sock])
    if failed:
        raise EngineError(f"The model did not load: {failed[0]}")
    return bridge.load_error


def _check_pipeline(args: argparse.Namespace) -> None:
    """Refuse, before any rank starts, a pipeline that cannot run."""
    from engine.models.split import split_refusal

    if args.pipeline < 1:
        raise EngineError("--pipeline takes the number of ranks, 1 or more.")
    if args.hostfile is not None:
        read_hostfile(args.hostfile)  # a file that is no hostfile is said first
    if args.hostfile is None and args.pipeline == 1:
        if args.split is not None:
            raise EngineError("--split needs --pipeline N or --hostfile FILE.")
        return
    refusal = split_refusal(args.model)
    if refusal is not None:
        raise EngineError(refusal)


def _layer_counts(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--split takes layer counts separated by commas, e.g. 10,14 (not {text!r})"
        ) from None


def _tokens_up_to(option: str, most: int) -> Callable[[str], int]:
    """The type of an option taking 1 to ``most`` tokens."""
    def tokens(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if not 1 <= value <= most:
            raise argparse.ArgumentTypeError(
                f"{option} takes a number of tokens from 1 to {most:,} (not {text!r})")
        return value
    return tokens


def _read_share(text: str) -> float:
    """``--read-share``: above 0 and at most 1."""
    try:
        return check_read_share(float(text))
    except (ValueError, EngineError):
        raise argparse.ArgumentTypeError(
            f"--read-share takes a number above 0 and at most 1, e.g. 0.5 (not {text!r})"
        ) from None


def _gigabytes(text: str) -> int:
    """``--kv-disk-budget``: GB as the app says them (``engine.format.GB``), in bytes."""
    try:
        size = float(text)
    except ValueError:
        size = -1.0
    if not size >= 0 or size == float("inf"):
        raise argparse.ArgumentTypeError(
            f"--kv-disk-budget takes a size in GB, 0 or more, e.g. 20 (not {text!r})")
    return round(size * GB)


def _kv_mode(text: str) -> KvMode:
    """``--kv``: a mode of the registry, by its name or an alias."""
    try:
        return parse_mode(text)
    except UnsupportedModeError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _add_kv_option(command: argparse.ArgumentParser, purpose: str = "") -> None:
    """``--kv`` for ``command``: every subcommand takes the registry's names and
    aliases and defaults to its default mode, as the app does."""
    command.add_argument("--kv", type=_kv_mode, default=DEFAULT_MODE,
                         help=f"KV mode: {', '.join(MODES)} (default {DEFAULT_MODE}){purpose}")


def _session_name(text: str) -> str:
    try:
        check_name(f"{SESSION_PREFIX}{text}")
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--session names a file: use letters, digits, '_', '-' or '.' (not {text!r})"
        ) from None
    return text


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m engine`` argument parser."""
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="answer one prompt")
    gen.add_argument("--model", required=True, help='a model folder, or "demo"')
    _add_kv_option(gen)
    gen.add_argument("--page-size", type=_tokens_up_to("--page-size", MAX_PAGE_SIZE),
                     default=DEFAULT_PAGE_SIZE)
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the prompt; \\n and \\t in it become a newline "
                                          "and a tab (--prompt-file reads a file as it is)")
    source.add_argument("--prompt-file")
    defaults = SamplingParams()
    gen.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    gen.add_argument("--temp", type=float, default=defaults.temperature)
    gen.add_argument("--top-p", type=float, default=defaults.top_p)
    gen.add_argument("--top-k", type=int, default=defaults.top_k)
    gen.add_argument("--min-p", type=float, default=defaults.min_p)
    gen.add_argument("--repetition-penalty", type=float, default=defaults.repetition_penalty)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--speculative", choices=speculative.MODES, default=None,
                     help="draft tokens from the prompt's own text and verify them in one "
                          f"pass (default: {defaults.speculative}; off over a pipeline)")
    gen.add_argument("--chunk-size", type=_tokens_up_to("--chunk-size", MAX_CHUNK),
                     default=DEFAULT_CHUNK, help="prefill chunk in tokens")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--session", type=_session_name,
                     help="store the KV cache as this snapshot and reuse it")
    gen.add_argument("--session-dir", type=Path,
                     help="folder of --session snapshots (default: the data directory's)")
    gen.add_argument("--pipeline", type=int, default=1, metavar="N",
                     help="split the model over N local processes (MLX ring backend)")
    gen.add_argument("--hostfile", type=Path, default=None,
                     help="split the model over the hosts of this MLX hostfile (mlx.launch's "
                          "JSON format) instead of local processes")
    gen.add_argument("--split", type=_layer_counts, default=None, metavar="A,B",
                     help="layers per rank with --pipeline, rank 0 (the last layers) first")
    gen.set_defaults(handler=generate)
    found = commands.add_parser("models", help="list the models found")
    found.add_argument("--json", action="store_true")
    found.set_defaults(handler=models)
    api = commands.add_parser("serve", help="serve the OpenAI/Anthropic HTTP API")
    api.add_argument("--model", required=True, help='a model folder, or "demo"')
    api.add_argument("--host", default="127.0.0.1",
                     help="address to bind (default: this machine only)")
    api.add_argument("--port", type=int, default=1234)
    _add_kv_option(api, ", for requests that ask for none")
    api.add_argument("--api-key", default=None, help="require this key on every request")
    api.add_argument("--sessions", type=int, default=4, help="server sessions held in memory")
    api.add_argument("--parallel", type=int, default=None, metavar="N",
                     help="requests answered together (default: as many 8k-token "
                          "conversations as free memory holds, 1 to 8); more wait in "
                          "the queue")
    api.add_argument("--read-share", type=_read_share, default=DEFAULT_READ_SHARE, metavar="S",
                     help="the share of the time a long prompt being read in takes while "
                          "other requests answer, above 0 and at most 1 (default: "
                          f"{DEFAULT_READ_SHARE}, equal turns; 1: a chunk at every step, "
                          "the answers slowed the most)")
    api.add_argument("--queue-limit", type=int, default=16,
                     help="requests waiting at once, beside the --parallel ones, before "
                          "answering 429")
    api.add_argument("--kv-disk-budget", type=_gigabytes, default=None, metavar="GB",
                     help="stored-KV disk budget, the app's stored chats included "
                          "(default: the smaller of 20 GB and 10%% of free disk)")
    api.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN",
                     help="let web pages of ORIGIN (e.g. http://localhost:3000) call the "
                          "API; repeatable; none by default")
    api.add_argument("--allow-host", action="append", default=[], metavar="NAME",
                     help="answer requests addressed to NAME too (without --api-key only "
                          "localhost, 127.0.0.1 and [::1] are answered); repeatable")
    api.add_argument("--pipeline", type=int, default=1, metavar="N",
                     help="split the model over N local processes (MLX ring backend); "
                          "if a rank is lost, the server goes on on this machine alone "
                          "when the model fits here")
    api.add_argument("--hostfile", type=Path, default=None,
                     help="split the model over the hosts of this MLX hostfile (mlx.launch's "
                          "JSON format), this machine (127.0.0.1) first")
    api.add_argument("--split", type=_layer_counts, default=None, metavar="A,B",
                     help="layers per rank with --pipeline or --hostfile, rank 0 (the last "
                          "layers) first")
    api.set_defaults(handler=serve)
    facts = commands.add_parser("info", help="model facts and KV size per mode")
    facts.add_argument("model", help='a model folder, or "demo"')
    facts.add_argument("--json", action="store_true")
    facts.set_defaults(handler=info)
    return parser


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    """Run the CLI; returns the exit status (1 on an engine error)."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # for a pipeline's ranks
    out = out or sys.stdout
    try:
        return args.handler(args, out)
    except EngineError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # what was stored on the way out (a --session) is kept
        return interrupted()
    except ReaderGone:
        # Say nothing more, and keep the interpreter's last flush of the output
        # from raising into the closed pipe.
        with contextlib.suppress(OSError, ValueError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())
        return 1
