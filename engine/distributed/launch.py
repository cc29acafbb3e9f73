"""``python -m engine generate --pipeline N``: the same command on N local ranks.

The process the user started launches N copies of itself with ``mlx.launch``
(ring backend) and waits; each rank runs the ordinary CLI on a model split by
mlx-lm's ``pipeline`` (rank 0 holds the last layers), in lock-step because every
rank computes the same logits after mlx-lm's all_gather and samples them with the
same seed. Each rank writes a report into a folder the launcher names; the
launcher prints rank 0's output with every rank's share of the KV cache.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from engine.errors import EngineError

REPORT_DIR = "LONGLEAF_PIPELINE_DIR"  # set for the ranks by the launcher
RANK_TIMEOUT = 24 * 3600.0


def rank_report_dir() -> Path | None:
    """The folder a launched rank reports into; None outside a pipeline launch."""
    folder = os.environ.get(REPORT_DIR)
    return Path(folder) if folder else None


def launch(argv: Sequence[str], ranks: int, seed: int | None, out: TextIO) -> int:
    """Run ``python -m engine <argv>`` on ``ranks`` local ranks; print rank 0's output.

    Raises:
        EngineError: mlx.launch is missing, or a rank failed (named, with its error).
    """
    launcher = Path(sys.executable).with_name("mlx.launch")
    if not launcher.exists():
        raise EngineError("MLX's launcher (mlx.launch) is not installed beside this Python.")
    # Every rank samples the same token only if every rank draws the same numbers.
    seed = random.randrange(2**31) if seed is None else seed
    with tempfile.TemporaryDirectory(prefix="pipeline-") as folder:
        command = [str(launcher), "-n", str(ranks), "--backend", "ring",
                   sys.executable, "-m", "engine", *argv, "--seed", str(seed)]
        env = {**os.environ, REPORT_DIR: folder}
        done = subprocess.run(command, env=env, capture_output=True, text=True,
                              timeout=RANK_TIMEOUT, check=False)
        reports = _reports(Path(folder), ranks)
    missing = [rank for rank in range(ranks) if rank not in reports]
    if done.returncode != 0 or missing:
        raise EngineError(_failure(done, missing))
    first = reports[0]
    if first.get("result") is not None:
        result = dict(first["result"], ranks=[reports[r]["rank_stats"] for r in range(ranks)])
        out.write(json.dumps(result) + "\n")
    else:
        out.write(first["text"] + "\n")
    return int(first.get("status", 0))


def write_rank_report(folder: Path, rank: int, report: dict[str, Any]) -> None:
    """A rank's outcome, for the launcher (written whole, then renamed)."""
    path = folder / f"rank{rank}.json"
    partial = path.with_suffix(".part")
    partial.write_text(json.dumps(report), encoding="utf-8")
    partial.replace(path)


def _reports(folder: Path, ranks: int) -> dict[int, dict[str, Any]]:
    reports = {}
    for rank in range(ranks):
        path = folder / f"rank{rank}.json"
        if path.exists():
            reports[rank] = json.loads(path.read_text(encoding="utf-8"))
    return reports


def _failure(done: subprocess.CompletedProcess[str], missing: list[int]) -> str:
    lines = [line for line in (done.stderr or "").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")] or lines[-1:]
    which = ", ".join(f"rank {rank}" for rank in missing) or "a rank"
    detail = f": {errors[-1]}" if errors else ""
    return f"The pipeline run failed on {which} (this machine){detail}"
