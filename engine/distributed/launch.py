"""``python -m engine generate --pipeline N``: the same command on N ranks.

The process the user started launches N copies of itself with ``mlx.launch``
(ring backend, or the hosts and backend of an MLX hostfile) and waits; each rank
loads its stage of a model split by mlx-lm's ``pipeline`` (rank 0 holds the last
layers). Rank 0 runs the request and commands the others
(``engine.distributed.commands``); they follow (``engine.distributed.follower``).
Each rank writes a report into a folder the launcher names; the launcher prints
rank 0's output with every rank's share of the KV cache and the pool's fit.

MLX collectives have no timeout, so the launcher watches its ranks: each writes
its pid into the folder once its group is up, and a rank whose process is gone
without a report ends the whole group after a short grace, with an error naming
that rank, instead of leaving its peers blocked in a send or receive.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from engine.errors import EngineError

REPORT_DIR = "LONGLEAF_PIPELINE_DIR"  # set for the ranks by the launcher
LOCAL_HOSTS = frozenset({"127.0.0.1"})  # mlx.launch starts these without ssh
RANK_TIMEOUT = 24 * 3600.0
POLL_SECONDS = 0.25
# A lost rank's peers get this long to stop on their own (mlx.launch terminates
# them when it notices) before the launcher kills the whole group.
LOST_RANK_GRACE = 3.0
# mlx.launch's own warning when a rank ends with an error (not when it stops it).
_EXITED = re.compile(r"Node with rank (\d+) exited with code (-?\d+)")


def rank_report_dir() -> Path | None:
    """The folder a launched rank reports into; None outside a pipeline launch."""
    folder = os.environ.get(REPORT_DIR)
    return Path(folder) if folder else None


LOCAL_RANKS = "LONGLEAF_LOCAL_RANKS"  # set when every rank runs on this machine


def local_rank_env(local_ranks: int, ranks: int) -> dict[str, str]:
    """What the launcher adds to the environment of the ranks it starts on this machine.

    BLAS threads: each rank its share of the cores (a count the user set is kept),
    since the stages run one after the other and a pool sized for the whole machine
    spins against the other stage. When every rank is local, ``LOCAL_RANKS`` tells
    them to pin themselves to their share (``commands.share_cores``). The
    launcher's environment reaches only the ranks it starts here (ssh does not
    pass it on).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = str(max(1, (cores or 1) // max(1, local_ranks)))
    env = {name: os.environ.get(name, share) for name in ("OPENBLAS_NUM_THREADS",
                                                          "OMP_NUM_THREADS")}
    if local_ranks == ranks:
        env[LOCAL_RANKS] = str(ranks)
    return env


def launch(argv: Sequence[str], ranks: int, seed: int | None, out: TextIO,
           hostfile: Path | None = None) -> int:
    """Run ``python -m engine <argv>`` on ``ranks`` local ranks; print rank 0's output.

    With ``hostfile`` (MLX's own JSON hostfile, as ``mlx.launch --hostfile`` reads
    it) the ranks are its hosts, started by mlx.launch (ssh, except for 127.0.0.1)
    with the backend the file names (ring by default). Ranks on other machines
    report on their own disk; their share is not collected here.

    Raises:
        EngineError: mlx.launch is missing, the hostfile is unusable, or a rank
            failed (named, with its error).
    """
    launcher = Path(sys.executable).with_name("mlx.launch")
    if not launcher.exists():
        raise EngineError("MLX's launcher (mlx.launch) is not installed beside this Python.")
    hosts = None if hostfile is None else read_hostfile(hostfile)
    if hosts is not None:
        ranks = len(hosts)
    local = [r for r in range(ranks) if hosts is None or hosts[r] in LOCAL_HOSTS]
    # Every rank samples the same token only if every rank draws the same numbers.
    seed = random.randrange(2**31) if seed is None else seed
    with tempfile.TemporaryDirectory(prefix="pipeline-") as folder:
        command = launch_command(launcher, argv, ranks, seed, folder, hostfile)
        env = {**os.environ, REPORT_DIR: folder, **local_rank_env(len(local), ranks)}
        done, lost = _supervise(command, env, Path(folder), ranks)
        reports = _reports(Path(folder), ranks)
    for rank in range(ranks):
        if rank not in local and rank not in reports:
            reports[rank] = {"rank_stats": {"rank": rank, "host": hosts[rank],
                                            "collected": False}}
    missing = [rank for rank in range(ranks) if rank not in reports]
    if done.returncode != 0 or missing:
        raise EngineError(_failure(done, lost or missing))
    first = reports[0]
    if first.get("result") is not None:
        shares = [reports[r]["rank_stats"] for r in range(ranks)]
        result = dict(first["result"], ranks=shares, pool=pool_fit(shares))
        out.write(json.dumps(result) + "\n")
    else:
        out.write(first["text"] + "\n")
    return int(first.get("status", 0))


def read_hostfile(path: Path) -> list[str]:
    """The ssh host of each rank in an MLX hostfile, rank 0 first.

    Raises:
        EngineError: the file is missing or not an MLX hostfile, or names under 2 hosts.
    """
    from mlx._distributed_utils.common import Hostfile

    try:
        hosts = [host.ssh_hostname for host in Hostfile.from_file(str(path)).hosts]
    except ValueError as error:
        raise EngineError(f"{error}. An MLX hostfile is JSON: "
                          '{"hosts": [{"ssh": "mac1.local", "ips": ["10.0.0.1"]}, ...]}.'
                          ) from None
    if len(hosts) < 2:
        raise EngineError(f"The hostfile {path} names {len(hosts)} host; a pipeline needs "
                          "at least 2.")
    return hosts


def launch_command(launcher: Path, argv: Sequence[str], ranks: int, seed: int,
                   folder: str, hostfile: Path | None = None) -> list[str]:
    """The mlx.launch command line of a pipeline run (local ranks, or a hostfile's)."""
    where = (["-n", str(ranks), "--backend", "ring"] if hostfile is None else
             ["--hostfile", str(hostfile), "--env", f"{REPORT_DIR}={folder}"])
    return [str(launcher), *where, sys.executable, "-m", "engine", *_without_hostfile(argv),
            "--seed", str(seed)]


def _without_hostfile(argv: Sequence[str]) -> list[str]:
    # The ranks run the command without it: they are the hosts it names.
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--hostfile":
            skip = True
        elif not arg.startswith("--hostfile="):
            kept.append(arg)
    return kept


def pool_fit(shares: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Tokens that fit on the pool per KV mode, and the rank that limits each.

    Every rank holds every token for its own layers, so the pool holds what its
    tightest rank holds.
    """
    tokens: dict[str, int | None] = {}
    tight: dict[str, int | None] = {}
    modes = dict.fromkeys(mode for share in shares for mode in share.get("tokens_fit", {}))
    for mode in modes:
        fits = [(share["tokens_fit"][mode], share["rank"]) for share in shares
                if share.get("tokens_fit", {}).get(mode) is not None]
        least = min(fits) if len(fits) == len(shares) else None
        tokens[mode], tight[mode] = (least[0], least[1]) if least else (None, None)
    return {"tokens_fit": tokens, "tight_rank": tight}


def write_rank_report(folder: Path, rank: int, report: dict[str, Any]) -> None:
    """A rank's outcome, for the launcher (written whole, then renamed)."""
    path = folder / f"rank{rank}.json"
    partial = path.with_suffix(".part")
    partial.write_text(json.dumps(report), encoding="utf-8")
    partial.replace(path)


def write_rank_pid(folder: Path, rank: int) -> None:
    """Tell the launcher which process is this rank, so it can notice it dying."""
    (folder / f"rank{rank}.pid").write_text(str(os.getpid()), encoding="utf-8")


def _supervise(command: list[str], env: dict[str, str], folder: Path,
               ranks: int) -> tuple[subprocess.CompletedProcess[str], list[int]]:
    """Run mlx.launch to its end; stop its group once a rank is lost. Returns the ranks lost."""
    # A session of its own: the launcher, its shells and every rank share one
    # process group that can be ended at once.
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + RANK_TIMEOUT
    lost: list[int] = []
    lost_at = 0.0
    try:
        while True:
            try:
                stdout, stderr = process.communicate(timeout=POLL_SECONDS)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if not lost:
                lost, lost_at = _lost_ranks(folder, ranks), now
            if (lost and now - lost_at > LOST_RANK_GRACE) or now > deadline:
                _end_group(process)
    finally:
        if process.poll() is None:  # interrupted: leave no rank behind
            _end_group(process)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr), lost


def _lost_ranks(folder: Path, ranks: int) -> list[int]:
    """Ranks whose process has gone without writing a report."""
    lost = []
    for rank in range(ranks):
        pid_file, report = folder / f"rank{rank}.pid", folder / f"rank{rank}.json"
        if pid_file.exists() and not report.exists() and not _alive(pid_file):
            lost.append(rank)
    return lost


def _alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text(encoding="utf-8")), 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError):  # not ours to signal, or a pid still being written
        return True
    return True


