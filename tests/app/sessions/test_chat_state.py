"""Each chat has one state and one sentence for it, from one source."""

from __future__ import annotations

from types import SimpleNamespace

from app.sessions.chat_state import (
    ChatFacts,
    ChatState,
    chat_state,
    chat_tokens,
    reuse_sentence,
    sidebar_line,
    state_sentence,
)

SNAPSHOT = SimpleNamespace(tokens=3930, mode="q6", disk_bytes=12_300_000)


def test_every_state_has_its_own_sentence() -> None:
    cases = {
        ChatState.NEW: ChatFacts(),
        ChatState.IN_MEMORY: ChatFacts(held_tokens=5007, history_tokens=5007),
        ChatState.ON_DISK: ChatFacts(history_tokens=2132, snapshot=SNAPSHOT),
        ChatState.WAITING: ChatFacts(job="waiting", waiting_for="A"),
        ChatState.READING: ChatFacts(job="reading", progress=(2499, 4706)),
        ChatState.ANSWERING: ChatFacts(job="answering", held_tokens=10),
        ChatState.CHECKING: ChatFacts(job="checking", progress=(1, 1024)),
    }
    sentences = {state: state_sentence(facts) for state, facts in cases.items()}
    assert {state: chat_state(facts) for state, facts in cases.items()} == {
        state: state for state in cases}
    assert len(set(sentences.values())) == len(cases)
    assert sentences[ChatState.NEW] == "New chat: nothing to read yet."
    assert sentences[ChatState.IN_MEMORY] == "In memory: 5,007 tokens, ready to answer at once."
    assert sentences[ChatState.ON_DISK].startswith("On disk: 3,930 tokens stored (")
    assert sentences[ChatState.WAITING] == "Waiting for ‘A’ to finish…"
    assert sentences[ChatState.READING] == "Reading the conversation… 2,499 / 4,706 tokens"
    assert sentences[ChatState.CHECKING] == "Checking quality… 1 / 1,024 tokens"


def test_a_new_chat_is_not_rebuilt_and_an_empty_cache_is_not_in_memory() -> None:
    assert "rebuilt" not in state_sentence(ChatFacts())
    # A stored chat whose cache was opened for a quality check holds no token:
    # it is still on disk, not "in memory · 0 tokens".
    opened_empty = ChatFacts(held_tokens=0, history_tokens=5007, snapshot=SNAPSHOT)
    assert chat_state(opened_empty) is ChatState.ON_DISK
    assert chat_state(ChatFacts(held_tokens=0)) is ChatState.NEW


def test_one_token_count_the_snapshot_wins_over_a_stale_history_count() -> None:
    # Closed mid-answer: the history's count was saved before the answer, the
    # snapshot was stored after it.
    facts = ChatFacts(history_tokens=2132, snapshot=SNAPSHOT)
    assert chat_tokens(facts) == 3930
    assert sidebar_line(facts, "just now") == "On disk · 3,930 tokens · just now"
    older = ChatFacts(history_tokens=5007, snapshot=SNAPSHOT)
    assert chat_tokens(older) == 5007
    assert "3,930 of its 5,007 tokens stored" in state_sentence(older)
    assert state_sentence(ChatFacts(history_tokens=2132)) == (
        "On disk as text: the next message reads its 2,132 tokens in again.")


def test_the_sidebar_says_a_jobs_state_and_an_idle_chats_place() -> None:
    assert sidebar_line(ChatFacts(job="checking"), "now") == "Checking quality…"
    assert sidebar_line(ChatFacts(job="answering"), "now") == "Answering…"
    held = ChatFacts(held_tokens=38)
    assert sidebar_line(held, "5 min ago") == "In memory · 38 tokens · 5 min ago"
    assert sidebar_line(ChatFacts(), "just now") == "New · just now"


def test_the_reuse_of_a_snapshot_is_said() -> None:
    assert reuse_sentence(3930, 120) == "Reused 3,930 stored tokens, read 120 new"
    assert reuse_sentence(0, 120) == ""


def test_a_chat_waiting_behind_a_long_title_names_it_in_a_few_words() -> None:
    title = "Section 1. The longleaf pine (Pinus palustris) grows in the coastal plain " * 3
    sentence = state_sentence(ChatFacts(job="waiting", waiting_for=title.strip()))
    assert sentence.startswith("Waiting for ‘Section 1. The longleaf pine") and len(sentence) < 64
    assert "…’ to finish…" in sentence


def test_an_answer_the_engine_holds_says_the_engines_reason() -> None:
    reason = "Waiting for memory to answer beside ‘Pines’: 300 MB more is needed."
    facts = ChatFacts(job="waiting", held=reason, held_tokens=40)
    assert chat_state(facts) is ChatState.WAITING
    assert state_sentence(facts) == reason
    assert sidebar_line(facts, "now") == "Waiting…"
