"""Which schedule the attention walks the pages with, and the host syncs it costs.

Two schedules compute the same online softmax over the same page blocks; they
differ in how a block is kept from running before the one ahead of it has merged:

- ``cpu``: the host evaluates each block's softmax state before building the
  next (one host synchronization per block). On the CPU backend that is free
  (the host thread is the device) and bounds the transient to one block.
- ``gpu``: the next block's stored pages are made to depend on the running state
  inside the graph (``mx.depends``), so a decode step or a prefill chunk is one
  lazy graph with no host synchronization inside the attention. On Metal or CUDA
  each synchronization is a command-buffer commit and a wait with the device
  idle; a count that grows with the context bounds 262k tokens by round trips.

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
