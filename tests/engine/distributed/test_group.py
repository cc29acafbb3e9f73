"""The group watcher: a rank that falls silent ends its group, named, in bounded time."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from engine.distributed import group as group_module
from engine.distributed.group import Group

# Stands in for mlx.launch: relays two ranks' beats, then rank 1 falls silent.
_RANKS = textwrap.dedent("""
    import sys, time
    for second in range(600):
        print("longleaf:alive 0", file=sys.stderr, flush=True)
        if second < 2:
            print("longleaf:alive 1", flush=True)  # over ssh -tt: on stdout
        print("ordinary output", file=sys.stderr, flush=True)
        time.sleep(0.1)
""")


def test_a_rank_that_stops_beating_ends_the_group_naming_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(group_module, "STALL_SECONDS", 1.0)
    group = Group([sys.executable, "-c", _RANKS], {}, tmp_path, 2)
    started = time.monotonic()
    done, lost = group.watch()
    took = time.monotonic() - started
    assert lost == [1] and group.stalled == [1]
    assert took < 10.0, f"the stall was noticed after {took:.1f} s"
    message = group.failure(done, lost)
    assert message.startswith("The pipeline run failed on rank 1 (this machine): it stopped "
                              "responding"), message
    # Beats never reach the output kept for messages; the rest does.
    assert "longleaf:alive" not in done.stdout + done.stderr
    assert "ordinary output" in done.stderr


def test_a_rank_that_reported_may_fall_silent(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(group_module, "STALL_SECONDS", 0.5)
    (tmp_path / "rank1.json").write_text("{}", encoding="utf-8")
    quiet = textwrap.dedent("""
        import sys, time
        print("longleaf:alive 1", file=sys.stderr, flush=True)
        time.sleep(2.5)
    """)
    done, lost = Group([sys.executable, "-c", quiet], {}, tmp_path, 2).watch()
    assert done.returncode == 0 and lost == []


@pytest.mark.parametrize(("hosts", "fill"), [
    (None, group_module.STDIN_FILL),
    (["127.0.0.1", "127.0.0.1"], group_module.STDIN_FILL),
    (["127.0.0.1", "studio.local"], 0),  # a terminal over ssh -tt: it would echo it
])
def test_the_launchers_stdin_is_filled_and_stays_open_while_it_runs(
        tmp_path: Path, hosts: list[str] | None, fill: int) -> None:
    # Stands in for mlx.launch forwarding stdin: everything written arrives, and
    # no end of file follows while the run lasts (mlx.launch spins at one).
    reader = textwrap.dedent(f"""
        import select, sys
        got = 0
        while got < {fill}:
            chunk = sys.stdin.buffer.read1(1 << 16)
            if not chunk:
                sys.exit("end of file after " + str(got) + " bytes")
            got += len(chunk)
        readable, _, _ = select.select([sys.stdin], [], [], 1.0)
        print("open" if not readable else "more or end of file")
    """)
    done, lost = Group([sys.executable, "-c", reader], {}, tmp_path, 1, hosts).watch()
    assert (done.returncode, lost) == (0, []), done.stderr
    assert done.stdout.strip() == "open"


def test_a_killed_rank_is_named_killed_whatever_the_others_printed(tmp_path: Path) -> None:
    # The peer it left reports the lost link as an error line, before or after the
    # launcher notices the kill: the kill is the cause.
    group = Group([sys.executable, "-c", "pass"], {}, tmp_path, 2)
    group.watch()
    stderr = ("error: The engine hit an unexpected error (RuntimeError: [ring] connection "
              "to a peer was lost).\nNode with rank 1 exited with code -9\n")
    done = subprocess.CompletedProcess([], 1, "", stderr)
    message = group.failure(done, [1])
    assert message == ("The pipeline run failed on rank 1 (this machine): its process was "
                       "killed (signal 9)")
    # A rank that ends with its own error says it.
    done = subprocess.CompletedProcess([], 1, "", "error: No room.\nNode with rank 1 "
                                                  "exited with code 1\n")
    assert group.failure(done, [1]).endswith("(this machine): error: No room.")


def test_a_killed_rank_is_the_cause_even_when_its_peer_was_seen_to_end_first(
        tmp_path: Path) -> None:
    # The launcher may end before the watcher polls: no rank is known lost, and the
    # peer's error on the lost link was the first end mlx.launch saw.
    group = Group([sys.executable, "-c", "pass"], {}, tmp_path, 2)
    group.watch()
    stderr = ("error: The engine hit an unexpected error (RuntimeError: [ring] connection "
              "to a peer was lost).\nNode with rank 0 exited with code 1\n"
              "Node with rank 1 exited with code -9\n")
    message = group.failure(subprocess.CompletedProcess([], 1, "", stderr), [0, 1])
    assert message == ("The pipeline run failed on rank 1 (this machine): its process was "
                       "killed (signal 9)")
    # Ranks the launcher stopped (SIGTERM) followed the first to end: that one is named.
    stderr = ("error: No room.\nNode with rank 1 exited with code 1\n"
              "Node with rank 0 exited with code -15\n")
    message = group.failure(subprocess.CompletedProcess([], 1, "", stderr), [0, 1])
    assert message == "The pipeline run failed on rank 1 (this machine): error: No room."


def test_a_remote_ranks_own_error_is_quoted_from_its_ssh_terminal(tmp_path: Path) -> None:
    # Over ssh -tt a remote rank's stderr arrives on the launcher's stdout, with
    # terminal line ends; its local peer reports only the link it lost.
    group = Group([sys.executable, "-c", "pass"], {}, tmp_path, 2, ["127.0.0.1", "mac2.local"])
    group.watch()
    stdout = "error: This Mac has no room for the model's layers.\r\n"
    stderr = ("error: The engine hit an unexpected error (RuntimeError: [ring] connection "
              "to a peer was lost).\nNode with rank 1 exited with code 1\n")
    message = group.failure(subprocess.CompletedProcess([], 1, stdout, stderr), [1])
    assert message == ("The pipeline run failed on rank 1 (mac2.local): error: This Mac has "
                       "no room for the model's layers.")
