"""One pipeline group started for a front end, and rank 0's connection back to it.

A ``Link`` starts ``mlx.launch … python -m engine.distributed.rank`` (local ring
ranks, or an MLX hostfile's hosts with rank 0 on this machine), watches it with
``engine.distributed.group.Group`` and accepts rank 0's connection on a
``multiprocessing.connection.Listener`` (127.0.0.1, a fresh random authkey that
reaches rank 0 in its environment, never on a command line). It reports each
message rank 0 sends, and once, the group's end when nobody asked for it.

Any program of this machine may connect to either port first. A connection to
the listener that does not prove the key within ``HANDSHAKE_TIMEOUT`` is closed
and the listener waits on for rank 0 (nothing it sent is unpickled: the
handshake comes first). A ring that does not form (another program connected to
a rank's port before its peer) is started again on other ports, at most
``launch.RING_ATTEMPTS`` times; both are said through ``on_notice``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Sequence
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, Listener, answer_challenge, deliver_challenge
from pathlib import Path
from typing import Any

from engine.distributed.group import LOCAL_HOSTS, LOST_RANK_GRACE, Group
from engine.distributed.launch import (
    RING_ATTEMPTS,
    clear_rank_files,
    launch_command,
    launcher_command,
    rank_environment,
    read_hostfile,
    ring_gave_up,
    ring_retry,
)
from engine.errors import EngineError

log = logging.getLogger(__name__)

ADDRESS_ENV = "LONGLEAF_ENGINE_ADDRESS"  # where rank 0 connects back to ("host:port")
KEY_ENV = "LONGLEAF_ENGINE_KEY"  # the connection's authkey, hex
RANK_MODULE = "engine.distributed.rank"
# Rank 0 connects once MLX is imported and its group is up; loading comes after.
CONNECT_TIMEOUT = 300.0
# After the connection drops, the watcher gets this long to see the group end
# (its lost-rank grace included) before the group is ended by force.
DROP_GRACE = LOST_RANK_GRACE + 3.0
# The lost group's message ends with what the app's user can do.
RESTART_HINT = "Load the model again to restart it."
# Rank 0 answers the listener's challenge at once; a connection silent this long
# is another program's, and must not keep rank 0 waiting behind it.
HANDSHAKE_TIMEOUT = 10.0
REFUSED = ("Another program connected to the port where the pipeline's rank 0 reports to "
           "Longleaf and was refused (it did not have the run's key); the start goes on.")


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
        argv: the arguments of ``python -m engine.distributed.rank`` on every rank.
        ranks: local ranks with the ring backend (ignored with ``hostfile``).
        hostfile: an MLX hostfile whose first host is this machine (127.0.0.1).
        on_message: called on the relay thread with each message rank 0 sends.
        on_lost: called once, on the watcher thread, with this link and the
            message naming the rank and machine, when the group ends unasked.
        on_notice: called with what the user should hear while the start goes on
            (a connection refused, the ranks started again on other ports).

    Raises:
        EngineError: the hostfile is unusable or puts rank 0 on another machine.
    """

    def __init__(self, argv: Sequence[str], ranks: int, hostfile: Path | None,
                 on_message: Callable[[tuple[Any, ...]], None],
                 on_lost: Callable[[Link, str], None],
                 on_notice: Callable[[str], None] | None = None) -> None:
        hosts = None if hostfile is None else hostfile_hosts(hostfile)
        ranks = ranks if hosts is None else len(hosts)
        self._launcher = launcher_command()
        self._argv, self._ranks, self._hostfile, self._hosts = list(argv), ranks, hostfile, hosts
        self._on_message = on_message
        self._on_lost = on_lost
        self._on_notice = on_notice or (lambda _text: None)
        self._send_lock = threading.Lock()
        self._group_lock = threading.Lock()  # a start again, against an end by force
        self.conn: Connection | None = None
        self.ended = threading.Event()  # the group's processes have all ended
        self.stopping = False  # asked to stop: the group's end is no loss
        self._forced: str | None = None  # why this side ended the group, if it did
        self._gave_up: str | None = None  # why the ring never formed, after every try
        self._threads: list[threading.Thread] = []
        self.starts = 1  # starts of the group (more after a ring that did not form)
        self.refused = 0  # connections to the listener that did not prove the key
        self._key = secrets.token_bytes(32)
        # No authkey here: ``_accept`` runs the same handshake with a bound on each read.
        self._listener = Listener(("127.0.0.1", 0))
        self._address = self._listener.address
        self._folder = tempfile.mkdtemp(prefix="pipeline-")
        self.group = self._new_group()

    def _new_group(self) -> Group:
        """Start the ranks (local ones on ports free now)."""
        command = launch_command(self._launcher, self._argv, self._ranks, None, self._folder,
                                 self._hostfile, module=RANK_MODULE)
        env = {**rank_environment(self._folder, self._ranks, self._hosts),
               ADDRESS_ENV: f"{self._address[0]}:{self._address[1]}", KEY_ENV: self._key.hex()}
        self._command = command
        return Group(command, env, Path(self._folder), self._ranks, self._hosts)

    @property
    def connected(self) -> bool:
        """True while rank 0's connection is up and its group runs."""
        return self.conn is not None and not self.conn.closed and not self.ended.is_set()

    def start(self) -> None:
        """Watch the group (a separate step, so the owner holds the link before any loss)."""
        self._thread(self._watch, "longleaf-pipeline-watch")

    def connect(self) -> bool:
        """Wait for rank 0's connection; False when the group ended first (reported)."""
        timer = threading.Timer(CONNECT_TIMEOUT, self._connect_timed_out)
        timer.daemon = True
        timer.start()
        try:
            conn = self._accept()
        finally:
            timer.cancel()
            self._listener.close()
        if conn is None:
            return False
        if self.ended.is_set() or self.stopping:
            conn.close()
            return False
        self.conn = conn
        self._thread(self._relay, "longleaf-pipeline-relay")
        return True

    def _accept(self) -> Connection | None:
        """Rank 0's connection: the first that proves the key; None once the group ended."""
        while not (self.ended.is_set() or self.stopping):
            try:
                conn = self._listener.accept()
            except OSError as error:
                log.info("pipeline rank 0 did not connect: %s", error)
                return None
            try:
                authenticate(conn, self._key, HANDSHAKE_TIMEOUT)
            except (AuthenticationError, EOFError, OSError) as error:
                conn.close()
                if self.ended.is_set() or self.stopping:
                    return None  # the watcher's wake-up call, or a late one
                self.refused += 1
                log.warning("refused a connection to the pipeline's listener that did not "
                            "prove the run's key: %s", error or type(error).__name__)
                if self.refused == 1:
                    self._on_notice(REFUSED)
                continue
            return conn
        return None

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

    def _connect_timed_out(self) -> None:
        """End a group rank 0 never connected from, naming the ranks that never
        started (a Mac asleep, unreachable, or not answering ssh)."""
        silent = self.group.silent_ranks()
        where = ", ".join(f"rank {rank} ({self.group.machine(rank)})" for rank in silent)
        why = (f"rank 0 did not connect within {CONNECT_TIMEOUT:.0f} s: "
               + (f"{where} never started. Check that each machine is awake and reaches "
                  "the others at the hostfile's addresses" if silent else
                  "every rank had started, but the model's load took longer"))
        self._force_end(why)

    def _force_end(self, why: str) -> None:
        with self._group_lock:
            if not self.ended.is_set():
                self._forced = why
                self.group.end()

    def _start_again(self, done: Any) -> bool:
        """After a ring that did not form, start local ranks again on other ports (said);
        False when the group's end stands (rank 0 connected, asked or forced to end, a
        hostfile's hosts, another failure, or no try left)."""
        with self._group_lock:
            if (self.conn is not None or self.stopping or self._forced is not None
                    or self._hosts is not None or not self.group.ring_failed(done)):
                return False
            if self.starts >= RING_ATTEMPTS:
                self._gave_up = ring_gave_up(done)
                return False
            said = ring_retry(self._command, self._ranks, done)
            log.warning("%s", said)
            clear_rank_files(Path(self._folder))
            self.starts += 1
            self.group = self._new_group()
        self._on_notice(said)
        return True

    def _watch(self) -> None:
        while True:
            done, lost = self.group.watch()
            if not self._start_again(done):
                break
        self.ended.set()
        if self.conn is None:
            # Wake an accept still waiting for a rank 0 that will never come: a bare
            # connection fails its handshake at once. (Refused: it has ended already.)
            with contextlib.suppress(OSError):
                socket.create_connection(self._address, timeout=2.0).close()
        shutil.rmtree(self._folder, ignore_errors=True)
        if self.stopping:
            return
        if self._gave_up is not None:
            message = self._gave_up
        elif self._forced:
            message = f"The pipeline run failed: {self._forced}"
        else:
            message = self.group.failure(done, lost)
        self._on_lost(self, f"{message.rstrip('.')}. {RESTART_HINT}")


def authenticate(conn: Connection, key: bytes, timeout: float) -> None:
    """The handshake ``Listener(authkey=key)`` makes on ``conn``, each read bounded by
    ``timeout`` seconds (a program that connects and then says nothing would hold
    the listener for good).

    Raises:
        AuthenticationError: the peer does not hold ``key``.
        EOFError, OSError: it closed the connection, or said nothing in time.
    """
    with socket.socket(fileno=os.dup(conn.fileno())) as view:  # the same socket, not its fd
        view.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(timeout))
        try:
            deliver_challenge(conn, key)
            answer_challenge(conn, key)
        finally:
            with contextlib.suppress(OSError):  # closed by the peer meanwhile
                view.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, _timeval(0.0))


def _timeval(seconds: float) -> bytes:
    # struct timeval on 64-bit Linux and macOS: 8 bytes of seconds, then microseconds
    # (8 bytes on Linux; 4 and padding on macOS, the same bytes little-endian).
    whole = int(seconds)
    return struct.pack("ll", whole, int((seconds - whole) * 1_000_000))
