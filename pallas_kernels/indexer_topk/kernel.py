"""Lightning-indexer scoring + top-k — portable Pallas kernels (Triton backend; interpret mode on CPU).

Two kernels, no other device work (the pool is read in place; nothing is padded or copied):

1. `_score_select_kernel`, grid (query token, split of its entries). A program scores its split in
   blocks of `block_c` entries — gather the key rows through the entry->row map, one
   [h, d] x [d, block_c] matmul, ReLU, head-weighted sum — and keeps every score in registers as a
   [rows, block_c] tile (a split is at most `max_split` entries). Then it selects the split's exact
   top-k in registers: a 32-step radix select on the scores' order-preserving integer keys finds the
   k-th best key T, entries above T all win, entries equal to T win in entry order until k are taken
   (the tie rule: lower id first), and a prefix sum scatters the winners to k candidate slots.
   Scores never reach HBM; entries j >= n_valid are never scored and their rows never read. An FP8 key
   pool (E4M3 + one f32 scale per row) is converted exactly in registers and its scales multiply the logits.
2. `_rank_kernel`, grid (query token, block of candidates): each candidate counts the candidates of
   its query that beat it (score desc, then lower id) and is scattered to out[rank] if rank < k;
   unfilled slots get -1. This replaces a sort (Triton-Pallas has none).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend, _fp8
from pallas_kernels._util import cdiv, next_pow2
from pallas_kernels.indexer_topk.blocks import BlockSizes, choose_split_len
from pallas_kernels.indexer_topk.validate import validate_indexer_topk_static

_INT_MIN = -(2**31)
RANK_INNER = 32  # candidates compared per step of the rank kernel: a [block, 32] compare tile


def _count(mask):
    """Number of True in a 2-D mask (two single-axis reductions: the form Triton lowers)."""
    return jnp.sum(jnp.sum(mask.astype(jnp.int32), axis=1), axis=0)


def _exclusive_cumsum_2d(mask):
    """Row-major exclusive prefix count of a [R, B] mask."""
    x = mask.astype(jnp.int32)
    row_total = jnp.sum(x, axis=1)  # [R]
    row_offset = jnp.cumsum(row_total) - row_total
    return row_offset[:, None] + jnp.cumsum(x, axis=1) - x


def _order_key(s):
    """f32 -> i32 with the same order (signed compare); -0.0 must already be folded into +0.0."""
    bits = lax.bitcast_convert_type(s, jnp.int32)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


def _score_select_kernel(
    n_valid_ref,  # [1] i32: visible entries of this query
    q_ref,  # [h, d]
    w_ref,  # [h] f32
    key_rows_ref,  # [c] i32: pool row of logical entry j
    keys_ref,  # [r, d] whole pool, gathered by index
    *refs,  # [key_scale [r] f32 of an FP8 pool], s_out [m] f32: this split's top-k scores (unordered; -inf = empty
    # slot), j_out [m] i32: their entry ids (-1 = empty slot)
    c: int,
    k: int,
    block_c: int,
    split_len: int,
    prefetch: int,
    precision,
    scaled: bool,
):
    key_scale_ref, s_out_ref, j_out_ref = refs if scaled else (None, *refs)
    q = q_ref[...]
    w = w_ref[...]
    scale = q.shape[-1] ** -0.5
    rows = split_len // block_c
    begin = pl.program_id(1) * split_len  # this split: entries [begin, end)
    end = jnp.minimum(begin + split_len, jnp.clip(n_valid_ref[0], 0, c))
    n_vis = jnp.maximum(end - begin, 0)
    row_id = lax.broadcasted_iota(jnp.int32, (rows, 1), 0)

    def ids_of(r):
        first = begin + r * block_c
        visible = first + lax.broadcasted_iota(jnp.int32, (block_c,), 0) < end
        return _backend.load_range(key_rows_ref, first, block_c, visible, 0), visible

    def fetch(ids, visible):
        """Key rows [block_c, d] in q's dtype (invisible rows never read) and, for an FP8 pool, their scales."""
        k_blk = _fp8.to_compute(_backend.gather_rows(keys_ref, ids, visible), q.dtype)
        return k_blk, None if key_scale_ref is None else _backend.load_1d(key_scale_ref, ids, visible, 0.0)

    def score(r, scores, block):
        k_blk, k_scale = block
        logits = lax.dot_general(
            q, k_blk, (((1,), (1,)), ((), ())), precision=precision, preferred_element_type=jnp.float32
        )  # [h, block_c]
        if k_scale is not None:  # an FP8 key is value * scale: scale the [h, block_c] logits, not the keys
            logits = logits * k_scale[None, :]
        s = jnp.sum(w[:, None] * jnp.maximum(logits, 0.0), axis=0) * scale  # [block_c]
        return jnp.where(row_id == r, s[None, :], scores)

    n_blocks = (n_vis + block_c - 1) // block_c
    scores = jnp.zeros((rows, block_c), jnp.float32)
    if prefetch:
        # The gather of block r + 1 is in flight (loop-carried registers) while block r is scored, and
        # the entry->row map one block further ahead; loads past the split are masked off.
        def body(r, c):
            scores, k_blk, ids_next = c
            k_next = fetch(*ids_next)
            return score(r, scores, k_blk), k_next, ids_of(r + 2)

        scores = lax.fori_loop(0, n_blocks, body, (scores, fetch(*ids_of(0)), ids_of(1)))[0]
    else:
        scores = lax.fori_loop(0, n_blocks, lambda r, sc: score(r, sc, fetch(*ids_of(r))), scores)
    scores = jnp.where(scores == 0, 0.0, scores)  # -0.0 and +0.0 are one score (the documented order)
    j2 = begin + row_id * block_c + lax.broadcasted_iota(jnp.int32, (1, block_c), 1)  # [rows, block_c]
    visible = j2 < end
    want = jnp.minimum(n_vis, k)

    if split_len <= k:  # static: every visible entry of the split is a candidate
        win = visible
    else:
        key = _order_key(scores)

        # Radix select: the largest T (built bit by bit in the unsigned order) with >= want keys >= T.
        def bit(i, t_u):
            cand = t_u | lax.shift_left(jnp.int32(1), 31 - i)
            enough = _count(visible & (key >= (cand ^ _INT_MIN))) >= want
            return jnp.where(enough, cand, t_u)

        t = lax.fori_loop(0, 32, bit, jnp.int32(0)) ^ _INT_MIN  # the want-th best key
        above = visible & (key > t)
        tied = visible & (key == t)
        win = above | (tied & (_exclusive_cumsum_2d(tied) < want - _count(above)))

    _backend.store_1d(s_out_ref, _exclusive_cumsum_2d(win), scores, win)
    _backend.store_1d(j_out_ref, _exclusive_cumsum_2d(win), j2, win)
    slot = lax.broadcasted_iota(jnp.int32, (s_out_ref.shape[0],), 0)
    empty = slot >= want
    _backend.store_range(s_out_ref, 0, jnp.full(slot.shape, -jnp.inf, jnp.float32), empty)
    _backend.store_range(j_out_ref, 0, jnp.full(slot.shape, -1, jnp.int32), empty)


