"""A conversation as token ids: the chat template, end-of-turn ids, shared prefixes.

A request renders and tokenizes the whole conversation once (``render_prompt``)
and compares the ids with the ones its cache holds; where earlier messages end
comes from the same encoding's character offsets, not from tokenizing the
conversation again per message. These functions need only the tokenizer, no MLX.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jinja2

from engine.errors import EngineError, TemplateRefused

log = logging.getLogger(__name__)

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


@dataclass(frozen=True)
class Prompt:
    """A conversation rendered and tokenized once.

    Attributes:
        ids: its token ids, as ``mlx_lm generate`` renders them.
        messages: the messages it was rendered from (text cleaned).
        text: the rendered text (None for a base model, whose ids also hold
            the tokenizer's special tokens).
        starts: where each token starts in ``text``, in characters (None when
            the tokenizer does not say).
        tools: the tool definitions the template rendered (None: none).
        continues: the answer goes on from the prompt's own text (a continued
            answer, a plain-text completion), so its first word keeps its
            leading space; False when it starts a turn of its own.
    """

    ids: list[int]
    messages: list[dict[str, str]]
    text: str | None = None
    starts: list[int] | None = None
    tools: list[dict] | None = None
    continues: bool = False

    def boundaries(self, tokenizer: Any, *, after: int, most: int) -> list[int]:
        """Token counts of ``ids`` that end a message, past ``after``; at most ``most``.

        Renders the text of the conversation cut after each earlier message,
        newest first (the template only: no tokenizer), keeps the cuts ``text``
        starts with and maps each to the token that starts there; some templates
        render a partial conversation differently, and a cut inside a token is
        no boundary. Stops at the first boundary at or before ``after``.
        """
        if self.text is None or self.starts is None:
            return message_boundaries(tokenizer, self.messages, self.ids, after=after,
                                      most=most, tools=self.tools)
        found: list[int] = []
        for count in range(len(self.messages) - 1, 0, -1):
            if len(found) >= most:
                break
            try:
                cut = _template_text(tokenizer, self.messages[:count],
                                     add_generation_prompt=False, tools=self.tools)
            except Exception as error:  # some templates refuse partial conversations
                log.debug("no boundary after message %d: %s", count, error)
                continue
            position = bisect.bisect_left(self.starts, len(cut))
            if position <= after:
                break
            if (position < len(self.ids) and self.starts[position] == len(cut)
                    and self.text.startswith(cut)):
                found.append(position)
        return sorted(found)


def _template_text(tokenizer: Any, messages: list[dict[str, str]], *,
                   add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
    # Tools only when there are some: a template without tool support then
    # renders exactly as it always did.
    extra = {"tools": tools} if tools else {}
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra)
    except jinja2.TemplateError as error:
        # A template's raise_exception states a rule of its own (roles that
        # alternate, the form of a call's id): its words tell the user what to change.
        raise TemplateRefused("The model's chat template refused this conversation: "
                              f"{error}") from error


def _continued_text(tokenizer: Any, messages: list[dict[str, str]],
                    tools: list[dict] | None = None) -> str:
    """The conversation rendered up to the end of its final (assistant) message's text.

    Cut after the last copy of that text, stripped, as templates often trim a
    message (transformers cuts the same way); an answer of nothing but spaces
    goes right after the opening of the answer's turn.
    """
    final = messages[-1]["content"]
    stripped = final.strip()
    if not stripped:
        return _template_text(tokenizer, messages[:-1], add_generation_prompt=True,
                              tools=tools) + final
    text = _template_text(tokenizer, messages, add_generation_prompt=False, tools=tools)
    end = text.rfind(stripped)
    if end < 0:
        raise EngineError("This model's chat template drops the answer to continue, so it "
                          "cannot go on from where the answer ended; send a new message.")
    return text[:end + len(stripped)]


def _backend(tokenizer: Any) -> Any | None:
    """The Rust ``tokenizers.Tokenizer`` behind an mlx-lm/HF tokenizer, if there is one."""
    inner = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(inner, "_tokenizer", None)
    return backend if hasattr(backend, "encode_batch") else None


def _encoding(backend: Any, text: str) -> Any:
    """``text``'s encoding (no special tokens added), made without the interpreter's lock.

    The Rust tokenizer's one-text ``encode`` keeps the lock for the whole call, so
    no other thread of the process runs while it reads a long prompt: the server's
    event loop stops answering, the window stops repainting. Its batch call lets
    them go on, and gives the same encoding.
    """
    return backend.encode_batch([text], add_special_tokens=False)[0]


def encode_with_starts(tokenizer: Any, text: str, *,
                       starts: bool = True) -> tuple[list[int], list[int] | None]:
    """``text``'s ids (no special tokens added) and where each starts, in characters.

    The starts are None when the tokenizer has no fast backend to ask, or when
    not asked for (``starts=False``: listing them takes a while for a long text).
    """
    backend = _backend(tokenizer)
    if backend is None:
        return list(tokenizer.encode(text, add_special_tokens=False)), None
    encoding = _encoding(backend, text)
    if not starts:
        return list(encoding.ids), None
    return list(encoding.ids), [start for start, _ in encoding.offsets]


def token_ends(tokenizer: Any, text: str) -> list[int]:
    """Where each of ``text``'s tokens ends, in characters (one tokenization).

    A tokenizer without a fast backend gives no offsets: the ends are then
    summed from each token decoded alone (near, not exact, where a character
    spans two tokens).
    """
    text = clean_text(text)
    backend = _backend(tokenizer)
    if backend is not None:
        return [end for _, end in _encoding(backend, text).offsets]
    ends, end = [], 0
    for token in tokenizer.encode(text, add_special_tokens=False):
        end += len(tokenizer.decode([token]))
        ends.append(min(end, len(text)))
    return ends


def render_prompt(
    tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool,
    tools: list[dict] | None = None, template: bool = True, starts: bool = True,
) -> Prompt:
    """The conversation rendered the way ``mlx_lm generate`` does, tokenized once.

    Asked for the answer (``add_generation_prompt``) of a conversation that ends
    with an assistant message, it continues that message: the prompt ends where
    its text ends, without an end of turn or a new turn (what transformers calls
    ``continue_final_message``, and a final assistant message means in the
    Anthropic API: the answer starts with it).

    ``tools`` (OpenAI-style function definitions) go to the chat template, as
    ``mlx_lm.server`` passes them; a base model has no template to take them.
    ``template=False`` reads the contents as plain text even where the model has
    a chat template (a text completion's prompt). ``starts=False`` leaves the
    tokens' starts out (``Prompt.boundaries`` then tokenizes again per message).
    """
    if not messages:
        return Prompt([], [])
    messages = [{**m, "content": clean_text(m["content"])} for m in messages]
    continued = add_generation_prompt and messages[-1]["role"] == "assistant"
    if template and getattr(tokenizer, "has_chat_template", False):
        if continued:
            text = _continued_text(tokenizer, messages, tools)
        else:
            text = _template_text(tokenizer, messages,
                                  add_generation_prompt=add_generation_prompt, tools=tools)
        ids, where = encode_with_starts(tokenizer, text, starts=starts)
        return Prompt(ids, messages, text, where, tools or None, continues=continued)
    # Base models have no template: the contents, one after another.
    text = "\n\n".join(message["content"] for message in messages)
    return Prompt(list(tokenizer.encode(text, add_special_tokens=True)), messages,
                  continues=True)


def render_conversation(
    tokenizer: Any, messages: list[dict[str, str]], *, add_generation_prompt: bool,
    tools: list[dict] | None = None, template: bool = True,
) -> list[int]:
    """Token ids of the conversation, rendered the way ``mlx_lm generate`` does."""
    return render_prompt(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                         tools=tools, template=template, starts=False).ids


@dataclass(frozen=True)
class TurnOverhead:
    """Tokens the chat template adds around one more user message's text.

    Attributes:
        first: a chat's first message: the system prompt, the role markers and
            the generation prompt (with the tokenizer's BOS).
        later: a later message, after an answer the cache holds whole: the end
            of that answer's turn, the role markers and the generation prompt.
        end_held: 1 when the model's end-of-turn token is what the template puts
            after an answer: an answer that ended on it fed it to the cache already.
    """

    first: int
    later: int
    end_held: int = 0

    def after(self, ending: str | None) -> int:
        """The overhead of a message after an answer that ended so (None: a first message).

        ``ending`` is the answer's finish reason: "stop" (its end-of-turn token
        is held when ``end_held``), "length" (its last token was sampled but
        never fed: the next message reads it), or "cancelled" (held whole).
        """
        if ending is None:
            return self.first
        if ending == "stop":
            return self.later - self.end_held
        if ending in ("length", "memory"):
            return self.later + 1
        return self.later


PROBE_QUESTION, PROBE_ANSWER = "Hello there", "Hi"


def turn_overhead(tokenizer: Any, system_prompt: str = "") -> TurnOverhead:
    """What one more user turn costs beyond its text, from a tiny conversation.

    Renders the conversation with and without one more user turn and subtracts,
    so a front end can say what the engine will read for a message (its text's
    tokens plus these) without rendering the whole conversation again. A later
    turn is measured from the previous answer's text, rendered as the prompt
    that continues it: what the cache holds of an answer it fed whole.
    """
    head = [{"role": "system", "content": system_prompt}] if system_prompt else []
    question = {"role": "user", "content": PROBE_QUESTION}
    answer = {"role": "assistant", "content": PROBE_ANSWER}
    text = len(tokenizer.encode(PROBE_QUESTION, add_special_tokens=False))
    first = render_prompt(tokenizer, [*head, question], add_generation_prompt=True).ids
    held = render_prompt(tokenizer, [*head, question, answer], add_generation_prompt=True).ids
    after = render_prompt(tokenizer, [*head, question, answer, question],
                          add_generation_prompt=True).ids
    kept = common_prefix(held, after)
    end_held = int(kept < len(after) and after[kept] in end_of_turn_ids(tokenizer))
    return TurnOverhead(first=max(0, len(first) - text),
                        later=max(0, len(after) - kept - text), end_held=end_held)


def message_boundaries(
    tokenizer: Any, messages: list[dict[str, str]], prompt: list[int], *, after: int,
    most: int, tools: list[dict] | None = None,
) -> list[int]:
    """Token counts of ``prompt`` that end a message, past ``after``; at most ``most``.

    For tokenizers that give no character offsets (``Prompt.boundaries`` asks
    this one then): renders and tokenizes the conversation cut after each
    earlier message, newest first, and keeps
    the lengths whose ids ``prompt`` starts with (some templates render a partial
    conversation differently). Stops at the first boundary at or before ``after``.
    """
    found: list[int] = []
    for count in range(len(messages) - 1, 0, -1):
        if len(found) >= most:
            break
        try:
            ids = render_conversation(tokenizer, messages[:count], add_generation_prompt=False,
                                      tools=tools)
        except Exception:  # some templates refuse partial conversations
            continue
        if len(ids) <= after:
            break
        if len(ids) < len(prompt) and ids == prompt[: len(ids)]:
            found.append(len(ids))
    return sorted(found)
