"""The bytes an answer's token adds to its text, for OpenAI's logprobs.

A token of a byte-level tokenizer (GPT-2's scheme: Llama 3, Qwen, SmolLM) or a
SentencePiece byte-fallback token (``<0xE6>``) may hold part of a character:
decoded alone it is U+FFFD, and its bytes must come from the token itself so a
client can join a split character back (what the ``bytes`` field is for).
"""

from __future__ import annotations

import functools
import re

BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
REPLACEMENT = "\ufffd"


@functools.cache
def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    chars = {byte: chr(byte) for byte in printable}
    others = (byte for byte in range(256) if byte not in chars)
    chars.update((byte, chr(256 + n)) for n, byte in enumerate(others))
    return {char: byte for byte, char in chars.items()}


def token_bytes(piece: object, text: str) -> bytes:
    """The bytes of one token.

    Args:
        piece: the tokenizer's own string for the token (``convert_ids_to_tokens``).
        text: the token decoded alone.
    """
    if REPLACEMENT not in text or not isinstance(piece, str):
        return text.encode("utf-8")
    if match := BYTE_TOKEN.fullmatch(piece):
        return bytes([int(match.group(1), 16)])
    byte_of = _byte_of_char()
    if piece and all(char in byte_of for char in piece):
        return bytes(byte_of[char] for char in piece)
    return text.encode("utf-8")  # a real U+FFFD, or a scheme not known here
