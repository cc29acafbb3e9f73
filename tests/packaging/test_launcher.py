"""The bundled app's entry point runs modules as ``python -m`` does: a pipeline's
launcher, ranks and host check start ``sys.executable -m …``, the app in a bundle."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.packaging.conftest import PACKAGING


def test_a_module_is_run_not_taken_for_a_file_to_open() -> None:
    environment = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
    ran = subprocess.run([sys.executable, str(PACKAGING / "launcher.py"), "-m",
                          "engine.distributed.hosts"], env=environment, capture_output=True,
                         text=True, timeout=120)
    # Before, "-m is not an option and was ignored" and the window opened.
    assert ran.returncode == 0, ran.stderr
    facts = json.loads(ran.stdout)
    assert {"version", "host", "addresses"} <= set(facts)


def test_mlx_launch_runs_as_a_module() -> None:
    ran = subprocess.run([sys.executable, "-m", "engine.distributed.mlx_launch",
                          "--print-python"], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.strip() == sys.executable
