"""Sparse MQA attention with a sink — portable Pallas kernel (Triton backend; interpret mode on CPU).

Design: one program per (head block, token, split). It loads the token's [block_h, d] queries once,
then walks its share of the token's row lists — blocks of list A, then blocks of list B — gathering
`block_k` rows per step by index and updating an online softmax (m, den, acc in f32). MQA makes the
[block_h, d] x [d, block_k] matmul the natural shape: one gathered K block serves every head.

Only "live" blocks are visited: the wrapper passes, per token, the number of blocks up to the last
valid slot of each list, so padding (-1 tails, e.g. HCA lists shorter than nb) costs nothing.
With one split the kernel adds the sink and writes the output; with several it writes partials
(acc, m, den) merged by `reference.merge_partials` / `finalize_partials` (the spec's merge rule).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels._util import cdiv, next_pow2, round_up
from pallas_kernels.sparse_attention.blocks import BlockSizes, choose_num_splits
from pallas_kernels.sparse_attention.reference import finalize_partials, merge_partials
from pallas_kernels.sparse_attention.validate import validate_sparse_attention_static


def _sparse_attention_kernel(
    counts_ref,  # [2] i32: live blocks of list A, of list B (this token)
    q_ref,  # [block_h, d]
    sink_ref,  # [block_h] f32
    idx_a_ref,  # [na_p] i32, -1 = unused
    idx_b_ref,  # [nb_p] i32, -1 = unused
    kv_a_ref,  # [ra, d] whole pool, gathered by index
    kv_b_ref,  # [rb, d] whole pool, gathered by index
    *out_refs,  # one split: out [block_h, d]; else acc [block_h, d] f32, m [block_h] f32, den [block_h] f32
    scale: float,
    block_k: int,
    blocks_per_split: int,
    a_blocks: int,
    precision,
):
    q = q_ref[...]
    block_h, d = q.shape
    first = pl.program_id(2) * blocks_per_split  # this split's blocks: [first, first + blocks_per_split)
    last = first + blocks_per_split

    def step(kv_ref, idx_ref, blk, carry):
        acc, m, den = carry
        ids = idx_ref[pl.ds(blk * block_k, block_k)]  # [block_k]
        valid = ids >= 0
        rows = _backend.gather_rows(kv_ref, ids, valid)  # [block_k, d]; 0 for unused slots (never read)
        s = (
            lax.dot_general(q, rows, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32)
            * scale
        )  # [block_h, block_k]
        s = jnp.where(valid[None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))
        shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)  # no valid row yet: avoid -inf - -inf
        alpha = jnp.exp(m - shift)
        p = jnp.exp(s - shift[:, None])
        pv = lax.dot_general(
            p.astype(rows.dtype),
            rows,
            (((1,), (0,)), ((), ())),
            precision=precision,
            preferred_element_type=jnp.float32,
        )  # [block_h, d]
        return alpha[:, None] * acc + pv, m_new, alpha * den + jnp.sum(p, axis=1)

    carry = (
        jnp.zeros((block_h, d), jnp.float32),
        jnp.full((block_h,), -jnp.inf, jnp.float32),
        jnp.zeros((block_h,), jnp.float32),
    )
    # Global block ids: [0, a_blocks) are list A, [a_blocks, ...) list B.
    carry = lax.fori_loop(first, jnp.minimum(last, counts_ref[0]), functools.partial(step, kv_a_ref, idx_a_ref), carry)
    carry = lax.fori_loop(
        jnp.maximum(first - a_blocks, 0),
        jnp.minimum(last - a_blocks, counts_ref[1]),
        functools.partial(step, kv_b_ref, idx_b_ref),
        carry,
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


def _prepare_list(kv, idx, block_k):
    """Pad a row list to whole blocks with -1; give an empty pool one dummy row (never read)."""
    n = idx.shape[1]
    n_p = max(round_up(n, block_k), block_k)
    idx = jnp.pad(idx, ((0, 0), (0, n_p - n)), constant_values=-1)
    if kv.shape[0] == 0:
        kv = jnp.zeros((1, kv.shape[1]), kv.dtype)
    # Blocks up to the last valid slot; interior -1 slots are masked inside the kernel.
    live = jnp.max(jnp.where(idx >= 0, jnp.arange(1, n_p + 1, dtype=jnp.int32), 0), axis=1)
    return kv, idx, (live + block_k - 1) // block_k


@functools.partial(jax.jit, static_argnames=("scale", "block_sizes", "interpret"))
def sparse_attention(q, kv_a, idx_a, kv_b, idx_b, sink, *, scale, block_sizes=None, interpret=False):
    """Sparse MQA attention with a sink over rows gathered from two pools (see `reference`).

    Args:
      q: [t, h, d] bf16/f32. kv_a: [ra, d] (same dtype). idx_a: [t, na] i32, -1 = unused.
      kv_b: [rb, d]. idx_b: [t, nb] i32 (nb may be 0). sink: [h] f32. scale: static float.
      block_sizes: `BlockSizes` (static) or None for defaults. interpret: run the Pallas interpreter.
    Returns:
      out: [t, h, d] in q.dtype; 0 for a token without valid rows.
    """
    validate_sparse_attention_static(q, kv_a, idx_a, kv_b, idx_b, sink, scale=scale)
    bs = block_sizes or BlockSizes.get_default(q.dtype)
    t, h, d = q.shape
    if t == 0:
        return jnp.zeros_like(q)

    min_dim = _backend.min_dot_dim(interpret)
    block_h = max(min(bs.block_h, next_pow2(h)), min_dim)
    block_k = max(bs.block_k, min_dim)
    h_p = round_up(h, block_h)
    q_p = jnp.pad(q, ((0, 0), (0, h_p - h), (0, 0)))  # padded heads: zero queries, sliced off below
    sink_p = jnp.pad(sink, (0, h_p - h))
    kv_a, idx_a, live_a = _prepare_list(kv_a, idx_a, block_k)
    kv_b, idx_b, live_b = _prepare_list(kv_b, idx_b, block_k)
    counts = jnp.stack([live_a, live_b], axis=1)  # [t, 2]
    a_blocks, b_blocks = idx_a.shape[1] // block_k, idx_b.shape[1] // block_k

    head_blocks = h_p // block_h
    n_splits = choose_num_splits(bs.num_splits, t=t, head_blocks=head_blocks, total_blocks=a_blocks + b_blocks)
    blocks_per_split = cdiv(a_blocks + b_blocks, n_splits)
    n_splits = cdiv(a_blocks + b_blocks, blocks_per_split)

    # Grid (head block, token, split): head blocks of one token run side by side, so a gathered
    # K block is fetched from HBM once and re-read from L2 by the other head blocks.
    grid = (head_blocks, t, n_splits)
    in_specs = [
        pl.BlockSpec((None, 2), lambda hb, ti, si: (ti, 0)),
        pl.BlockSpec((None, block_h, d), lambda hb, ti, si: (ti, hb, 0)),
        pl.BlockSpec((block_h,), lambda hb, ti, si: (hb,)),
        pl.BlockSpec((None, idx_a.shape[1]), lambda hb, ti, si: (ti, 0)),
        pl.BlockSpec((None, idx_b.shape[1]), lambda hb, ti, si: (ti, 0)),
        pl.BlockSpec(kv_a.shape, lambda hb, ti, si: (0, 0)),
        pl.BlockSpec(kv_b.shape, lambda hb, ti, si: (0, 0)),
    ]
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
        scale=float(scale),
        block_k=block_k,
        blocks_per_split=blocks_per_split,
        a_blocks=a_blocks,
        precision=_backend.dot_precision(q.dtype),
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
    )(counts, q_p, sink_p, idx_a, idx_b, kv_a, kv_b)

    if n_splits == 1:
        return result[:, :h]
    acc, m, den = merge_partials(*result, axis=0)
    return finalize_partials(acc[:, :h], m[:, :h], den[:, :h], sink, q.dtype)
