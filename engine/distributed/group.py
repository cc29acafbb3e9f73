"""One mlx.launch run of a pipeline's ranks, watched until it ends.

MLX collectives have no timeout, so the ranks are watched from outside: each
writes its pid into the run's folder once its group is up, and a rank whose
process is gone without a report ends the whole group after a short grace,
instead of leaving its peers blocked in a send or receive. Each rank also beats
(``engine.distributed.alive``) through the launcher's output, which the watcher
reads as it comes: a rank silent too long is stalled, and ends the group at
once, wherever it runs. The launcher, its
shells and every local rank share one process group, ended at once. Both the
CLI's ``--pipeline`` run (``engine.distributed.launch``) and the app's engine
child (``engine.distributed.remote``) run their ranks through this.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from engine.distributed.alive import STALL_SECONDS, beating_rank

LOCAL_HOSTS = frozenset({"127.0.0.1"})  # mlx.launch starts these without ssh
RANK_TIMEOUT = 24 * 3600.0
POLL_SECONDS = 0.25
# A lost rank's peers get this long to stop on their own (mlx.launch terminates
# them when it notices) before the whole group is killed.
LOST_RANK_GRACE = 3.0
# The launcher's output lines kept for the failure message (its last lines).
OUTPUT_LINES = 400
# More than the launcher's stdin pipe and every rank's stdin pipe hold (64 KiB each
# on Linux and macOS), for up to a dozen ranks.
STDIN_FILL = 1 << 20
# A rank's exit code when its group could not form (EX_TEMPFAIL: worth another
# try); ``launch.join_group`` exits with it.
RING_FAILED = 75
# mlx.launch's own warning when a rank ends with an error (not when it stops it).
_EXITED = re.compile(r"Node with rank (\d+) exited with code (-?\d+)")


class Group:
    """A running ``mlx.launch`` command and the folder its ranks report into.

    Args:
        command: the mlx.launch command line.
        env: its environment.
        folder: where each rank writes ``rank<N>.pid`` and ``rank<N>.json``.
        ranks: how many ranks it starts.
        hosts: each rank's ssh host, rank 0 first (None: all on this machine).
    """

    def __init__(self, command: list[str], env: dict[str, str], folder: Path, ranks: int,
                 hosts: Sequence[str] | None = None) -> None:
        self.folder = folder
        self.ranks = ranks
        self.hosts = None if hosts is None else list(hosts)
        # A session of its own: the launcher, its shells and every local rank
        # share one process group that can be ended at once.
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                        text=True, start_new_session=True)
        # Kept open either way (at end of file the launcher's main loop spins). Filled
        # only when every rank is here: over ``ssh -tt`` a rank's stdin is a terminal
        # that echoes what it gets and, with ssh's buffers between, never fills.
        if self.hosts is None or all(host in LOCAL_HOSTS for host in self.hosts):
            threading.Thread(target=_fill, args=(self.process.stdin,),
                             name="longleaf-pipeline-stdin", daemon=True).start()
        self.stalled: list[int] = []  # ranks that stopped beating (set by ``watch``)
        self._beats: dict[int, float] = {}  # each rank's last sign of life (monotonic)
        self._output = {name: deque[str](maxlen=OUTPUT_LINES) for name in ("stdout", "stderr")}
        self._readers = [
            threading.Thread(target=self._read, args=(stream, self._output[name]),
                             name=f"longleaf-pipeline-{name}", daemon=True)
            for name, stream in (("stdout", self.process.stdout),
                                 ("stderr", self.process.stderr))]
        for reader in self._readers:
            reader.start()

    def watch(self, stop: threading.Event | None = None,
              timeout: float = RANK_TIMEOUT) -> tuple[subprocess.CompletedProcess[str], list[int]]:
        """Wait for the run to end; end it once a rank is lost or stalled, ``stop`` is
        set or ``timeout`` passes. Returns its outcome and the ranks lost."""
        deadline = time.monotonic() + timeout
        lost: list[int] = []
        lost_at = 0.0
        try:
            while True:
                try:
                    self.process.wait(timeout=POLL_SECONDS)
                    break
                except subprocess.TimeoutExpired:
                    pass
                now = time.monotonic()
                if not lost:
                    lost, lost_at = self.lost_ranks(), now
                if not lost and (stalled := self.stalled_ranks(now)):
                    # No grace: nobody else will end a stalled rank's peers.
                    self.stalled = lost = stalled
                    lost_at = now - LOST_RANK_GRACE
                if ((lost and now - lost_at >= LOST_RANK_GRACE) or now > deadline
                        or (stop is not None and stop.is_set())):
                    self.end()
        finally:
            if self.process.poll() is None:  # interrupted: leave no rank behind
                self.end()
            with contextlib.suppress(OSError):  # the launcher is gone: nothing to tell
                if self.process.stdin is not None:
                    self.process.stdin.close()
        for reader in self._readers:
            reader.join(POLL_SECONDS * 8)
        stdout, stderr = ("".join(self._output[name]) for name in ("stdout", "stderr"))
        done = subprocess.CompletedProcess(self.process.args, self.process.returncode,
                                           stdout, stderr)
        return done, lost

    def stalled_ranks(self, now: float) -> list[int]:
        """Ranks that beat once and then fell silent for ``STALL_SECONDS``, without a
        report (a rank that has reported may end quietly)."""
        beats = dict(self._beats)
        return [rank for rank, last in sorted(beats.items())
                if now - last > STALL_SECONDS
                and not (self.folder / f"rank{rank}.json").exists()]

    def _read(self, stream: IO[str] | None, lines: deque[str]) -> None:
        if stream is None:
            return
        for line in stream:
            rank = beating_rank(line)
            if rank is None:
                lines.append(line)
            else:
                self._beats[rank] = time.monotonic()

    def silent_ranks(self) -> list[int]:
        """Ranks that never gave a sign of life: their group never formed with them."""
        return [rank for rank in range(self.ranks) if rank not in self._beats]

    def lost_ranks(self) -> list[int]:
        """Ranks whose process has gone without writing a report."""
        lost = []
        for rank in range(self.ranks):
            pid_file = self.folder / f"rank{rank}.pid"
            report = self.folder / f"rank{rank}.json"
            if pid_file.exists() and not report.exists() and not _alive(pid_file):
                lost.append(rank)
        return lost

    def pids(self) -> dict[int, int]:
        """The pid of each rank that has written one (ranks on this machine)."""
        pids = {}
        for rank in range(self.ranks):
            with contextlib.suppress(OSError, ValueError):  # not written (yet)
                pids[rank] = int((self.folder / f"rank{rank}.pid").read_text(encoding="utf-8"))
        return pids

    def end(self) -> None:
        """Kill the launcher's whole process group (every local rank with it)."""
        with contextlib.suppress(ProcessLookupError):  # the group has ended already
            os.killpg(self.process.pid, signal.SIGKILL)

    def machine(self, rank: int) -> str:
        """How a message names a rank's machine."""
        host = None if self.hosts is None else self.hosts[rank]
        return "this machine" if host is None or host in LOCAL_HOSTS else host

    def ring_failed(self, done: subprocess.CompletedProcess[str]) -> bool:
        """Whether the run ended because its ranks' group could not form (a rank exited
        with ``RING_FAILED``)."""
        return any(int(code) == RING_FAILED for _rank, code in _EXITED.findall(done.stderr or ""))

    def failure(self, done: subprocess.CompletedProcess[str], suspects: list[int]) -> str:
        """Why the run failed, naming the rank (and its machine) that caused it."""
        stderr = done.stderr or ""
        exited = {int(rank): int(code) for rank, code in _EXITED.findall(stderr)}
        # mlx.launch warns in the order its threads see the ranks end, and stops the
        # others (SIGTERM) only after the first. A rank killed by any other signal was
        # killed from outside: that is the cause, even when the peer it left, failing
        # on the lost link at once, was seen to end first.
        killed = [rank for rank, code in exited.items() if code < 0 and code != -signal.SIGTERM]
        first = killed[:1] or ([next(iter(exited))] if exited else [])
        failed = suspects if len(suspects) == 1 else first or suspects
        lines = [line for line in stderr.splitlines() if line.strip()]
        remote = bool(failed) and self.machine(failed[0]) != "this machine"
        errors = said_errors(done, remote)
        if failed and failed[0] in self.stalled:
            detail = (f": it stopped responding (no sign of life for {STALL_SECONDS:.0f} s; "
                      "is the machine asleep, or its process stopped?)")
        elif failed and exited.get(failed[0], 0) < 0:
            # A killed rank says nothing: any error line is another rank's, about
            # the peer it lost (printed before or after the launcher noticed).
            detail = f": its process was killed (signal {-exited[failed[0]]})"
        elif failed and exited.get(failed[0]) == RING_FAILED:
            said = errors[-1].removeprefix("error: ") if errors else "no reason given"
            detail = (f": the ranks could not connect to each other ({said}). Check that "
                      "each machine reaches the others at the hostfile's addresses and that "
                      "no other program uses the ring's ports")
        elif errors:
            detail = f": {errors[-1]}"
        elif failed and failed[0] in exited:
            detail = f": its process exited with code {exited[failed[0]]}"
        else:
            detail = f": {lines[-1]}" if lines else ": its process ended without a report"
        which = ", ".join(f"rank {rank}" for rank in failed) or "a rank"
        where = f" ({self.machine(failed[0])})" if failed else ""
        return f"The pipeline run failed on {which}{where}{detail}"


