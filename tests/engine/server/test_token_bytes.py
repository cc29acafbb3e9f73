"""A token's bytes: its own where it holds part of a character, else its text's."""

from __future__ import annotations

from engine.server.token_bytes import token_bytes


def test_a_sentencepiece_byte_token_gives_its_byte() -> None:
    assert token_bytes("<0xE6>", "\ufffd") == b"\xe6"


def test_a_byte_level_token_gives_the_bytes_its_characters_stand_for() -> None:
    # GPT-2's alphabet: "Ã" stands for 0xC3, "Ġ" for a space (0x20).
    assert token_bytes("ĠÃ", " \ufffd") == b" \xc3"


def test_a_whole_token_and_an_unknown_scheme_give_the_text() -> None:
    assert token_bytes("Ġhello", " hello") == b" hello"
    assert token_bytes("▁\ufffd", " \ufffd") == " \ufffd".encode()
    assert token_bytes(None, "\ufffd") == "\ufffd".encode()