def _end_group(process: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):  # the group has ended already
        os.killpg(process.pid, signal.SIGKILL)


def _reports(folder: Path, ranks: int) -> dict[int, dict[str, Any]]:
    reports = {}
    for rank in range(ranks):
        path = folder / f"rank{rank}.json"
        if path.exists():
            reports[rank] = json.loads(path.read_text(encoding="utf-8"))
    return reports


def _failure(done: subprocess.CompletedProcess[str], suspects: list[int]) -> str:
    stderr = done.stderr or ""
    exited = {int(rank): int(code) for rank, code in _EXITED.findall(stderr)}
    # mlx.launch warns in the order the ranks end, and stops the others only
    # after the first: that one is the cause, the rest (SIGTERM) followed it.
    first = [next(iter(exited))] if exited else []
    failed = suspects if len(suspects) == 1 else first or suspects
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    if errors:
        detail = f": {errors[-1]}"
    elif failed and exited.get(failed[0], 0) < 0:
        detail = f": its process was killed (signal {-exited[failed[0]]})"
    elif failed and failed[0] in exited:
        detail = f": its process exited with code {exited[failed[0]]}"
    else:
        detail = f": {lines[-1]}" if lines else ": its process ended without a report"
    which = ", ".join(f"rank {rank}" for rank in failed) or "a rank"
    return f"The pipeline run failed on {which} (this machine){detail}"
