"""Claude Code's own CLI (npm @anthropic-ai/claude-code, pinned in tests/clients),
unmodified, in ``-p`` mode with its default tools, against a live server on a tiny
model with a tool-calling template: one tool round trip, no protocol error, and
the second request reads the first from the cache."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from mlx_lm.utils import load_tokenizer

from engine.server import app as server_app
from engine.server.bridge import ServerBridge
from tests.engine.server.agents import agent_binary, quiet_env
from tests.engine.server.conftest import Served, start_server
from tests.engine.server.tool_models import AGENT_MODEL, Turns, make_tool_model_dir

# Claude Code's system prompt and tool list run to tens of thousands of tokens of
# the tiny tokenizer.
CONTEXT = 131072


@pytest.fixture(scope="module")
def agent_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("claude-code")
    folder = make_tool_model_dir(root, max_position_embeddings=CONTEXT, **AGENT_MODEL)
    running, stop = start_server(folder, root / "kv")
    yield running
    stop()


def recorded_outcomes(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every request's ``Outcome`` (its prompt and cached tokens), in order."""
    outcomes: list = []
    original = server_app.Run._outcome

    def outcome(run, *args, **kwargs):
        result = original(run, *args, **kwargs)
        outcomes.append(result)
        return result
    monkeypatch.setattr(server_app.Run, "_outcome", outcome)
    return outcomes


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first read is Claude Code's whole prompt, ~35k tokens
def test_claude_code_reads_a_file_with_its_tool_and_answers(
        agent_server: Served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    claude = agent_binary("claude")
    work = tmp_path / "work"
    work.mkdir()
    note = work / "note.txt"
    note.write_text("The longleaf pine needs fire.\n")
    call = ('<tool_call>\n{"name": "Read", "arguments": {"file_path": "'
            + str(note) + '"}}\n</tool_call>')
    turns = Turns(load_tokenizer(Path(agent_server.bridge.info.path)), call,
                  "The note says the longleaf pine needs fire.")
    turns.install(monkeypatch, ServerBridge)
    outcomes = recorded_outcomes(monkeypatch)
    env = quiet_env(tmp_path / "home", ANTHROPIC_BASE_URL=agent_server.url,
                    ANTHROPIC_API_KEY=agent_server.key,
                    CLAUDE_CODE_AUTO_COMPACT_WINDOW=str(CONTEXT))
    done = subprocess.run(
        [str(claude), "-p", "What does note.txt say?", "--output-format", "json"],
        cwd=work, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout)
    assert result["is_error"] is False, result
    assert result["result"] == "The note says the longleaf pine needs fire."
    # The tool ran: its result (the file's text) came back in the second request.
    tool_turns = [m for m in turns.requests[-1] if m["role"] == "tool"]
    assert tool_turns and "The longleaf pine needs fire." in tool_turns[-1]["content"]
    # Two requests, the call and the answer: nothing was refused, retried or resent
    # unstreamed, and the resent conversation came from the cache.
    first, second = outcomes
    assert second.cached_tokens >= 0.95 * first.prompt_tokens
    # The resent conversation came from the cache.
    assert second.cached_tokens >= 0.95 * first.prompt_tokens
