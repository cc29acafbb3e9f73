"""``mx.compile`` for the cache's elementwise chains, with regions a graph count can see.

A compiled function's elementwise ops run as one GPU kernel, but a traced graph
(``mx.export_function``) lists them unfused. While :func:`marking` is on, a
function made by :func:`compiled` runs uncompiled with each input marked as an
entry (``mx.depends`` on itself once) and each output as an exit (on itself
twice), so a counter can tell which ops MLX would fuse
(``benchmarks.graph_count``). Off (always, outside a count), the call is the
compiled function itself.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx

_marking = False


def compiled(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``mx.compile(fn)``, compiled on first call (importing calls no MLX function)."""

    @functools.cache
    def fused() -> Callable[..., Any]:
        return mx.compile(fn)

    @functools.wraps(fn)
    def call(*args: mx.array) -> Any:
        if _marking:
            return _marked(fn, args)
        return fused()(*args)

    return call


def _marked(fn: Callable[..., Any], args: tuple[mx.array, ...]) -> Any:
    out = fn(*(mx.depends([a], [a])[0] for a in args))
    if isinstance(out, tuple):
        return tuple(mx.depends([o], [o, o])[0] for o in out)
    return mx.depends([out], [out, out])[0]


@contextlib.contextmanager
def marking() -> Iterator[None]:
    """Mark compiled regions in the graphs built inside the block (graph counts only)."""
    global _marking
    before, _marking = _marking, True
    try:
        yield
    finally:
        _marking = before
