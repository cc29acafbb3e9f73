"""The local server inside the app: on the app's own worker, started and stopped by Settings.

A real window on the tiny llama, a real uvicorn server on 127.0.0.1, the official
openai SDK as the client.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from PySide6.QtCore import Qt

from app.chat.model import ChatMessage
from app.controller import ChatController
from app.settings import Settings
from app.window.main_window import MainWindow
from engine.events import Finished
from engine.session.sampling import SamplingParams
from tests.app.conftest import ANSWER_TIMEOUT_MS, close_window, open_window

DOC = ("Longleaf pines grow in sandy soil across the coastal plain, and fire keeps the "
       "understory open. ") * 12


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _enable(port: int, *, share: bool = False) -> None:
    settings = Settings()
    settings.server_enabled = True
    settings.server_port = port
    settings.server_share_chats = share
    settings.sync()


def _client(port: int) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused",
                         max_retries=0, timeout=120)


def _wait_ready(qtbot, window: MainWindow) -> None:
    host = window.controller.local_server
    qtbot.waitUntil(lambda: host.status.state == "ready", timeout=60_000)


@pytest.fixture
def served(qtbot, tiny_llama: Path) -> Iterator[tuple[MainWindow, int]]:
    port = _free_port()
    _enable(port)
    window = open_window(qtbot, tiny_llama)
    try:
        _wait_ready(qtbot, window)
        yield window, port
    finally:
        close_window(window)
    assert not [t for t in threading.enumerate() if t.name.startswith("longleaf-server")]


def test_the_app_serves_openai_clients_on_its_own_engine(qtbot, served) -> None:
    window, port = served
    assert window.server_status.text() == f"Local server on http://127.0.0.1:{port}"
    assert window.statusBar().isVisible()
    health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    reply = _client(port).chat.completions.create(
        model="anything", messages=[{"role": "user", "content": "Say hi."}], max_tokens=6,
        temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens > 0
    # The worker is the app's: the API session is listed in the panel as one.
    section = window.panel.api_sessions
    # "Another app's chat 1 · q8 · N tokens · bytes", the bytes from its own stats sample.
    qtbot.waitUntil(lambda: section.rows.text().count(" · ") == 3, timeout=10_000)
    name, mode, tokens, size = section.rows.text().split(" · ")
    assert name == "Another app's chat 1" and mode == window.settings.default_mode
    assert tokens.endswith(" tokens") and size.endswith("B")
    assert not section.isHidden()
    assert window.controller.local_server.sessions()[0].name.startswith("api-")


def _last_message(controller: ChatController) -> ChatMessage:
    return controller.model.message(controller.model.rowCount() - 1)


def test_a_chat_answer_and_an_api_request_answer_together(qtbot, served) -> None:
    window, port = served
    host, controller = window.controller.local_server, window.controller
    seen: list[tuple[str, bool]] = []  # (server state, whether the app's chat runs)
    host.statusChanged.connect(lambda status: seen.append((status.state, controller.busy)))
    together: list[list[str]] = []  # the panel's "answering together", as it changes
    host.statusChanged.connect(lambda _status: together.append(
        [title for title, _bytes in controller.answering_together()]))
    replies: list[object] = []
    ended: list[tuple[int, bool]] = []  # (request id, the server's), on the engine thread

    def ask() -> None:
        replies.append(_client(port).chat.completions.create(
            model="m", messages=[{"role": "user", "content": DOC}], max_tokens=8,
            temperature=0))

    def note(event: object) -> bool:
        if isinstance(event, Finished) and event.stats is not None:  # an answer ended
            ended.append((event.request_id, event.request_id in host.server.bridge._tickets))
        return False

    # Ahead of the server's own claim, so it sees both kinds of request end.
    controller.bridge._claims = (note, *controller.bridge._claims)

    controller.settings.sampling = SamplingParams(temperature=0.0, max_tokens=4000)
    window.composer.set_text(DOC)
    client = threading.Thread(target=ask, name="test-client")
    with qtbot.waitSignal(controller.answerFinished, timeout=ANSWER_TIMEOUT_MS) as done:
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
        # Once the chat's answer streams, so the request joins it rather than going first.
        qtbot.waitUntil(lambda: bool(_last_message(controller).content),
                        timeout=ANSWER_TIMEOUT_MS)
        client.start()  # it joins the chat's answer on the one engine thread
        qtbot.waitUntil(lambda: bool(replies), timeout=ANSWER_TIMEOUT_MS)
        # The API request was answered while the chat's long answer went on, and the
        # memory panel listed both.
        assert controller.busy and ("answering", True) in seen
        assert controller.current is not None
        assert [controller.current.title, "Another app's chat 1"] in together
        controller.stop()
    assert done.args[0] == "stopped"
    client.join(120)
    controller.bridge.remove_claim(note)
    assert not client.is_alive() and replies
    assert replies[0].choices[0].message.content is not None
    assert [mine for _rid, mine in ended] == [True, False]  # the API's ended first
    qtbot.waitUntil(lambda: host.status.state == "ready", timeout=10_000)
    last = _last_message(controller)
    assert last.role == "assistant" and last.content


def test_a_chat_sent_during_an_api_answer_answers_beside_it(qtbot, served) -> None:
    window, port = served
    host = window.controller.local_server
    pieces: list[str] = []

    def stream() -> None:
        for chunk in _client(port).chat.completions.create(
                model="m", messages=[{"role": "user", "content": DOC}], max_tokens=48,
                temperature=0, stream=True):
            if chunk.choices and chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)

    client = threading.Thread(target=stream, name="test-client")
    client.start()
    qtbot.waitUntil(lambda: host.status.state == "answering", timeout=30_000)
    assert window.server_status.text().startswith("Local server: answering a request")
    window.composer.set_text("Which trees?")
    with qtbot.waitSignal(window.controller.answerFinished, timeout=ANSWER_TIMEOUT_MS) as done:
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
        assert window.controller.activity.states() != {}  # started, not held in line
        assert not window.composer.waiting_box.isVisible()
    client.join(120)
    assert done.args[0] != "failed" and not client.is_alive() and pieces


def test_api_requests_reuse_the_apps_chats_only_when_shared(qtbot, served) -> None:
    window, port = served
    window.composer.set_text(DOC)
    with qtbot.waitSignal(window.controller.answerFinished, timeout=ANSWER_TIMEOUT_MS):
        qtbot.keyClick(window.composer.edit, Qt.Key.Key_Return)
    messages = [{"role": "system", "content": window.settings.system_prompt},
                {"role": "user", "content": DOC}]

    def cached() -> int:
        reply = _client(port).chat.completions.create(model="m", messages=messages,
                                                      max_tokens=2, temperature=0)
        return reply.usage.prompt_tokens_details.cached_tokens

    assert cached() == 0  # the chat's KV is not the server's to take
    window.controller.local_server.stop()
    window.settings.server_share_chats = True
    window.controller.local_server.apply()
    _wait_ready(qtbot, window)
    assert cached() > 0


def test_turning_the_server_off_stops_it(qtbot, served) -> None:
    window, port = served
    window.settings.server_enabled = False
    window.controller.local_server.apply()
    assert not window.controller.local_server.running
    assert not [t for t in threading.enumerate() if t.name.startswith("longleaf-server")]
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/health", timeout=5)
    qtbot.waitUntil(lambda: not window.statusBar().isVisible(), timeout=5_000)
    window.settings.server_enabled = True  # and on again, on the same port
    window.controller.local_server.apply()
    _wait_ready(qtbot, window)
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200


def test_a_port_in_use_is_a_message_and_the_app_stays_up(qtbot, tiny_llama: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        _enable(port)
        window = open_window(qtbot, tiny_llama)
        try:
            assert f"Port {port} is already in use" in window.banner.label.text()
            assert window.controller.local_server.status.state == "failed"
            assert f"Port {port}" in window.server_status.text()
            assert not window.controller.local_server.running
            assert window.controller.model_ready  # the app goes on
        finally:
            close_window(window)


def test_network_access_listens_everywhere_and_asks_for_the_key(qtbot, tiny_llama: Path) -> None:
    port = _free_port()
    _enable(port)
    settings = Settings()
    settings.server_allow_network = True
    settings.server_api_key = "ll-secret"
    settings.sync()
    window = open_window(qtbot, tiny_llama)
    try:
        _wait_ready(qtbot, window)
        assert window.controller.local_server.server.host == "0.0.0.0"
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(url + "/v1/models", timeout=10).status_code == 401
        good = httpx.get(url + "/v1/models", headers={"Authorization": "Bearer ll-secret"},
                         timeout=10)
        assert good.status_code == 200 and good.json()["data"][0]["id"] == tiny_llama.name
    finally:
        close_window(window)


def test_quitting_while_an_api_answer_streams_ends_every_thread(qtbot, tiny_llama: Path) -> None:
    port = _free_port()
    _enable(port)
    window = open_window(qtbot, tiny_llama)
    host = window.controller.local_server
    errors: list[BaseException] = []

    def stream() -> None:
        try:
            for _chunk in _client(port).chat.completions.create(
                    model="m", messages=[{"role": "user", "content": DOC}], max_tokens=4000,
                    temperature=0, stream=True):
                pass
        except (openai.APIError, httpx.HTTPError) as error:  # cut off by the quit
            errors.append(error)

    client = threading.Thread(target=stream, name="test-client")
    try:
        _wait_ready(qtbot, window)
        client.start()
        qtbot.waitUntil(lambda: host.status.state == "answering", timeout=30_000)
    finally:
        close_window(window)
    client.join(60)
    assert not client.is_alive()
    assert not [t for t in threading.enumerate() if t.name.startswith("longleaf")]


def test_a_new_default_mode_reaches_the_running_server_without_a_restart(qtbot, served) -> None:
    # It restarted the server: answers in flight ended with 503, its sessions closed,
    # and the window waited for the old server's thread.
    window, port = served
    host = window.controller.local_server
    running = host.server
    other = next(m for m in ("q4", "q6") if m != window.settings.default_mode)
    window.settings.default_mode = other
    host.apply()
    assert host.server is running and running.running
    (served_model,) = _client(port).models.list().data
    assert served_model.model_extra["kv_mode"] == other
