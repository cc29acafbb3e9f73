"""Ranks on one machine: each gets its share of BLAS threads and, pinned, of the cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from engine.distributed.launch import LOCAL_RANKS, local_rank_env

CORES = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []


def test_local_ranks_share_the_cores_and_a_users_thread_count_is_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    share = str(max(1, (len(CORES) or os.cpu_count() or 1) // 2))
    env = local_rank_env(2, 2)
    assert env == {"OPENBLAS_NUM_THREADS": share, "OMP_NUM_THREADS": share, LOCAL_RANKS: "2"}
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    assert local_rank_env(2, 2)["OPENBLAS_NUM_THREADS"] == "3"
    # One rank here, one on another machine: threads shared out, nobody pinned.
    assert LOCAL_RANKS not in local_rank_env(1, 2)


PIN = """
import json, os, threading
from engine.distributed.commands import share_cores

class Group:
    def rank(self): return 1
    def size(self): return 2

share_cores(Group())
later = {}
worker = threading.Thread(target=lambda: later.update(cpus=sorted(os.sched_getaffinity(0))))
worker.start(); worker.join()
print(json.dumps({"threads": [sorted(os.sched_getaffinity(int(t)))
                              for t in os.listdir("/proc/self/task")], "later": later["cpus"]}))
"""


def _pinned(extra_env: dict[str, str]) -> dict:
    env = {key: value for key, value in os.environ.items() if key != LOCAL_RANKS}
    done = subprocess.run([sys.executable, "-c", PIN], env={**env, **extra_env},
                          capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no thread pinning here")
def test_a_local_rank_pins_every_thread_to_its_share_and_new_threads_follow() -> None:
    share = max(1, len(CORES) // 2)
    start = share % len(CORES)
    mine = CORES[start:start + share]
    seen = _pinned({LOCAL_RANKS: "2"})
    assert all(cpus == mine for cpus in seen["threads"])
    assert seen["later"] == mine
    # Not every rank local (or not launched by us): nothing is pinned.
    assert _pinned({})["later"] == CORES
