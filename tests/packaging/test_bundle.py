"""Build the Linux one-folder bundle and run ``Longleaf --self-test`` from it.

This proves the spec collects everything the app needs at run time: Qt and its
offscreen platform plugin, MLX's native library and its BLAS, every mlx-lm
model module, the tokenizer stack and the demo model's GGUF (converted on first
use into the test's LONGLEAF_HOME). The bundle runs without the virtualenv on
its path and without the LD_PRELOADed system OpenBLAS, so nothing leaks in.

It runs in the default suite on Linux (the test extra installs PyInstaller
there) because a bundle that misses a file only fails here. Measured on the
2-core development machine: 225 s for tests/packaging in a fresh clone, 412 s
to 667 s when other work loaded the machine. LONGLEAF_SKIP_BUNDLE_TEST=1 skips
it for a quick local run.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.memory.fit import MODES
from tests.packaging.conftest import PACKAGING, load_packaging_module

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(3600),
    pytest.mark.skipif(
        os.environ.get("LONGLEAF_SKIP_BUNDLE_TEST") == "1",
        reason="LONGLEAF_SKIP_BUNDLE_TEST=1 skips the bundle build",
    ),
    pytest.mark.skipif(sys.platform != "linux", reason="the Linux one-folder bundle"),
]


def test_linux_bundle_runs_the_self_test(tmp_path: Path) -> None:
    pytest.importorskip("PyInstaller", reason="pip install pyinstaller to build the bundle")
    build = load_packaging_module("build")
    dist, work = tmp_path / "dist", tmp_path / "work"
    subprocess.run(
        [sys.executable, str(PACKAGING / "build.py"), "--dist", str(dist), "--work", str(work)],
        check=True,
        timeout=3000,
    )
    program = build.executable(dist)
    assert build.missing_files(dist) == []
    modules = build.bundled_modules(dist)
    assert "engine.cache.paged_cache" in modules and "app.controller" in modules
    assert build.stray_modules(modules) == []

    environment = {
        key: value
        for key, value in os.environ.items()
        if key not in ("LD_PRELOAD", "PYTHONPATH", "VIRTUAL_ENV")
    }
    environment["QT_QPA_PLATFORM"] = "offscreen"
    result = subprocess.run(
        [str(program), "--self-test", "--max-tokens", "4"],
        cwd=tmp_path,
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )

    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "self-test: Qt platform offscreen" in output
    for mode in MODES:
        assert f"self-test: {mode}: " in output, output
    assert "self-test: OK" in output
    assert any(Path(os.environ["LONGLEAF_HOME"]).rglob("config.json")), "demo not converted"
    # The pipeline starts MLX's launcher and the host check through the bundle's
    # own executable ("-m"): there is no other Python in a bundle.
    for module, expected in (("engine.distributed.hosts", '"addresses"'),
                             ("engine.distributed.mlx_launch", "--hostfile")):
        argv = [str(program), "-m", module] + (["--help"] if "launch" in module else [])
        ran = subprocess.run(argv, cwd=tmp_path, env=environment, capture_output=True,
                             text=True, timeout=300)
        assert ran.returncode == 0 and expected in ran.stdout, ran.stdout + ran.stderr
