"""OpenAI's Codex CLI (npm @openai/codex, pinned in tests/clients), unmodified,
``codex exec`` with a custom provider on the Responses API, against a live server
on a tiny model with a tool-calling template: one tool round trip (its shell
tool), no protocol error, and the second request reads the first from the cache."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

from engine.server.bridge import ServerBridge
from tests.engine.server.agents import agent_binary, quiet_env
from tests.engine.server.conftest import Served, start_server
from tests.engine.server.test_claude_code import recorded_outcomes
from tests.engine.server.tool_models import AGENT_MODEL, Turns, make_tool_model_dir

CONTEXT = 65536
CONFIG = """\
model = "tiny"
model_provider = "longleaf"
model_context_window = {context}

[model_providers.longleaf]
name = "Longleaf"
base_url = "{url}/v1"
wire_api = "responses"
env_key = "LONGLEAF_API_KEY"
"""


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("codex")
    folder = make_tool_model_dir(root, max_position_embeddings=CONTEXT, **AGENT_MODEL)
    running, stop = start_server(folder, root / "kv")
    yield running
    stop()


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first read is Codex's whole prompt
def test_codex_exec_runs_a_command_with_its_tool_and_answers(
        agent_server: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    codex = agent_binary("codex")
    work = tmp_path / "work"
    work.mkdir()
    (work / "note.txt").write_text("The longleaf pine needs fire.\n")
    call = ('<tool_call>\n{"name": "exec_command", "arguments": {"cmd": "cat note.txt"}}'
            '\n</tool_call>')
    turns = Turns(load_tokenizer(Path(agent_server.bridge.info.path)), call,
                  "The note says the longleaf pine needs fire.")
    turns.install(monkeypatch, ServerBridge)
    outcomes = recorded_outcomes(monkeypatch)
    home = tmp_path / "codex-home"
    home.mkdir()
    (home / "config.toml").write_text(CONFIG.format(url=agent_server.url, context=CONTEXT))
    last = tmp_path / "last.txt"
    env = quiet_env(tmp_path / "home", CODEX_HOME=str(home),
                    LONGLEAF_API_KEY=agent_server.key)
    done = subprocess.run(
        [str(codex), "exec", "--skip-git-repo-check", "--sandbox", "danger-full-access",
         "--output-last-message", str(last), "What does note.txt say?"],
        cwd=work, env=env, capture_output=True, text=True, timeout=600,
        stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert last.read_text().strip() == "The note says the longleaf pine needs fire."
    assert "ERROR" not in done.stderr, done.stderr[-3000:]
    tool_turns = [m for m in turns.requests[-1] if m["role"] == "tool"]
    assert tool_turns and "The longleaf pine needs fire." in tool_turns[-1]["content"]
    first, second = outcomes
    assert second.cached_tokens >= 0.95 * first.prompt_tokens
