"""Ranks on one machine: each gets its share of the BLAS threads."""

from __future__ import annotations

import os

import pytest

from engine.distributed.launch import local_rank_env, rank_environment

CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def test_local_ranks_share_the_cores_and_a_users_thread_count_is_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENBLAS_NUM_THREADS", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    share = str(max(1, CORES // 2))
    assert local_rank_env(2) == {"OPENBLAS_NUM_THREADS": share, "OMP_NUM_THREADS": share}
    monkeypatch.setenv("OPENBLAS_NUM_THREADS", "3")
    assert local_rank_env(2)["OPENBLAS_NUM_THREADS"] == "3"


def test_only_the_ranks_on_this_machine_count_towards_its_share(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    # One rank here, one on another Mac: the rank here has every core.
    env = rank_environment("/tmp/x", 2, ["127.0.0.1", "studio.local"])
    assert env["OMP_NUM_THREADS"] == str(CORES)
    assert env["LONGLEAF_PIPELINE_DIR"] == "/tmp/x"
