"""CORS: web pages of the named origins only; none by default, never a wildcard."""

from __future__ import annotations

import io

import pytest
from starlette.testclient import TestClient

from engine import cli
from engine.errors import EngineError
from engine.server.app import Server, cors_origins
from engine.server.bridge import ServerBridge

ALLOWED = "http://localhost:3000"
PREFLIGHT = {"Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def client(*origins: str) -> TestClient:
    # The model is never loaded: preflights and /health need no engine.
    bridge = ServerBridge("demo", "q8", None)
    return TestClient(Server(bridge, "key", cors_origins=cors_origins(list(origins))).app())


def test_preflight_of_an_allowed_origin_is_answered() -> None:
    reply = client(ALLOWED, "https://app.example").options(
        "/v1/chat/completions", headers={"Origin": ALLOWED, **PREFLIGHT})
    assert reply.status_code == 200
    assert reply.headers["access-control-allow-origin"] == ALLOWED
    assert "POST" in reply.headers["access-control-allow-methods"]
    assert "authorization" in reply.headers["access-control-allow-headers"].lower()
    simple = client(ALLOWED).get("/health", headers={"Origin": ALLOWED})
    assert simple.headers["access-control-allow-origin"] == ALLOWED


@pytest.mark.parametrize("origins", [(), (ALLOWED,)])
def test_other_origins_get_no_cors_headers(origins: tuple[str, ...]) -> None:
    api = client(*origins)
    evil = "http://evil.example"
    reply = api.options("/v1/messages", headers={"Origin": evil, **PREFLIGHT})
    assert reply.status_code in (400, 405)
    assert "access-control-allow-origin" not in reply.headers
    assert "access-control-allow-origin" not in api.get(
        "/health", headers={"Origin": evil}).headers


@pytest.mark.parametrize("bad", ["*", "http://*.example", "localhost:3000", "http://a/b"])
def test_wildcards_and_non_origins_are_refused(bad: str) -> None:
    with pytest.raises(EngineError):
        cors_origins([bad])


def test_cli_takes_repeated_origins_and_refuses_a_wildcard(capsys) -> None:
    args = cli.build_parser().parse_args(["serve", "--model", "demo", "--cors-origin", ALLOWED,
                                          "--cors-origin", "https://b.example"])
    assert args.cors_origin == [ALLOWED, "https://b.example"]
    assert cli.build_parser().parse_args(["serve", "--model", "demo"]).cors_origin == []
    assert cli.main(["serve", "--model", "demo", "--cors-origin", "*"], io.StringIO()) == 1
    assert "wildcard" in capsys.readouterr().err
