"""What a lazy MLX graph would cost on a GPU: primitives, Metal kernels and bytes moved.

:func:`trace` records every primitive a function builds (``mx.export_function``
lists each with its inputs' and outputs' shapes and dtypes); :func:`tally` maps
each to the Metal kernels MLX dispatches for it and the bytes those kernels read
and write. The counts come from the graph alone, so they are exact and free of
noise on any machine; the mapping is MLX 0.32's Metal backend read from its
source, and it is an assumption wherever it says so below.

The mapping (``mlx/backend/metal``):

- **views, no kernel**: Broadcast, ExpandDims, Squeeze, Transpose, Slice, View,
  AsStrided, Depends, StopGradient, Split, and Reshape, Flatten and Unflatten of
  a row-contiguous array (of any other array: one copy kernel).
- **one kernel**: every elementwise op (unary, binary, Select, AsType), Reduce,
  ArgReduce, Softmax, LogSumExp, Matmul, GatherMM, Gather, Scatter, SliceUpdate
  (in place: its target is the sole owner of its buffer, as a cache's storage is),
  Arange, Full, Copy, Hadamard, RMSNorm, RoPE, and any primitive not named here
  (listed in :attr:`Tally.unknown`).
- **one kernel each, per shape**: QuantizedMatmul and GatherQMM are one kernel,
  except ``x @ w`` (not transposed) with fewer than 4 rows and an inner size of
  1024 or more, which MLX splits over K (``qvm_split_k``: two kernels);
  Concatenate copies each input with a kernel of its own.
- **fused attention** (``mx.fast.scaled_dot_product_attention``): recorded by
  :func:`fused_attention` as MLX's Metal path runs it, since the CPU backend
  traces the unfused fallback instead: one kernel (``sdpa_vector``), or two
  (``sdpa_vector_2pass``) with grouped-query heads over 4,096 keys or more; the
  fallback's ops where Metal falls back too (more than 8 queries at head_dim 256).
- **copies for layout**: Softmax and LogSumExp copy an input that is not
  row-contiguous, the quantized matmuls an input whose last two axes are not a
  row-major matrix (one kernel each).
- **compiled regions** (:func:`engine.cache.fusion.compiled`, traced under
  :func:`engine.cache.fusion.marking`): the elementwise ops of one region that
  feed each other run as one kernel, as ``mx.compile`` fuses them on the GPU.

``mx.export_function`` simplifies what it traces: identical ops on the same
inputs count once, and a ``Copy`` or ``stop_gradient`` that changes nothing is
dropped. Where a graph builds the same op twice, the GPU would run it twice
and the count says once.

Bytes: a kernel reads its inputs and writes its outputs once; a view costs
nothing and is read at its own size (never more than the buffer behind it), a
gather reads what it gathers (GatherQMM: each indexed matrix of ``w`` with its
scales and biases), a SliceUpdate reads and writes only the update.
"""

from __future__ import annotations

import collections
import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from engine.cache import fusion

ROW, MATRIX, STRIDED = "row", "matrix", "strided"

_VIEWS = frozenset({
    "Broadcast", "ExpandDims", "Squeeze", "Transpose", "Slice", "View", "AsStrided",
    "Depends", "StopGradient", "Split",
})
_RESHAPES = frozenset({"Reshape", "Flatten", "Unflatten"})
_ELEMENTWISE = frozenset({
    "Abs", "Add", "AsType", "BitwiseBinary", "BitwiseInvert", "Ceil", "Cos", "Divide",
    "Equal", "Erf", "ErfInv", "Exp", "Expm1", "Floor", "Greater", "GreaterEqual", "Less",
    "LessEqual", "Log", "Log1p", "LogAddExp", "LogicalAnd", "LogicalNot", "LogicalOr",
    "Maximum", "Minimum", "Multiply", "Negative", "NotEqual", "Power", "Remainder", "Round",
    "Rsqrt", "Select", "Sigmoid", "Sign", "Sin", "Sqrt", "Square", "Subtract", "Tanh",
})
_KNOWN_SINGLE = frozenset({
    "Reduce", "ArgReduce", "Softmax", "LogSumExp", "Matmul", "GatherMM", "Gather", "Scatter",
    "SliceUpdate", "Arange", "Full", "Copy", "Hadamard", "RMSNorm", "RoPE", "QuantizedMatmul",
    "GatherQMM", "Concatenate",
})
_ROW_INPUTS = frozenset({"Softmax", "LogSumExp"})
_MATRIX_INPUTS = frozenset({"QuantizedMatmul", "GatherQMM"})
_MARKER = "Depends"


