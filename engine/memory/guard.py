"""The memory guard: one RAM budget that model loads, ingest and every session's pages respect.

Longleaf pushes memory to the edge on purpose, so the engine must never be what
drives a machine into swap (mlx-lm users report kernel panics around 58k tokens
when the KV cache outgrows RAM). The guard keeps a headroom of physical memory
free for the system and other apps, and:

- gives every open session's page pool a byte limit drawn from ONE budget: the
  pages of all sessions together stay within the configured KV budget and
  within free RAM minus the headroom, minus what the session's prefill chunk
  needs while it runs (attention scratch and activations), so pages never take
  the memory the next chunk needs;
- tells a prefill whether free RAM holds its next chunk's transient (the
  chunk's size is the setting's, never shrunk to fit: a read that does not fit
  waits or stops, see ``engine.session.prefill``);
- refuses a model load whose weights would not fit, naming the numbers;
- watches system memory while the engine works and reports critical pressure
  (available memory below a floor, or macOS's "critical" pressure level), so a
  generation or ingest stops cleanly instead of swapping.

Memory is read through an injectable probe, so tests simulate pressure without
touching real memory. Nothing here calls MLX.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import psutil

from engine.errors import EngineError, InsufficientMemory, MemoryPressure
from engine.format import GB, human_bytes
from engine.memory.stats import pressure_level

if TYPE_CHECKING:
    from engine.cache.pages import PagePool

MIB = 2**20
# Headroom left free for the OS, the app and activations: max(2 GiB, 15 % of RAM).
MIN_HEADROOM = 2 * GB
HEADROOM_SHARE = 0.15
# Below this much available memory the machine is about to swap: stop work.
MIN_FLOOR = 512 * MIB
FLOOR_SHARE = 0.05
# Reading system memory costs tens of microseconds; per token is wasteful.
CHECK_INTERVAL = 0.1


@dataclass(frozen=True)
class MemoryReading:
    """System memory at one instant."""

    total_bytes: int
    available_bytes: int
    pressure_level: str | None = None


MemoryProbe = Callable[[], MemoryReading]


@dataclass(frozen=True)
class Hold:
    """One attached session's pages and reserve, as plain numbers."""

    key: str
    group: int  # sessions sharing pages share one group: its storage counts once
    bytes_allocated: int
    reserved_bytes: int
    foreign_bytes: int = 0  # other chats' pages in that group's storage


@dataclass(frozen=True)
class BudgetView:
    """The KV budget and what every session holds of it, frozen at one instant.

    The guard builds one on the engine thread; fit checks on any other thread
    read it instead of the live pools.
    """

    budget_bytes: int | None
    headroom_bytes: int | None
    holds: tuple[Hold, ...] = ()

    def headroom(self, reading: MemoryReading) -> int:
        """Bytes kept free on this machine."""
        if self.headroom_bytes is not None:
            return self.headroom_bytes
        return default_headroom(reading.total_bytes)

    def reserved_bytes(self, key: str | None) -> int:
        """What ``key``'s layers outside the pages may hold (0: none, or not attached)."""
        return sum(h.reserved_bytes for h in self.holds if h.key == key)

    def held_bytes(self, exclude: str | None = None) -> int:
        """Bytes the attached pools allocated, plus their reserves (all but ``exclude``)."""
        others = [h for h in self.holds if h.key != exclude]
        mine = {h.group for h in self.holds if h.key == exclude}
        groups = {h.group: h.bytes_allocated for h in others if h.group not in mine}
        return sum(groups.values()) + sum(h.reserved_bytes for h in others)

    def foreign_bytes(self, key: str | None) -> int:
        """Bytes of other chats' pages in the storage ``key`` shares with them (its
        pool's limit covers that whole storage; its own room does not)."""
        return sum(h.foreign_bytes for h in self.holds if h.key == key)

    def kv_share(self, key: str | None = None) -> int | None:
        """Bytes of the KV budget left for ``key``: the budget minus other sessions' pages."""
        if self.budget_bytes is None:
            return None
        return max(0, self.budget_bytes - self.held_bytes(exclude=key))


def system_memory() -> MemoryReading:
    """Read psutil's system memory and, on macOS, the kernel's pressure level."""
    virtual = psutil.virtual_memory()
    return MemoryReading(int(virtual.total), int(virtual.available), pressure_level())


def default_headroom(total_bytes: int) -> int:
    """Bytes to keep free on a machine with ``total_bytes`` of RAM."""
    return max(MIN_HEADROOM, int(total_bytes * HEADROOM_SHARE))


def default_floor(total_bytes: int) -> int:
    """Available bytes below which memory counts as critical."""
    return max(MIN_FLOOR, int(total_bytes * FLOOR_SHARE))