def _rank_kernel(s_ref, j_ref, out_ref, *, n: int, k: int, block: int, inner: int):
    """s_ref, j_ref [n]: one query's candidates (s = -inf: none). out_ref [k]: ids by rank, then -1."""
    first = pl.program_id(1) * block
    i = first + lax.broadcasted_iota(jnp.int32, (block,), 0)
    s_i = _backend.load_range(s_ref, first, block, i < n, -jnp.inf)
    j_i = _backend.load_range(j_ref, first, block, i < n, -1)

    def body(b, carry):
        rank, n_cand = carry
        o = b * inner + lax.broadcasted_iota(jnp.int32, (inner,), 0)
        s_o = _backend.load_range(s_ref, b * inner, inner, o < n, -jnp.inf)
        j_o = _backend.load_range(j_ref, b * inner, inner, o < n, -1)
        real = s_o > -jnp.inf
        beats = real[None, :] & (
            (s_o[None, :] > s_i[:, None]) | ((s_o[None, :] == s_i[:, None]) & (j_o[None, :] < j_i[:, None]))
        )  # [block (i), inner (o)]: o ranks above i
        return rank + jnp.sum(beats.astype(jnp.int32), axis=1), n_cand + jnp.sum(real.astype(jnp.int32))

    rank, n_cand = lax.fori_loop(0, cdiv(n, inner), body, (jnp.zeros((block,), jnp.int32), jnp.int32(0)))
    win = (s_i > -jnp.inf) & (rank < k)
    _backend.store_1d(out_ref, rank, j_i, win)
    empty = (i >= jnp.minimum(n_cand, k)) & (i < k)  # this program's share of the unfilled slots
    _backend.store_range(out_ref, first, jnp.full(i.shape, -1, jnp.int32), empty)


