"""Will this many tokens fit? Pure arithmetic over model facts and free memory.

The report is a pure function of frozen values (``FitInputs``, which the engine
worker publishes, and a memory reading), so the app may ask from any thread
while the engine is busy (e.g. to warn before a document is dropped); only
``prefill_facts``, which reads the loaded model and asks MLX how many streams
the heads split over, runs on the engine thread. Besides the KV pages, a prefill
needs the weights, one chunk's attention scratch and its activations at once: the
"prefill peak" that every estimate (this report, the guard, the stats) counts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, cast

from mlx.utils import tree_flatten

from engine.cache import kvquant
from engine.cache.attention import schedule, streams
from engine.cache.attention.scratch import chunk_scratch_bytes, decode_scratch_bytes
from engine.cache.modes import FP16, MODES, KvMode
from engine.cache.paged_cache import PagedKVCache
from engine.cache.pages import DEFAULT_PAGE_SIZE, PREFILL_SCRATCH_BYTES, PageLayout
from engine.errors import ContextTooLong, EngineError, MemoryShort, UnsupportedModeError
from engine.events import RankShare
from engine.format import human_bytes
from engine.memory.guard import BudgetView, MemoryReading

# Per chunk token, the arrays one layer keeps alive at once (the layers run one after
# another): the residual, its norm, the attention output and its projection
# (hidden-wide), queries, keys and values, and the MLP's gate, up and their product.
# The vocabulary projection is not among them: prefill evaluates the cache only.
_HIDDEN_COPIES = 4
_MLP_COPIES = 3
# Per row of a decode step, float32 rows over the vocabulary alive at once: the
# last position's logits, their log-probabilities and the sampler's working copy.
_LOGIT_COPIES = 3


@dataclass(frozen=True)
class ModelFacts:
    """What the session needs to know about a model to size its cache."""

    attention_layers: int
    kv_heads: int
    head_dim: int
    max_context: int


def first_fact(info: Any, names: Sequence[str]) -> Any:
    """The first of ``names`` that ``info`` has (ModelInfo spellings vary by source)."""
    for name in names:
        value = getattr(info, name, None)
        if value is not None:
            return value
    raise EngineError(f"Model facts lack {names[0]}; reload the model.")


def facts_from_info(info: Any) -> ModelFacts:
    """Read the sizing facts from an ``engine.models.info.ModelInfo``."""
    return ModelFacts(
        attention_layers=int(first_fact(info, ("attention_layers", "num_attention_layers"))),
        kv_heads=int(first_fact(info, ("kv_heads", "num_kv_heads"))),
        head_dim=int(first_fact(info, ("head_dim",))),
        max_context=int(first_fact(info, ("max_context", "context_length"))),
    )


def facts_from_cache(cache: list[Any], max_context: int) -> ModelFacts | None:
    """Sizing facts of the layers that really hold pages (None: no paged layer).

    Preferred over the model's config: sliding-window and linear-attention layers
    keep mlx-lm's own bounded caches and take no pages.
    """
    paged = [layer for layer in cache if isinstance(layer, PagedKVCache)]
    if not paged or paged[0].store is None:
        return None
    return ModelFacts(len(paged), paged[0].kv_heads, paged[0].head_dim, max_context)


@dataclass(frozen=True)
class PrefillFacts:
    """What reading a prompt in needs in memory besides the KV pages.

    Attributes:
        weights_bytes: the loaded model's weights.
        activation_bytes_per_token: activations of one chunk token inside one layer.
        scratch_bytes: the attention's scratch budget for one chunk, at any context.
        q_heads: query heads of an attention layer; with ``kv_heads``, ``head_dim``
            and ``page_size``, the attention's own block arithmetic predicts the
            scratch (0: count the whole budget).
        kv_heads: KV heads of an attention layer.
        head_dim: values per head.
        page_size: tokens per page.
        head_streams: streams the attention splits a long context's heads over.
        gpu_schedule: the attention runs the GPU schedule's blocks.
        vocab_size: tokens of the vocabulary (a decode step's logits are this wide).
    """

    weights_bytes: int
    activation_bytes_per_token: int
    scratch_bytes: int = PREFILL_SCRATCH_BYTES
    q_heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    page_size: int = DEFAULT_PAGE_SIZE
    head_streams: int = 1
    gpu_schedule: bool = False
    vocab_size: int = 0

    def scratch_for(self, chunk: int, context: int | None = None) -> int:
        """The attention scratch of one ``chunk``-token chunk (``context``: tokens then held)."""
        if not (self.q_heads and self.kv_heads and self.head_dim):
            return self.scratch_bytes
        return chunk_scratch_bytes(chunk, self.q_heads, self.kv_heads, self.head_dim,
                                   self.page_size, self.scratch_bytes, context,
                                   self.head_streams, self.gpu_schedule)

    def transient_bytes(self, chunk: int, context: int | None = None) -> int:
        """Bytes one chunk of ``chunk`` tokens needs while it runs (scratch + activations)."""
        return self.scratch_for(chunk, context) + chunk * self.activation_bytes_per_token

    def step_transient_bytes(self, rows: int) -> int:
        """Bytes one decode step of ``rows`` conversations needs while it runs.

        Per row: its activations, its attention's scratch (each row attends its
        own pages; counted as if every row's were alive at once) and its logits
        with their float32 copies. A batch of one is an answer's step alone.
        """
        scratch = self.scratch_bytes
        if self.q_heads and self.kv_heads and self.head_dim:
            scratch = decode_scratch_bytes(self.q_heads, self.kv_heads, self.head_dim,
                                           self.page_size, self.scratch_bytes)
        logits = _LOGIT_COPIES * 4 * self.vocab_size
        return rows * (self.activation_bytes_per_token + scratch + logits)

    def peak_bytes(self, kv_bytes: int, chunk: int, context: int | None = None) -> int:
        """The prefill peak: weights + ``kv_bytes`` of pages + one chunk's transient."""
        return self.weights_bytes + kv_bytes + self.transient_bytes(chunk, context)


STREAM_CONTEXT = 8192
"""Tokens a conversation is sized at when the default stream limit is chosen."""
MOST_STREAMS = 8
"""The most answers run together by default: past it a step's rows cost more
attention than the weights' read they share."""


def default_streams(kv_bytes_per_token: int, prefill: PrefillFacts, free_bytes: int) -> int:
    """Answers that may run together when the user sets no limit: as many
    conversations of ``STREAM_CONTEXT`` tokens, each with its row of a decode
    step, as ``free_bytes`` holds beside the loaded model (1 to ``MOST_STREAMS``).

    The limit only bounds how many join; each one still joins only when memory
    holds its own pages (``engine.session.batch``).
    """
    per_stream = kv_bytes_per_token * STREAM_CONTEXT + prefill.step_transient_bytes(1)
    return max(1, min(MOST_STREAMS, free_bytes // max(1, per_stream)))


def _arg(args: Any, name: str) -> int:
    return int(getattr(args, name, 0) or 0)


def prefill_facts(
    model: Any, compute_bytes: int, scratch_bytes: int = PREFILL_SCRATCH_BYTES,
    page_size: int = DEFAULT_PAGE_SIZE,
) -> PrefillFacts:
    """Estimate a prefill's needs from an mlx-lm model's config and array shapes.

    Reads ``model.args`` and the parameters' sizes only (nothing is evaluated), and
    the device (for how the attention splits its heads): call it on the engine thread.

    Args:
        model: an mlx-lm model.
        compute_bytes: bytes of one activation value (4 where MLX computes in fp32).
        scratch_bytes: the attention's scratch budget per chunk.
        page_size: tokens per page (the attention's blocks are whole pages).
    """
    args = getattr(model, "args", None)
    hidden = _arg(args, "hidden_size")
    heads = _arg(args, "num_attention_heads")
    kv_heads = _arg(args, "num_key_value_heads") or heads
    head_dim = _arg(args, "head_dim") or (hidden // heads if heads else 0)
    # A MoE layer runs its chosen experts (and a shared one) on every token.
    experts = (_arg(args, "moe_intermediate_size") * _arg(args, "num_experts_per_tok")
               + _arg(args, "shared_expert_intermediate_size"))
    mlp = max(_arg(args, "intermediate_size"), experts)
    per_value = _HIDDEN_COPIES * hidden + (heads + 2 * kv_heads) * head_dim + _MLP_COPIES * mlp
    # tree_flatten returns a dict only when handed one to fill; here its list.
    parameters = cast("list[tuple[str, Any]]", tree_flatten(model.parameters()))
    weights = sum(int(array.nbytes) for _, array in parameters)
    return PrefillFacts(weights, per_value * compute_bytes, scratch_bytes,
                        heads, kv_heads, head_dim, page_size,
                        streams.streams_for(kv_heads) if kv_heads else 1,
                        schedule.current() == schedule.GPU, _arg(args, "vocab_size"))


@dataclass(frozen=True)
class ModeFit:
    """How ``token_count`` tokens fare in one KV mode.

    Attributes:
        mode: the KV mode.
        supported: False when the mode cannot store this model's heads.
        bytes_needed: KV bytes for the tokens, rounded up to whole pages.
        fits_context: within the model's maximum context.
        fits_budget: within the page pool's byte budget (True without a budget).
        fits_ram: within free RAM now, after the safety headroom.
        tokens_fit_ram: tokens this mode could hold in free RAM now.
        tokens_fit_budget: tokens the budget holds in this mode (None: no budget).
        tokens_fit: tokens this mode can hold in all (context, budget, RAM).
        prefill_peak_bytes: weights + these KV bytes + one chunk's scratch and
            activations: what reading the tokens in needs at its peak (0: unknown).
    """

    mode: KvMode
    supported: bool
    bytes_needed: int
    fits_context: bool
    fits_budget: bool
    fits_ram: bool
    tokens_fit_ram: int
    tokens_fit_budget: int | None
    tokens_fit: int
    prefill_peak_bytes: int = 0

    @property
    def fits(self) -> bool:
        """True when the mode is usable and every limit holds."""
        return self.supported and self.fits_context and self.fits_budget and self.fits_ram


@dataclass(frozen=True)
class FitReport:
    """Whether ``token_count`` tokens fit, per KV mode, and what to do if not.

    ``free_bytes`` is what the pages may take: free RAM after the headroom and
    after ``transient_bytes``, one prefill chunk's scratch and activations (and,
    asked for a batch's rows, after the decode step's transient where it is larger).

    On a pipeline, ``ranks`` holds every machine's share, rank 0 first (empty on
    one machine); the rest of the report is rank 0's own, and ``pool_tokens`` and
    ``tight_machine`` say what the machines hold together.
    """

    token_count: int
    max_context: int
    budget_bytes: int | None
    available_bytes: int
    session_mode: KvMode | None
    modes: tuple[ModeFit, ...]
    free_bytes: int = 0
    other_sessions_bytes: int = 0
    prefill: PrefillFacts | None = None
    chunk_tokens: int = 0
    transient_bytes: int = 0
    ranks: tuple[RankShare, ...] = ()

    def pool_tokens(self, mode: KvMode) -> int | None:
        """Tokens the pipeline's machines hold together in ``mode``: its tightest
        machine's, as each holds every token for its own layers (None: one machine,
        or a machine cannot store the mode)."""
        fits = [share.tokens_in(mode) for share in self.ranks]
        known = [tokens for tokens in fits if tokens is not None]
        return None if not fits or len(known) < len(fits) else min(known)

    def tight_machine(self, mode: KvMode) -> RankShare | None:
        """The machine that holds the fewest tokens in ``mode``, when that is fewer
        than the model's context (None: one machine, or every one holds it all)."""
        tokens = self.pool_tokens(mode)
        if tokens is None or tokens >= self.max_context:
            return None
        return next(share for share in self.ranks if share.tokens_in(mode) == tokens)

    def machine_short(self, mode: KvMode, tokens: int) -> str | None:
        """Why another machine of the pipeline cannot hold ``tokens`` in ``mode``
        (None: every one can, or the limit is rank 0's own, which the report's
        other sentences say)."""
        tight = self.tight_machine(mode)
        if tight is None:
            return None
        held = tight.tokens_in(mode)
        if (held is None or held >= tokens or tight.rank == 0
                or not self.for_mode(mode).fits_context):
            return None
        return (f"This won't fit in {mode}: {tight.machine} holds only {held:,} tokens for its "
                "layers. Free memory on that machine, or use a smaller mode.")

    @property
    def prefill_peak_bytes(self) -> int:
        """The prefill peak in the session's mode (else the suggested one, else fp16)."""
        return self.for_mode(self.session_mode or self.suggested_mode or FP16).prefill_peak_bytes

    def for_mode(self, mode: KvMode) -> ModeFit:
        """Return the entry for ``mode``."""
        found = next((entry for entry in self.modes if entry.mode == mode), None)
        if found is None:
            raise UnsupportedModeError(f"This fit report projects no KV mode {mode!r}.")
        return found

    @property
    def fits(self) -> bool:
        """True when the session's mode fits (or any mode, without a session)."""
        if self.session_mode is not None:
            return self.for_mode(self.session_mode).fits
        return any(entry.fits for entry in self.modes)

    @property
    def suggested_mode(self) -> KvMode | None:
        """The best-quality mode that fits, or None when none does."""
        return next((entry.mode for entry in self.modes if entry.fits), None)

    def message(self) -> str:
        """A sentence a user can act on when the tokens do not fit."""
        mode = self.session_mode or FP16
        entry = self.for_mode(mode)
        limits = [f"the model's context is {self.max_context:,} tokens"]
        if self.budget_bytes is not None:
            others = (f", {human_bytes(self.other_sessions_bytes)} of the budget held by "
                      "other open conversations" if self.other_sessions_bytes else "")
            limits.append(f"the KV budget left for it ({human_bytes(self.budget_bytes)}"
                          f"{others}) holds {entry.tokens_fit_budget or 0:,} tokens in {mode}")
        chunk = self.prefill.transient_bytes(self.chunk_tokens) if self.prefill else 0
        kept = "for reading it in" if chunk >= self.transient_bytes else "for its pages to grow"
        reading = (f" and {human_bytes(self.transient_bytes)} {kept}"
                   if self.transient_bytes else "")
        limits.append(f"free RAM ({human_bytes(self.free_bytes)} after the safety headroom"
                      f"{reading}) holds about {entry.tokens_fit_ram:,} tokens in {mode}")
        needed = (f" ({human_bytes(entry.bytes_needed)} of KV in {mode})"
                  if entry.supported else "")
        text = (f"This conversation needs {self.token_count:,} tokens{needed} but only "
                f"{entry.tokens_fit:,} fit in {mode}: " + "; ".join(limits) + ".")
        if not entry.fits_context:
            return text + " No KV mode raises the model's context: shorten the " \
                          "conversation or start a new one."
        suggestion = self.suggested_mode
        if suggestion is not None and suggestion != mode:
            return text + f" Reopen this conversation in {suggestion} to fit it."
        return text + " Close other sessions or apps to free memory, or shorten " \
                      "the conversation."

    def error(self) -> ContextTooLong:
        """Why the tokens do not fit, as the error to raise: past the model's context
        (``ContextTooLong``), or short of memory now (``MemoryShort``)."""
        within = self.for_mode(self.session_mode or FP16).fits_context
        return (MemoryShort if within else ContextTooLong)(self.message())

    def raise_if_too_long(self) -> None:
        """Raise :meth:`error` unless the tokens fit."""
        if not self.fits:
            raise self.error()


def _round_to_pages(tokens: int, page_size: int) -> int:
    return -(-tokens // page_size) * page_size


def fit_report(
    *,
    token_count: int,
    attention_layers: int,
    kv_heads: int,
    head_dim: int,
    max_context: int,
    page_size: int,
    available_bytes: int,
    budget_bytes: int | None = None,
    headroom_bytes: int = 0,
    session_mode: KvMode | None = None,
    session_bytes_allocated: int = 0,
    other_sessions_bytes: int = 0,
    prefill: PrefillFacts | None = None,
    chunk_tokens: int = 0,
    decode_rows: int = 0,
) -> FitReport:
    """Project whether ``token_count`` tokens fit, for every KV mode.

    Args:
        token_count: tokens the session would hold in total.
        attention_layers: layers that keep a growing KV cache.
        kv_heads: KV heads per attention layer.
        head_dim: values per head.
        max_context: the model's maximum context in tokens.
        page_size: tokens per page.
        available_bytes: free system memory now.
        budget_bytes: the page pool's byte budget, or None for no budget.
        headroom_bytes: memory to leave free for activations and the OS.
        session_mode: the session's fixed mode, or None without a session.
        session_bytes_allocated: KV bytes the session already holds; they count as
            usable again by every mode (growing in place, or reopening elsewhere).
        other_sessions_bytes: KV bytes other open sessions hold; ``budget_bytes`` is
            then what they leave of the one shared budget (for the message).
        prefill: the model's prefill needs; None counts the pages only.
        chunk_tokens: tokens of the prefill chunk whose transient must fit too.
        decode_rows: rows of the batch's decode step the pages must leave room
            for, the asking conversation's among them (0: it answers alone).
    """
    chunk = prefill.transient_bytes(chunk_tokens) if prefill else 0
    entries = []
    room: dict[KvMode, tuple[int, int]] = {}  # per mode: (free for pages, transient)
    for mode in MODES:
        try:
            page_bytes = kvquant.project_kv_bytes(
                attention_layers, kv_heads, head_dim, page_size, mode
            )
            growth = PageLayout(mode, page_size, kv_heads, head_dim).part_bytes(max_context)
        except (UnsupportedModeError, ValueError):
            entries.append(ModeFit(mode, False, 0, False, False, False, 0, 0, 0))
            continue
        # What the guard keeps free of pages (``Session``'s pool): a chunk's
        # transient, or the copy a layer's storage makes as it grows, the larger.
        transient = max(chunk, growth)
        free = max(0, available_bytes - headroom_bytes - transient) + session_bytes_allocated
        if prefill and decode_rows:
            # A decode step runs before or after a chunk, never beside it: only what
            # its rows need past that transient comes off the pages' room.
            free = max(0, free - max(0, prefill.step_transient_bytes(decode_rows) - transient))
        room[mode] = (free, transient)
        page_bytes = max(page_bytes, 1)
        needed = _round_to_pages(token_count, page_size) // page_size * page_bytes
        ram_tokens = free // page_bytes * page_size
        budget_tokens = (
            budget_bytes // page_bytes * page_size if budget_bytes is not None else None
        )
        limits = [max_context, ram_tokens]
        if budget_tokens is not None:
            limits.append(budget_tokens)
        entries.append(ModeFit(
            mode=mode,
            supported=True,
            bytes_needed=needed,
            fits_context=token_count <= max_context,
            fits_budget=budget_bytes is None or needed <= budget_bytes,
            fits_ram=needed <= free,
            tokens_fit_ram=ram_tokens,
            tokens_fit_budget=budget_tokens,
            tokens_fit=min(limits),
            prefill_peak_bytes=(prefill.peak_bytes(needed, chunk_tokens, token_count)
                                if prefill else 0),
        ))
    # The report's one figure: the session's mode, or without a session the
    # mode that leaves the least (a chat may open in any).
    free, transient = (room[session_mode] if session_mode in room
                       else min(room.values(), default=(0, chunk)))
    return FitReport(
        token_count=token_count,
        max_context=max_context,
        budget_bytes=budget_bytes,
        available_bytes=available_bytes,
        session_mode=session_mode,
        modes=tuple(entries),
        free_bytes=free,
        other_sessions_bytes=other_sessions_bytes,
        prefill=prefill,
        chunk_tokens=chunk_tokens,
        transient_bytes=transient,
    )


@dataclass(frozen=True)
class FitInputs:
    """Everything a fit check needs, frozen on the engine thread.

    The worker publishes one per open session (and one for a chat not opened
    yet) with every stats sample and every finished request, so a fit check on
    any thread reads these values, never a live session or pool.
    """

    facts: ModelFacts
    page_size: int
    budget: BudgetView
    prefill: PrefillFacts | None = None
    chunk_tokens: int = 0
    session_id: str | None = None  # None: a chat not opened yet
    session_mode: KvMode | None = None
    session_bytes_allocated: int = 0
    # A pipeline's machines (``RankShare``), rank 0 first; its free RAM and tokens
    # are filled in by each check. Empty on one machine.
    ranks: tuple[RankShare, ...] = ()
    # Rows of the batch's decode step its pages must leave room for (0: alone).
    decode_rows: int = 0
    # What a chat not opened yet will keep for its layers outside the pages and
    # their checkpoints (an open session's is the guard's reserve).
    new_chat_reserve_bytes: int = 0


def with_page_size(inputs: FitInputs, page_size: int) -> FitInputs:
    """``inputs`` for pages of ``page_size`` tokens (a chat not opened yet's, as the
    user set them): whole pages and the attention's blocks are counted at that size."""
    prefill = inputs.prefill
    if prefill is not None:
        prefill = dataclasses.replace(prefill, page_size=page_size)
    return dataclasses.replace(inputs, page_size=page_size, prefill=prefill)


def without(inputs: FitInputs, reading: MemoryReading,
            gone: Collection[str]) -> tuple[FitInputs, MemoryReading]:
    """``inputs`` and ``reading`` as if the sessions ``gone`` had dropped their pages:
    those back in the KV budget and in free RAM (the asking session keeps its own).

    They stay open, so the budget still keeps their reserves (what their sliding
    windows and linear-attention state may hold). Pages shared with a session
    that stays are not freed, as the guard counts them: a group's storage once.
    """
    gone = set(gone) - {inputs.session_id}
    if not gone:
        return inputs, reading
    budget = inputs.budget
    staying = {h.group for h in budget.holds if h.key not in gone}
    kept = dataclasses.replace(budget, holds=tuple(
        h if h.key not in gone or h.group in staying else dataclasses.replace(h, bytes_allocated=0)
        for h in budget.holds))
    freed = (budget.held_bytes(exclude=inputs.session_id)
             - kept.held_bytes(exclude=inputs.session_id))
    return (dataclasses.replace(inputs, budget=kept),
            dataclasses.replace(reading, available_bytes=reading.available_bytes + freed))


def guarded_fit_report(inputs: FitInputs, reading: MemoryReading, token_count: int) -> FitReport:
    """``fit_report`` for ``inputs`` with free RAM from ``reading``: pure, any thread.

    The asking session's own pages are not counted against it; its prefill
    facts and chunk add the prefill peak (see :func:`fit_report`).
    """
    budget, session_id = inputs.budget, inputs.session_id
    share = budget.kv_share(session_id)
    # What the session's sliding windows and linear-attention state may hold is
    # kept for them in the budget and in free RAM, as the guard does for its pages;
    # where it shares a document's storage, the other chats' pages there are theirs.
    reserved = (budget.reserved_bytes(session_id) if session_id is not None
                else inputs.new_chat_reserve_bytes)
    foreign = budget.foreign_bytes(session_id)
    if share is not None:
        share = max(0, share - reserved - foreign)
    facts = inputs.facts
    report = fit_report(
        token_count=token_count,
        attention_layers=facts.attention_layers,
        kv_heads=facts.kv_heads,
        head_dim=facts.head_dim,
        max_context=facts.max_context,
        page_size=inputs.page_size,
        available_bytes=reading.available_bytes,
        budget_bytes=share,
        headroom_bytes=budget.headroom(reading) + reserved,
        session_mode=inputs.session_mode,
        session_bytes_allocated=inputs.session_bytes_allocated,
        other_sessions_bytes=(budget.held_bytes(exclude=session_id) + foreign
                              if share is not None else 0),
        prefill=inputs.prefill,
        chunk_tokens=inputs.chunk_tokens,
        decode_rows=inputs.decode_rows,
    )
    if not inputs.ranks:
        return report
    own = dataclasses.replace(
        inputs.ranks[0], free_bytes=reading.available_bytes,
        tokens_fit=tuple(m.tokens_fit if m.supported else None for m in report.modes))
    return dataclasses.replace(report, ranks=(own, *inputs.ranks[1:]))
