"""Lightning-indexer scoring + streaming top-k — portable Pallas kernel (Triton backend; interpret on CPU).

Design: one program per (query token, split of its entries). The program holds the token's [h, d]
indexer queries and walks its entries in blocks of `block_c`: gather the key rows through the
entry->row map, score them with one [h, d] x [d, block_c] matmul + ReLU + head-weighted sum, and keep
a running top-m set (m = next_pow2(k)) in registers (see `running_topk`). Scores never reach HBM;
each program writes only its m candidates, and one sort of [splits * m] per query (XLA) orders them
and applies the tie rule. Entries j >= n_valid are never scored and their rows are never read.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels._util import cdiv, next_pow2, round_up
from pallas_kernels.indexer_topk import running_topk as rt
from pallas_kernels.indexer_topk.blocks import BlockSizes, choose_num_splits
from pallas_kernels.indexer_topk.reference import select_topk
from pallas_kernels.indexer_topk.validate import validate_indexer_topk_static


class _State(NamedTuple):
    """Loop carry: the running top-m buffer and the stage (see `running_topk`)."""

    buf_s: jax.Array  # [m] f32
    buf_j: jax.Array  # [m] i32
    buf_r: jax.Array  # [m] i32 rank in the buffer
    st_s: jax.Array  # [stage] f32
    st_j: jax.Array  # [stage] i32
    n_st: jax.Array  # i32 filled stage slots


def _indexer_topk_kernel(
    n_valid_ref,  # [1] i32: visible entries of this query
    q_ref,  # [h, d]
    w_ref,  # [h] f32
    key_rows_ref,  # [c_p] i32: pool row of logical entry j
    keys_ref,  # [r, d] whole pool, gathered by index
    s_out_ref,  # [m] f32: this split's top-m scores (unordered; -inf = empty)
    j_out_ref,  # [m] i32: their entry ids
    *,
    block_c: int,
    stage: int,
    split_len: int,
    precision,
):
    q = q_ref[...]
    w = w_ref[...]
    scale = q.shape[-1] ** -0.5
    m = s_out_ref.shape[0]
    begin = pl.program_id(1) * split_len  # this split: entries [begin, min(begin + split_len, n_valid))
    end = jnp.minimum(begin + split_len, n_valid_ref[0])

    def flush(st: _State) -> _State:
        buf = rt.merge(st.buf_s, st.buf_j, st.buf_r, st.st_s, st.st_j)
        # n_st - n_st, not 0 / zeros_like (a jaxpr literal): Triton's scf.yield needs an SSA value.
        return _State(*buf, *rt.init_stage(stage), st.n_st - st.n_st)

    def body(blk, st: _State) -> _State:
        start = begin + blk * block_c
        j = start + lax.broadcasted_iota(jnp.int32, (block_c,), 0)  # [block_c] entry ids
        visible = j < end
        k_blk = _backend.gather_rows(keys_ref, key_rows_ref[pl.ds(start, block_c)], visible)  # [block_c, d]
        logits = lax.dot_general(
            q, k_blk, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )  # [h, block_c]
        s = jnp.sum(w[:, None] * jnp.maximum(logits, 0.0), axis=0) * scale  # [block_c]
        s = jnp.where(visible, s, -jnp.inf)  # invisible entries (zero rows) score 0: exclude them
        # Only entries above the buffer's worst score can matter (later ids lose every tie), so
        # stage just those, and merge the stage into the buffer only when it would overflow.
        n_new = jnp.sum((visible & (s > jnp.min(st.buf_s))).astype(jnp.int32))
        st = lax.cond(st.n_st + n_new > stage, flush, lambda x: x, st)
        take = visible & (s > jnp.min(st.buf_s))
        st_s, st_j, n_st = rt.stage_append(st.st_s, st.st_j, st.n_st, s, j, take)
        return st._replace(st_s=st_s, st_j=st_j, n_st=n_st)

    st = _State(*rt.init_buffer(m), *rt.init_stage(stage), jnp.int32(0))
    st = flush(lax.fori_loop(0, pl.cdiv(jnp.maximum(end - begin, 0), block_c), body, st))
    s_out_ref[...] = st.buf_s
    j_out_ref[...] = st.buf_j


@functools.partial(jax.jit, static_argnames=("k", "block_sizes", "interpret"))
def indexer_topk(q, w, keys, key_rows, n_valid, *, k, block_sizes=None, interpret=False):
    """Top-k logical entries per query by indexer score (see `reference` for the exact definition).

    Args:
      q: [t, hi, di] f32/bf16. w: [t, hi] f32. keys: [r, di] (q's dtype). key_rows: [t, c] i32.
      n_valid: [t] i32. k: static. block_sizes: `BlockSizes` (static) or None. interpret: Pallas interpreter.
    Returns:
      idx: [t, k] i32 entry ids, best first, ties to the lower id; -1 beyond min(k, n_valid).
    """
    validate_indexer_topk_static(q, w, keys, key_rows, n_valid, k=k)
    bs = block_sizes or BlockSizes.get_default()
    t, h, d = q.shape
    c = key_rows.shape[1]
    if t == 0 or c == 0:
        return jnp.full((t, k), -1, jnp.int32)

    block_c = max(bs.block_c, _backend.min_dot_dim(interpret))
    stage = next_pow2(max(bs.stage, block_c))  # a flushed stage must hold a whole block
    m = next_pow2(k)
    n_splits = choose_num_splits(bs.num_splits, t=t, c=c, m=m, block_c=block_c)
    split_len = round_up(cdiv(c, n_splits), block_c)
    n_splits = cdiv(c, split_len)
    c_p = round_up(c, block_c)
    if c_p != c:  # whole blocks of the entry->row map (padding is never visible)
        key_rows = jnp.pad(key_rows, ((0, 0), (0, c_p - c)))
    if keys.shape[0] == 0:  # nothing can be visible; keep the gather well-formed
        keys = jnp.zeros((1, d), keys.dtype)
    n_valid = jnp.clip(n_valid, 0, c)

    kernel = functools.partial(
        _indexer_topk_kernel,
        block_c=block_c,
        stage=stage,
        split_len=split_len,
        precision=_backend.dot_precision(q.dtype),
    )
    # Grid (token, split): neighbouring tokens of one request share key rows, so they run together.
    scores, ids = pl.pallas_call(
        kernel,
        grid=(t, n_splits),
        in_specs=[
            pl.BlockSpec((1,), lambda ti, si: (ti,)),
            pl.BlockSpec((None, h, d), lambda ti, si: (ti, 0, 0)),
            pl.BlockSpec((None, h), lambda ti, si: (ti, 0)),
            pl.BlockSpec((None, c_p), lambda ti, si: (ti, 0)),
            pl.BlockSpec(keys.shape, lambda ti, si: (0, 0)),
        ],
        out_specs=[
            pl.BlockSpec((None, None, m), lambda ti, si: (ti, si, 0)),
            pl.BlockSpec((None, None, m), lambda ti, si: (ti, si, 0)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((t, n_splits, m), jnp.float32),
            jax.ShapeDtypeStruct((t, n_splits, m), jnp.int32),
        ],
        compiler_params=_backend.compiler_params(num_warps=bs.num_warps, num_stages=bs.num_stages, interpret=interpret),
        interpret=interpret,
        name="indexer_topk",
    )(n_valid, q, w, key_rows, keys)
    return select_topk(scores.reshape(t, n_splits * m), ids.reshape(t, n_splits * m), k)
