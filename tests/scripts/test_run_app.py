"""scripts/run-app.sh starts the app with the arguments as the user gave them."""

from __future__ import annotations

import shutil
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def _executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


def test_relative_paths_mean_the_folder_it_was_run_from(tmp_path: Path) -> None:
    checkout = tmp_path / "longleaf"
    (checkout / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "run-app.sh", checkout / "scripts" / "run-app.sh")
    (checkout / "scripts" / "env.sh").write_text("")
    _executable(checkout / "scripts" / "setup.sh", "#!/usr/bin/env bash\n")
    # The app as a stand-in: the folder it runs in (which relative paths are
    # read against), and the arguments it was given.
    _executable(checkout / ".venv" / "bin" / "longleaf",
                '#!/usr/bin/env bash\npwd\nprintf "%s\\n" "$@"\n')
    work = tmp_path / "work"
    work.mkdir()
    ran = subprocess.run(["bash", "../longleaf/scripts/run-app.sh", "--model", "my-model",
                          "notes.txt"], cwd=work, capture_output=True, text=True,
                         check=True, timeout=60)
    # Before, the script ran the app from the checkout: "my-model" was looked for there.
    assert ran.stdout.splitlines() == [str(work), "--model", "my-model", "notes.txt"]
