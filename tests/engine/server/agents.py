"""The agent CLIs the suite drives: where tests/clients installed them, and their
environment (a home of their own, nothing sent anywhere but the test's server)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

CLIENTS = Path(__file__).resolve().parents[2] / "clients"
INSTALL_HINT = ("install the pinned agent CLIs with `bash scripts/setup.sh --test` (needs "
                "node and npm; tests/clients/package.json)")


def agent_binary(name: str) -> Path:
    """The installed CLI ``name`` ("claude", "codex"); skips the test, saying why, when
    it is not installed or does not run here."""
    modules = CLIENTS / "node_modules"
    # npm's link, else the platform package's own binary (claude's link is a stub
    # until its install script copies the binary over it, which npm may not run).
    found = [modules / ".bin" / name, *sorted(modules.glob(f"@*/{name}-*/{name}"))]
    error: Exception | None = None
    for binary in (path for path in found if path.exists()):
        try:
            subprocess.run([str(binary), "--version"], capture_output=True, timeout=120,
                           check=True)
            return binary
        except (OSError, subprocess.SubprocessError) as failed:
            error = failed
    if error is not None:
        pytest.skip(f"the {name} CLI does not run on this machine: {error}")
    why = "node/npm are not on this machine" if shutil.which("npm") is None \
        else f"tests/clients has no {name}"
    pytest.skip(f"{name} CLI not installed ({why}): {INSTALL_HINT}")


def quiet_env(home: Path, **extra: str) -> dict[str, str]:
    """An environment for an agent CLI: its own home, no telemetry or updates."""
    env = {key: value for key, value in os.environ.items()
           if not key.startswith(("ANTHROPIC_", "OPENAI_", "CLAUDE_", "CODEX_"))}
    home.mkdir(parents=True, exist_ok=True)
    env.update({"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"),
                "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1",
                "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "NO_COLOR": "1"})
    env.update(extra)
    return env
