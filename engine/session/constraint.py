"""Constrained decoding: an answer kept to a grammar (a JSON schema's) by masking,
at every step, the tokens the grammar does not allow next.

llguidance's matcher (Microsoft's grammar engine, the one vLLM, SGLang and
llama.cpp use) computes each mask from the tokens so far in tens of
microseconds, takes JSON schemas, Lark grammars and regular expressions, and
needs nothing but the tokenizer: no torch. It runs on the engine thread, as a
logits processor in mlx-lm's sense.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLTokenizer

from engine.errors import EngineError

_tokenizers: weakref.WeakKeyDictionary[Any, LLTokenizer] = weakref.WeakKeyDictionary()
_tokenizers_lock = threading.Lock()


class GrammarError(EngineError):
    """A grammar (or JSON schema) the matcher cannot take; the message names the part."""


def json_schema_grammar(schema: dict) -> str:
    """The grammar of the JSON documents ``schema`` allows, written compactly.

    Raises:
        GrammarError: the schema cannot be compiled (the message says which part).
    """
    try:
        grammar = LLMatcher.grammar_from_json_schema(
            schema, overrides={"whitespace_flexible": False})
    except ValueError as error:
        raise GrammarError(f"The JSON schema cannot be used: {error}") from error
    failed, messages = LLMatcher.validate_grammar_with_warnings(grammar)
    if failed:
        raise GrammarError(f"The JSON schema cannot be used: {messages[0]}")
    return grammar


def _ll_tokenizer(tokenizer: Any, end_ids: frozenset[int]) -> LLTokenizer:
    """llguidance's view of ``tokenizer`` (mlx-lm's wrapper), built once per tokenizer."""
    from llguidance.hf import from_tokenizer

    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    with _tokenizers_lock:
        cached = _tokenizers.get(inner)
        if cached is None:
            cached = from_tokenizer(inner, eos_token=sorted(end_ids))
            _tokenizers[inner] = cached
    return cached


class GrammarMask:
    """A logits processor that allows only the tokens ``grammar`` allows next.

    Each call after the first reads the token the previous step sampled (the
    last of ``history``) into the matcher, so decoding waits for it: the
    next step cannot be queued before the mask it needs exists. Once the
    grammar is complete only the end of the turn remains. A speculative
    verification calls it once per row, so each row is masked after the draft
    tokens before it; ``valid_prefix`` keeps drafts to what the grammar allows
    and ``rewind`` takes the rejected ones back out.

    Raises:
        GrammarError: the grammar cannot be compiled for this tokenizer.
    """

    def __init__(self, grammar: str, tokenizer: Any, end_ids: frozenset[int]) -> None:
        self.matcher = LLMatcher(_ll_tokenizer(tokenizer, end_ids), grammar, log_level=0)
        if self.matcher.is_error():
            raise GrammarError(f"The grammar cannot be used: {self.matcher.get_error()}")
        self.end_ids = sorted(end_ids)
        self.started = False

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        if self.started:
            self.matcher.consume_token(int(history[-1]))
        self.started = True
        return mx.where(self.allowed(logits.shape[-1]), logits, -mx.inf)

    def valid_prefix(self, pending: int, draft: list[int]) -> int:
        """How many of ``draft`` the grammar allows after the unread ``pending``."""
        if self.matcher.is_stopped() or self.matcher.is_error():
            return 0
        if not self.started:  # ``pending`` is the prompt's last token, not the answer's
            return self.matcher.validate_tokens(draft)
        if not self.matcher.consume_token(pending):
            return 0
        valid = self.matcher.validate_tokens(draft)
        self.matcher.rollback(1)
        return valid

    def rewind(self, count: int) -> None:
        """Take back the last ``count`` tokens read (drafts the verification rejected)."""
        if count > 0 and not self.matcher.rollback(count):
            raise GrammarError("The grammar could not take back rejected draft tokens.")

    def allowed(self, size: int) -> mx.array:
        """The tokens allowed next, as a (1, ``size``) boolean row."""
        if self.matcher.is_stopped() or self.matcher.is_error():
            row = np.zeros(size, dtype=bool)
            row[[i for i in self.end_ids if i < size]] = True
        else:
            bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
            row = np.unpackbits(bits, bitorder="little")[:size].astype(bool)
            if row.size < size:  # a model's padded vocabulary: those rows never allowed
                row = np.concatenate([row, np.zeros(size - row.size, dtype=bool)])
        return mx.array(row)[None]
