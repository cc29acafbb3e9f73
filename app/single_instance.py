"""One Longleaf per data folder.

The running app holds a lock file in its data folder; a second launch on the
same folder does not open a second window (which would mark the first one's
live answer interrupted and sweep its half-written files) but hands the files
it was given to the first through a local socket, which attaches them as if
they had been dropped on its window, and exits. QLockFile records the holder's
pid and host, so a lock a crashed app left is taken over.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from pathlib import Path

from PySide6.QtCore import QLockFile, QObject, QStandardPaths, QSysInfo, Signal
from PySide6.QtNetwork import QLocalServer, QLocalSocket

LOCK_NAME = "longleaf.lock"
SOCKET_NAME = "longleaf.sock"
MAX_SOCKET_PATH = 100  # sun_path is 104 bytes on macOS, 108 on Linux
CONNECT_MS = 2000
HANDOFF_WAIT_S = 10.0  # a first instance that holds the lock may still be starting
MAX_MESSAGE_BYTES = 1 << 20
END = b"\n"  # ends a launch's message: the holder answers it without waiting for a close
TAKEN = b"\x06"  # the holder's answer: the files reach its open window
ANSWER_POLL_MS = 50


def socket_name(folder: Path) -> str:
    """The local socket of the app that holds ``folder``: a path inside it when short
    enough for a Unix socket, else the user's own runtime folder (never the shared
    /tmp, where Qt would put a bare name)."""
    inside = folder / SOCKET_NAME
    if len(str(inside).encode()) <= MAX_SOCKET_PATH:
        return str(inside)
    runtime = os.environ.get("XDG_RUNTIME_DIR") or (
        QStandardPaths.writableLocation(QStandardPaths.StandardLocation.RuntimeLocation)
        if sys.platform == "darwin" else "")
    if not runtime:
        return str(inside)  # too long to listen on: a second launch then waits and says so
    digest = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:16]
    return str(Path(runtime) / f"longleaf-{digest}.sock")


class InstanceLock(QObject):
    """The data folder's lock, and the server that takes files from later launches.

    Args:
        folder: the data folder.
    """

    filesReceived = Signal(list)  # absolute paths

    def __init__(self, folder: Path, parent: QObject | None = None) -> None:
        super().__init__(parent)
        self.folder = folder
        self._lock = QLockFile(str(folder / LOCK_NAME))
        self._lock.setStaleLockTime(0)  # stale only when its holder is gone, never by age
        self._server: QLocalServer | None = None
        self._unanswered: set[QLocalSocket] = set()  # launches connected, not yet told

    def acquire(self) -> bool:
        """Take the lock now if no live process holds it; True when this one does."""
        if not self._lock.tryLock(0):
            return False
        # QLockFile leaves the umask's mode; everything in the data folder is user-only.
        os.chmod(self.folder / LOCK_NAME, 0o600)
        return True

    def held_elsewhere(self) -> bool:
        """After a failed ``acquire``: True when another live process holds the lock.

        False when the lock file could not be made at all, and when it names a
        process of this machine that is gone but could not be taken over: a
        crashed run's lock in a folder that turned read-only. Either way no
        Longleaf can be writing there.
        """
        if self._lock.error() != QLockFile.LockError.LockFailedError:
            return False
        info = self._lock.getLockInfo()
        if not info:
            return True
        pid, host, _app = info
        return host != QSysInfo.machineHostName() or _alive(pid)

    def listen(self) -> bool:
        """Start taking files from later launches; call once the lock is held."""
        name = socket_name(self.folder)
        QLocalServer.removeServer(name)  # a crashed holder's socket file; we hold the lock
        server = QLocalServer(self)
        server.setSocketOptions(QLocalServer.SocketOption.UserAccessOption)
        server.newConnection.connect(self._on_connection)
        if not server.listen(name):
            return False
        self._server = server
        return True

    def stop_listening(self) -> None:
        """Take no more files, the lock still held: the window is closing. A launch
        meanwhile is not answered, so it waits and takes the lock once it is free."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
            while server.hasPendingConnections():  # connected before the close, not read
                server.nextPendingConnection().abort()
        for socket in list(self._unanswered):
            socket.abort()  # its launch hears no answer: not taken

    def release(self) -> None:
        """Stop listening and give the lock up."""
        self.stop_listening()
        self._lock.unlock()

    def _on_connection(self) -> None:
        assert self._server is not None
        while self._server.hasPendingConnections():
            self._serve(self._server.nextPendingConnection())

    def _serve(self, socket: QLocalSocket) -> None:
        """Read one launch's message; its files go to the window, and the launch is told."""
        received = bytearray()
        self._unanswered.add(socket)

        def read() -> None:
            received.extend(bytes(socket.readAll().data()))
            if len(received) > MAX_MESSAGE_BYTES:
                self._unanswered.discard(socket)  # not a launch's message: nothing taken
                socket.abort()
            elif received.endswith(END) and self._take(socket, bytes(received)):
                socket.write(TAKEN)
                socket.flush()

        def done() -> None:
            if socket in self._unanswered:
                read()  # a launch of an older Longleaf ends its message by closing
                self._take(socket, bytes(received))
            self._unanswered.discard(socket)
            socket.deleteLater()

        socket.readyRead.connect(read)
        socket.disconnected.connect(done)

    def _take(self, socket: QLocalSocket, message: bytes) -> bool:
        """Hand ``message``'s files to the window once; True when they went to it."""
        if socket not in self._unanswered or self._server is None:
            return False  # answered already, or no longer listening: the window is going
        self._unanswered.discard(socket)
        paths = _paths(message)
        if paths:
            self.filesReceived.emit(paths)
        return True


