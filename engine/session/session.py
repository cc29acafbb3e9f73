"""A chat session: one model, a fixed KV mode, a paged cache and the ids it holds.

Each turn renders the whole conversation with the chat template, keeps the
longest prefix of token ids the cache already holds, trims the rest and ingests
only what is new, so a long conversation is never prefilled twice. Every method
here runs MLX and must be called from the engine worker thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection, Generator
from dataclasses import dataclass, replace

import mlx.core as mx

from engine.cache import adapter, kvquant, other_layers, sharing
from engine.cache.modes import FP16, KvMode
from engine.cache.outside import MAC_VALUE_BYTES, OutsideShape
from engine.cache.paged_cache import PagedKVCache
from engine.cache.pages import DEFAULT_PAGE_SIZE, PREFILL_SCRATCH_BYTES, PagePool
from engine.errors import EngineError, KvBudgetExceeded
from engine.events import GenerationStats
from engine.memory import fit
from engine.memory.guard import MemoryGuard, PressureWatch
from engine.models.loader import LoadedModel
from engine.models.probe import make_session_cache
from engine.session import checkpoints, speculative
from engine.session.followers import FollowerLink
from engine.session.prefill import (
    Chunk,
    ChunkedPrefill,
    Emit,
    PrefillResult,
    activation_value_bytes,
    always,
    finish,
    never,
)
from engine.session.prompt_ids import Prompt, common_prefix, end_of_turn_ids, render_prompt
from engine.session.sampling import AnswerStream, SamplingParams

log = logging.getLogger(__name__)

# Tokens per prefill chunk unless the settings say otherwise: small enough that a
# slow machine finishes one in about a second, so Stop and progress stay responsive.
DEFAULT_CHUNK = 512
# The largest a user may choose (Settings, the CLI): a page past this holds idle
# room in every layer, and a chunk's scratch grows with its tokens.
MAX_CHUNK = 8192
MAX_PAGE_SIZE = 4096


@dataclass(frozen=True)
class AnswerStart:
    """An answer ready for its first decode step: the conversation read in.

    Attributes:
        stream: the answer's sampling loop over the session's cache.
        prompt: the conversation's ids; the cache holds all but the last.
        max_tokens: most tokens the answer may make (its setting, or the room left).
        fed: prompt tokens this answer read in (the rest were held already).
        prefill_seconds: how long reading them took.
        watch: the cancel the answer checks (a user's Stop, or memory).
        started: ``time.perf_counter()`` when the request started.
    """

    stream: AnswerStream
    prompt: list[int]
    max_tokens: int
    fed: int
    prefill_seconds: float
    watch: PressureWatch
    started: float


def check_sizes(page_size: int, chunk_size: int) -> None:
    """Raise EngineError unless a page and a chunk each hold a token at least."""
    if page_size < 1 or chunk_size < 1:
        raise EngineError("Page size and chunk size must be at least 1 token.")


def probed_linear_bytes(loaded: object) -> int:
    """What the load-time probe measured of one conversation's linear-attention
    state (0: none, or a model loaded without the probe)."""
    probe = getattr(loaded, "probe", None)
    return probe.linear_state_bytes if probe is not None else 0


def outside_pages(cache: list, facts: fit.ModelFacts, value_bytes: int, chunk_size: int, *,
                  linear_bytes: int, checkpointed: bool) -> other_layers.OtherLayers:
    """What ``cache``'s layers outside the pages may hold, with the checkpoints of
    them a session keeps when it keeps any (``checkpointed``)."""
    return other_layers.other_layers(
        cache, facts.kv_heads, facts.head_dim, value_bytes, chunk_size,
        linear_bytes=linear_bytes,
        checkpoint_copies=checkpoints.MAX_KEPT if checkpointed else 0)


def new_chat_cache(loaded: LoadedModel) -> list:
    """The per-layer cache a new fp16 chat of ``loaded`` holds (its layers' kinds are
    every mode's; no pages until it reads: engine thread).

    Raises:
        ModelLoadError: the load-time probe refused the model.
    """
    return make_session_cache(loaded, FP16, DEFAULT_PAGE_SIZE).cache


def outside_pages_reserve(outside: OutsideShape, value_bytes: int = MAC_VALUE_BYTES) -> int:
    """What a new chat of a model known by its config alone (``ModelInfo.outside``)
    will reserve beside its pages, as :func:`new_chat_outside_pages` says once it
    loads: the bound at the default chunk, once and again for each checkpoint a chat
    keeps. ``value_bytes``: of one activation (a Mac's GPU: 16 bits)."""
    return outside.bound_bytes(DEFAULT_CHUNK, value_bytes) * (1 + checkpoints.MAX_KEPT)


def new_chat_outside_pages(loaded: LoadedModel, chunk_size: int) -> other_layers.OtherLayers:
    """What a chat not opened yet will keep outside its pages (engine thread)."""
    cache = new_chat_cache(loaded)
    facts = (fit.facts_from_cache(cache, fit.first_fact(loaded.info, ("max_context",
                                                                      "context_length")))
             or fit.facts_from_info(loaded.info))
    return outside_pages(cache, facts, activation_value_bytes(), chunk_size,
                         linear_bytes=probed_linear_bytes(loaded),
                         checkpointed=checkpoints.needs_checkpoints(cache))


class Session:
    """A model plus a paged KV cache in one fixed mode, and the ids the cache holds.

    Args:
        session_id: the app's name for the conversation.
        loaded: an ``engine.models.loader.LoadedModel`` (model, tokenizer, info).
        mode: KV mode name or alias; fixed for the session's life.
        page_size: tokens per page.
        budget_bytes: byte budget of the session's page pool, or None; ignored
            when ``guard`` is given (the guard's one budget applies).
        chunk_size: tokens per prefill chunk; chunks end at its multiples (and at
            message boundaries), never sized by timing or free RAM
            (``engine.session.prefill``).
        guard: the memory guard whose one KV budget and RAM headroom every
            session's pages share; None makes a guard for this session alone.
        scratch_bytes: the prefill attention's scratch per chunk, counted with
            the weights, pages and activations in every memory estimate; None
            takes the page pool's own budget (``PREFILL_SCRATCH_BYTES``).
        rotate: store q8/q6/q4 rows after a Hadamard rotation; None takes the
            mode's default (``engine.cache.adapter.rotates_by_default``).
    """

    def __init__(
        self,
        session_id: str,
        loaded: LoadedModel,
        mode: KvMode,
        page_size: int = DEFAULT_PAGE_SIZE,
        *,
        budget_bytes: int | None = None,
        chunk_size: int = DEFAULT_CHUNK,
        guard: MemoryGuard | None = None,
        scratch_bytes: int | None = None,
        rotate: bool | None = None,
        followers: FollowerLink | None = None,
    ) -> None:
        check_sizes(page_size, chunk_size)
        self.session_id = session_id
        self.loaded = loaded
        self.rotate = rotate
        self.model = loaded.model
        # A pipeline's other ranks (``engine.distributed.rank_commands.SessionLink``):
        # every cache operation below is sent to them first. None: one machine.
        self.followers = followers
        # Which cache the probe chose ("paged", or mlx-lm's own) and why.
        self.cache_kind = "paged"
        self.cache_note = ""
        # The model's facts; its folder fingerprints the session's KV snapshots.
        self.info = loaded.info
        self.tokenizer = loaded.tokenizer
        self.max_context = max_context = int(
            fit.first_fact(loaded.info, ("max_context", "context_length")))
        self.mode = mode
        self.page_size = page_size
        self.guard = guard if guard is not None else MemoryGuard(budget_bytes=budget_bytes)
        self.chunk_size = chunk_size
        # Timings of a prefill, and its wait for free RAM (injectable in tests).
        self.clock: Callable[[], float] = time.perf_counter
        self.sleep: Callable[[float], None] = time.sleep
        self.end_ids = end_of_turn_ids(self.tokenizer)
        self.checkpoints = checkpoints.CheckpointStore()
        # What the probe measured of one conversation's linear-attention state, so
        # a chat reserves it before its first token makes it (0: unknown, none).
        self._linear_bytes = probed_linear_bytes(loaded)
        # Where speculative decoding looks up its drafts; kept between answers.
        self.context_index = speculative.ContextIndex()
        self._tokens: list[int] = []
        # Counters the tests and benchmarks read: what was actually computed.
        self.tokens_ingested = 0
        # Why the last request stopped for memory, for logs (None: it did not).
        self.memory_stop: str | None = None
        self._scratch_bytes = scratch_bytes
        # Asked of MLX here, on the engine thread: fit checks read it from the GUI thread.
        self._value_bytes = activation_value_bytes()
        self.prefill_facts = fit.prefill_facts(
            self.model, self._value_bytes,
            PREFILL_SCRATCH_BYTES if scratch_bytes is None else scratch_bytes, page_size)
        self._new_cache()
        # Linear-attention and sliding-window layers cannot trim: keep checkpoints,
        # also where only another rank of a pipeline has such layers (its rewinds
        # go to checkpoints, so this rank's must go to the same ones).
        own = checkpoints.needs_checkpoints(self.cache)
        elsewhere = bool(getattr(followers, "needs_checkpoints", False))
        self._needs_checkpoints = own or elsewhere
        self._rewinds_exactly = not elsewhere or own
        self.facts = (fit.facts_from_cache(self.cache, max_context)
                      or fit.facts_from_info(loaded.info))
        # KV bytes one more token takes over every paged layer (pages come whole,
        # but per token is what sizes a chunk).
        self.kv_token_bytes = -(-kvquant.project_kv_bytes(
            self.facts.attention_layers, self.facts.kv_heads, self.facts.head_dim,
            page_size, self.mode) // page_size)
        self.guard.refresh(self.session_id)  # with the windows' bound, known now

    # -- cache bookkeeping -------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        """The ids the cache holds, in order (extended in place as tokens are fed)."""
        return self._tokens

    @tokens.setter
    def tokens(self, ids: list[int]) -> None:
        # Whoever replaces the ids (a snapshot reopen) replaced the cache's state
        # too: checkpoints past the prefix both share no longer describe it.
        self.checkpoints.drop_after(common_prefix(self._tokens, ids))
        self._tokens = ids

    def _new_cache(self) -> None:
        # The load-time probe decides: the paged cache where it gives mlx-lm's
        # numbers, mlx-lm's own cache (with the reason) where it does not.
        chosen = make_session_cache(self.loaded, self.mode, self.page_size, rotate=self.rotate)
        self.cache, self.cache_kind, self.cache_note = chosen.cache, chosen.kind, chosen.note
        self._attach_pool()

    @property
    def rotation(self) -> str | None:
        """The format id of the rotation the cache stores rows in (None: as given)."""
        return adapter.rotation_format(self.cache)

    def page_pool(self) -> PagePool | None:
        """The pool handing out this session's pages (None: no paged layer)."""
        return next((c.pool for c in self.cache if isinstance(c, PagedKVCache)), None)

    def bytes_allocated(self) -> int:
        """Bytes this session's page stores hold (shared ones whole: a page group's)."""
        return int(self.stats().bytes_allocated) if self.cache else 0

    def own_bytes(self) -> int:
        """Bytes of its page stores this session may fill: all of them, less the
        pages other chats hold where it shares them (a document's)."""
        pool = self.page_pool()
        return self.bytes_allocated() - (pool.foreign_bytes() if pool is not None else 0)

    def _attach_pool(self) -> None:
        pool = self.page_pool()
        budget = getattr(pool, "scratch_bytes", None)
        if self._scratch_bytes is None and isinstance(budget, int):
            # The attention bounds a chunk's scratch by its pool's budget: count that one.
            self.prefill_facts = replace(self.prefill_facts, scratch_bytes=budget)
        if pool is not None:
            pool.max_tokens = self.max_context
            # The guard sets and keeps updating the pool's limit: its share of
            # the one KV budget, bounded by free RAM less a prefill chunk's needs
            # (or what growing a layer's storage holds for a moment, if more).
            transient = max(self.prefill_facts.transient_bytes(self.chunk_size),
                            pool.growth_transient_bytes(self.max_context))
            self.guard.attach(self.session_id, pool, transient,
                              lambda: self.other_layers().reserve_bytes)

    def reset(self) -> None:
        """Drop every held token and page."""
        sharing.release_pages(self.cache)  # pages shared with other chats stay theirs
        self.cache = []
        if self.followers is not None:
            self.followers.reset()
        self._new_cache()
        self.tokens = []
        self.checkpoints.clear()
        # The old pages went to MLX's buffer cache: hand them back to the system.
        mx.clear_cache()

    def close(self) -> None:
        """Release the cache's pages."""
        pool = self.page_pool()
        if pool is not None:
            self.guard.detach(self.session_id, pool)
        sharing.release_pages(self.cache)
        self.cache = []
        self.tokens = []
        self.checkpoints.clear()
        if self.followers is not None:
            self.followers.close()

    def trim_to(self, length: int) -> None:
        """Keep at most the first ``length`` held tokens.

        Paged layers trim exactly. Linear-attention and wrapped sliding-window
        layers go back to the newest checkpoint at or before ``length``, so fewer
        tokens may stay held; the caller feeds the rest again.
        """
        if len(self.tokens) > length:
            self.rewind(length)

    def rollback(self) -> None:
        """Bring every layer back to the tokens held, after a step that failed midway.

        A failed forward pass may have left some layers a chunk ahead (or behind).
        """
        offsets = [o for o in (getattr(c, "offset", None) for c in self.cache)
                   if isinstance(o, int)]
        self.rewind(min([len(self.tokens), *offsets]))

    def rewind(self, length: int) -> None:
        """Go back to ``length`` tokens, or to the newest checkpoint before (else reset)."""
        kept = checkpoints.rewind(self.cache, length, self.checkpoints,
                                  exact=self._rewinds_exactly)
        if kept is None:
            # No checkpoint reaches back that far: start over rather than hold
            # state that disagrees with the ids.
            log.info("cache of %s cannot go back to %d tokens; rebuilding",
                     self.session_id, length)
            self.reset()
            return
        del self.tokens[kept:]
        if self.followers is not None:
            self.followers.rewind(length, kept)

    @property
    def needs_checkpoints(self) -> bool:
        """Whether rewinding this session goes back to checkpoints (on some rank)."""
        return self._needs_checkpoints

    def checkpoint(self, *, boundary: bool) -> None:
        """Keep what layers that cannot trim need to come back to the tokens held."""
        if self._needs_checkpoints and self.followers is not None:
            self.followers.checkpoint(boundary, len(self.tokens))
        self._keep_checkpoint(boundary)

    def _keep_checkpoint(self, boundary: bool) -> None:
        if self._needs_checkpoints:
            self.checkpoints.add(checkpoints.take(self.cache, len(self.tokens),
                                                  boundary=boundary))

    def other_layers(self) -> other_layers.OtherLayers:
        """What the layers outside the pages may hold (sliding windows, linear attention)."""
        facts = getattr(self, "facts", None)
        if facts is None:  # the first cache is being made: it holds nothing yet
            return other_layers.OtherLayers()
        return outside_pages(self.cache, facts, self._value_bytes, self.chunk_size,
                             linear_bytes=self._linear_bytes,
                             checkpointed=self._needs_checkpoints)

    def stats(self) -> adapter.CacheStats:
        """The adapter's ``CacheStats`` (no MLX evaluation)."""
        return adapter.cache_stats(self.cache)

    # -- templates ---------------------------------------------------------

    def prompt(self, messages: list[dict[str, str]], *, add_generation_prompt: bool,
               tools: list[dict] | None = None, template: bool = True) -> Prompt:
        """The conversation rendered the way ``mlx_lm generate`` does, tokenized once.

        A request makes it once and hands it to every step that reads the ids;
        ``tools`` go to the chat template; ``template=False`` reads plain text.
        """
        return render_prompt(self.tokenizer, messages,
                             add_generation_prompt=add_generation_prompt, tools=tools,
                             template=template)

    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool) -> list[int]:
        """Token ids of the conversation, rendered the way ``mlx_lm generate`` does."""
        return self.prompt(messages, add_generation_prompt=add_generation_prompt).ids

    def _boundaries(self, prompt: Prompt, kept: int) -> list[int]:
        """Where earlier messages end in ``prompt``'s part still to feed.

        Prefill cuts its chunks there and checkpoints them, so an edit of a later
        message goes back no further. Only models that need checkpoints look.
        """
        if not self._needs_checkpoints:
            return []
        return prompt.boundaries(self.tokenizer, after=kept,
                                 most=checkpoints.MAX_BOUNDARIES - 1)

    # -- limits ------------------------------------------------------------

    def fit_inputs(self) -> fit.FitInputs:
        """What a fit check of this session needs, as frozen values (engine thread)."""
        stats = self.stats() if self.cache else None
        held = self.own_bytes()
        # A pipeline's machines: rank 0's pages now, the others' as they last said.
        ranks = () if self.followers is None else self.followers.machines(
            int(stats.bytes_used) if stats else 0, int(stats.pages_in_use) if stats else 0, 0)
        return fit.FitInputs(
            self.facts, self.page_size, self.guard.view(), prefill=self.prefill_facts,
            chunk_tokens=self.chunk_size, session_id=self.session_id,
            session_mode=self.mode, session_bytes_allocated=held, ranks=ranks,
        )

    def fit_report(self, token_count: int, gone: Collection[str] = (),
                   decode_rows: int = 0) -> fit.FitReport:
        """Whether ``token_count`` tokens fit this session, per mode (no MLX); with
        the pages of the sessions ``gone`` counted as dropped, when given, and
        room left for a decode step of ``decode_rows`` rows (a batch's, this
        session's row among them; 0: as it answers alone)."""
        inputs = replace(self.fit_inputs(), decode_rows=decode_rows)
        inputs, reading = fit.without(inputs, self.guard.read(), gone)
        return fit.guarded_fit_report(inputs, reading, token_count)

    def hold_to(self, token_count: int) -> None:
        """Hold this session's pages, and the other ranks' of it on a pipeline, to
        ``token_count`` tokens in its mode (``MemoryGuard.set_ceiling``; no MLX):
        what it was counted for while it answers beside others. The other ranks let
        go at the request's end, this rank at :meth:`let_go`."""
        self.guard.set_ceiling(self.session_id, token_count)
        if self.followers is not None:
            self.followers.hold_to(token_count)

    def let_go(self) -> None:
        """Let this session's pages grow as alone again (after :meth:`hold_to`)."""
        self.guard.set_ceiling(self.session_id, None)

    def holds(self, token_count: int, gone: Collection[str] = ()) -> bool:
        """Whether ``token_count`` tokens fit this session in its mode, as the checks
        a read starts with find (``gone`` as :meth:`fit_report`'s; no MLX)."""
        return self.fit_report(token_count, gone).fits

    def chunk_bytes(self, tokens: int) -> int:
        """Free RAM a prefill chunk of ``tokens`` needs while it runs: the attention
        scratch, the activations and the chunk's new pages (no MLX)."""
        facts = self.prefill_facts
        return facts.scratch_bytes + tokens * (facts.activation_bytes_per_token
                                               + self.kv_token_bytes)

    def prefill_peak_bytes(self) -> int:
        """The peak the next prefill chunk is expected to reach (no MLX evaluation).

        Weights, the pages held plus the chunk's, the checkpoints, the chunk's
        attention scratch and its activations, for the chunk the next prefill
        starts with.
        """
        held = self.bytes_allocated()
        held += self.checkpoints.nbytes
        chunk = self.chunk_size
        return self.prefill_facts.peak_bytes(held + chunk * self.kv_token_bytes, chunk,
                                             len(self.tokens) + chunk)

    def room_for(self, token_count: int) -> int:
        """Tokens that may follow ``token_count`` tokens; raises if those don't fit.

        Raises:
            ContextTooLong: the tokens exceed the context, the budget or free RAM.
        """
        report = self.fit_report(token_count)
        report.raise_if_too_long()
        room = report.for_mode(self.mode).tokens_fit - token_count
        if self.followers is not None:  # every rank's own pages and free RAM
            room = min(room, self.followers.room(token_count, self.mode))
        return room

    # -- prefill -----------------------------------------------------------

    def sync(self, prompt: list[int], *, keep_last: bool) -> int:
        """Trim the cache to its longest prefix of ``prompt``; returns tokens kept.

        With ``keep_last`` at least one prompt token stays unfed, because the
        first generated token needs the logits of the prompt's last position.
        A model with layers that cannot trim may keep fewer (back to its newest
        checkpoint); the caller feeds ``prompt`` from the returned count.
        """
        keep = common_prefix(self.tokens, prompt)
        if keep_last:
            keep = min(keep, len(prompt) - 1)
        self.trim_to(keep)
        return len(self.tokens)

    @property
    def reads_ahead(self) -> bool:
        """Whether ``forward`` may send the next chunk ahead: a pipeline's other
        ranks read it while this rank runs its own layers of the current one."""
        return self.followers is not None

    def forward(self, chunk: Chunk, *, ahead: Chunk | None = None,
                announced: bool = False) -> bool:
        """Run ``chunk`` through the model into the cache, hold and checkpoint it.

        On a pipeline the other ranks are sent ``chunk`` first, unless the last
        forward sent it ahead (``announced``), and then ``ahead`` too when the
        pages hold both. Returns whether ``ahead`` was sent: it must be the next
        chunk forwarded (with ``announced``), since the other ranks read it.

        Raises:
            KvBudgetExceeded: the pages cannot hold ``chunk``; no layer changed and
                nothing was sent.
        """
        ids = chunk.ids
        if not announced:  # an announced chunk's pages were reserved when it was sent
            adapter.ensure_capacity(self.cache, len(ids))
        sent_ahead = False
        if self.followers is not None:
            position = len(self.tokens)
            if not announced:
                self.followers.prefill(chunk, position)
            if ahead is not None and self._reserve(len(ids) + len(ahead.ids)):
                self.followers.prefill(ahead, position + len(ids))
                sent_ahead = True
        self.model(mx.array(ids)[None], cache=self.cache)
        # Evaluating the cache (not the logits) runs every layer but skips the
        # vocabulary projection of the whole chunk, as mlx-lm's prefill does.
        mx.eval(adapter.eval_targets(self.cache))
        # Only a finished chunk counts as held: a failure above rolls back to here.
        self.tokens.extend(ids)
        self.tokens_ingested += len(ids)
        # The other ranks checkpoint their layers after the chunk, as its command says.
        self._keep_checkpoint(chunk.boundary)
        return sent_ahead

    def _reserve(self, tokens: int) -> bool:
        """Whether the pages can hold ``tokens`` more tokens (reserved if they can)."""
        try:
            adapter.ensure_capacity(self.cache, tokens)
        except KvBudgetExceeded:
            return False
        return True

    def set_chunk_size(self, chunk_size: int) -> None:
        """Prefill in chunks of ``chunk_size`` tokens from the next prefill on (on
        every rank of a pipeline)."""
        changed = chunk_size != self.chunk_size
        self.chunk_size = chunk_size
        self._attach_pool()  # the guard keeps the new chunk's transient free of pages
        if changed and self.followers is not None:
            self.followers.set_chunk_size(chunk_size)

    def prefill(
        self,
        ids: list[int],
        *,
        request_id: int,
        cancel: threading.Event | PressureWatch,
        emit: Emit,
        tick: Callable[[], None],
        boundaries: list[int] | None = None,
        total: int | None = None,
    ) -> PrefillResult:
        """Feed ``ids`` after the held tokens, in chunks (no template, no fit check).

        ``boundaries`` (token positions, e.g. where messages end) also end a chunk;
        a model that needs checkpoints gets one there. ``total`` is the length of
        the conversation ``ids`` end, for the words of a stop (default: held + ids).

        Raises:
            EngineError: whatever stopped it short (``Cancelled``, ``MemoryPressure``,
                ``ContextTooLong``, ...), saying how many tokens it kept.
        """
        return finish(self.prefill_chunks(ids, request_id=request_id, cancel=cancel,
                                          emit=emit, tick=tick, boundaries=boundaries,
                                          total=total, ahead=always))

    def prefill_chunks(
        self,
        ids: list[int],
        *,
        request_id: int,
        cancel: threading.Event | PressureWatch,
        emit: Emit,
        tick: Callable[[], None],
        boundaries: list[int] | None = None,
        total: int | None = None,
        ahead: Callable[[], bool] = never,
    ) -> Generator[bool, None, PrefillResult]:
        """:meth:`prefill`, one chunk a ``next``, each saying whether it sent the next
        chunk ahead, as far as ``ahead`` allows (see ``ChunkedPrefill.chunks``)."""
        if not isinstance(cancel, PressureWatch):
            cancel = self.guard.watch(self.session_id, cancel)
        newest = self.checkpoints.newest()
        if ids and (newest is None or newest.tokens != len(self.tokens)):
            self.checkpoint(boundary=True)  # e.g. after an answer: a failure comes back here
        prefill = ChunkedPrefill(self, self.guard, self.session_id, self.chunk_size,
                                 clock=self.clock, sleep=self.sleep)
        result = yield from prefill.chunks(
            ids, list(boundaries or ()), request_id=request_id, watch=cancel, emit=emit,
            tick=tick, total=len(self.tokens) + len(ids) if total is None else total,
            ahead=ahead)
        self.memory_stop = result.memory
        result.raise_if_stopped()
        return result

    def ingest(
        self,
        messages: list[dict[str, str]],
        *,
        request_id: int,
        cancel: threading.Event,
        emit: Emit,
        tick: Callable[[], None],
        prompt: Prompt | None = None,
    ) -> GenerationStats:
        """Prefill the conversation without generating (e.g. a dropped document).

        ``prompt`` is the request's own rendering of ``messages`` (without the
        generation prompt), when it made one already.

        Raises:
            ContextTooLong: the conversation does not fit.
            Cancelled: cancelled between chunks; the chunks done stay held and the
                next request continues from them (the error says how many).
            MemoryPressure: memory was (or turned) critical; the chunks done stay.
        """
        self.memory_stop = None
        self.guard.check_pressure("reading the conversation in")
        rendered = prompt or self.prompt(messages, add_generation_prompt=False)
        ids = rendered.ids
        self.guard.refresh(self.session_id)
        self.room_for(len(ids))
        kept = self.sync(ids, keep_last=False)
        watch = self.guard.watch(self.session_id, cancel)
        read = self.prefill(ids[kept:], request_id=request_id, cancel=watch, emit=emit,
                            tick=tick, boundaries=self._boundaries(rendered, kept),
                            total=len(ids))
        return GenerationStats(len(ids), 0, None,
                               read.read / read.seconds if read.seconds else 0.0, 0.0,
                               prefill_tokens=read.read)

    # -- generation --------------------------------------------------------

    def _memory_reason(self, reason: str, watch: PressureWatch, cut_short: bool) -> str:
        """Tell an answer stopped for memory apart from a user's cancel or a length limit."""
        if reason == "cancelled" and watch.tripped is not None and not watch.cancel.is_set():
            self.memory_stop = watch.tripped
            return "memory"
        if reason == "length" and cut_short and self.guard.ram_bound(self.session_id):
            # The pool refused a page because free RAM (not the budget) ran out.
            self.memory_stop = "free RAM reached the safety headroom"
            return "memory"
        return reason

    def chat(
        self,
        messages: list[dict[str, str]],
        sampling: SamplingParams,
        *,
        request_id: int,
        cancel: threading.Event,
        emit: Emit,
        tick: Callable[[], None],
        prompt: Prompt | None = None,
    ) -> tuple[str, GenerationStats]:
        """Answer the conversation's last turn, streaming ``TokenChunk`` events.

        ``prompt`` is the request's own rendering of ``messages`` (with the
        generation prompt), when it made one already.

        Returns:
            The finish reason ("stop", "length", "cancelled", or "memory" when
            system memory turned critical or free RAM ran out mid-answer) and the
            timings.

        Raises:
            ContextTooLong: the conversation (plus one answer token) does not fit.
            MemoryPressure: memory was critical before the answer could start.
            Cancelled: cancelled while reading the conversation in; the chunks
                done stay held (the error says how many).
        """
        answer = self.start_answer(messages, sampling, request_id=request_id, cancel=cancel,
                                   emit=emit, tick=tick, prompt=prompt)
        return self.finish_answer(answer, self.run_answer(answer))

    def run_answer(self, answer: AnswerStart, pause: Callable[[], bool] | None = None) -> str:
        """Decode ``answer`` until it ends ("stop", "length", "cancelled") or
        ``pause`` says so between two steps ("paused": it goes on in a batch, from
        ``answer.stream.paused_at``)."""
        try:
            return answer.stream.run(answer.prompt, answer.max_tokens, pause)
        except Exception:
            # A failed step may leave layers at different lengths.
            self.rollback()
            raise

    def start_answer(
        self,
        messages: list[dict[str, str]],
        sampling: SamplingParams,
        *,
        request_id: int,
        cancel: threading.Event,
        emit: Emit,
        tick: Callable[[], None],
        prompt: Prompt | None = None,
    ) -> AnswerStart:
        """Read the conversation in (all but the prompt's last token) and set up its answer.

        What :meth:`chat` does before its first decode step. Arguments and
        errors as :meth:`chat`'s.
        """
        return finish(self.answer_steps(messages, sampling, request_id=request_id,
                                        cancel=cancel, emit=emit, tick=tick, prompt=prompt,
                                        by_chunk=False))

    def answer_steps(
        self,
        messages: list[dict[str, str]],
        sampling: SamplingParams,
        *,
        request_id: int,
        cancel: threading.Event,
        emit: Emit,
        tick: Callable[[], None],
        prompt: Prompt | None = None,
        by_chunk: bool = True,
        ahead: Callable[[], bool] = never,
    ) -> Generator[bool, None, AnswerStart]:
        """:meth:`start_answer`, a step a ``next``: the checks, then each chunk read
        (``by_chunk``; else the whole read in one step, by :meth:`prefill`). Each
        step says whether it sent the next chunk ahead to a pipeline's other ranks,
        as far as ``ahead`` allows (``ChunkedPrefill.chunks``).

        A batch (``engine.session.batch``) reads a conversation in this way
        between its decode steps. Errors are raised by the ``next`` that meets them.
        """
        started = time.perf_counter()
        self.memory_stop = None
        self.guard.check_pressure("the answer")
        rendered = prompt or self.prompt(messages, add_generation_prompt=True)
        ids = rendered.ids
        if not ids:
            raise EngineError("Nothing to answer: the conversation is empty.")
        self.guard.refresh(self.session_id)
        room = self.room_for(len(ids))
        if room < 1:
            raise self.fit_report(len(ids) + 1).error()
        yield False  # checked: the conversation fits
        kept = self.sync(ids, keep_last=True)
        watch = self.guard.watch(self.session_id, cancel)
        boundaries = self._boundaries(rendered, kept)
        if by_chunk:
            read = yield from self.prefill_chunks(
                ids[kept:-1], request_id=request_id, cancel=watch, emit=emit, tick=tick,
                boundaries=boundaries, total=len(ids), ahead=ahead)
        else:
            read = self.prefill(ids[kept:-1], request_id=request_id, cancel=watch, emit=emit,
                                tick=tick, boundaries=boundaries, total=len(ids))
        model = self.model
        if self.followers is not None:
            model = self.followers.decoding(self.model)
            # The other ranks follow one decode step at a time; a draft's verification
            # and rewind are not steps they know. The CLI and the server refuse such a
            # request outright; the app's setting (one for every chat) answers plainly.
            sampling = replace(sampling, speculative="off")
        stream = AnswerStream(
            model, self.cache, self.tokenizer, self.end_ids, self.tokens,
            sampling, request_id=request_id, cancel=watch, emit=emit, tick=tick,
            index=self.context_index, after=ids if rendered.continues else (),
        )
        return AnswerStart(stream, ids, min(sampling.max_tokens, room), len(ids) - kept,
                           read.seconds, watch, started)

    def finish_answer(self, answer: AnswerStart, reason: str) -> tuple[str, GenerationStats]:
        """The finish reason (a memory stop told apart) and the timings of an answer."""
        generation = answer.stream
        cut_short = len(generation.generated) < answer.max_tokens
        reason = self._memory_reason(reason, answer.watch, cut_short)
        first_step = generation.first_token_at - generation.started
        prefill_total = answer.prefill_seconds + first_step
        decode_seconds = generation.last_token_at - generation.first_token_at
        return reason, GenerationStats(
            prompt_tokens=len(answer.prompt),
            generated_tokens=len(generation.generated),
            time_to_first_token=(
                generation.first_token_at - answer.started if generation.generated else None
            ),
            prefill_tps=answer.fed / prefill_total if prefill_total > 0 else 0.0,
            decode_tps=(
                (len(generation.generated) - 1) / decode_seconds if decode_seconds > 0 else 0.0
            ),
            prefill_tokens=answer.fed,
            draft_tokens=generation.draft_tokens,
            accepted_tokens=generation.accepted_tokens,
            decode_steps=generation.steps,
        )