@functools.partial(jax.jit, static_argnames=("k", "block_sizes", "interpret"))
def indexer_topk(q, w, keys, key_rows, n_valid, *, k, key_scale=None, block_sizes=None, interpret=False):
    """Top-k logical entries per query by indexer score (see `reference` for the exact definition).

    Args:
      q: [t, hi, di] f32/bf16. w: [t, hi] f32. keys: [r, di] (q's dtype, or FP8 E4M3 with key_scale).
      key_rows: [t, c] i32. n_valid: [t] i32. k: static. key_scale: [r] f32 row scales of an FP8 pool, else None.
      block_sizes: `BlockSizes` (static) or None. interpret: Pallas interpreter.
    Returns:
      idx: [t, k] i32 entry ids, best first, ties to the lower id; -1 beyond min(k, n_valid).
    """
    validate_indexer_topk_static(q, w, keys, key_rows, n_valid, k=k, key_scale=key_scale)
    bs = block_sizes or BlockSizes.get_default(q.dtype)
    t, h, d = q.shape
    c = key_rows.shape[1]
    if t == 0 or c == 0:
        return jnp.full((t, k), -1, jnp.int32)
    if keys.shape[0] == 0:  # nothing can be visible; keep the gather well-formed
        keys = jnp.zeros((1, d), keys.dtype)
        key_scale = None if key_scale is None else jnp.zeros((1,), jnp.float32)
    keys = _fp8.kernel_operand(keys)
    scale_operands = () if key_scale is None else (key_scale,)

    block_c = max(next_pow2(bs.block_c), _backend.min_dot_dim(interpret))
    m = next_pow2(k)  # candidate slots per split (a power of two; k of them used)
    split_len = choose_split_len(bs, t=t, c=c, m=m, block_c=block_c)
    n_splits = cdiv(c, split_len)
    params = functools.partial(_backend.compiler_params, interpret=interpret)

    # Grid (token, split): neighbouring tokens of one request share key rows, so they run together.
    cand_s, cand_j = pl.pallas_call(
        functools.partial(
            _score_select_kernel,
            c=c,
            k=k,
            block_c=block_c,
            split_len=split_len,
            prefetch=bs.prefetch,
            precision=_backend.dot_precision(q.dtype),
            scaled=key_scale is not None,
        ),
        grid=(t, n_splits),
        in_specs=[
            pl.BlockSpec((1,), lambda ti, si: (ti,)),
            pl.BlockSpec((None, h, d), lambda ti, si: (ti, 0, 0)),
            pl.BlockSpec((None, h), lambda ti, si: (ti, 0)),
            pl.BlockSpec((None, c), lambda ti, si: (ti, 0)),
            pl.BlockSpec(keys.shape, lambda ti, si: (0, 0)),
        ] + [pl.BlockSpec(a.shape, lambda ti, si: (0,)) for a in scale_operands],
        out_specs=[
            pl.BlockSpec((None, m), lambda ti, si: (ti, si)),
            pl.BlockSpec((None, m), lambda ti, si: (ti, si)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((t, n_splits * m), jnp.float32),
            jax.ShapeDtypeStruct((t, n_splits * m), jnp.int32),
        ],
        compiler_params=params(num_warps=bs.num_warps, num_stages=bs.num_stages),
        interpret=interpret,
        name="indexer_score_select",
    )(n_valid, q, w, key_rows, keys, *scale_operands)

    n = n_splits * m
    block = min(next_pow2(bs.rank_block), next_pow2(n))
    inner = min(RANK_INNER, block)
    return pl.pallas_call(
        functools.partial(_rank_kernel, n=n, k=k, block=block, inner=inner),
        grid=(t, cdiv(n, block)),
        in_specs=[
            pl.BlockSpec((None, n), lambda ti, bi: (ti, 0)),
            pl.BlockSpec((None, n), lambda ti, bi: (ti, 0)),
        ],
        out_specs=pl.BlockSpec((None, k), lambda ti, bi: (ti, 0)),
        out_shape=jax.ShapeDtypeStruct((t, k), jnp.int32),
        compiler_params=params(num_warps=4, num_stages=1),
        interpret=interpret,
        name="indexer_rank",
    )(cand_s, cand_j)
