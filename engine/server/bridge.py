"""The server's side of the engine worker: requests in, events out, sessions picked.

The bridge never touches MLX or a live engine object: it submits commands to the
``EngineWorker`` and routes the frozen events that come back to the request that
asked, through an ``asyncio`` queue of the server's event loop. It renders
prompts with its own tokenizer instance (loaded from the model folder after the
worker loaded the model) to choose which server session a request continues.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.cache.modes import DEFAULT_MODE, KvMode
from engine.errors import EngineError, EngineStopped
from engine.events import Event, Failed, Finished, ModelLoaded, Notice, request_id_of
from engine.runtime.held_sessions import API_SESSION_PREFIX
from engine.runtime.interface import Worker
from engine.runtime.worker import EngineWorker
from engine.server.call_grammar import Calls, call_grammar, opens_thought
from engine.server.token_bytes import token_bytes
from engine.server.tools import ToolSyntax
from engine.session.batch import DEFAULT_READ_SHARE
from engine.session.prompt_ids import clean_text, common_prefix, render_conversation
from engine.session.sampling import SamplingParams
from engine.snapshots.snapshot_store import SnapshotStore

if TYPE_CHECKING:
    from engine.memory.fit import FitReport
    from engine.models.info import ModelInfo

log = logging.getLogger(__name__)

LOAD_TIMEOUT = 3600.0
LOADING = "The model is still loading; try again shortly."
STOPPING = "The server is stopping; start it again (or use another) and send the request again."


class QueueFull(EngineError):
    """More requests wait for the engine than the server's queue limit allows."""


class NotReady(EngineError):
    """No model is ready to answer: it is loading, or (the message) why none is."""


@dataclass
class Ticket:
    """One HTTP request's events, delivered on the server's event loop.

    Attributes:
        loop: the event loop the request's handler awaits on.
        queue: the events of every engine request made for it, in order.
        chat_id: the id of its chat request (its ``Finished`` ends the ticket).
        session: the server session it runs on.
        mode: the KV mode of that session.
        reused: prompt tokens a held session continued has cached already (what
            the request will read from the cache at least; a stored snapshot or
            another session may add more, known when it ends).
        prompt: the prompt's ids.
        held_before: the prompt the session held before this request (empty for
            a new session): still what it holds if the request ends unread.
    """

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    chat_id: int = 0
    session: str = ""
    mode: KvMode = DEFAULT_MODE  # set with the session it runs in
    reused: int = 0
    prompt: list[int] = field(default_factory=list)
    held_before: list[int] = field(default_factory=list)
    cancel: threading.Event | None = None  # the request's own, set when the server stops

    def put(self, event: Event) -> None:
        """Hand ``event`` to the handler (called on the worker thread)."""
        # A loop that has closed (the server stopped) has no handler left to read it.
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.queue.put_nowait, event)