def _alive(pid: int) -> bool:
    """Whether process ``pid`` of this machine still runs (another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's, or no way to ask: assume it runs
        return True
    return True


def _paths(message: bytes) -> list[str]:
    try:
        files = json.loads(message.decode("utf-8")).get("files", [])
    except (UnicodeDecodeError, ValueError, AttributeError, RecursionError):
        return []  # not a launch of Longleaf's: nothing to attach
    return [f for f in files if isinstance(f, str)] if isinstance(files, list) else []


def hand_over(folder: Path, files: list[str], wait_s: float | None = None) -> bool:
    """Send ``files`` to the app that holds ``folder``; True once it says it took them.

    A holder that is quitting takes nothing and does not answer: written into the
    socket is not taken. Its answer is waited for at most ``wait_s`` seconds.
    """
    socket = QLocalSocket()
    socket.connectToServer(socket_name(folder))
    if not socket.waitForConnected(CONNECT_MS):
        return False
    absolute = [str(Path(f).absolute()) for f in files]
    socket.write(json.dumps({"files": absolute}).encode("utf-8") + END)
    wait_s = HANDOFF_WAIT_S if wait_s is None else wait_s
    sent = socket.waitForBytesWritten(CONNECT_MS) or not socket.bytesToWrite()
    taken = sent and _answered(socket, time.monotonic() + wait_s)
    socket.disconnectFromServer()
    if socket.state() != QLocalSocket.LocalSocketState.UnconnectedState:
        socket.waitForDisconnected(CONNECT_MS)
    return taken


def _answered(socket: QLocalSocket, deadline: float) -> bool:
    """Whether the holder says it took the message before ``deadline`` (False when it
    closes the connection without a word)."""
    while socket.state() == QLocalSocket.LocalSocketState.ConnectedState:
        # In short waits: PySide keeps the GIL through one, and a holder in this
        # process (the tests') answers from Python.
        if socket.bytesAvailable() or socket.waitForReadyRead(ANSWER_POLL_MS):
            return bytes(socket.read(1).data()) == TAKEN
        if time.monotonic() >= deadline:
            return False
    return False


def hand_over_or_take(lock: InstanceLock, files: list[str],
                      wait_s: float = HANDOFF_WAIT_S) -> bool:
    """While another live process holds the lock, hand ``files`` to it.

    Returns:
        True when the running app took them (this launch should exit); False when
        the lock is now this process's (the other one exited meanwhile).

    Raises:
        TimeoutError: the holder neither answers nor exits within ``wait_s``.
    """
    deadline = time.monotonic() + wait_s
    while True:
        if hand_over(lock.folder, files, max(0.0, deadline - time.monotonic())):
            return True
        if lock.acquire():
            return False
        if time.monotonic() > deadline:
            raise TimeoutError(f"the Longleaf that holds {lock.folder} does not answer")
        time.sleep(0.2)