class MemoryGuard:
    """One RAM budget for the engine: model weights, and every session's KV pages.

    Args:
        budget_bytes: bytes the KV pages of ALL open sessions may take together;
            None leaves only the RAM limit (free memory minus the headroom).
        headroom_bytes: memory to keep free; default ``default_headroom(total)``.
        floor_bytes: available memory below which pressure is critical; default
            ``default_floor(total)``. Should be below the headroom.
        probe: reads system memory; inject a fake one in tests.
        check_interval: least seconds between two probes while work runs.
        clock: monotonic clock for ``check_interval``.
    """

    def __init__(
        self,
        *,
        budget_bytes: int | None = None,
        headroom_bytes: int | None = None,
        floor_bytes: int | None = None,
        probe: MemoryProbe = system_memory,
        check_interval: float = CHECK_INTERVAL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if budget_bytes is not None and budget_bytes < 0:
            raise EngineError("The KV memory budget cannot be negative.")
        self.budget_bytes = budget_bytes
        self.headroom_bytes = headroom_bytes
        self.floor_bytes = floor_bytes
        self.probe = probe
        self.check_interval = check_interval
        self.clock = clock
        self._lock = threading.Lock()
        self._pools: dict[str, PagePool] = {}
        self._transient: dict[str, int] = {}
        self._reserved: dict[str, Callable[[], int] | None] = {}
        self._ram_bound: dict[str, bool] = {}
        self._ceilings: dict[str, int] = {}
        self._last_check: float | None = None

    # -- memory readings -------------------------------------------------------

    def read(self) -> MemoryReading:
        """A fresh reading from the probe."""
        return self.probe()

    def headroom(self, reading: MemoryReading) -> int:
        """Bytes kept free on this machine."""
        return BudgetView(None, self.headroom_bytes).headroom(reading)

    def floor(self, reading: MemoryReading) -> int:
        """Available bytes below which memory is critical."""
        if self.floor_bytes is not None:
            return self.floor_bytes
        return min(default_floor(reading.total_bytes), self.headroom(reading))

    def free_bytes(self, reading: MemoryReading | None = None) -> int:
        """Bytes the engine may still take: available memory minus the headroom."""
        reading = reading or self.read()
        return max(0, reading.available_bytes - self.headroom(reading))

    def critical(self, reading: MemoryReading | None = None) -> str | None:
        """A sentence describing critical memory pressure, or None when there is none."""
        reading = reading or self.read()
        available = human_bytes(reading.available_bytes)
        if reading.pressure_level == "critical":
            return f"macOS reports critical memory pressure ({available} available)"
        floor = self.floor(reading)
        if reading.available_bytes < floor:
            return (f"system memory is critically low ({available} available of "
                    f"{human_bytes(reading.total_bytes)}, below the {human_bytes(floor)} "
                    "safety floor)")
        return None

    def check_pressure(self, what: str) -> None:
        """Raise ``MemoryPressure`` before starting ``what`` if memory is critical."""
        state = self.critical()
        if state is not None:
            raise MemoryPressure(
                f"Longleaf did not start {what}: {state}. Close other apps or "
                "conversations to free memory, then try again."
            )

    # -- one KV budget for every session's pages ----------------------------

    def attach(
        self, key: str, pool: PagePool, transient_bytes: int = 0,
        reserved: Callable[[], int] | None = None,
    ) -> None:
        """Make ``pool`` draw from this budget, under ``key``.

        ``transient_bytes`` stay free of its pages: what one prefill chunk of the
        session needs while it runs. ``reserved`` says what the session's layers
        outside the pages (sliding windows, linear-attention state) may hold: the
        budget and free RAM keep that for them too.
        """
        with self._lock:
            self._pools[key] = pool
            self._transient[key] = transient_bytes
            self._reserved[key] = reserved
        self.refresh(key)

    def reserved_bytes(self, key: str | None) -> int:
        """What ``key``'s layers outside the pages may hold (0: none, or not attached)."""
        with self._lock:
            reserved = self._reserved.get(key) if key is not None else None
        return int(reserved()) if reserved is not None else 0

    def detach(self, key: str, pool: PagePool | None = None) -> None:
        """Stop counting a closed session's pool (only ``pool``, when given)."""
        with self._lock:
            if pool is None or self._pools.get(key) is pool:
                self._pools.pop(key, None)
                self._transient.pop(key, None)
                self._reserved.pop(key, None)
                self._ram_bound.pop(key, None)
                self._ceilings.pop(key, None)

    def view(self) -> BudgetView:
        """The budget and every attached pool's bytes, frozen (call on the engine thread)."""
        with self._lock:
            pools = list(self._pools.items())
        holds = tuple(
            Hold(key, id(_group(pool)), int(pool.bytes_allocated), self.reserved_bytes(key),
                 pool.foreign_bytes())
            for key, pool in pools
        )
        return BudgetView(self.budget_bytes, self.headroom_bytes, holds)

    def held_bytes(self, exclude: str | None = None) -> int:
        """Bytes the attached pools allocated, plus their reserves (all but ``exclude``)."""
        return self.view().held_bytes(exclude)

    def kv_share(self, key: str | None = None) -> int | None:
        """Bytes of the KV budget left for ``key``: the budget minus other sessions' pages."""
        return self.view().kv_share(key)

    def refresh(self, key: str, reading: MemoryReading | None = None) -> int | None:
        """Set ``key``'s pool limit to what it may hold now; returns that limit.

        The limit is the smaller of its share of the KV budget and what it holds
        plus free RAM less its prefill transient, so pages never eat into the
        headroom nor into the memory the next prefill chunk needs; and no more
        than its ceiling, when it has one (:meth:`set_ceiling`).
        """
        with self._lock:
            pool = self._pools.get(key)
            transient = self._transient.get(key, 0)
        if pool is None:
            return None
        reserved = self.reserved_bytes(key)
        share = self.kv_share(key)
        if share is not None:
            share = max(0, share - reserved)
        ram = int(pool.bytes_allocated) + max(0, self.free_bytes(reading) - transient - reserved)
        limit = ram if share is None else min(share, ram)
        with self._lock:
            self._ram_bound[key] = share is None or ram < share
            ceiling = self._ceilings.get(key)
        if ceiling is not None:
            limit = min(limit, max(pool.bytes_to_hold(ceiling), int(pool.bytes_allocated)))
        pool.budget_bytes = limit
        return limit

    def set_ceiling(self, key: str, tokens: int | None) -> None:
        """Hold ``key``'s pool to what ``tokens`` tokens take from now on (None: no
        ceiling), never below what it holds already; its limit is set again now.

        What a conversation answering beside others was counted for when it joined:
        a pool grows ahead of its tokens, and without a ceiling that growth could
        take room counted for another answer. Where it shares pages with other
        chats, the ceiling leaves room for theirs as they stand at each refresh
        (``PagePool.bytes_to_hold``).
        """
        with self._lock:
            if tokens is None:
                self._ceilings.pop(key, None)
            else:
                self._ceilings[key] = tokens
        self.refresh(key)

    def ram_bound(self, key: str) -> bool:
        """Whether free RAM, not the KV budget, set ``key``'s pool limit last."""
        with self._lock:
            return self._ram_bound.get(key, False)

    def poll(self, key: str | None) -> str | None:
        """While work runs: the critical-pressure sentence, else refresh ``key``'s limit.

        Probes at most once per ``check_interval``; between probes returns None.
        """
        now = self.clock()
        if self._last_check is not None and now - self._last_check < self.check_interval:
            return None
        self._last_check = now
        reading = self.read()
        state = self.critical(reading)
        if state is None and key is not None:
            self.refresh(key, reading)
        return state

    def watch(self, key: str | None, cancel: threading.Event) -> PressureWatch:
        """A stand-in for ``cancel`` that also trips on critical memory pressure."""
        self._last_check = None  # the first check of a request always probes
        return PressureWatch(self, key, cancel)

    # -- model loads ---------------------------------------------------------

    def check_load(
        self,
        needed_bytes: int,
        *,
        name: str,
        releasable_bytes: int = 0,
        quantized: bool = True,
    ) -> bool:
        """Check that a model of ``needed_bytes`` fits; True when held memory must go first.

        Args:
            needed_bytes: estimated bytes of the loaded weights.
            name: the model's name, for the message.
            releasable_bytes: bytes the engine frees by unloading the current model
                and its sessions first.
            quantized: whether the weights are already quantized (else a 4-bit
                version is suggested when it would fit).

        Raises:
            InsufficientMemory: the weights do not fit even after releasing.
        """
        reading = self.read()
        free = self.free_bytes(reading)
        if needed_bytes <= free:
            return False
        if needed_bytes <= free + releasable_bytes:
            return True
        total_free = free + releasable_bytes
        message = (
            f"Loading {name} needs about {human_bytes(needed_bytes)} of memory, but only "
            f"{human_bytes(total_free)} is free for it ({human_bytes(reading.available_bytes)} "
            f"available, {human_bytes(self.headroom(reading))} kept free for the system "
            "and other apps)."
        )
        four_bit = needed_bytes * 5 // 16  # 4-bit codes plus scales, vs 16-bit weights
        if not quantized and four_bit <= total_free:
            message += (f" A 4-bit version of this model (about {human_bytes(four_bit)}) "
                        "would fit; convert it with mlx_lm.convert -q or download one.")
        else:
            message += " Close other apps to free memory, or choose a smaller model."
        raise InsufficientMemory(message, needed_bytes=needed_bytes, free_bytes=total_free)


def _group(pool: PagePool) -> object:
    return getattr(pool, "group", pool)


class PressureWatch:
    """Behaves like the request's cancel ``Event`` and also trips on memory pressure.

    The session's prefill and answer loops only ask ``is_set()``; handing them
    this instead of the user's event lets them stop at the same clean points
    (between chunks, between tokens) when memory turns critical.
    """

    def __init__(self, guard: MemoryGuard, key: str | None, cancel: threading.Event) -> None:
        self.guard = guard
        self.key = key
        self.cancel = cancel
        self.tripped: str | None = None

    def is_set(self) -> bool:
        """True once the user cancelled or memory turned critical."""
        if self.cancel.is_set():
            return True
        if self.tripped is None:
            self.tripped = self.guard.poll(self.key)
        return self.tripped is not None

    def set(self) -> None:
        """Cancel, as the user would."""
        self.cancel.set()
