"""The ring backend's floor: what a decode step's messages cost between two local ranks.

Run by the pipeline benchmark as ``mlx.launch -n 2 --backend ring python -m
benchmarks.ring_floor``: bare messages of the sizes a decode step of the tiny
model sends (the command header, the stage's hidden state, mlx-lm's final
``all_gather``), each evaluated alone and timed on rank 0, and the CPU time a
rank burns while it waits in a receive (the ring backend polls its sockets).
Rank 0 prints one JSON line.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Callable

import mlx.core as mx

ROUNDS = 200
WARMUP = 20
WAIT_SECONDS = 0.5


def _timed(fn: Callable[[], None], rounds: int = ROUNDS) -> float:
    """Mean milliseconds of ``fn`` over ``rounds`` calls, after a warm-up."""
    for _ in range(WARMUP):
        fn()
    started = time.perf_counter()
    for _ in range(rounds):
        fn()
    return (time.perf_counter() - started) / rounds * 1e3


def _cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    group = mx.distributed.init()
    rank = group.rank()
    header = mx.zeros((8,), dtype=mx.int32)
    hidden = mx.zeros((1, 1, 64), dtype=mx.float16)

    def send_recv(values: mx.array) -> Callable[[], None]:
        def once() -> None:
            if rank == 0:
                mx.eval(mx.distributed.send(values, 1, group=group))
                mx.eval(mx.distributed.recv_like(values, 1, group=group))
            else:
                mx.eval(mx.distributed.recv_like(values, 0, group=group))
                mx.eval(mx.distributed.send(values, 0, group=group))
        return once

    def gather(values: mx.array) -> Callable[[], None]:
        return lambda: mx.eval(mx.distributed.all_gather(values, group=group))

    # A round trip is two messages: halve it for one.
    row = {
        "header send/recv ms": _timed(send_recv(header)) / 2,
        "hidden send/recv ms": _timed(send_recv(hidden)) / 2,
        "header all_gather ms": _timed(gather(header)),
        "hidden all_gather ms": _timed(gather(hidden)),
        "header all_sum ms": _timed(lambda: mx.eval(mx.distributed.all_sum(header, group=group))),
    }
    # Rank 1 sleeps while rank 0 waits in a receive: the CPU rank 0 spends waiting.
    cpu, wall = _cpu_seconds(), time.perf_counter()
    if rank == 1:
        time.sleep(WAIT_SECONDS)
        mx.eval(mx.distributed.send(header, 0, group=group))
    else:
        mx.eval(mx.distributed.recv_like(header, 1, group=group))
    row["cpu while waiting, share of a core"] = (_cpu_seconds() - cpu) / (
        time.perf_counter() - wall)
    if rank == 0:
        row["load average"] = os.getloadavg()[0]
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
