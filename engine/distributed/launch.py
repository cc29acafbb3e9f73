"""``python -m engine generate --pipeline N``: the same command on N ranks.

The process the user started launches N copies of itself with ``mlx.launch``
(ring backend, or the hosts and backend of an MLX hostfile) and waits; each rank
loads its stage of a model split by mlx-lm's ``pipeline`` (rank 0 holds the last
layers). Rank 0 runs the request and commands the others
(``engine.distributed.rank_commands``); they follow (``engine.distributed.follower``).
Each rank writes a report into a folder the launcher names; the launcher prints
rank 0's output with every rank's share of the KV cache and the pool's fit.

MLX collectives have no timeout, so the launcher watches its ranks
(``engine.distributed.group``): a rank whose process is gone without a report
ends the whole group after a short grace, with an error naming that rank.

MLX's ring links are plain TCP on 127.0.0.1 for local ranks: any program of the
machine may connect to a rank's port before its peer does, and the ring then
never forms. A rank whose group cannot form exits with ``RING_FAILED``; local
ranks are then started again on other ports, at most ``RING_ATTEMPTS`` times,
and each time it is said.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from engine.distributed.alive import guard_links, start_beating
from engine.distributed.group import LOCAL_HOSTS, RING_FAILED, Group, said_errors
from engine.errors import EngineError

if TYPE_CHECKING:  # MLX is imported where a rank joins: the launcher runs without it
    import mlx.core as mx

REPORT_DIR = "LONGLEAF_PIPELINE_DIR"  # set for the ranks by the launcher
DEFAULT_RING_PORT = 32323  # mlx.launch's own --starting-port
RING_ATTEMPTS = 3  # starts of local ranks, each on other ports


def rank_report_dir() -> Path | None:
    """The folder a launched rank reports into; None outside a pipeline launch.

    The launcher's folder is on the launcher's disk: a rank on another machine
    (a hostfile's host) gets a folder of its own there, as ``launch`` says its
    share stays on its own disk.

    Raises:
        EngineError: this machine has no room for the rank's folder.
    """
    folder = os.environ.get(REPORT_DIR)
    if not folder:
        return None
    if Path(folder).is_dir():
        return Path(folder)
    try:
        return Path(tempfile.mkdtemp(prefix="pipeline-"))
    except OSError as error:
        raise EngineError(f"This machine cannot make the pipeline rank's folder for its "
                          f"reports ({error.strerror or error}). Free some disk space, "
                          "then load the model again.") from error


def launch(argv: Sequence[str], ranks: int, seed: int | None, out: TextIO,
           hostfile: Path | None = None) -> int:
    """Run ``python -m engine <argv>`` on ``ranks`` local ranks; print rank 0's output.

    With ``hostfile`` (MLX's own JSON hostfile, as ``mlx.launch --hostfile`` reads
    it) the ranks are its hosts, started by mlx.launch (ssh, except for 127.0.0.1)
    with the backend the file names (ring by default). Ranks on other machines
    report on their own disk; their share is not collected here.

    Raises:
        EngineError: the hostfile is unusable, or a rank failed (named, with its
            error).
    """
    launcher = launcher_command()
    hosts = None if hostfile is None else read_hostfile(hostfile)
    if hosts is not None:
        ranks = len(hosts)
    local = [r for r in range(ranks) if hosts is None or hosts[r] in LOCAL_HOSTS]
    names = hosts or []
    # Every rank samples the same token only if every rank draws the same numbers.
    seed = random.randrange(2**31) if seed is None else seed
    with tempfile.TemporaryDirectory(prefix="pipeline-") as folder:
        env = rank_environment(folder, ranks, hosts)
        for attempt in range(1, RING_ATTEMPTS + 1):
            command = launch_command(launcher, argv, ranks, seed, folder, hostfile)
            group = Group(command, env, Path(folder), ranks, hosts)
            done, lost = group.watch()
            if hosts is not None or not group.ring_failed(done):
                break
            if attempt == RING_ATTEMPTS:
                raise EngineError(ring_gave_up(done))
            print(ring_retry(command, ranks, done), file=sys.stderr, flush=True)
            clear_rank_files(Path(folder))
        reports = _reports(Path(folder), ranks)
    for rank in range(ranks):
        if rank not in local and rank not in reports:
            reports[rank] = {"rank_stats": {"rank": rank, "host": names[rank],
                                            "collected": False}}
    missing = [rank for rank in range(ranks) if rank not in reports]
    if done.returncode != 0 or missing:
        raise EngineError(group.failure(done, lost or missing))
    first = reports[0]
    if first.get("result") is not None:
        shares = [reports[r]["rank_stats"] for r in range(ranks)]
        result = dict(first["result"], ranks=shares, pool=pool_fit(shares))
        out.write(json.dumps(result) + "\n")
    else:
        out.write(first["text"] + "\n")
    return int(first.get("status", 0))


def ring_error(done: subprocess.CompletedProcess[str]) -> str:
    """What MLX said when the ring did not form (the ranks' last ``error:`` line)."""
    errors = said_errors(done)
    return errors[-1].removeprefix("error:").strip().rstrip(".") if errors else "no rank said why"


def ring_retry(command: Sequence[str], ranks: int, done: subprocess.CompletedProcess[str]) -> str:
    """What is said when local ranks are started again on other ports."""
    first = int(command[list(command).index("--starting-port") + 1])
    ports = f"port {first}" if ranks == 1 else f"ports {first}-{first + ranks - 1}"
    return (f"The pipeline's ranks could not connect to each other on {ports} of this "
            f"machine ({ring_error(done)}): another program may have connected to one of "
            "them first. Starting them again on other ports.")


def ring_gave_up(done: subprocess.CompletedProcess[str]) -> str:
    """The failure once every start of local ranks failed to form their ring."""
    return (f"The pipeline run failed: its ranks could not connect to each other on this "
            f"machine in {RING_ATTEMPTS} tries, each on other ports ({ring_error(done)}). "
            "Another program may keep connecting to their ports first: quit programs you "
            "do not know, then try again.")


def clear_rank_files(folder: Path) -> None:
    """Remove what the ranks of a failed start wrote, before the next start."""
    for path in folder.glob("rank*.*"):
        path.unlink(missing_ok=True)


def join_group(folder: Path) -> mx.distributed.Group:
    """This rank's MLX group, once every rank has connected (then ``rank_started``).

    A group that cannot form (a peer unreachable, a port taken or answered by
    another program) ends this process with ``RING_FAILED`` and an ``error:`` line
    saying MLX's reason, which the launcher reads.
    """
    import mlx.core as mx

    try:
        group = mx.distributed.init()
    except RuntimeError as error:
        print(f"error: {error}", file=sys.stderr, flush=True)
        raise SystemExit(RING_FAILED) from None
    rank_started(folder, group.rank())
    return group


def rank_environment(folder: str, ranks: int, hosts: Sequence[str] | None) -> dict[str, str]:
    """The environment mlx.launch gives the ranks: the report folder and, for the
    ranks on this machine, their share of its cores (``local_rank_env``)."""
    local = ranks if hosts is None else sum(host in LOCAL_HOSTS for host in hosts)
    return {**os.environ, REPORT_DIR: folder, **local_rank_env(local)}


def local_rank_env(local_ranks: int) -> dict[str, str]:
    """What the launcher adds to the environment of the ranks it starts on this machine.

    BLAS threads: each rank its share of the cores (a count the user set is kept),
    since the stages run one after the other and a pool sized for the whole machine
    spins against the other stage. The launcher's environment reaches only the
    ranks it starts here (ssh does not pass it on).
    """
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    share = str(max(1, (cores or 1) // max(1, local_ranks)))
    return {name: os.environ.get(name, share) for name in ("OPENBLAS_NUM_THREADS",
                                                           "OMP_NUM_THREADS")}


def launcher_command() -> list[str]:
    """The command that runs MLX's launcher with this Python (or bundled app)."""
    return [sys.executable, "-m", "engine.distributed.mlx_launch"]


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


def ring_addresses(path: Path) -> list[tuple[str, ...]]:
    """The addresses each rank's ring links use (the hostfile's ``ips``), rank 0 first;
    read after ``read_hostfile`` accepted the file."""
    from mlx._distributed_utils.common import Hostfile

    return [tuple(host.ips) for host in Hostfile.from_file(str(path)).hosts]


def launch_command(launcher: Sequence[str], argv: Sequence[str], ranks: int, seed: int | None,
                   folder: str, hostfile: Path | None = None,
                   module: str = "engine") -> list[str]:
    """The mlx.launch command line of a pipeline run (local ranks, or a hostfile's):
    ``python -m <module> <argv>`` on every rank (with ``--seed``, unless None)."""
    # Local ranks listen on ports of their own: mlx.launch's fixed default would
    # meet any other local group's (another run, a test beside it) and cut both.
    where = (["-n", str(ranks), "--backend", "ring", "--starting-port", str(free_ports(ranks))]
             if hostfile is None else
             ["--hostfile", str(hostfile), "--env", f"{REPORT_DIR}={folder}"])
    seeded = [] if seed is None else ["--seed", str(seed)]
    return [*launcher, *where, sys.executable, "-m", module, *_without_hostfile(argv),
            *seeded]


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports free on 127.0.0.1 right now.

    Best effort: another process may take one before the ranks listen; then
    mlx.launch's default start is as good as any.
    """
    for _ in range(64):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            first = probe.getsockname()[1]
        if first + count <= 65536 and all(_free(first + i) for i in range(1, count)):
            return first
    return DEFAULT_RING_PORT


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


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


def rank_started(folder: Path, rank: int) -> None:
    """Once this rank's group is up: tell the launcher which process it is (so it can
    notice it dying), guard the group's links and start beating (``alive``), so it
    can notice a stall too."""
    (folder / f"rank{rank}.pid").write_text(str(os.getpid()), encoding="utf-8")
    guard_links()
    start_beating(rank)


def _reports(folder: Path, ranks: int) -> dict[int, dict[str, Any]]:
    reports = {}
    for rank in range(ranks):
        path = folder / f"rank{rank}.json"
        if path.exists():
            reports[rank] = json.loads(path.read_text(encoding="utf-8"))
    return reports