@dataclass(frozen=True)
class Tensor:
    """One array of a traced graph: its name in the trace, shape and dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: mx.Dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.size


@dataclass(frozen=True)
class Node:
    """One primitive of a traced graph."""

    name: str
    inputs: tuple[Tensor, ...]
    outputs: tuple[Tensor, ...]
    arguments: tuple[Any, ...]


@dataclass
class Tally:
    """What a graph dispatches: primitives, kernels (by primitive) and bytes moved."""

    primitives: int = 0
    kernels: int = 0
    read: int = 0
    written: int = 0
    by_primitive: collections.Counter[str] = field(default_factory=collections.Counter)
    unknown: set[str] = field(default_factory=set)

    @property
    def traffic(self) -> int:
        return self.read + self.written

    def add(self, name: str, kernels: int, read: int, written: int) -> None:
        self.kernels += kernels
        self.read += read
        self.written += written
        if kernels:
            self.by_primitive[name] += kernels


@dataclass(frozen=True)
class FusedCall:
    """A fused attention call the trace does not show: its inputs and output."""

    queries: Tensor
    keys: Tensor
    values: Tensor
    mask: Tensor | None
    output: Tensor


_fused_calls: list[FusedCall] | None = None


def _tensor(entry: tuple[str, tuple[int, ...], mx.Dtype]) -> Tensor:
    name, shape, dtype = entry
    return Tensor(name, tuple(shape), dtype)


def _as_tensor(array: mx.array, name: str) -> Tensor:
    return Tensor(name, tuple(array.shape), array.dtype)


def trace(fun: Callable[..., Any], *args: mx.array) -> tuple[list[Node], list[FusedCall]]:
    """Every primitive ``fun(*args)`` builds, in order, and its fused attention calls.

    Compiled regions are marked (:func:`engine.cache.fusion.marking`) and
    ``mx.fast.scaled_dot_product_attention`` is recorded where Metal runs it
    fused (:func:`fused_attention`).
    """
    nodes: list[Node] = []

    def record(entry: dict[str, Any]) -> None:
        if entry["type"] == "primitive":
            nodes.append(Node(entry["name"], tuple(map(_tensor, entry["inputs"])),
                              tuple(map(_tensor, entry["outputs"])),
                              tuple(entry["arguments"])))

    with fusion.marking(), fused_attention() as calls:
        mx.export_function(record, fun, *args)
    return nodes, calls


@contextlib.contextmanager
def fused_attention() -> Iterator[list[FusedCall]]:
    """Record fused SDPA calls the way Metal runs them, instead of the CPU's fallback.

    Inside the block, a call Metal would run fused returns its queries unchanged
    (same shape and dtype as the output) and is listed; other calls run the
    original, whose fallback ops are what Metal runs too.
    """
    global _fused_calls
    original = mx.fast.scaled_dot_product_attention
    calls: list[FusedCall] = []

    def stand_in(q: mx.array, k: mx.array, v: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        mask = kwargs.get("mask", args[1] if len(args) > 1 else None)
        if not _metal_fuses(q, k, v):
            return original(q, k, v, *args, **kwargs)
        array_mask = mask if isinstance(mask, mx.array) else None
        calls.append(FusedCall(
            _as_tensor(q, f"sdpa{len(calls)}.q"), _as_tensor(k, f"sdpa{len(calls)}.k"),
            _as_tensor(v, f"sdpa{len(calls)}.v"),
            None if array_mask is None else _as_tensor(array_mask, f"sdpa{len(calls)}.mask"),
            _as_tensor(q, f"sdpa{len(calls)}.out")))
        return q

    before, _fused_calls = _fused_calls, calls
    mx.fast.scaled_dot_product_attention = stand_in
    try:
        yield calls
    finally:
        mx.fast.scaled_dot_product_attention = original
        _fused_calls = before


def _metal_fuses(q: mx.array, k: mx.array, v: mx.array) -> bool:
    """Whether MLX's Metal backend runs this SDPA fused (its ``use_fallback``)."""
    length, head_dim, gqa = q.shape[2], q.shape[-1], q.shape[1] // k.shape[1]
    if length > 8:
        return head_dim in (64, 72, 80, 96, 128) and head_dim == v.shape[-1]
    return head_dim == v.shape[-1] and head_dim in (64, 96, 128, 256) and length * gqa <= 32


def sdpa_kernels(call: FusedCall) -> int:
    """Metal kernels of a fused vector SDPA: two-pass for long grouped-query keys."""
    gqa = call.queries.shape[1] // call.keys.shape[1]
    return 2 if gqa > 1 and call.keys.shape[2] >= 4096 else 1


# -- layouts and buffers -----------------------------------------------------------------


