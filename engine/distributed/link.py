"""One pipeline group started for a front end, and rank 0's connection back to it.

A ``Link`` starts ``mlx.launch … python -m engine.distributed.host`` (local ring
ranks, or an MLX hostfile's hosts with rank 0 on this machine), watches it with
``engine.distributed.group.Group`` and accepts rank 0's connection on a
``multiprocessing.connection.Listener`` (127.0.0.1, a fresh random authkey that
reaches rank 0 in its environment, never on a command line). It reports each
message rank 0 sends, and once, the group's end when nobody asked for it.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import shutil
import socket
import tempfile
import threading
from collections.abc import Callable, Sequence
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

from engine.distributed.group import LOCAL_HOSTS, LOST_RANK_GRACE, Group
from engine.distributed.launch import (
    launch_command,
    launcher_path,
    rank_environment,
    read_hostfile,
)
from engine.errors import EngineError

log = logging.getLogger(__name__)

ADDRESS_ENV = "LONGLEAF_ENGINE_ADDRESS"  # where rank 0 connects back to ("host:port")
KEY_ENV = "LONGLEAF_ENGINE_KEY"  # the connection's authkey, hex
HOST_MODULE = "engine.distributed.host"
# Rank 0 connects once MLX is imported and its group is up; loading comes after.
CONNECT_TIMEOUT = 300.0
# After the connection drops, the watcher gets this long to see the group end
# (its lost-rank grace included) before the group is ended by force.
DROP_GRACE = LOST_RANK_GRACE + 3.0
# The lost group's message ends with what the app's user can do.
RESTART_HINT = "Load the model again to restart it."


def hostfile_hosts(hostfile: Path) -> list[str]:
    """The ssh host of each rank in ``hostfile``, checked to put rank 0 on this machine.

    Raises:
        EngineError: the hostfile is unusable, or its first host is another machine.
    """
    hosts = read_hostfile(hostfile)
    if hosts[0] not in LOCAL_HOSTS:
        raise EngineError(
            f"The first host of {hostfile} is {hosts[0]}; it must be this Mac "
            "(127.0.0.1), where Longleaf runs the pipeline's rank 0.")
    return hosts


class Link:
    """A started group and rank 0's connection.

    Args:
        argv: the arguments of ``python -m engine.distributed.host`` on every rank.
        ranks: local ranks with the ring backend (ignored with ``hostfile``).
        hostfile: an MLX hostfile whose first host is this machine (127.0.0.1).
        on_message: called on the relay thread with each message rank 0 sends.
        on_lost: called once, on the watcher thread, with this link and the
            message naming the rank and machine, when the group ends unasked.

    Raises:
        EngineError: mlx.launch is missing, or the hostfile is unusable or puts
            rank 0 on another machine.
    """

    def __init__(self, argv: Sequence[str], ranks: int, hostfile: Path | None,
                 on_message: Callable[[tuple[Any, ...]], None],
                 on_lost: Callable[[Link, str], None]) -> None:
        hosts = None if hostfile is None else hostfile_hosts(hostfile)
        ranks = ranks if hosts is None else len(hosts)
        launcher = launcher_path()
        self._on_message = on_message
        self._on_lost = on_lost
        self._send_lock = threading.Lock()
        self.conn: Connection | None = None
        self.ended = threading.Event()  # the group's processes have all ended
        self.stopping = False  # asked to stop: the group's end is no loss
        self._forced: str | None = None  # why this side ended the group, if it did
        self._threads: list[threading.Thread] = []
        key = secrets.token_bytes(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=key)
        self._address = self._listener.address
        folder = tempfile.mkdtemp(prefix="pipeline-")
        command = launch_command(launcher, argv, ranks, None, folder, hostfile,
                                 module=HOST_MODULE)
        env = {**rank_environment(folder, ranks, hosts),
               ADDRESS_ENV: f"{self._address[0]}:{self._address[1]}", KEY_ENV: key.hex()}
        self.group = Group(command, env, Path(folder), ranks, hosts)

    @property
    def connected(self) -> bool:
        """True while rank 0's connection is up and its group runs."""
        return self.conn is not None and not self.conn.closed and not self.ended.is_set()

    def start(self) -> None:
        """Watch the group (a separate step, so the owner holds the link before any loss)."""
        self._thread(self._watch, "longleaf-pipeline-watch")

    def connect(self) -> bool:
        """Wait for rank 0's connection; False when the group ended first (reported)."""
        timer = threading.Timer(CONNECT_TIMEOUT, self._force_end,
                                (f"rank 0 did not connect within {CONNECT_TIMEOUT:.0f} s",))
        timer.daemon = True
        timer.start()
        try:
            conn = self._listener.accept()
        except (OSError, EOFError, AuthenticationError) as error:
            log.info("pipeline rank 0 did not connect: %s", error)
            return False
        finally:
            timer.cancel()
            self._listener.close()
        if self.ended.is_set() or self.stopping:
            conn.close()
            return False
        self.conn = conn
        self._thread(self._relay, "longleaf-pipeline-relay")
        return True

    def send(self, message: tuple[Any, ...]) -> bool:
        """Send ``message`` to rank 0; False when the connection is gone.

        Raises:
            pickle.PicklingError, TypeError, AttributeError: ``message`` holds a
                value that cannot be pickled.
        """
        conn = self.conn
        if conn is None:
            return False
        try:
            with self._send_lock:
                conn.send(message)
        except (OSError, ValueError) as error:  # closed, or cut by the group's end
            log.info("pipeline connection lost while sending: %s", error)
            return False
        return True

    def stop(self, timeout: float) -> None:
        """Ask rank 0 to stop (it stores its sessions and ends the followers), wait
        ``timeout`` for the group to end, then kill what is left of it."""
        self.stopping = True
        self.send(("shutdown", timeout))
        if not self.ended.wait(timeout + 1.0):
            self.group.end()
        self.ended.wait(5.0)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(5.0)

    def _thread(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _relay(self) -> None:
        conn = self.conn
        assert conn is not None
        while True:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                break
            self._on_message(message)
        conn.close()
        if not self.stopping and not self.ended.wait(DROP_GRACE):
            self._force_end("rank 0 (this machine) closed its connection to the app")

    def _force_end(self, why: str) -> None:
        if not self.ended.is_set():
            self._forced = why
            self.group.end()

    def _watch(self) -> None:
        done, lost = self.group.watch()
        self.ended.set()
        if self.conn is None:
            # Wake an accept still waiting for a rank 0 that will never come: a bare
            # connection fails its handshake at once. (Refused: it has ended already.)
            with contextlib.suppress(OSError):
                socket.create_connection(self._address, timeout=2.0).close()
        shutil.rmtree(self.group.folder, ignore_errors=True)
        if self.stopping:
            return
        message = (f"The pipeline run failed: {self._forced}" if self._forced
                   else self.group.failure(done, lost))
        self._on_lost(self, f"{message.rstrip('.')}. {RESTART_HINT}")
