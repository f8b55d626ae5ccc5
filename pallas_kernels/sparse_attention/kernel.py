"""Sparse MQA attention with a sink — portable Pallas kernel (Triton backend; interpret mode on CPU).

Design: one program per (head block, token, split). It loads the token's [block_h, d] queries once,
then walks its share of the token's row lists — blocks of list A, then blocks of list B — gathering
`block_k` rows per step by index and updating an online softmax (m, den, acc in f32). MQA makes the
[block_h, d] x [d, block_k] matmul the natural shape: one gathered K block serves every head.

Only "live" blocks are visited: each program finds, in its token's index rows, the last valid slot of
each list, so padding (-1 tails, e.g. HCA lists shorter than nb) costs nothing. Pools and index rows
are passed whole and read in place (no padding, no copies, no XLA ops around the call).
With one split the kernel adds the sink and writes the output; with several it writes partials
(acc, m, den) merged by `reference.merge_partials` / `finalize_partials` (the spec's merge rule).

FP8 pools (E4M3 values plus one f32 scale per row, either list or both): the gathered tile is converted exactly
to q's dtype in registers (`pallas_kernels._fp8`) and its row scales multiply the logits and the probabilities,
so the kernel reads one byte per cached value and never a dequantized copy.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend, _fp8
from pallas_kernels._util import cdiv, next_pow2, round_up
from pallas_kernels.sparse_attention.blocks import BlockSizes, choose_num_splits
from pallas_kernels.sparse_attention.reference import finalize_partials, merge_partials
from pallas_kernels.sparse_attention.validate import validate_sparse_attention_static


def _live_blocks(idx_ref, n: int, block_k: int):
    """Blocks of a row list up to its last valid slot (interior -1 slots are masked per block)."""
    slot = lax.broadcasted_iota(jnp.int32, (next_pow2(n),), 0)
    ids = _backend.load_range(idx_ref, 0, next_pow2(n), slot < n, -1)
    live = jnp.max(jnp.where(ids >= 0, slot + 1, 0))
    return (live + block_k - 1) // block_k


def _sparse_attention_kernel(
    q_ref,  # [block_h, d]
    *refs,  # [a_base [1] i32 if based], [sink [block_h] f32 if with_sink], idx_a [na] i32 (-1 = unused),
    # [idx_b [nb]], kv_a [ra, d] whole pool, [kv_b [rb, d]], [a's row scales [ra] f32 if FP8], [b's row scales
    # [rb] f32 if FP8], outputs
    na: int,
    nb: int,
    scale: float,
    block_k: int,
    blocks_per_split: int,
    prefetch: int,
    precision,
    scaled: tuple[bool, bool],
    with_sink: bool,
    based: bool,
):
    refs = list(refs)
    a_base = refs.pop(0)[0] if based else None  # list A's row offset (a [1] i32 operand)
    sink_ref = refs.pop(0) if with_sink else None
    if nb:
        idx_a_ref, idx_b_ref, kv_a_ref, kv_b_ref = (refs.pop(0) for _ in range(4))
    else:
        idx_a_ref, kv_a_ref = (refs.pop(0) for _ in range(2))
        kv_b_ref = idx_b_ref = None
    scale_a_ref = refs.pop(0) if scaled[0] else None
    scale_b_ref = refs.pop(0) if nb and scaled[1] else None
    out_refs = refs
    block_h, d = q_ref.shape
    q_outer = None if prefetch else q_ref[...]
    first = pl.program_id(2) * blocks_per_split  # this split's blocks: [first, first + blocks_per_split)
    last = first + blocks_per_split
    a_blocks = cdiv(na, block_k)

    def update(carry, rows, valid, row_scale):
        """One online-softmax step over a gathered [block_k, d] tile (rows of invalid slots are 0). An FP8 tile
        arrives as its exact E4M3 values with their row scales [block_k]: K = rows * scale enters the logits
        and V = rows * scale the probabilities, [block_h, block_k] multiplies instead of [block_k, d]."""
        acc, m, den = carry
        # With register prefetch q is re-read (from L1) every step rather than held: as a loop-invariant
        # matmul operand Triton would keep it in registers ([block_h, d] replicated across warps), which
        # spills. Without, Triton's pipeliner keeps it in shared memory.
        q = q_ref[...] if prefetch else q_outer
        s = lax.dot_general(q, rows, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=f32)
        if row_scale is not None:
            s = s * row_scale[None, :]
        s = jnp.where(valid[None, :], s * scale, -jnp.inf)  # [block_h, block_k]
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no valid row yet: avoid -inf - -inf
        alpha = jnp.exp(m - shift)
        p = jnp.exp(s - shift[:, None])
        pw = p if row_scale is None else p * row_scale[None, :]
        pv = lax.dot_general(
            pw.astype(rows.dtype), rows, (((1,), (0,)), ((), ())), precision=precision, preferred_element_type=f32
        )  # [block_h, d]
        return alpha[:, None] * acc + pv, m_new, alpha * den + jnp.sum(p, axis=1)

    def walk(kv_ref, scale_ref, idx_ref, n, lo, hi, carry, base=None):
        """Blocks [lo, hi) of one list (its rows counted from `base`, if given). With prefetch P, the gathers of
        blocks blk+1..blk+P are in flight (loop-carried registers) while block blk is computed, and the index
        slots one block further ahead; loads past `hi` are masked off (no memory traffic)."""

        def ids_of(blk):
            slot = blk * block_k + lax.broadcasted_iota(jnp.int32, (block_k,), 0)
            ok = (slot < n) & (blk < hi) if prefetch else slot < n  # (no prefetch: the loop bound is hi)
            return _backend.load_range(idx_ref, blk * block_k, block_k, ok, -1)  # [block_k]

        def fetch(ids):
            valid = ids >= 0
            ids = ids if base is None else ids + base
            rows = _fp8.to_compute(_backend.gather_rows(kv_ref, ids, valid), q_ref.dtype)  # unused slots: 0, never read
            row_scale = None if scale_ref is None else _backend.load_1d(scale_ref, ids, valid, 0.0)
            return rows, valid, row_scale

        if not prefetch:  # gather and use in the same step (Triton's own pipeliner, if any)
            return lax.fori_loop(lo, hi, lambda blk, c: update(c, *fetch(ids_of(blk))), carry)

        tiles = tuple(fetch(ids_of(lo + i)) for i in range(prefetch))

        def body(blk, c):
            carry, tiles, ids_next = c
            tiles = (*tiles, fetch(ids_next))  # issue block blk + prefetch
            ids_next = ids_of(blk + prefetch + 1)
            return update(carry, *tiles[0]), tiles[1:], ids_next

        return lax.fori_loop(lo, hi, body, (carry, tiles, ids_of(lo + prefetch)))[0]

    f32 = jnp.float32
    carry = (
        jnp.zeros((block_h, d), jnp.float32),
        jnp.full((block_h,), -jnp.inf, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
    )
    # Global block ids: [0, a_blocks) are list A, [a_blocks, ...) list B.
    live_a = _live_blocks(idx_a_ref, na, block_k)
    carry = walk(kv_a_ref, scale_a_ref, idx_a_ref, na, first, jnp.minimum(last, live_a), carry, a_base)
    if nb:
        live_b = _live_blocks(idx_b_ref, nb, block_k)
        carry = walk(
            kv_b_ref, scale_b_ref, idx_b_ref, nb, jnp.maximum(first - a_blocks, 0), jnp.minimum(last - a_blocks, live_b), carry
        )
    acc, m, den = carry

    if len(out_refs) == 1:
        (out_ref,) = out_refs
        shift = jnp.where(m == -jnp.inf, 0.0, m)
        den = den + jnp.exp(sink_ref[...] - shift)  # the sink: denominator only
        out_ref[...] = (acc / den[:, None]).astype(out_ref.dtype)
    else:
        acc_ref, m_ref, den_ref = out_refs
        acc_ref[...] = acc
        m_ref[...] = m
        den_ref[...] = den


@functools.partial(jax.jit, static_argnames=("scale", "block_sizes", "interpret"))
def sparse_attention(q, kv_a, idx_a, kv_b, idx_b, sink, *, scale, kv_a_scale=None, kv_b_scale=None, a_base=None,
                     block_sizes=None, interpret=False):
    """Sparse MQA attention with a sink over rows gathered from two pools (see `reference`).

    Args:
      q: [t, h, d] bf16/f32. kv_a: [ra, d] (q's dtype, or FP8 E4M3 with kv_a_scale). idx_a: [t, na] i32, -1 = unused.
      kv_b: [rb, d] (likewise). idx_b: [t, nb] i32 (nb may be 0). sink: [h] f32. scale: static float.
      kv_a_scale, kv_b_scale: [ra] / [rb] f32 row scales of an FP8 pool (row = value * scale), else None.
      a_base: None, or an int32 scalar (traced) added to every valid slot of idx_a: list A's rows of one layer
        of a pool of layers, whose index rows are then the same for every layer (one XLA kernel computes them
        for all; with the offset in the rows, a kernel each).
      block_sizes: `BlockSizes` (static) or None for defaults. interpret: run the Pallas interpreter.
    Returns:
      out: [t, h, d] in q.dtype; 0 for a token without valid rows.
    """
    validate_sparse_attention_static(q, kv_a, idx_a, kv_b, idx_b, sink, scale=scale, kv_a_scale=kv_a_scale,
                                     kv_b_scale=kv_b_scale, a_base=a_base)
    bs = block_sizes or BlockSizes.get_default(q.dtype)
    t, h, d = q.shape
    if t == 0:
        return jnp.zeros_like(q)

    min_dim = _backend.min_dot_dim(interpret)
    block_h = max(min(bs.block_h, next_pow2(h)), min_dim)
    block_k = max(bs.block_k, min_dim)
    h_p = round_up(h, block_h)
    out_sink = sink
    if h_p != h:  # padded heads: zero queries, sliced off below (never at Flash dims)
        q = jnp.pad(q, ((0, 0), (0, h_p - h), (0, 0)))
        sink = jnp.pad(sink, (0, h_p - h))
    na, nb = idx_a.shape[1], idx_b.shape[1]
    if na == 0:  # an empty list A: one -1 slot (tiny; never at Flash dims)
        idx_a, na = jnp.full((t, 1), -1, jnp.int32), 1
    # An empty pool can only be referenced by -1 slots: one dummy row keeps the gather well-formed.
    kv_a = kv_a if kv_a.shape[0] else jnp.zeros((1, d), kv_a.dtype)
    kv_b = kv_b if kv_b.shape[0] else jnp.zeros((1, d), kv_b.dtype)
    scales = [s if s is None or s.shape[0] else jnp.zeros((1,), jnp.float32) for s in (kv_a_scale, kv_b_scale)]
    kv_a, kv_b = _fp8.kernel_operand(kv_a), _fp8.kernel_operand(kv_b)
    total_blocks = cdiv(na, block_k) + cdiv(nb, block_k)

    head_blocks = h_p // block_h
    n_splits = choose_num_splits(bs.num_splits, t=t, head_blocks=head_blocks, total_blocks=total_blocks)
    blocks_per_split = cdiv(total_blocks, n_splits)
    n_splits = cdiv(total_blocks, blocks_per_split)

    # Grid (head block, token, split): head blocks of one token run side by side, so a gathered
    # K block is fetched from HBM once and re-read from L2 by the other head blocks.
    # Index rows and pools are passed whole: the kernel reads only live slots and gathered rows.
    grid = (head_blocks, t, n_splits)

    def row(n):
        return pl.BlockSpec((None, n), lambda hb, ti, si: (ti, 0))

    def whole(x):
        return pl.BlockSpec(x.shape, lambda hb, ti, si: (0, 0))

    # With splits the sink enters only the merge below (XLA), so the kernel does not take it: as an operand of a
    # custom call a scanned layer's sink (a slice of its stack) was copied into a buffer of its own, a launch per
    # layer at every decode step; the merge's fusion reads the slice in place.
    with_sink = n_splits == 1
    in_specs = [pl.BlockSpec((None, block_h, d), lambda hb, ti, si: (ti, hb, 0))]
    operands = [q]
    based = a_base is not None
    if based:
        base = jnp.asarray(a_base, jnp.int32).reshape(1)
        in_specs.append(pl.BlockSpec(base.shape, lambda hb, ti, si: (0,)))
        operands.append(base)
    if with_sink:
        in_specs.append(pl.BlockSpec((block_h,), lambda hb, ti, si: (hb,)))
        operands.append(sink)
    if nb:
        in_specs += [row(na), row(nb), whole(kv_a), whole(kv_b)]
        operands += [idx_a, idx_b, kv_a, kv_b]
    else:
        in_specs += [row(na), whole(kv_a)]
        operands += [idx_a, kv_a]
    scaled = (scales[0] is not None, scales[1] is not None)
    for row_scale in (scales[0], scales[1] if nb else None):
        if row_scale is not None:
            in_specs.append(pl.BlockSpec(row_scale.shape, lambda hb, ti, si: (0,)))
            operands.append(row_scale)

    if n_splits == 1:
        out_shape = jax.ShapeDtypeStruct((t, h_p, d), q.dtype)
        out_specs = pl.BlockSpec((None, block_h, d), lambda hb, ti, si: (ti, hb, 0))
    else:
        out_shape = (
            jax.ShapeDtypeStruct((n_splits, t, h_p, d), jnp.float32),
            jax.ShapeDtypeStruct((n_splits, t, h_p), jnp.float32),
            jax.ShapeDtypeStruct((n_splits, t, h_p), jnp.float32),
        )
        out_specs = (
            pl.BlockSpec((None, None, block_h, d), lambda hb, ti, si: (si, ti, hb, 0)),
            pl.BlockSpec((None, None, block_h), lambda hb, ti, si: (si, ti, hb)),
            pl.BlockSpec((None, None, block_h), lambda hb, ti, si: (si, ti, hb)),
        )
    kernel = functools.partial(
        _sparse_attention_kernel,
        na=na,
        nb=nb,
        scale=float(scale),
        block_k=block_k,
        blocks_per_split=blocks_per_split,
        prefetch=bs.prefetch,
        precision=_backend.dot_precision(q.dtype),
        scaled=scaled,
        with_sink=with_sink,
        based=based,
    )
    result = pl.pallas_call(
        kernel,
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_backend.compiler_params(num_warps=bs.num_warps, num_stages=bs.num_stages, interpret=interpret),
        interpret=interpret,
        name="sparse_attention",
    )(*operands)

    if n_splits > 1:  # few tokens: partials of each split, merged by the spec's rule (small: t * h * d)
        acc, m, den = merge_partials(*result, axis=0)
        return finalize_partials(acc[:, :h], m[:, :h], den[:, :h], out_sink, q.dtype)
    return result[:, :h] if h_p != h else result
