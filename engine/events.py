"""Events the engine worker emits: frozen dataclasses of plain Python values.

They cross from the MLX worker thread to any consumer (the Qt app, the CLI,
tests), so they never hold an ``mx.array`` or any other live engine object.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from engine.cache.modes import MODES, KvMode

if TYPE_CHECKING:
    # Only for the annotations: importing them here would pull MLX into every consumer.
    from engine.models.info import ModelInfo
    from engine.snapshots.manifest import SnapshotInfo


@dataclass(frozen=True)
class TokenLogprob:
    """One sampled token's log probability and the most likely alternatives.

    Attributes:
        token_id: the sampled token.
        logprob: its natural-log probability under the model's distribution
            (after logit bias and penalties, before temperature and top-p).
        top: the most likely tokens at that position as (token id, logprob),
            most likely first; empty unless asked for.
    """

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass(frozen=True)
class TokenChunk:
    """Detokenized text that never splits a UTF-8 character.

    ``logprobs`` has one entry per id of ``token_ids`` when the request asked
    for log probabilities, else it is empty.
    """

    request_id: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class IngestProgress:
    """Prefill progress, reported after every chunk."""

    request_id: int
    tokens_done: int
    tokens_total: int
    tokens_per_second: float
    eta_seconds: float | None
    # The chunk just read: its tokens, the context held before it and its seconds
    # (the model's work only, never a wait for memory), for a rate model that knows
    # reading slows as the context grows (engine.memory.prefill_rate). 0: not timed
    # (beside answers a chunk's time holds a decode pass too).
    chunk_tokens: int = 0
    chunk_start: int = 0
    chunk_seconds: float = 0.0
    # The share of the device's time the read has now: 1 alone; beside answers the
    # reads' share (engine.session.batch.ReadShare), the rest of the time decoding.
    read_share: float = 1.0


@dataclass(frozen=True)
class LayerPages:
    """Page occupancy of one attention layer."""

    layer: int
    pages_in_use: int
    tokens: int
    bytes_used: int


@dataclass(frozen=True)
class RankShare:
    """One machine of a pipeline: its part of a session's cache and its memory.

    Attributes:
        rank: the pipeline rank (0 runs the app's engine).
        host: the machine's host name.
        layers: the model layers it runs, first and one past the last (one
            process's numbering; rank 0 holds the last layers).
        kv_bytes: KV bytes of the session's pages in use on its layers.
        pages_in_use: pages of the session it holds (every layer's).
        free_bytes: free RAM on that machine (before the safety headroom).
        tokens_fit: per mode (``engine.cache.modes.MODES`` order), the tokens its
            own pages and free RAM hold for this session (None: the mode cannot
            store the model); empty where not projected.

    A follower's figures are those it gave at its last reply to rank 0 (the
    session's open, a request's fit check and its end); rank 0's are live.
    """

    rank: int
    host: str
    layers: tuple[int, int]
    kv_bytes: int
    pages_in_use: int
    free_bytes: int
    tokens_fit: tuple[int | None, ...] = ()

    @property
    def machine(self) -> str:
        """How a message names this machine: "rank 1 (mac2)"."""
        return f"rank {self.rank} ({self.host})"

    def tokens_in(self, mode: KvMode) -> int | None:
        """Tokens this machine holds in ``mode`` (None: unsupported or not projected)."""
        index = MODES.index(mode)
        return self.tokens_fit[index] if index < len(self.tokens_fit) else None


@dataclass(frozen=True)
class StatsSample:
    """One sample of KV, page-pool and memory state; cheap to take often.

    ``prefill_peak_bytes`` is what the session's next prefill chunk is expected to
    need at its peak: weights + KV pages + checkpoints + the chunk's attention
    scratch and activations (0: no session). Compare with ``mlx_peak_bytes``.
    ``checkpoint_bytes`` is what the session's checkpoints of linear-attention and
    sliding-window layers hold (``engine.session.checkpoints``); ``other_cache_bytes`` what
    the layers that are not paged hold now (sliding windows, linear-attention state,
    or mlx-lm's own cache where the probe chose it); ``other_cache_bound_bytes`` the
    most the bounded ones may hold, and ``checkpoint_bound_bytes`` the most their
    checkpoints may (the KV budget keeps both for them), and
    ``other_cache_kinds`` what they are ("sliding windows, linear attention").
    """

    session_id: str | None
    kv_mode: KvMode | None
    tokens_in_context: int
    kv_bytes_used: int
    kv_bytes_allocated: int
    pages_in_use: int
    pages_allocated: int
    pages_free: int
    page_size: int
    last_page_fill: float
    mlx_active_bytes: int
    mlx_peak_bytes: int
    mlx_cache_bytes: int
    process_rss_bytes: int
    system_total_bytes: int
    system_available_bytes: int
    system_used_percent: float
    swap_used_bytes: int
    pressure_level: str | None
    timestamp: float
    layers: tuple[LayerPages, ...] = field(default_factory=tuple)
    prefill_peak_bytes: int = 0
    checkpoint_bytes: int = 0
    other_cache_bytes: int = 0
    # Pages shared with other open chats (one document read once): the part of
    # kv_bytes_used they hold too, kv_bytes_used with each shared page divided among
    # its holders (None: nothing shared), and how many other chats share them.
    kv_shared_bytes: int = 0
    kv_bytes_once: int | None = None
    kv_shared_with: int = 0
    # kv_bytes_once plus the room the pages' storage holds ahead for the next
    # tokens, divided among the chats sharing it: summed over chats, the bytes the
    # pages take in memory (the memory limit's measure; up to about twice those in use).
    kv_bytes_held_once: int = 0
    other_cache_bound_bytes: int = 0
    other_cache_kinds: str = ""
    checkpoint_bound_bytes: int = 0
    # A pipeline's machines, rank 0 first (empty on one machine).
    ranks: tuple[RankShare, ...] = ()


@dataclass(frozen=True)
class GenerationStats:
    """Timing of one finished request."""

    prompt_tokens: int
    generated_tokens: int
    time_to_first_token: float | None
    prefill_tps: float
    decode_tps: float
    # Tokens this request fed through the model (the rest of the prompt was held),
    # and how many of the held ones came from a KV snapshot on disk.
    prefill_tokens: int = 0
    reused_tokens: int = 0
    # Speculative decoding: tokens proposed, proposed tokens accepted (the token
    # each verification adds of its own not counted), and the answer's forward
    # passes, so tokens per step = 1 + accepted_tokens / decode_steps (the passes
    # include the one that sampled the end token and any queued after it).
    draft_tokens: int = 0
    accepted_tokens: int = 0
    decode_steps: int = 0


@dataclass(frozen=True)
class Finished:
    """A request ended.

    ``reason`` is "stop" (end-of-turn token), "length" (max tokens or context),
    "cancelled" (the user), "memory" (system memory turned critical; the partial
    answer and the cache stay consistent) or "done" (a request that generates
    nothing).

    ``kept_tokens`` of ``total_tokens`` are set when reading the conversation in
    stopped short (a cancel during prefill): the cache keeps that many tokens of
    the conversation and the next request continues from them.
    """

    request_id: int
    reason: str
    stats: GenerationStats | None = None
    kept_tokens: int | None = None
    total_tokens: int | None = None


@dataclass(frozen=True)
class Failed:
    """A request failed; ``message`` is the EngineError text a user can act on.

    ``kept_tokens`` of ``total_tokens`` are set when the failure stopped reading
    the conversation in midway (memory): the chunks read before it stay held.
    """

    request_id: int
    message: str
    error_type: str
    kept_tokens: int | None = None
    total_tokens: int | None = None


@dataclass(frozen=True)
class ModelLoaded:
    """A model finished loading, with its facts (a frozen dataclass of plain values)."""

    request_id: int
    info: ModelInfo


@dataclass(frozen=True)
class SessionOpened:
    """A session (model + fixed KV mode + its cache) is ready.

    ``cache_kind`` is "paged", or mlx-lm's own cache ("mlx-lm", "mlx-lm quantized")
    when the model's load-time probe found the paged cache wrong for it;
    ``cache_note`` then says why, for the user.
    """

    request_id: int
    session_id: str
    kv_mode: KvMode
    page_size: int
    cache_kind: str = "paged"
    cache_note: str = ""
    rotation: str | None = None  # the rows' rotation format id; None: stored as given


@dataclass(frozen=True)
class Notice:
    """A one-line notice about a request that goes on (a stored cache not used)."""

    request_id: int
    message: str


@dataclass(frozen=True)
class AnswerWaiting:
    """An answer waits to join the ones answering together: memory cannot hold
    its pages and its share of a step beside them yet (or one before it waits).
    Or, once answering, it waits for its next page, which another answer under
    the same memory may give back when it ends. Or a conversation being read in
    waits for free memory to read its next chunk (other programs hold it).

    Sent when it starts waiting and each time the reason changes (again when it
    waits again after going on); a ``WaitEnded`` once it joins or goes on (then
    its reading progress or next token), or its ``Finished`` when it is cancelled
    or ends while it waits.

    Attributes:
        reason: why it waits and for what, as a user reads it.
        short_bytes: bytes more than memory holds now that it needs (0 while it
            waits its turn behind another; its next page's bytes while it waits
            to go on).
        behind: the request it waits its turn behind, which ``reason`` calls
            "the conversation before it" (``engine.session.batch.WAITED_BEHIND``); None
            when it waits for memory itself.
    """

    request_id: int
    reason: str
    short_bytes: int
    behind: int | None = None


@dataclass(frozen=True)
class WaitEnded:
    """A request told ``AnswerWaiting`` waits no more: it joined the answers (its
    read begins), started, or memory came free for its next chunk. Its progress or
    next token follows, which for a long conversation is a chunk's time later: a
    front end stops saying it waits now.
    """

    request_id: int


@dataclass(frozen=True)
class StoredKv:
    """The KV snapshots on disk, sent after every change to them (save, evict, clear).

    Attributes:
        budget_bytes: the stored-KV disk budget in force.
        total_bytes: bytes of every file in the snapshot folder.
        snapshots: one ``SnapshotInfo`` (plain values) per stored
            chat, most recently used first; ``name`` is the chat's session id.
        elsewhere_bytes: bytes of the other folders that count against the same
            budget (the local server's stored KV, for the app's).
        model_digest: the weights' fingerprint of the model loaded now ("": none
            loaded): a snapshot stored with other weights is not reopened, but set
            aside when its chat is.
    """

    budget_bytes: int
    total_bytes: int
    snapshots: tuple[SnapshotInfo, ...] = ()
    elsewhere_bytes: int = 0
    model_digest: str = ""

    def reopenable(self, info: SnapshotInfo) -> bool:
        """Whether ``info`` was stored with the model loaded now (as far as is known:
        with no model loaded, or no digest recorded, it may be)."""
        return not (self.model_digest and info.model_digest
                    and info.model_digest != self.model_digest)


@dataclass(frozen=True)
class QualityReceipt:
    """What a chat's KV mode costs against fp16 on the chat's own text.

    Measured teacher-forced over the last ``window_tokens`` of the ``context_tokens``
    the chat held, read as one standalone window: at each of ``positions`` positions,
    ``top1`` is the share whose most likely next token is fp16's, ``kl_mean`` and
    ``kl_p99`` the KL(fp16 ‖ mode) of the next-token distribution (nats);
    ``perplexity`` and ``reference_perplexity`` are the mode's and fp16's on the
    window's own next tokens (None: a one-token window, or a receipt stored before
    they were measured). It says nothing about tokens outside that window.
    ``measured_at`` is seconds since the epoch.
    """

    mode: KvMode
    rotated: bool
    window_tokens: int
    context_tokens: int
    positions: int
    top1: float
    kl_mean: float
    kl_p99: float
    model: str
    measured_at: float
    perplexity: float | None = None
    reference_perplexity: float | None = None


@dataclass(frozen=True)
class QualityProgress(IngestProgress):
    """A quality check's progress, after every chunk of its window (tokens of the window)."""


@dataclass(frozen=True)
class QualityChecked:
    """A quality check finished; ``Finished("done")`` follows."""

    request_id: int
    session_id: str
    receipt: QualityReceipt


@dataclass(frozen=True)
class PipelineLost:
    """The engine's pipeline group is gone (a rank died, a link dropped, its launcher
    ended); sent once, after every request that was running got its ``Failed``.

    Every request after it fails at once with ``message`` (which names the rank and
    its host) until the next ``load_model`` starts the group again.
    """

    message: str


Event = (TokenChunk | IngestProgress | StatsSample | Finished | Failed | ModelLoaded
         | SessionOpened | Notice | AnswerWaiting | WaitEnded | StoredKv | QualityChecked
         | PipelineLost)
"""Everything a worker sends (``QualityProgress`` is an ``IngestProgress``)."""

Ending = Finished | Failed
"""How every request ends: exactly one of these."""

RequestEvent = (TokenChunk | IngestProgress | Finished | Failed | ModelLoaded | SessionOpened
                | Notice | AnswerWaiting | WaitEnded | QualityChecked)
"""The events of one request: each carries its ``request_id``."""

_REQUEST_EVENTS = (TokenChunk, IngestProgress, Finished, Failed, ModelLoaded, SessionOpened,
                   Notice, AnswerWaiting, WaitEnded, QualityChecked)


def request_id_of(event: Event) -> int | None:
    """The id of the request ``event`` belongs to (None: news of no one request)."""
    return event.request_id if isinstance(event, _REQUEST_EVENTS) else None


def renumbered(event: Event, request_id: int) -> Event:
    """``event`` with ``request_id`` for its request's id (unchanged if it has none)."""
    if isinstance(event, AnswerWaiting) and event.behind is not None:
        # The request it waits behind came from the same worker: the same shift.
        return replace(event, request_id=request_id,
                       behind=event.behind + request_id - event.request_id)
    if isinstance(event, _REQUEST_EVENTS):
        return replace(event, request_id=request_id)
    return event
