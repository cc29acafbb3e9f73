"""The answer recorder keeps an answer bound to its chat while other chats are shown."""

from __future__ import annotations

from app.chat.model import ChatMessage, ChatModel
from app.chat.recorder import AnswerRecorder
from app.store import HistoryStore


def test_an_answer_keeps_growing_in_its_own_chat_while_another_is_shown(qtbot) -> None:
    store = HistoryStore()
    answering = store.create_session("answering", "q8", "demo")
    other = store.create_session("other", "q4", "demo")
    store.add_message(other.id, "user", "a question in the other chat")
    model = ChatModel()
    recorder = AnswerRecorder(store, model)
    message_id = recorder.start(answering.id)
    recorder.append("first ")

    model.set_messages([ChatMessage.from_record(m) for m in store.messages(other.id)])
    recorder.show(other.id)
    recorder.append("second ")
    model.flush()
    assert [m.content for m in model.messages()] == ["a question in the other chat"]

    model.set_messages([ChatMessage.from_record(m) for m in store.messages(answering.id)])
    recorder.show(answering.id)
    assert model.message(0).content == "first second "
    recorder.append("third")
    recorder.finish("complete", None, {"generated_tokens": 3})
    assert model.message(0).content == "first second third"
    assert model.message(0).status == "complete"
    saved = store.messages(answering.id)[0]
    assert (saved.id, saved.content, saved.status) == (message_id, "first second third",
                                                       "complete")
    assert [m.content for m in store.messages(other.id)] == ["a question in the other chat"]
    store.close()


def test_an_answer_finished_while_another_chat_is_shown_leaves_that_chat_alone(qtbot) -> None:
    store = HistoryStore()
    answering = store.create_session("answering", "q8", "demo")
    other = store.create_session("other", "q4", "demo")
    store.add_message(other.id, "assistant", "an old answer", "complete")
    model = ChatModel()
    recorder = AnswerRecorder(store, model)
    recorder.start(answering.id)
    recorder.append("partial")
    model.set_messages([ChatMessage.from_record(m) for m in store.messages(other.id)])
    recorder.show(other.id)
    recorder.finish("stopped", "Stopped")
    assert [(m.content, m.status) for m in model.messages()] == [("an old answer", "complete")]
    saved = store.messages(answering.id)[0]
    assert (saved.content, saved.status) == ("partial", "stopped")
    store.close()
