"""scripts/run-app.sh starts the app with the arguments as the user gave them."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.scripts.test_setup import bash_script

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


@pytest.mark.parametrize("cdpath", [None, ".:/tmp"])
def test_relative_paths_mean_the_folder_it_was_run_from(tmp_path: Path,
                                                        cdpath: str | None) -> None:
    checkout = tmp_path / "longleaf"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "run-app.sh", checkout / "scripts" / "run-app.sh")
    (checkout / "scripts" / "env.sh").write_text("")
    bash_script(checkout / "scripts" / "setup.sh", "")
    # The app as a stand-in: the folder it runs in (which relative paths are
    # read against), and the arguments it was given.
    bash_script(checkout / ".venv" / "bin" / "longleaf", 'pwd\nprintf "%s\\n" "$@"\n')
    # A CDPATH makes cd print the folder it found (into a name taken from its output).
    env = {key: value for key, value in os.environ.items() if key != "CDPATH"}
    if cdpath is not None:
        env["CDPATH"] = cdpath
    ran = subprocess.run(["bash", "longleaf/scripts/run-app.sh", "--model", "my-model",
                          "notes.txt"], cwd=tmp_path, capture_output=True, text=True,
                         check=True, timeout=60, env=env)
    # Before, the script ran the app from the checkout: "my-model" was looked for there.
    assert ran.stdout.splitlines() == [str(tmp_path), "--model", "my-model", "notes.txt"]
