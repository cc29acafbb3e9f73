"""Before a pipeline starts: can each host of an MLX hostfile run its rank?

``mlx.launch`` starts every rank with this machine's Python at the same path
and in the same folder, over ``ssh`` (except for 127.0.0.1, which it starts
here). So each host is asked the same way: this module runs there as
``python -m engine.distributed.hosts FOLDER`` and prints what that host has
(its Longleaf version, its network addresses and the model folder's weight
digest), and the answers are compared with this machine's and the hostfile's:
each host must own the addresses the hostfile gives its ring links, else the
ranks would wait for each other at start. Nothing here loads MLX; a check of a large
model hashes its weights once per machine (the digests are cached by
``engine.snapshots.fingerprint``).
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import psutil

from engine.distributed.launch import LOCAL_HOSTS, read_hostfile, ring_addresses
from engine.errors import EngineError

CONNECT_TIMEOUT_S = 5  # ssh's own: how long a host may take to answer at all
PROBE_TIMEOUT_S = 300.0  # a first check of a large model hashes all its weights
SSH_FAILED = 255  # ssh's exit status when it could not connect or log in


@dataclass(frozen=True)
class HostCheck:
    """One hostfile entry's verdict, in rank order; ``message`` names the host."""

    host: str
    ok: bool
    message: str


def longleaf_version() -> str:
    """This installation's version, as every rank must run the same one."""
    try:
        return metadata.version("longleaf")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "source"


def probe(model_folder: str | None) -> dict[str, Any]:
    """What this machine has: its Longleaf version, addresses and the model folder's digest.

    ``model`` is ``{"digest": ...}``, or ``{"error": ...}`` when the folder is
    missing or unreadable here; absent without a folder to check.
    """
    facts: dict[str, Any] = {"version": longleaf_version(), "host": socket.gethostname(),
                             "addresses": own_addresses()}
    if model_folder is not None:
        if not Path(model_folder).is_dir():
            facts["model"] = {"error": "missing"}
        else:
            from engine.snapshots.fingerprint import model_fingerprint

            try:
                facts["model"] = {"digest": model_fingerprint(model_folder)["digest"]}
            except EngineError as error:
                facts["model"] = {"error": str(error)}
    return facts


def own_addresses() -> list[str]:
    """Every IPv4 and IPv6 address of this machine's network interfaces."""
    families = (socket.AF_INET, socket.AF_INET6)
    return sorted({address.address.split("%")[0]  # an IPv6 link-local's zone
                   for addresses in psutil.net_if_addrs().values()
                   for address in addresses if address.family in families})


def probe_command(host: str, model_folder: str | None,
                  connect_timeout: int = CONNECT_TIMEOUT_S) -> list[str]:
    """The command that asks ``host`` for its facts, as mlx.launch would start a rank there."""
    command = [sys.executable, "-m", "engine.distributed.hosts"]
    if model_folder is not None:
        command.append(model_folder)
    if host in LOCAL_HOSTS:
        return command
    # Like mlx.launch: the same folder when the host has it, then this Python.
    remote = f"cd {shlex.quote(os.getcwd())} 2>/dev/null; exec {shlex.join(command)}"
    return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={connect_timeout}",
            "-o", "LogLevel=ERROR", host, remote]


