"""A pipeline's start when other programs of this machine connect to its ports first.

The group here is a stand-in (no mlx.launch): these tests are about the link's
listener and its starts. ``test_ring_start.py`` runs the real ring.
"""

from __future__ import annotations

import itertools
import socket
import subprocess
import threading
from multiprocessing.connection import Client
from pathlib import Path
from typing import ClassVar

import pytest

from engine.distributed import launch, link
from engine.distributed.group import RING_FAILED, Group
from engine.distributed.link import REFUSED, RESTART_HINT, Link

RING_ERROR = ("error: [ring] Couldn't connect (error: 111)\n"
              f"[WARN] Node with rank 1 exited with code {RING_FAILED}\n"
              "[WARN] Node with rank 0 exited with code -15\n")


class StandIn(Group):
    """A group that starts nothing: each one ends as ``ENDINGS`` says in turn (None:
    when it is ended)."""

    ENDINGS: ClassVar[list[str | None]] = []
    made: ClassVar[list[StandIn]] = []

    def __init__(self, command, env, folder, ranks, hosts=None) -> None:
        self.command, self.folder, self.ranks = command, folder, ranks
        self.hosts = None if hosts is None else list(hosts)
        self.stalled = []
        self.ending = self.ENDINGS[len(self.made)] if len(self.made) < len(self.ENDINGS) \
            else None
        self.ended = threading.Event()
        self.made.append(self)

    def watch(self, stop=None, timeout=0.0):
        if self.ending is None:
            self.ended.wait(120)
        return subprocess.CompletedProcess(self.command, 0, "", self.ending or ""), []

    def end(self) -> None:
        self.ended.set()


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch) -> type[StandIn]:
    monkeypatch.setattr(link, "Group", StandIn)
    monkeypatch.setattr(link, "launcher_command", lambda: ["/usr/bin/true"])
    ports = itertools.count(41000, 1000)
    monkeypatch.setattr(launch, "free_ports", lambda _count: next(ports))
    monkeypatch.setattr(StandIn, "made", [])
    monkeypatch.setattr(StandIn, "ENDINGS", [])
    return StandIn


class Seen:
    def __init__(self) -> None:
        self.messages: list[tuple] = []
        self.lost: list[str] = []
        self.notices: list[str] = []

    def open(self) -> Link:
        return Link(["--model", "m"], 2, None, self.messages.append,
                    lambda _link, message: self.lost.append(message), self.notices.append)


def rank_zero(started: Link) -> threading.Thread:
    """What rank 0 does: connect with the run's key, say hello."""
    def run() -> None:
        with Client(started._address, authkey=started._key) as conn:
            conn.send(("event", "hello"))
            conn.recv()  # until the link closes it
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_connections_without_the_key_are_refused_and_rank_0_still_gets_in(
        stand_in, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(link, "HANDSHAKE_TIMEOUT", 0.5)
    seen = Seen()
    started = seen.open()
    started.start()
    connected: list[bool] = []
    waiter = threading.Thread(target=lambda: connected.append(started.connect()))
    waiter.start()
    try:
        # Garbage first: was an AuthenticationError that closed the listener, so rank 0
        # met "Connection refused" and the server went on with one machine, unsaid.
        with socket.create_connection(started._address) as garbage:
            garbage.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n" * 10)
            # Then one that connects and says nothing: it must not hold the place.
            with socket.create_connection(started._address):
                rank = rank_zero(started)
                waiter.join(60)
        assert connected == [True]
        assert started.refused == 2
        assert seen.notices == [REFUSED]
        assert started.conn is not None
        deadline = threading.Event()
        while not seen.messages and not deadline.wait(0.05):
            pass
        assert seen.messages == [("event", "hello")]
    finally:
        started.stop(0.5)
        rank.join(10)
    assert not seen.lost


def test_a_ring_that_did_not_form_starts_again_on_other_ports(stand_in) -> None:
    stand_in.ENDINGS = [RING_ERROR]  # the first start fails, the second runs
    seen = Seen()
    started = seen.open()
    started.start()
    # Rank 0 is the second start's: connected before the link has read the first
    # one's failure (a busy machine), it would be the first start's.
    waited = threading.Event()
    for _ in range(1200):  # a minute at most; the assertions below say what went wrong
        if len(stand_in.made) == 2 or waited.wait(0.05):
            break
    rank = rank_zero(started)
    try:
        assert started.connect()
        assert len(stand_in.made) == 2 and started.starts == 2
        first, second = (group.command for group in stand_in.made)
        assert first[first.index("--starting-port") + 1] == "41000"
        assert second[second.index("--starting-port") + 1] == "42000"
        assert seen.notices == [
            "The pipeline's ranks could not connect to each other on ports 41000-41001 of "
            "this machine ([ring] Couldn't connect (error: 111)): another program may have "
            "connected to one of them first. Starting them again on other ports."]
    finally:
        started.stop(0.5)
        rank.join(10)
    assert not seen.lost


def test_a_ring_that_never_forms_is_given_up_after_the_last_try(stand_in) -> None:
    stand_in.ENDINGS = [RING_ERROR] * launch.RING_ATTEMPTS
    seen = Seen()
    started = seen.open()
    started.start()
    assert not started.connect()  # the watcher woke it once the last start failed
    for thread in started._threads:
        thread.join(10)  # the watcher reports the loss after it woke the listener
    assert len(stand_in.made) == launch.RING_ATTEMPTS
    assert len(seen.notices) == launch.RING_ATTEMPTS - 1
    assert seen.lost == [
        f"The pipeline run failed: its ranks could not connect to each other on this machine "
        f"in {launch.RING_ATTEMPTS} tries, each on other ports ([ring] Couldn't connect "
        "(error: 111)). Another program may keep connecting to their ports first: quit "
        f"programs you do not know, then try again. {RESTART_HINT}"]
    started.stop(0.5)


def test_a_hostfiles_ring_that_did_not_form_is_said_in_words(tmp_path: Path) -> None:
    done = subprocess.CompletedProcess([], 0, "", RING_ERROR)
    group = StandIn.__new__(StandIn)
    group.hosts, group.stalled = ["127.0.0.1", "mac2.local"], []
    message = group.failure(done, [])
    assert message == (
        "The pipeline run failed on rank 1 (mac2.local): the ranks could not connect to "
        "each other ([ring] Couldn't connect (error: 111)). Check that each machine reaches "
        "the others at the hostfile's addresses and that no other program uses the ring's "
        "ports")


def test_a_mac_that_never_starts_its_rank_is_named_when_the_wait_ends(
        stand_in, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(link, "CONNECT_TIMEOUT", 1.0)
    # Rank 0 (this Mac) beat; rank 1 on the other Mac never did.
    monkeypatch.setattr(StandIn, "_beats", {0: 1.0}, raising=False)
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text('{"hosts": [{"ssh": "127.0.0.1", "ips": ["127.0.0.1"]}, '
                        '{"ssh": "mac2.local", "ips": ["10.0.0.2"]}]}', encoding="utf-8")
    seen = Seen()
    started = Link(["--model", "m"], 2, hostfile, seen.messages.append,
                   lambda _link, message: seen.lost.append(message), seen.notices.append)
    started.start()
    assert not started.connect()
    for thread in started._threads:
        thread.join(10)
    assert seen.lost == [
        "The pipeline run failed: rank 0 did not connect within 1 s: rank 1 (mac2.local) "
        "never started. Check that each machine is awake and reaches the others at the "
        f"hostfile's addresses. {RESTART_HINT}"]
