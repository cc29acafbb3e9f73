"""The mode registry: its order, its neighbours, and the names it parses."""

from __future__ import annotations

import pytest

from engine.cache.modes import (
    DEFAULT_MODE,
    MODES,
    REFERENCE,
    KvMode,
    ModeFacts,
    packed_group,
    parse_mode,
)
from engine.errors import UnsupportedModeError


def test_modes_are_listed_best_quality_first() -> None:
    assert list(MODES) == ["fp16", "q8", "q6", "q4"]
    assert [MODES[m].bits for m in MODES] == [16, 8, 6, 4]
    assert DEFAULT_MODE == "q8" and REFERENCE == "fp16"
    assert MODES.quantized() == ("q8", "q6", "q4")


def test_neighbours_follow_the_order() -> None:
    assert [MODES.smaller(m) for m in MODES] == ["q8", "q6", "q4", None]
    assert [MODES.larger(m) for m in MODES] == [None, "fp16", "q8", "q6"]
    assert [MODES.at(MODES.index(m)) for m in MODES] == list(MODES)


def test_only_the_quantized_modes_rotate_by_default() -> None:
    assert [m for m in MODES if MODES[m].rotated] == list(MODES.quantized())


def test_find_takes_registered_names_only() -> None:
    assert MODES.find("q6") == "q6"
    assert MODES.find("6bit") is None and MODES.find("") is None


def test_an_unknown_mode_is_an_engine_error() -> None:
    with pytest.raises(UnsupportedModeError, match="Unknown KV mode 'q5'"):
        MODES[KvMode("q5")]
    assert "q5" not in MODES


@pytest.mark.parametrize(("bits", "group"), [(16, (1, 2)), (8, (1, 1)), (6, (4, 3)),
                                             (5, (8, 5)), (4, (2, 1))])
def test_packed_groups_fill_whole_bytes(bits: int, group: tuple[int, int]) -> None:
    assert packed_group(bits) == group


def test_a_registered_mode_joins_every_list_until_removed() -> None:
    row = ModeFacts(KvMode("q5"), 5, rotated=True, label="5-bit", description="between",
                    colour="#000000", aliases=("5bit",))
    MODES.add(row)
    try:
        assert list(MODES) == ["fp16", "q8", "q6", "q5", "q4"]
        assert MODES.smaller(KvMode("q6")) == "q5" and MODES.larger(KvMode("q4")) == "q5"
        assert parse_mode("5-BIT") == "q5" and "q5 (5bit)" in MODES.accepted_names()
        with pytest.raises(ValueError, match="registered already"):
            MODES.add(row)
    finally:
        MODES.remove(KvMode("q5"))
    assert list(MODES) == ["fp16", "q8", "q6", "q4"]


@pytest.mark.parametrize(
    ("name", "mode"),
    [
        *[(a, "q8") for a in ("q8", "8", "8bit", "int8", "uint8", "q8_0", "Q8-0", "INT8")],
        *[(a, "q6") for a in ("q6", "6", "6bit", "int6", "uint6", "Q6", "6-bit", "UInt6")],
        *[(a, "q4") for a in ("q4", "4", "4bit", "int4", "uint4", "q4_0", "Q4-0", "4_bit")],
        *[(a, "fp16") for a in ("fp16", "f16", "16", "off", "none", "FP16", "Off", "None")],
        (8, "q8"),
        (6, "q6"),
    ],
)
def test_parse_mode_accepts_aliases(name: str | int, mode: str) -> None:
    assert parse_mode(name) == mode


@pytest.mark.parametrize("name", ["q6_k", "Q6_K", "q6-k", "q6_0", "Q6-0", "q6k"])
def test_foreign_six_bit_formats_are_rejected(name: str) -> None:
    with pytest.raises(UnsupportedModeError, match="another project"):
        parse_mode(name)


@pytest.mark.parametrize("name", ["q5", "fp8", "bf16", "q4_k", "", "int3", "q8_1"])
def test_unknown_mode_lists_accepted_names(name: str) -> None:
    with pytest.raises(ValueError, match="Accepted: q8") as info:
        parse_mode(name)
    assert isinstance(info.value, UnsupportedModeError)
    for accepted in ("q8", "q6", "q4", "fp16", "6bit", "off"):
        assert accepted in str(info.value)


