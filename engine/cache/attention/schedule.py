"""Which schedule the attention runs, and the host syncs it costs.

Two schedules read the same stored pages and give the same outputs within the
compute dtype's rounding; they differ in how they are cut into work:

- ``cpu``: blocks of columns dequantized in fp32 and merged into an online
  softmax, the host evaluating each block's state before building the next (one
  host synchronization per block). On the CPU backend that is free (the host
  thread is the device) and bounds the transient to one block
  (:mod:`engine.cache.attention.block_walk`).
- ``gpu``: a decode step reads every column with one op per part of the storage,
  and a prefill chunk's blocks wait for the state before them inside the graph
  (``mx.depends``), so either is one lazy graph with no host synchronization and
  a fixed few kernels per block (:mod:`engine.cache.attention.gpu`). On Metal or
  CUDA each synchronization is a command-buffer commit and a wait with the device
  idle, and each kernel a launch: counts that grow with the context would bound
  262k tokens by round trips and launches.

The default follows the backend (asked once, on the first attention call, which
runs on the engine thread); ``LONGLEAF_ATTENTION_SCHEDULE=gpu|cpu`` forces either,
read at that same first call. Every host synchronization the attention makes
goes through :func:`host_sync`, which counts them (:func:`host_syncs`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import mlx.core as mx

from engine.errors import EngineError

ENV_VAR = "LONGLEAF_ATTENTION_SCHEDULE"
CPU = "cpu"
GPU = "gpu"
SCHEDULES = (CPU, GPU)

_chosen: str | None = None
_syncs = 0


def backend_schedule() -> str:
    """The schedule the default device calls for: ``gpu`` on Metal or CUDA, else ``cpu``.

    Asks MLX for the device: call it on the engine thread only.
    """
    return GPU if mx.default_device().type == mx.gpu else CPU


def parse(value: str) -> str:
    """``value`` as a schedule name, or an EngineError naming the accepted ones."""
    name = value.strip().lower()
    if name not in SCHEDULES:
        raise EngineError(
            f"{ENV_VAR}={value!r} is not a schedule; set it to 'gpu' or 'cpu', or unset it "
            "to let the backend choose."
        )
    return name


def current() -> str:
    """The schedule every attention call uses, chosen on the first call and kept."""
    global _chosen
    if _chosen is None:
        forced = os.environ.get(ENV_VAR, "")
        _chosen = parse(forced) if forced.strip() else backend_schedule()
    return _chosen


@contextlib.contextmanager
def forced(name: str) -> Iterator[None]:
    """Run the attention with schedule ``name`` inside the block (tests, the bench)."""
    global _chosen
    before, _chosen = _chosen, parse(name)
    try:
        yield
    finally:
        _chosen = before


def host_sync(arrays: Any) -> None:
    """``mx.eval(arrays)``, counted: the attention's only host synchronization point."""
    global _syncs
    _syncs += 1
    mx.eval(arrays)


def host_syncs() -> int:
    """Host synchronizations the attention has made in this process so far.

    The difference across a decode step or a prefill chunk is what that step cost.
    """
    return _syncs
