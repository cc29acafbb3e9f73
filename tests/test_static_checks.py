"""The linter and the type checker are part of the test command: a finding fails it.

Both run as the README's test command installs them (the test extra pins mypy),
with their settings in pyproject.toml: ruff over app, engine, benchmarks and tests, mypy
over the files ``[tool.mypy]`` names at the strictness stated there.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=600)


def test_ruff_finds_nothing() -> None:
    result = _run("ruff", "check", "app", "engine", "benchmarks", "tests")
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.slow
def test_mypy_finds_nothing(tmp_path: Path) -> None:
    # A cache of this run's own: nothing is written into the checkout.
    result = _run("mypy", "--cache-dir", str(tmp_path / "mypy"))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Success: no issues found" in result.stdout