def _slice_layout(layout: str, shape: tuple[int, ...], args: tuple[Any, ...]) -> str:
    start, stop, step = (tuple(a) for a in args)
    out = [max(0, -(-(e - s) // st)) for s, e, st in zip(start, stop, step, strict=True)]
    if layout == STRIDED or any(st != 1 and n > 1 for st, n in zip(step, out, strict=True)):
        return STRIDED
    cut = next((i for i, (o, full) in enumerate(zip(out, shape, strict=True)) if o != full), None)
    if cut is None:
        return layout
    row = all(out[i] == 1 for i in range(cut)) and all(
        out[i] == shape[i] for i in range(cut + 1, len(shape)))
    if row and layout == ROW:
        return ROW
    matrix = len(shape) < 2 or (out[-1] == shape[-1])
    return MATRIX if matrix else STRIDED


def _moved_layout(layout: str, shape: tuple[int, ...], perm: list[int]) -> str:
    kept = [axis for axis in perm if shape[axis] > 1]
    if kept == sorted(kept):
        return layout
    if len(perm) >= 2 and perm[-2:] == [len(perm) - 2, len(perm) - 1] and layout != STRIDED:
        return MATRIX
    return STRIDED


def _broadcast_layout(layout: str, source: Tensor, target: Tensor) -> str:
    if math.prod(source.shape) == math.prod(target.shape):
        return layout
    if layout != STRIDED and len(target.shape) >= 2 and source.shape[-2:] == target.shape[-2:]:
        return MATRIX
    return STRIDED


class _Graph:
    """Layout and backing bytes of every array of a trace, walked in order."""

    def __init__(self) -> None:
        self.layout: dict[str, str] = {}
        self.backing: dict[str, int] = {}

    def read(self, tensor: Tensor) -> int:
        return min(tensor.nbytes, self.backing.get(tensor.name, tensor.nbytes))

    def layout_of(self, tensor: Tensor) -> str:
        return self.layout.get(tensor.name, ROW)

    def view(self, node: Node) -> None:
        source, target = node.inputs[0], node.outputs[0]
        layout = self.layout_of(source)
        if node.name == "Slice":
            layout = _slice_layout(layout, source.shape, node.arguments)
        elif node.name == "Transpose":
            layout = _moved_layout(layout, source.shape, list(node.arguments[0]))
        elif node.name == "Broadcast":
            layout = _broadcast_layout(layout, source, target)
        for out in node.outputs:
            self.layout[out.name] = layout
            self.backing[out.name] = min(out.nbytes, self.read(source))

    def computed(self, node: Node) -> None:
        for out in node.outputs:
            self.layout[out.name] = ROW
            self.backing[out.name] = out.nbytes


def _marker(node: Node, copies: int) -> bool:
    """A fusion marker: ``Depends`` of one array on itself ``copies`` times."""
    names = {t.name for t in node.inputs}
    return node.name == _MARKER and len(node.inputs) == copies + 1 and len(names) == 1


def _regions(nodes: list[Node]) -> set[int]:
    """Indices of the nodes inside compiled regions (between the fusion markers)."""
    producer = {out.name: i for i, node in enumerate(nodes) for out in node.outputs}
    entries = {i for i, n in enumerate(nodes) if _marker(n, 1)}
    exits = {i for i, n in enumerate(nodes) if _marker(n, 2)}
    inside: set[int] = set()
    for i in exits:
        stack = [nodes[i].inputs[0].name]
        while stack:
            j = producer.get(stack.pop())
            if j is None or j in inside or j in entries or j in exits:
                continue
            inside.add(j)
            stack.extend(t.name for t in nodes[j].inputs)
    return inside


def _fused_groups(nodes: list[Node], inside: set[int]) -> list[list[int]]:
    """Connected elementwise ops of the compiled regions: one kernel each."""
    fusable = {i for i in inside if nodes[i].name in _ELEMENTWISE or nodes[i].name == "Broadcast"}
    parent = {i: i for i in fusable}

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    producer = {out.name: i for i, node in enumerate(nodes) for out in node.outputs}
    for i in fusable:
        for tensor in nodes[i].inputs:
            j = producer.get(tensor.name)
            if j in fusable:
                parent[root(i)] = root(j)
    groups: dict[int, list[int]] = collections.defaultdict(list)
    for i in sorted(fusable):
        groups[root(i)].append(i)
    return [g for g in groups.values() if any(nodes[i].name != "Broadcast" for i in g)]


def tally(nodes: list[Node], fused: list[FusedCall] = ()) -> Tally:  # type: ignore[assignment]
    """Kernels and bytes of a traced graph under the module's Metal mapping."""
    result = Tally(primitives=len(nodes) + len(fused))
    graph = _Graph()
    inside = _regions(nodes)
    groups = _fused_groups(nodes, inside)
    grouped = {i for g in groups for i in g}
    consumers = collections.Counter(t.name for n in nodes for t in n.inputs)
    for group in groups:
        _tally_group(result, graph, nodes, group, consumers)
    for index, node in enumerate(nodes):
        if index in grouped:
            continue
        if node.name == "Broadcast" and index in inside:
            graph.view(node)  # a compiled region's scalars: part of a fused kernel
            continue
        _tally_node(result, graph, node)
    for call in fused:
        reads = call.queries.nbytes + call.keys.nbytes + call.values.nbytes
        reads += 0 if call.mask is None else call.mask.nbytes
        result.add("ScaledDotProductAttention", sdpa_kernels(call), reads, call.output.nbytes)
    return result


def _tally_group(result: Tally, graph: _Graph, nodes: list[Node], group: list[int],
                 consumers: collections.Counter[str]) -> None:
    made = {out.name for i in group for out in nodes[i].outputs}
    used_inside = collections.Counter(t.name for i in group for t in nodes[i].inputs)
    # A fused kernel takes its scalar constants as arguments, not from memory.
    reads = sum(graph.read(t) for t in {t for i in group for t in nodes[i].inputs}
                if t.name not in made and t.shape)
    written = 0
    for i in group:
        graph.computed(nodes[i])
        for out in nodes[i].outputs:
            if consumers[out.name] > used_inside[out.name] or consumers[out.name] == 0:
                written += out.nbytes
    result.add("Compiled", 1, reads, written)


def _tally_node(result: Tally, graph: _Graph, node: Node) -> None:
    name = node.name
    if name in _VIEWS:
        graph.view(node)
        return
    if name in _RESHAPES:
        source = node.inputs[0]
        if graph.layout_of(source) == ROW:
            graph.view(node)
        else:
            result.add("Copy (reshape)", 1, graph.read(source), node.outputs[0].nbytes)
            graph.computed(node)
        return
    _layout_copies(result, graph, node)
    kernels, reads, written = _kernel_cost(graph, node)
    if name not in _ELEMENTWISE and name not in _KNOWN_SINGLE:
        result.unknown.add(name)
    result.add(name, kernels, reads, written)
    graph.computed(node)


def _layout_copies(result: Tally, graph: _Graph, node: Node) -> None:
    if node.name in _ROW_INPUTS:
        needs = [t for t in node.inputs if graph.layout_of(t) != ROW]
    elif node.name in _MATRIX_INPUTS:
        needs = [t for t in node.inputs[:4] if graph.layout_of(t) == STRIDED]
    else:
        return
    for tensor in needs:
        result.add("Copy (layout)", 1, graph.read(tensor), tensor.nbytes)


def _kernel_cost(graph: _Graph, node: Node) -> tuple[int, int, int]:
    """(kernels, bytes read, bytes written) of one primitive that dispatches work."""
    name, out = node.name, node.outputs[0]
    written = sum(t.nbytes for t in node.outputs)
    if name == "Concatenate":
        return len(node.inputs), sum(graph.read(t) for t in node.inputs), written
    if name == "SliceUpdate":
        update = node.inputs[1]
        return 1, graph.read(update), update.nbytes
    if name == "Gather":
        return 1, out.nbytes + sum(graph.read(t) for t in node.inputs[1:]), written
    if name in ("Full", "Arange"):
        return 1, 0, written
    if name == "GatherQMM":
        return 1, _gather_qmm_reads(graph, node), written
    reads = sum(graph.read(t) for t in node.inputs)
    if name == "QuantizedMatmul" and _splits_over_k(node):
        # qvm_split_k: partial products per split, then a reduction over them.
        partial = 32 * written if node.inputs[0].shape[-1] > 8192 else 8 * written
        return 2, reads + partial, written + partial
    return 1, reads, written


def _gather_qmm_reads(graph: _Graph, node: Node) -> int:
    x, w, *rest = node.inputs
    indices = node.inputs[-1]
    experts = math.prod(w.shape[:-2]) or 1
    matrices = math.prod(indices.shape)
    per_expert = sum(t.nbytes for t in (w, *rest[:-2])) // experts
    return graph.read(x) + sum(graph.read(t) for t in node.inputs[-2:]) + matrices * per_expert


def _splits_over_k(node: Node) -> bool:
    """MLX's ``x @ w`` (not transposed) with fewer than 4 rows and K >= 1024."""
    transpose = bool(node.arguments[-1]) if node.arguments else True
    x = node.inputs[0]
    rows = x.shape[-2] if len(x.shape) >= 2 else 1
    return not transpose and rows < 4 and x.shape[-1] >= 1024