def said_errors(done: subprocess.CompletedProcess[str], remote: bool = False) -> list[str]:
    """The ranks' ``error:`` lines, in the order said.

    mlx.launch starts a rank on another machine through ``ssh -tt``, whose terminal
    merges the rank's stderr into its stdout (with terminal line ends). The last
    line is the one a message quotes: with ``remote`` it is stdout's, the cause a
    remote rank said being more telling than its local peers' lost link.
    """
    def errors(text: str | None) -> list[str]:
        return [line.rstrip("\r") for line in (text or "").splitlines()
                if line.startswith("error:")]
    local, merged = errors(done.stderr), errors(done.stdout)
    return local + merged if remote else merged + local


def _fill(stdin: IO[str] | None) -> None:
    # mlx.launch hands its stdin on to every rank's stdin pipe, and each rank's
    # thread select()s on that pipe for writing: a pipe with room is always
    # writable, so the launcher spins and takes a core from the ranks. The ranks
    # never read stdin; once their pipes are full the launcher blocks.
    if stdin is None:
        return
    with contextlib.suppress(OSError, ValueError):  # the launcher ended first
        stdin.write("\n" * STDIN_FILL)
        stdin.flush()


def _alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text(encoding="utf-8")), 0)
    except ProcessLookupError:
        return False
    except (OSError, ValueError):  # not ours to signal, or a pid still being written
        return True
    return True