def _ask(host: str, model_folder: str | None, connect_timeout: int,
         timeout: float) -> dict[str, Any] | str:
    """The host's facts, or why it could not be asked (a sentence without the host)."""
    try:
        done = subprocess.run(probe_command(host, model_folder, connect_timeout),
                              capture_output=True, text=True, timeout=timeout,
                              stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return "ssh is not installed on this Mac"
    except subprocess.TimeoutExpired:
        return f"did not answer within {timeout:.0f} s"
    last = next((line for line in reversed(done.stderr.splitlines()) if line.strip()), "")
    if done.returncode == SSH_FAILED and host not in LOCAL_HOSTS:
        return (f"cannot be reached by ssh ({last or 'no reason given'}); make sure "
                f"`ssh {host}` logs in without a password (ssh-copy-id) and Remote Login "
                "is on in that Mac's Sharing settings")
    if done.returncode != 0:
        return (f"cannot run Longleaf's Python at {sys.executable} "
                f"({last or f'exit status {done.returncode}'}); install Longleaf at the "
                "same path as on this Mac")
    try:
        facts = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return "answered something other than Longleaf's host check; update Longleaf there"
    return facts if isinstance(facts, dict) else "answered an unreadable host check"


def verdict(rank: int, host: str, here: dict[str, Any], there: dict[str, Any] | str,
            model_folder: str | None, ring: Sequence[str] = ()) -> HostCheck:
    """Compare one host's facts with this machine's and with the addresses the
    hostfile gives its ring links (``ring``); the message names the host."""
    name = f"Rank {rank} ({host})"
    if isinstance(there, str):
        return HostCheck(host, False, f"{name} {there}.")
    if there.get("version") != here["version"]:
        return HostCheck(host, False,
                         f"{name} runs Longleaf {there.get('version')}, this Mac runs "
                         f"{here['version']}: install the same version on both.")
    owned = set(there.get("addresses") or ())
    # A host that does not list its addresses (a source tree of other code) is
    # not refused for it: mlx.launch then says at start which link fails.
    missing = [address for address in ring if address not in owned] if owned else []
    if missing:
        shown = ", ".join(sorted(owned - {"127.0.0.1", "::1"})[:4]) or "none but loopback"
        return HostCheck(host, False,
                         f"{name} does not have the address {', '.join(missing)} the "
                         f"hostfile gives its link to the other Macs (it has {shown}): "
                         "set that address on its Thunderbolt Bridge or network "
                         "interface, or correct the hostfile's \"ips\".")
    if model_folder is None:
        return HostCheck(host, True, f"{name}: reachable, Longleaf {here['version']} "
                                     "(no model folder to compare).")
    model = there.get("model") or {}
    if model.get("error") == "missing":
        return HostCheck(host, False, f"{name} has no folder {model_folder}: copy the "
                                      "model there, at the same path as on this Mac.")
    if "error" in model:
        return HostCheck(host, False, f"{name} cannot read the model: {model['error']}")
    ours = (here.get("model") or {}).get("digest")
    if model.get("digest") != ours:
        return HostCheck(host, False,
                         f"{name} has other weights in {model_folder} (digest "
                         f"{str(model.get('digest'))[:12]}…, this Mac {str(ours)[:12]}…): "
                         "copy the model folder again.")
    return HostCheck(host, True, f"{name}: reachable, Longleaf {here['version']}, same "
                                 f"model (digest {str(ours)[:12]}…).")


def check_hosts(hostfile: Path, model_folder: str | Path | None,
                connect_timeout: int = CONNECT_TIMEOUT_S,
                timeout: float = PROBE_TIMEOUT_S) -> list[HostCheck]:
    """Whether each host of ``hostfile`` can run its rank of ``model_folder``.

    Each distinct host is asked once (concurrently), over ssh with key login only
    (``BatchMode``), except 127.0.0.1, which is asked here as mlx.launch starts it.
    The first host must be this machine as 127.0.0.1: the app runs rank 0 there.

    Args:
        hostfile: an MLX hostfile (JSON, as ``mlx.launch --hostfile`` reads it).
        model_folder: the model every rank must hold at the same path with the
            same weights; None checks reachability and versions only.
        connect_timeout: seconds ssh waits for a host to answer.
        timeout: seconds one host's whole check may take.

    Returns:
        One ``HostCheck`` per hostfile entry, rank 0 first.

    Raises:
        EngineError: the hostfile is missing or not an MLX hostfile (its message),
            or this machine cannot read the model folder.
    """
    hosts = read_hostfile(Path(hostfile))
    folder = None if model_folder is None else str(Path(model_folder).resolve())
    here = probe(folder)
    if folder is not None and "error" in here["model"]:
        reason = here["model"]["error"]
        raise EngineError(f"This Mac cannot read the model folder {folder}"
                          f"{'' if reason == 'missing' else f': {reason}'}.")
    distinct = list(dict.fromkeys(hosts))
    with ThreadPoolExecutor(max_workers=len(distinct)) as pool:
        answers = dict(zip(distinct, pool.map(
            lambda host: _ask(host, folder, connect_timeout, timeout), distinct), strict=True))
    rings = ring_addresses(Path(hostfile))
    checks = [verdict(rank, host, here, answers[host], folder, rings[rank])
              for rank, host in enumerate(hosts)]
    if (why := rank_zero_problem(hosts)):
        checks[0] = HostCheck(hosts[0], False, why)
    return checks


def rank_zero_problem(hosts: Sequence[str]) -> str:
    """Why a hostfile's first host cannot be the app's rank 0 ("" when it can):
    Longleaf runs the first machine itself."""
    if hosts and hosts[0] not in LOCAL_HOSTS:
        return (f"Rank 0 ({hosts[0] or 'a host with no ssh name'}) must be this Mac: "
                "Longleaf runs the first machine itself. Put 127.0.0.1 first in the "
                "hostfile.")
    return ""


def main(argv: Sequence[str]) -> int:
    """Print this machine's facts as one JSON line (what ``check_hosts`` reads)."""
    print(json.dumps(probe(argv[0] if argv else None)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
