"""Every ``python -m engine …`` command the README and docs show names options its
subcommand has: a flag that was renamed or never existed fails here, not for a user."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from engine.cli import build_parser

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# A command from its subcommand on, to the end of its code span or line (a comment cut).
COMMAND = re.compile(r"python -m engine (generate|serve|models|info)\b([^`#\n|]*)")
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z-]*)")


def _options(subcommand: str) -> set[str]:
    parser = build_parser()
    (commands,) = (a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {flag for action in commands.choices[subcommand]._actions
            for flag in action.option_strings}


def _documented() -> list[tuple[str, str, str]]:
    """(file:line, subcommand, option) for every option a documented command names."""
    found = []
    for doc in DOCS:
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for command in COMMAND.finditer(line):
                found.extend((f"{doc.name}:{number}", command[1], option)
                             for option in OPTION.findall(command[2]))
    return found


def test_the_docs_show_commands_with_options() -> None:
    assert len(_documented()) >= 10  # the pattern still finds them


@pytest.mark.parametrize(("where", "subcommand", "option"), _documented())
def test_every_documented_option_exists(where: str, subcommand: str, option: str) -> None:
    assert option in _options(subcommand), f"{where}: {subcommand} has no {option}"