class ServerBridge:
    """Owns the worker and the server's sessions; every method is thread-safe.

    Args:
        model: a model folder or "demo".
        kv_mode: the KV mode of requests that do not ask for one.
        snapshot_dir: the server's own stored-KV folder (never the app's: API
            requests reuse only KV made by API requests).
        max_sessions: server sessions held in memory; the least recently used
            one is stored as a snapshot when another is needed.
        queue_limit: requests that may wait for the engine at once, beside those
            it answers together (``parallel``); more get 429.
        parallel: requests that decode together (the worker's stream limit);
            None: chosen from free memory when the model loads.
        read_share: the share of the time a prompt being read in takes beside
            answers (the worker's ``read_share``).
        snapshot_budget: the stored-KV disk budget in bytes (None: the default,
            as the app's).
        counted_with: other snapshot folders (the app's) whose bytes count
            against that budget with the server's own.
    """

    def __init__(self, model: str, kv_mode: KvMode, snapshot_dir: Path | None, *,
                 max_sessions: int = 4, queue_limit: int = 16, parallel: int | None = None,
                 worker: Worker | None = None, snapshot_budget: int | None = None,
                 counted_with: tuple[Path, ...] = (),
                 read_share: float = DEFAULT_READ_SHARE) -> None:
        self.model = model
        self.kv_mode = kv_mode
        self.max_sessions = max(1, max_sessions)
        self.queue_limit = max(1, queue_limit)
        self.snapshots = None if snapshot_dir is None else SnapshotStore(
            snapshot_dir, snapshot_budget, counted_with=counted_with)
        self.worker: Worker = worker or EngineWorker(self._on_event, snapshots=self.snapshots,
                                                     streams=parallel, read_share=read_share)
        self.ready = threading.Event()
        self.info: ModelInfo | None = None
        self.load_error: str | None = None
        self._tokenizer: Any = None
        self._tool_syntax: ToolSyntax | None = None
        # Held while the tokenizer encodes (on the render thread: seconds, for a
        # prompt of megabytes), so the event loop never waits on it: what the
        # handlers read of the tokenizer is kept beside it when a model is served.
        self._tokenizer_lock = threading.Lock()
        self._vocab_size = 0
        self._chat_template = ""
        # One thread renders prompts off the server's event loop (a long
        # conversation takes a while to tokenize); started with the model, so
        # no thread appears or lingers per request.
        self._renderer = ThreadPoolExecutor(1, thread_name_prefix="longleaf-server-render")
        self._lock = threading.Lock()
        self._tickets: dict[int, Ticket] = {}
        self._sessions: OrderedDict[str, tuple[KvMode, list[int]]] = OrderedDict()
        self._in_flight = 0
        self._loading = threading.Event()
        self._load_id = 0
        self._stopping = False

    # -- life ------------------------------------------------------------------

    def load(self) -> None:
        """Start the worker, load the model and the server's tokenizer (blocks)."""
        self.worker.start()
        with self._lock:
            self._load_id = self.worker.load_model(self.model)
        self._loading.wait(LOAD_TIMEOUT)
        if self.info is None:
            self.load_error = self.load_error or "The model did not load in time."
            return
        self.use_model(self.info)

    def use_model(self, info: ModelInfo) -> None:
        """Serve the model the worker loaded (its ``ModelInfo``): read the server's own
        tokenizer from its folder, then answer requests (blocks while it reads)."""
        import json

        from mlx_lm.utils import load_tokenizer

        folder = Path(info.path)
        try:
            config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
            tokenizer = load_tokenizer(folder, eos_token_ids=config.get("eos_token_id"))
        except (OSError, ValueError) as error:
            self.load_error = f"The tokenizer in {folder} cannot be read: {error}"
            return
        template = getattr(tokenizer, "chat_template", None)
        with self._tokenizer_lock:
            self.info, self._tokenizer, self.load_error = info, tokenizer, None
            self._tool_syntax = ToolSyntax.of(tokenizer)  # read once: each request asks
            self._vocab_size = len(tokenizer)
            self._chat_template = template if isinstance(template, str) else ""
        self._renderer.submit(int).result()  # its thread starts now, not mid-request
        self.ready.set()

    def stop_requests(self) -> None:
        """The server is stopping: refuse new requests and cancel those in flight, so
        each ends in its API's own words (a 503, or its stream's error event) while
        its connection is still open, not cut off when the connections close."""
        with self._lock:
            self._stopping = True
            cancels = [t.cancel for t in self._tickets.values() if t.cancel is not None]
        for cancel in cancels:
            cancel.set()

    def shutdown(self) -> None:
        """Stop the worker; its sessions are stored as snapshots on the way out."""
        self.worker.shutdown(timeout=30.0)
        self._renderer.shutdown(wait=True, cancel_futures=True)

    @property
    def model_id(self) -> str:
        """The loaded model's id: "demo" for the embedded one, else its folder name."""
        if self.model == "demo":
            return "demo"
        return Path(self.model).expanduser().name or str(self.model)

    @property
    def machines(self) -> int:
        """The machines the engine runs on now (a pipeline's ranks; 1: this one alone)."""
        return 1

    @property
    def in_flight(self) -> int:
        """Requests waiting for or running on the engine now."""
        with self._lock:
            return self._in_flight

    @property
    def max_context(self) -> int:
        """The loaded model's context in tokens."""
        return int(getattr(self.info, "max_context", 0) or 0)

    # -- events (worker thread) ------------------------------------------------

    def _on_event(self, event: Event) -> None:
        request_id = request_id_of(event)
        if request_id is None:
            return
        with self._lock:
            if request_id == self._load_id:
                self._loaded(event)
                return
            ticket = self._tickets.get(request_id)
            if ticket is not None and isinstance(event, Finished | Failed):
                del self._tickets[request_id]
                if request_id == ticket.chat_id:
                    # Counted by the engine's ending, not the handler's: a handler
                    # whose stream never started still frees its place.
                    self._in_flight -= 1
                    if isinstance(event, Failed):
                        # Dropped as its request leaves: a request that comes
                        # meanwhile must not continue it.
                        self._forget(ticket.session)
                    else:
                        self._held_after(ticket, event)
        if ticket is not None:
            ticket.put(event)

    def _loaded(self, event: Event) -> None:
        if isinstance(event, Notice):  # e.g. a pipeline's ranks started again
            log.warning("%s", event.message)
        elif isinstance(event, ModelLoaded):
            self.info = event.info
        elif isinstance(event, Failed):
            self.load_error = event.message
            self._loading.set()
        elif isinstance(event, Finished):
            self._loading.set()

    # -- requests (server threads) ---------------------------------------------

    def render(self, messages: list[dict[str, str]], tools: list[dict] | None = None,
               template: bool = True) -> list[int]:
        """The prompt ids the engine will read for ``messages`` (with the reply's opening).

        Slow for a long conversation: call it off the event loop.
        """
        with self._tokenizer_lock:
            return render_conversation(self._tokenizer, messages, add_generation_prompt=True,
                                       tools=tools, template=template)

    def render_later(self, messages: list[dict[str, str]], tools: list[dict] | None = None,
                     template: bool = True) -> Future:
        """``render`` on the bridge's render thread; await it with ``asyncio.wrap_future``."""
        return self._renderer.submit(self.render, messages, tools, template)

    def call_grammar_later(self, syntax: ToolSyntax, calls: Calls,
                           answer: str | None) -> Future:
        """``call_grammar`` on the render thread (it compiles each tool's schema to
        check it); await it with ``asyncio.wrap_future``."""
        return self._renderer.submit(call_grammar, syntax, calls, answer)

    @property
    def tool_syntax(self) -> ToolSyntax | None:
        """How the loaded model marks tool calls, or None where its tokenizer does not say."""
        return self._tool_syntax

    def opens_thought(self, prompt: list[int]) -> bool:
        """Whether ``prompt`` ends inside a thought (a thinking template's reply that
        starts with its think marker): the answer finishes that thought first. On
        the event loop: it waits for no render (``call_grammar.opens_thought``)."""
        return opens_thought(self._tokenizer, prompt)

    def count(self, text: str) -> int:
        """Tokens ``text`` encodes to."""
        with self._tokenizer_lock:
            return len(self._tokenizer.encode(clean_text(text), add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``."""
        with self._tokenizer_lock:
            return self._tokenizer.decode(ids)

    def token_texts(self, ids: list[int]) -> list[str]:
        """Each id's own text (a piece of a character decodes to U+FFFD).

        Called on the event loop (a streamed answer's logprobs), so it does not
        wait for the lock a long render holds: decoding only reads the tokenizer,
        which the Rust tokenizer allows beside an encode on another thread.
        """
        tokenizer = self._tokenizer
        return [tokenizer.decode([i]) for i in ids]

    def token_pieces(self, ids: list[int]) -> list[tuple[str, bytes]]:
        """Each id's own text and the bytes it adds to the answer (a piece of a
        character: its own bytes, where its text is U+FFFD). On the event loop,
        as ``token_texts``."""
        pieces = self._tokenizer.convert_ids_to_tokens(ids)
        return [(text, token_bytes(piece, text))
                for text, piece in zip(self.token_texts(ids), pieces, strict=True)]

    @property
    def chat_template(self) -> str:
        """The loaded model's chat template ("" for a base model)."""
        return self._chat_template

    @property
    def vocab_size(self) -> int:
        """Token ids the tokenizer knows (ids from 0 to this, exclusive)."""
        return self._vocab_size

    def fit(self, token_count: int) -> FitReport:
        """The guard's ``FitReport`` for ``token_count`` tokens of a new conversation,
        every machine's share included on a pipeline (arithmetic only)."""
        return self.worker.fit_check(None, token_count)

    def fit_later(self, token_count: int) -> Future:
        """``fit`` on the render thread; await it with ``asyncio.wrap_future``. On a
        pipeline it is a question to rank 0's process, which a hung rank 0 answers
        only when the stall limit ends it: the event loop must not wait for that."""
        return self._renderer.submit(self.fit, token_count)

    def submit(self, messages: list[dict[str, str]], prompt: list[int], mode: KvMode,
               sampling: SamplingParams, cancel: threading.Event,
               loop: asyncio.AbstractEventLoop, tools: list[dict] | None = None,
               template: bool = True) -> Ticket:
        """Queue a chat on the session that holds the most of ``prompt``.

        A held session of the same mode whose last prompt ``prompt`` continues is
        reused; otherwise a new one opens (the least recently used stored and
        closed first when all are taken), and the engine fills it from the other
        server sessions or the server's stored KV, whichever holds the longest prefix.

        Raises:
            QueueFull: the queue limit is reached.
            NotReady: the model went away since the request began (a lost pipeline),
                or the engine thread stopped on an error.
        """
        ticket = Ticket(loop, cancel=cancel)
        with self._lock:
            # Under the lock that a worker's replacement holds: a request either
            # reaches the old worker before it goes, or is refused here.
            if self._stopping:
                raise NotReady(STOPPING)
            if not self.ready.is_set():
                raise NotReady(self.load_error or LOADING)
            answering = self.worker.streams().limit
            if self._in_flight >= answering + self.queue_limit:
                at_once = ("one request at a time" if answering == 1
                           else f"{answering} requests at once")
                raise QueueFull(f"The engine answers {at_once}, with "
                                f"{self._in_flight - answering} more waiting (the server's "
                                "queue limit); try again shortly.")
            try:
                name, shared = self._continued(prompt, mode)
                if name is None:
                    name = self._open(mode, ticket)
                ticket.chat_id = self.worker.chat(name, messages, sampling, cancel,
                                                  tools=tools, template=template)
            except EngineStopped as stopped:  # no thread will ever answer it
                raise NotReady(str(stopped)) from stopped
            self._in_flight += 1
            ticket.reused = min(shared, len(prompt) - 1)
            ticket.prompt = list(prompt)
            ticket.held_before = self._sessions.get(name, (mode, []))[1]
            self._sessions[name] = (mode, ticket.prompt)
            self._sessions.move_to_end(name)
            ticket.session, ticket.mode = name, mode
            self._tickets[ticket.chat_id] = ticket
        return ticket

    def _held_after(self, ticket: Ticket, ended: Finished) -> None:
        """Keep as the session's prompt what it holds once ``ended`` ended its
        request stopped short: the part read in, or for a request stopped
        before its read began, the prompt held before it (under the lock)."""
        if ended.kept_tokens is not None:
            held = ticket.prompt[:ended.kept_tokens]
        elif ended.reason == "cancelled" and ended.stats is None:
            held = ticket.held_before
        else:
            return
        if ticket.session in self._sessions:
            self._sessions[ticket.session] = (ticket.mode, held)

    def release_idle(self) -> None:
        """Store and close the sessions no request is answering in, freeing their KV
        pages; an answer running goes on. The stored KV stays for a later request."""
        with self._lock:
            busy = {ticket.session for ticket in self._tickets.values()}
            names = [name for name in self._sessions if name not in busy]
            for name in names:
                del self._sessions[name]
        for name in names:
            try:
                self.worker.close_session(name, store=True)
            except EngineStopped:  # the engine went first: it let go of every session
                return

    def _forget(self, session: str) -> None:
        """Drop the session a failed request ran on from the ones to continue
        (under the lock)."""
        if self._sessions.pop(session, None) is not None:
            try:
                self.worker.close_session(session, store=False)
            except EngineStopped:
                log.info("%s not closed: the engine thread has stopped", session)

    def _continued(self, prompt: list[int], mode: KvMode) -> tuple[str | None, int]:
        """The idle held session whose last prompt ``prompt`` continues, and how many
        tokens they share (None, 0: none).

        A session answering another request is passed over: requests sent
        together (an agent's sub-agents) answer together on sessions of their
        own, each taking the prefix it shares from the other's pages.
        """
        best, most = None, 0
        busy = {ticket.session for ticket in self._tickets.values()}
        for name, (held_mode, held) in self._sessions.items():
            if held_mode != mode or not held or name in busy:
                continue
            shared = common_prefix(held, prompt)
            if shared >= len(held) - 1 and shared > most:
                best, most = name, shared
        return best, most

    def _open(self, mode: KvMode, ticket: Ticket) -> str:
        # Only idle sessions are evicted: closing one cancels the answer running
        # in it. With every held session busy the server holds one more for a
        # while (the queue limit bounds how many); later opens evict back down.
        busy = {waiting.session for waiting in self._tickets.values()}
        idle = [name for name in self._sessions if name not in busy]
        while len(self._sessions) >= self.max_sessions and idle:
            evicted = idle.pop(0)  # least recently used first
            del self._sessions[evicted]
            self.worker.close_session(evicted, store=True)
        name = f"{API_SESSION_PREFIX}{secrets.token_hex(6)}"
        opened = self.worker.open_session(name, mode)
        self._tickets[opened] = ticket
        return name
