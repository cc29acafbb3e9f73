"""pyproject.toml builds without setuptools' deprecation warnings."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def test_license_is_an_spdx_string_with_a_setuptools_that_reads_it() -> None:
    config = tomllib.loads(PYPROJECT.read_text())
    # A table (`{ text = ... }`) makes setuptools print ~25 deprecation lines per build.
    assert config["project"]["license"] == "Apache-2.0"
    setuptools = next(r for r in config["build-system"]["requires"] if r.startswith("setuptools"))
    assert int(re.search(r">=(\d+)", setuptools).group(1)) >= 77
