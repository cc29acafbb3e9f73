"""A keyless server answers this computer, not any web page: requests addressed to
another name (DNS rebinding) get 403 and bodies a page could send without asking
(a form, text/plain) get 415, each in the shape of the API asked; with a key, or
a name allowed, they are answered."""

from __future__ import annotations

import json
from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from engine.errors import EngineError
from engine.server.app import host_names
from tests.engine.server.conftest import Served, start_server
from tests.engine.tinymodels import make_tiny_model_dir

CHAT = {"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}


@pytest.fixture(scope="module")
def keyless(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("keyless")
    running, stop = start_server(make_tiny_model_dir(root, "llama"), root / "kv",
                                 api_key=None, allowed_hosts=("my-mac.local",))
    yield running
    stop()


def _port(served: Served) -> str:
    return served.url.rsplit(":", 1)[1]


@pytest.mark.parametrize("host", ["evil.example", "attacker.test:1234", "192.168.1.9",
                                  "localhost.evil.example", "[::2]"])
def test_another_host_name_is_refused_in_each_apis_shape(keyless, host):
    headers = {"Host": host}
    health = httpx.get(keyless.url + "/health", headers=headers)
    assert health.status_code == 403
    error = health.json()["error"]
    assert error["code"] == "host_not_allowed" and "API key" in error["message"]
    posted = httpx.post(keyless.url + "/v1/messages", headers=headers, json=CHAT)
    assert posted.status_code == 403
    body = posted.json()
    assert body["type"] == "error" and body["error"]["type"] == "permission_error"


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]", "LOCALHOST.",
                                  "my-mac.local"])
def test_this_computers_names_and_allowed_ones_are_answered(keyless, host):
    reply = httpx.get(keyless.url + "/health", headers={"Host": f"{host}:{_port(keyless)}"})
    assert reply.status_code == 200


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_a_body_a_web_page_could_send_unasked_is_refused(keyless, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    raw = json.dumps(CHAT).encode()
    openai_reply = httpx.post(keyless.url + "/v1/chat/completions", content=raw,
                              headers=headers)
    assert openai_reply.status_code == 415
    assert openai_reply.json()["error"]["code"] == "unsupported_media_type"
    claude_reply = httpx.post(keyless.url + "/v1/messages", content=raw, headers=headers)
    assert claude_reply.status_code == 415
    assert claude_reply.json()["error"]["type"] == "invalid_request_error"


def test_the_official_sdks_are_answered_without_a_key(keyless):
    chat = openai.OpenAI(base_url=keyless.url + "/v1", api_key="unused", max_retries=0)
    answer = chat.chat.completions.create(**CHAT)
    assert answer.choices[0].finish_reason in ("stop", "length")
    claude = anthropic.Anthropic(base_url=keyless.url, api_key="unused", max_retries=0)
    assert claude.messages.create(**CHAT).stop_reason in ("end_turn", "max_tokens")


def test_with_a_key_other_names_and_bodies_are_the_keys_to_judge(served: Served):
    headers = {"Host": "evil.example", "Authorization": f"Bearer {served.key}",
               "Content-Type": "text/plain"}
    reply = httpx.post(served.url + "/v1/chat/completions", content=json.dumps(CHAT),
                       headers=headers, timeout=60)
    assert reply.status_code == 200


def test_allowed_host_names_are_checked():
    assert host_names(["My-Mac.local.", "[fe80::1]", "10.0.0.2"]) == (
        "my-mac.local", "fe80::1", "10.0.0.2")
    for bad in ("*.local", "http://x", "x:1234", ""):
        with pytest.raises(EngineError, match="not a host name"):
            host_names([bad])
