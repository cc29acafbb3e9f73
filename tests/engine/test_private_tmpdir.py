"""MLX compiles kernels under TMPDIR and loads what it finds there: every Longleaf
process points TMPDIR at a user-only folder of its own before MLX is imported."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from engine import paths
from tests.engine.tinymodels import make_tiny_model_dir

REPO = Path(__file__).resolve().parents[2]


def _child_env(shared_tmp: Path, home: Path) -> dict[str, str]:
    env = {**os.environ, "TMPDIR": str(shared_tmp), "LONGLEAF_HOME": str(home),
           "PYTHONPATH": str(REPO)}
    env.pop("XDG_CACHE_HOME", None)
    return env


def test_cli_generate_leaves_nothing_in_the_shared_tmp(tmp_path: Path) -> None:
    shared_tmp = tmp_path / "shared-tmp"  # stands for /tmp
    shared_tmp.mkdir(mode=0o1777)
    # What an attacker plants where MLX looked before: never loaded, never touched.
    planted = shared_tmp / "mlx"
    planted.mkdir()
    (planted / "planted.so").write_bytes(b"not a library")
    home = tmp_path / "home"
    folder = make_tiny_model_dir(tmp_path / "models", "llama")
    code = (
        "import sys, os, tempfile, json\n"
        "from engine.cli import main\n"
        "status = main(sys.argv[1:])\n"
        "print(json.dumps({'TMPDIR': os.environ['TMPDIR'], 'py': tempfile.gettempdir()}),"
        " file=sys.stderr)\n"
        "raise SystemExit(status)\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, "generate", "--model", str(folder), "--kv", "q8",
         "--temp", "0", "--max-tokens", "4", "--prompt", "Hello there"],
        env=_child_env(shared_tmp, home), capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stderr.strip().splitlines()[-1])
    private = home / "cache" / "tmp"
    assert seen == {"TMPDIR": str(private), "py": str(private)}
    assert sorted(p.name for p in shared_tmp.rglob("*")) == ["mlx", "planted.so"]
    assert stat.S_IMODE(private.stat().st_mode) == 0o700
    # MLX's compiled CPU kernels went to the private folder (mlx-lm compiles its
    # activations), so the check above is not empty by accident.
    assert (private / "mlx").is_dir()


def test_python_m_engine_points_tmpdir_at_the_private_folder(tmp_path: Path) -> None:
    shared_tmp = tmp_path / "shared-tmp"
    shared_tmp.mkdir()
    home = tmp_path / "home"
    result = subprocess.run(
        [sys.executable, "-c",
         "import engine, os, subprocess, sys; print(os.environ['TMPDIR']);"
         "print(subprocess.run([sys.executable, '-c', 'import os; print(os.environ[\"TMPDIR\"])'],"
         " capture_output=True, text=True).stdout.strip())"],
        env=_child_env(shared_tmp, home), capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    private = str(home / "cache" / "tmp")
    assert result.stdout.split() == [private, private]  # a child Longleaf starts inherits it


@pytest.mark.skipif(sys.platform != "linux", reason="XDG locations are Linux's")
def test_the_temp_dir_follows_xdg_cache_home_without_longleaf_home(
    tmp_path: Path, monkeypatch, loose_umask: None
) -> None:
    monkeypatch.delenv("LONGLEAF_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    folder = paths.temp_dir()
    assert folder == tmp_path / "xdg" / paths.APP_NAME / "tmp"
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    assert stat.S_IMODE(folder.parent.stat().st_mode) == 0o700


def test_the_test_suite_itself_runs_with_a_private_tmpdir() -> None:
    tmpdir = Path(os.environ["TMPDIR"])
    assert stat.S_IMODE(tmpdir.stat().st_mode) == 0o700
    assert tmpdir.stat().st_uid == os.getuid()
    assert tmpdir.name == "tmp" and tmpdir.parent.name == "cache"


def test_an_unusable_cache_folder_falls_back_to_a_fresh_private_folder(tmp_path: Path) -> None:
    shared_tmp = tmp_path / "shared-tmp"
    shared_tmp.mkdir()
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")  # LONGLEAF_HOME below a file: nothing can be made
    result = subprocess.run(
        [sys.executable, "-c",
         "import os, stat, engine; t = os.environ['TMPDIR']; s = os.stat(t);"
         "print(t, oct(stat.S_IMODE(s.st_mode)), s.st_uid == os.getuid())"],
        env=_child_env(shared_tmp, blocker / "home"), capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    folder, mode, mine = result.stdout.split()
    assert Path(folder).parent == shared_tmp and Path(folder).name.startswith("longleaf-")
    assert (mode, mine) == ("0o700", "True")
    assert list(shared_tmp.iterdir()) == []  # removed at exit
