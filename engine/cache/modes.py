"""The KV storage modes: one registry of what each mode is, best quality first.

Every list of modes in the engine and the app (the Settings menu, the New chat
choices, the Reopen in… menu, the memory panel's rows, the models' columns, the
fit line, the CLI's ``--kv``, the API's ``@mode`` suffixes) iterates
:data:`MODES`, and every fact about a mode (its bits, whether its rows are
rotated by default, its words and colour) is read from its :class:`ModeFacts`
row. Text becomes a :data:`KvMode` once, where it enters (a setting, a command
line, an API request, a stored manifest), through :func:`parse_mode`.

Its own module, free of MLX, so front ends can list the modes without loading
MLX; ``kvquant`` turns a row's bits into its storage format.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import NewType

from engine.errors import UnsupportedModeError

KvMode = NewType("KvMode", str)
"""A mode's name, as a setting, a manifest and the API spell it ("q8")."""


@dataclass(frozen=True)
class ModeFacts:
    """One row of the registry: everything the code knows about a mode.

    Attributes:
        mode: the mode's name.
        bits: bits per stored value (16: the float16 values themselves).
        rotated: whether a cache rotates its rows unless told otherwise (a
            Hadamard rotation spreads outlier channels before quantizing: same
            bytes, closer to fp16; fp16 gains nothing).
        label: a few words for a menu ("8-bit — near lossless").
        description: one line on what the mode costs and keeps.
        colour: the mode's badge colour, as ``#rrggbb``.
        aliases: other names :func:`parse_mode` takes for it (case, ``-`` and
            ``_`` ignored).
    """

    mode: KvMode
    bits: int
    rotated: bool
    label: str
    description: str
    colour: str
    aliases: tuple[str, ...] = ()

    @property
    def group_values(self) -> int:
        """Values per packed group (:func:`packed_group`): a head_dim this mode
        stores is a multiple of it."""
        return packed_group(self.bits)[0]


def packed_group(bits: int) -> tuple[int, int]:
    """(values, bytes) of the smallest run of ``bits``-bit values that fills whole bytes."""
    values = _BYTE // math.gcd(bits, _BYTE)
    return values, values * bits // _BYTE


FP16 = KvMode("fp16")
Q8 = KvMode("q8")
Q6 = KvMode("q6")
Q4 = KvMode("q4")
DEFAULT_MODE = Q8
REFERENCE = FP16
"""The exact mode: what the quality check measures the others against."""

FULL_PRECISION_BITS = 16
_BYTE = 8

# Other projects' block formats with a different layout; accepting them would
# suggest compatibility that does not exist.
_FOREIGN_FORMATS: frozenset[str] = frozenset({"q6k", "q60"})


def _key(name: str | int) -> str:
    return str(name).strip().lower().replace("-", "").replace("_", "")


class ModeRegistry(Mapping[KvMode, ModeFacts]):
    """The modes in order, best quality first; a mapping from each name to its row.

    Iterating yields the names, so ``for mode in MODES`` and ``", ".join(MODES)``
    read as a list of modes would.
    """

    def __init__(self, rows: tuple[ModeFacts, ...]) -> None:
        self._rows: dict[KvMode, ModeFacts] = {row.mode: row for row in rows}

    def __getitem__(self, mode: KvMode) -> ModeFacts:
        try:
            return self._rows[mode]
        except KeyError:
            raise self._refusal(mode) from None

    def __contains__(self, mode: object) -> bool:
        return mode in self._rows

    def __iter__(self) -> Iterator[KvMode]:
        return iter(tuple(self._rows))

    def __len__(self) -> int:
        return len(self._rows)

    def index(self, mode: KvMode) -> int:
        """The mode's place in the order (0: the best quality)."""
        return list(self._rows).index(self[mode].mode)

    def find(self, name: str) -> KvMode | None:
        """The registered mode spelled exactly ``name`` (no alias), or None."""
        return self._rows[KvMode(name)].mode if name in self._rows else None

    def at(self, place: int) -> KvMode:
        """The mode at ``place`` in the order (:meth:`index`'s inverse)."""
        return list(self._rows)[place]

    def add(self, row: ModeFacts) -> None:
        """Register another mode, in its place by bits (its storage needs a packing:
        :func:`engine.cache.kvquant.register_packing`)."""
        if row.mode in self._rows:
            raise ValueError(f"KV mode {row.mode!r} is registered already")
        rows = sorted([*self._rows.values(), row], key=lambda r: -r.bits)
        self._rows = {r.mode: r for r in rows}

    def remove(self, mode: KvMode) -> None:
        """Forget a mode :meth:`add` registered."""
        del self._rows[mode]

    def smaller(self, mode: KvMode) -> KvMode | None:
        """The next mode down (more context in the same memory), or None."""
        order = list(self)
        place = self.index(mode)
        return order[place + 1] if place + 1 < len(order) else None

    def larger(self, mode: KvMode) -> KvMode | None:
        """The next mode up (closer to the reference), or None."""
        place = self.index(mode)
        return list(self)[place - 1] if place > 0 else None

    def quantized(self) -> tuple[KvMode, ...]:
        """The modes that store codes rather than the values themselves."""
        return tuple(m for m, row in self._rows.items() if row.bits != FULL_PRECISION_BITS)

    def accepted_names(self) -> str:
        """Each mode with its aliases, the quantized ones first: for error messages."""
        rows = sorted(self._rows.values(), key=lambda r: r.bits == FULL_PRECISION_BITS)
        return ", ".join(f"{r.mode} ({', '.join(r.aliases)})" if r.aliases else r.mode
                         for r in rows)

    def parse(self, name: str | int) -> KvMode:
        """The mode a name or alias means.

        Raises:
            UnsupportedModeError: the name is unknown or names a foreign format.
        """
        key = _key(name)
        for row in self._rows.values():
            if key == _key(row.mode) or key in {_key(a) for a in row.aliases}:
                return row.mode
        raise self._refusal(name)

    def _refusal(self, name: str | int) -> UnsupportedModeError:
        """Why ``name`` is no mode: another project's format, or unknown."""
        if _key(name) in _FOREIGN_FORMATS:
            return UnsupportedModeError(
                f"KV mode {name!r} is another project's block format and is not supported; "
                f"use q6 for Longleaf's 6-bit storage. Accepted: {self.accepted_names()}."
            )
        return UnsupportedModeError(f"Unknown KV mode {name!r}. Accepted: {self.accepted_names()}.")


MODES = ModeRegistry((
    ModeFacts(FP16, 16, rotated=False, label="full precision — largest",
              description="the reference: exact, and the largest", colour="#7a7f8c",
              aliases=("f16", "16", "off", "none")),
    ModeFacts(Q8, 8, rotated=True, label="8-bit — near lossless",
              description="about half of fp16's memory, nearly exact", colour="#2f7d5b",
              aliases=("8", "8bit", "int8", "uint8", "q8_0")),
    ModeFacts(Q6, 6, rotated=True, label="6-bit — between q8 and q4",
              description="smaller again, with minor differences", colour="#3b6fb6",
              aliases=("6", "6bit", "int6", "uint6")),
    ModeFacts(Q4, 4, rotated=True, label="4-bit — smallest, coarsest",
              description="the smallest, with the most differences", colour="#b0662a",
              aliases=("4", "4bit", "int4", "uint4", "q4_0")),
))


def parse_mode(name: str | int) -> KvMode:
    """The mode a user's, a manifest's or a request's text names (:meth:`ModeRegistry.parse`).

    Raises:
        UnsupportedModeError: the name is unknown or names a foreign format.
    """
    return MODES.parse(name)
