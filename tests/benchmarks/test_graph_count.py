"""The graph counter: kernels and bytes of small graphs whose Metal dispatches are known."""

from __future__ import annotations

import mlx.core as mx

from benchmarks import graph_count
from engine.cache import fusion


def _count(fun, *args):
    nodes, fused = graph_count.trace(fun, *args)
    return graph_count.tally(nodes, fused)


def test_views_cost_nothing_and_each_op_is_one_kernel():
    x = mx.zeros((4, 8))
    counted = _count(lambda a: (mx.exp(a[:, :4].T) + 1).sum(axis=0), x)
    # Exp, Add, Reduce dispatch; Slice, Transpose and the scalar's Broadcast are views.
    assert counted.kernels == 3
    assert counted.by_primitive == {"Exp": 1, "Add": 1, "Reduce": 1}


def test_a_reshape_of_a_transposed_array_copies_it():
    x = mx.zeros((4, 8), mx.float16)
    assert _count(lambda a: a.reshape(8, 4), x).kernels == 0
    counted = _count(lambda a: a.T.reshape(32), x)
    assert counted.kernels == 1
    assert counted.read == counted.written == x.nbytes


def test_a_compiled_region_is_one_kernel_for_its_elementwise_ops():
    chain = fusion.compiled(lambda a: mx.exp(a * 2 + 1) - a)
    x = mx.zeros((16,))
    counted = _count(chain, x)
    assert counted.kernels == 1
    # Read once, written once: its intermediates never reach memory.
    assert counted.read == x.nbytes and counted.written == x.nbytes


def test_a_reduction_splits_a_compiled_region():
    normalize = fusion.compiled(lambda a: (a - a.max(axis=-1, keepdims=True)) * 2)
    counted = _count(normalize, mx.zeros((4, 8)))
    assert counted.kernels == 2  # the max, then one fused subtract-and-scale


def test_uncompiled_chains_stay_one_kernel_per_op():
    counted = _count(lambda a: mx.exp(a * 2 + 1) - a, mx.zeros((16,)))
    assert counted.kernels == 4


def test_concatenate_copies_each_input():
    counted = _count(lambda a, b, c: mx.concatenate([a, b, c]), *(mx.zeros((4,)),) * 3)
    assert counted.kernels == 3


def test_a_gather_qmm_reads_only_the_matrices_it_indexes():
    w = mx.zeros((8, 32, 16), mx.uint32)  # 8 matrices of 32 rows, 128 values at 4 bits
    scales = mx.zeros((8, 32, 1), mx.float16)
    x = mx.zeros((2, 1, 128), mx.float16)
    rows, picked = mx.array([0, 1], dtype=mx.uint32), mx.array([1, 5], dtype=mx.uint32)
    counted = _count(
        lambda x, w, s, b, i, j: mx.gather_qmm(x, w, s, b, lhs_indices=i, rhs_indices=j,
                                                transpose=True, group_size=128, bits=4),
        x, w, scales, scales, rows, picked)
    per_matrix = (w.nbytes + 2 * scales.nbytes) // 8
    assert counted.kernels == 1
    assert counted.read == x.nbytes + rows.nbytes + picked.nbytes + 2 * per_matrix


def test_a_vector_quantized_matmul_over_a_long_k_splits_in_two_kernels():
    w = mx.zeros((2048, 16), mx.uint32)  # K = 2048 rows, 128 values at 4 bits
    scales = mx.zeros((2048, 1), mx.float16)
    one_row = mx.zeros((1, 2048), mx.float16)

    def matmul(x, w, s):
        return mx.quantized_matmul(x, w, s, s, transpose=False, group_size=128, bits=4)

    assert _count(matmul, one_row, w, scales).kernels == 2
    assert _count(matmul, mx.zeros((4, 2048), mx.float16), w, scales).kernels == 1


def test_fused_attention_is_counted_as_metal_runs_it():
    q = mx.zeros((1, 16, 1, 256), mx.float16)
    short, long = (mx.zeros((1, 4, n, 256), mx.float16) for n in (1024, 8192))

    def attend(q, k):
        return mx.fast.scaled_dot_product_attention(q, k, k, scale=1.0)

    one_pass, two_pass = _count(attend, q, short), _count(attend, q, long)
    assert one_pass.kernels == 1 and two_pass.kernels == 2
    assert one_pass.read == q.nbytes + 2 * short.nbytes
    # More than 8 queries at head_dim 256: Metal runs the unfused ops, and so do we.
    assert _count(attend, mx.zeros((1, 16, 16, 256), mx.float16), short).kernels > 2
