"""One rendering per request: the ids, the message boundaries from the same encoding's
character offsets, and a document's token ends, checked against tokenizing again."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer

from engine.errors import EngineError
from engine.session.prompt_ids import (
    common_prefix,
    message_boundaries,
    render_conversation,
    render_prompt,
    token_ends,
    turn_overhead,
)
from tests.engine.tinymodels import make_tiny_model_dir
from tests.engine.tokenizer_watch import watch_encodings

CONVERSATIONS = [
    [{"role": "user", "content": "Where do longleaf pines grow?"},
     {"role": "assistant", "content": "In the southeastern United States."},
     {"role": "user", "content": "How tall?"}],
    [{"role": "system", "content": "Answer briefly."},
     {"role": "user", "content": "Ünïcode — “quotes” 日本語 🌲 and\n\nblank lines\n"},
     {"role": "assistant", "content": "  leading spaces, trailing newline\n"},
     {"role": "user", "content": "<|im_end|> typed by the user, and <think>tags</think>"},
     {"role": "assistant", "content": "ok"},
     {"role": "user", "content": "x" * 300}],
]


@pytest.fixture(scope="module", params=["demo", "qwen3_next"])
def tokenizer(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    if request.param == "demo":
        _model, demo = request.getfixturevalue("demo_model")
        return demo
    return load_tokenizer(make_tiny_model_dir(tmp_path_factory.mktemp("tok"), "qwen3_next"))


def _encode_again(tokenizer: Any, messages: list[dict[str, str]], generation: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False,
                                         add_generation_prompt=generation)
    return list(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("generation", [True, False])
def test_boundaries_from_offsets_are_those_of_tokenizing_each_cut(tokenizer, messages,
                                                                  generation) -> None:
    prompt = render_prompt(tokenizer, messages, add_generation_prompt=generation)
    assert prompt.starts is not None  # the fast path, not the fallback
    assert prompt.ids == _encode_again(tokenizer, messages, generation)
    for after in (0, 5, len(prompt.ids) // 2):
        for most in (1, 2, 10):
            expected = message_boundaries(tokenizer, messages, prompt.ids, after=after,
                                          most=most)
            assert prompt.boundaries(tokenizer, after=after, most=most) == expected
    assert len(prompt.boundaries(tokenizer, after=0, most=10)) == len(messages) - 1


def test_token_ends_cut_a_document_at_whole_tokens(tokenizer) -> None:
    text = " ".join(f"Longleaf pine {i}: Pinus palustris, ünïcode 🌲." for i in range(200))
    ends = token_ends(tokenizer, text)
    assert len(ends) == len(tokenizer.encode(text, add_special_tokens=False))
    assert ends == sorted(ends) and ends[-1] == len(text)
    for count in (1, 7, len(ends) // 3, len(ends) - 1):
        assert len(tokenizer.encode(text[:ends[count - 1]], add_special_tokens=False)) == count


class _DroppingTemplate:
    """A chat template that leaves the last answer out, as some trim history."""

    has_chat_template = True

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        return "<user>" + messages[0]["content"] + "<assistant>"

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())


def test_continuing_an_answer_the_template_drops_says_so() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once"}]
    with pytest.raises(EngineError, match="cannot go on from where the answer ended"):
        render_prompt(_DroppingTemplate(), messages, add_generation_prompt=True)
    # Read without an answer to come, the same conversation renders as it is.
    assert render_prompt(_DroppingTemplate(), messages, add_generation_prompt=False).ids


def test_a_prompt_says_whether_the_answer_goes_on_from_its_text(tokenizer) -> None:
    question = [{"role": "user", "content": "Where do pines grow?"}]
    cut = [*question, {"role": "assistant", "content": "In size and"}]
    assert not render_prompt(tokenizer, question, add_generation_prompt=True).continues
    assert render_prompt(tokenizer, cut, add_generation_prompt=True).continues
    assert not render_prompt(tokenizer, cut, add_generation_prompt=False).continues
    # A text completion's prompt is plain text: the answer goes on from it.
    assert render_prompt(tokenizer, question, add_generation_prompt=True,
                         template=False).continues


def test_an_answer_of_only_spaces_continues_right_after_its_turn_opens() -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "\n\n"}]
    prompt = render_prompt(_DroppingTemplate(), messages, add_generation_prompt=True)
    assert prompt.text == "<user>hi<assistant>\n\n"


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_the_turn_overhead_plus_the_text_is_what_the_engine_reads(tokenizer, messages) -> None:
    # What a send reads: the rendered conversation past what the cache holds
    # (the previous prompt and the answer's fed tokens), as Session.chat syncs it.
    system = messages[0]["content"] if messages[0]["role"] == "system" else ""
    overhead = turn_overhead(tokenizer, system)
    head = messages[:1] if system else []
    text = messages[-1]["content"]
    count = len(tokenizer.encode(text, add_special_tokens=False))
    first = render_prompt(tokenizer, [*head, messages[-1]], add_generation_prompt=True).ids
    assert len(first) == overhead.after(None) + count
    prompt = render_prompt(tokenizer, messages, add_generation_prompt=True).ids
    answered = render_prompt(tokenizer, messages[:-1], add_generation_prompt=True).ids
    eos = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())[:1]
    for ending, held in (("cancelled", answered), ("length", answered[:-1]),
                         ("stop", answered + eos)):
        read = len(prompt) - common_prefix(held, prompt)
        assert read == overhead.after(ending) + count, ending


LONG_TEXT = "Longleaf pines grow on sandy soil in the south-east. " * 20_000  # ~1 MB

TOKENIZINGS: dict[str, Callable[[Any], object]] = {
    "a document's token ends": lambda tok: token_ends(tok, LONG_TEXT),
    "a prompt with offsets": lambda tok: render_prompt(
        tok, [{"role": "user", "content": LONG_TEXT}], add_generation_prompt=True),
    "a prompt's ids": lambda tok: render_conversation(
        tok, [{"role": "user", "content": LONG_TEXT}], add_generation_prompt=True),
    "a plain-text prompt": lambda tok: render_conversation(
        tok, [{"role": "user", "content": LONG_TEXT}], add_generation_prompt=True,
        template=False),
}


@pytest.mark.parametrize("tokenizing", list(TOKENIZINGS))
def test_tokenizing_a_long_text_lets_the_other_threads_run(
        tokenizing: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # Encoding a megabyte takes the Rust tokenizer a good fraction of a second. If
    # it held the interpreter's lock all that time, the thread woken as it began
    # (the server's event loop, the window) could not run until it returned.
    tokenizer = load_tokenizer(make_tiny_model_dir(tmp_path, "llama"))
    watched = watch_encodings(tokenizer, monkeypatch)
    TOKENIZINGS[tokenizing](tokenizer)
    assert watched.seen and all(watched.seen), watched.seen
