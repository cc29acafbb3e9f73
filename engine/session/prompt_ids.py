"""A conversation as token ids: the chat template, end-of-turn ids, shared prefixes.

The session renders the whole conversation every turn and compares the ids with
the ones its cache holds; these functions need only the tokenizer, no MLX.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# End-of-turn markers of common chat templates; added to the tokenizer's EOS ids
# when the vocabulary has them, so a turn ends even if generation_config forgot.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>", "<|endoftext|>")


def clean_text(text: str) -> str:
    """``text`` with lone UTF-16 surrogates (pasted from broken sources) replaced.

    Tokenizers refuse strings that cannot be encoded as UTF-8; every other
    character, control characters included, goes through unchanged.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
    return text


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix of two id sequences."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def end_of_turn_ids(tokenizer: Any) -> frozenset[int]:
    """The ids that end an assistant turn: mlx-lm's EOS ids plus template markers."""
    ids = set(getattr(tokenizer, "eos_token_ids", ()) or ())
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    ids.update(vocab[marker] for marker in END_OF_TURN if marker in vocab)
    return frozenset(ids)


def render_conversation(
    tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool
) -> list[int]:
    """Token ids of the conversation, rendered the way ``mlx_lm generate`` does."""
    if not messages:
        return []
    messages = [{**m, "content": clean_text(m["content"])} for m in messages]
    if getattr(tokenizer, "has_chat_template", False):
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        return list(tokenizer.encode(text, add_special_tokens=False))
    # Base models have no template: the contents, one after another.
    text = "\n\n".join(message["content"] for message in messages)
    return list(tokenizer.encode(text, add_special_tokens=True))


def message_boundaries(
    tokenizer: Any, messages: list[dict[str, str]], prompt: list[int], *, after: int,
    most: int,
) -> list[int]:
    """Token counts of ``prompt`` that end a message, past ``after``; at most ``most``.

    Renders the conversation cut after each earlier message, newest first, and keeps
    the lengths whose ids ``prompt`` starts with (some templates render a partial
    conversation differently). Stops at the first boundary at or before ``after``.
    """
    found: list[int] = []
    for count in range(len(messages) - 1, 0, -1):
        if len(found) >= most:
            break
        try:
            ids = render_conversation(tokenizer, messages[:count], add_generation_prompt=False)
        except Exception:  # some templates refuse partial conversations
            continue
        if len(ids) <= after:
            break
        if len(ids) < len(prompt) and ids == prompt[: len(ids)]:
            found.append(len(ids))
    return sorted(found)
