"""The mHC pre-step of a decoder block — portable Pallas kernel (Triton backend; interpret mode on CPU).

What it replaces: `mhc.hc_pre` + the sub-layer's RMSNorm were, on the pooled decode step at batch 1, seven kernel
launches a call (the streams' sum of squares, a two-stage reduction for the mixing projection, the sigmoid gates,
the Sinkhorn kernel, the weighted stream sum, the norm's reduction) with two calls a layer (H100,
`scripts/step_kernels.py`). The projection flat(X) @ fn stays an XLA matmul (the caller's; it needs the whole
GPU's bandwidth for fn's m*e x (2m + m*m) values); everything after it is this one launch.

Grid (token blocks, 2): program (p, 0) collapses and normalises block p's streams, program (p, 1) computes its
post gates and Sinkhorn-projected comb (a serial chain of rounds on a few values): on two SMs their latencies
overlap instead of adding up (the head has no comb: one program a block). Both read the streams' sum of squares
(rho). The hidden dim is walked in chunks ([block, mp, chunk] tiles, masked at every edge: tokens past the end,
streams past m when m is not a power of two, hidden past e); up to MAX_RESIDENT_CHUNKS chunks the token's streams
are loaded once (the loads issued together) and kept in registers, beyond that each pass re-reads them (from L2).
The comb logits are an [m, m] view of a row of `mix`, loaded with index arrays; the gates as contiguous tiles.

Stacked form (`layer`): scale, base and norm_weight carry a leading layer axis and the kernel loads layer `layer`
of each. A scanned layer body passes its stacks whole: as sliced operands of a custom call they were copied into
buffers of their own, three launches per call and two calls a layer at every decode step (`flash_slice(12)`: 12 of
each loop iteration's 15 async slices, docs/benchmarks/step_kernels_deviceless/).

Measured on an H100 at Flash dims (bf16 streams, `scripts/bench_mhc.py`, `docs/benchmarks/decode_b1_h100/`): the
pre-step of one token 12.0 -> 7.3 us of device time (mixes included), 8 tokens 14.5 -> 10.0 us, 2048 tokens
199 -> 155 us.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels._util import cdiv, edge_bound, next_pow2
from pallas_kernels.mhc_pre.blocks import BlockSizes, launch_tiles
from pallas_kernels.mhc_pre.validate import validate_mhc_pre_static
from pallas_kernels.sinkhorn.kernel import project_tile

# Up to this many hidden chunks a program loads the token's streams once and keeps them in registers (the loads
# issued together); more, and it walks the chunks three times (sum of squares, collapsed sum of squares, output).
MAX_RESIDENT_CHUNKS = 4


def _pick(v, k: int):
    """v[k] of a 1-D register tensor (Triton has no element access): a masked sum."""
    return jnp.sum(jnp.where(lax.broadcasted_iota(jnp.int32, v.shape, 0) == k, v, 0.0))


def _comb_logits(mix_ref, base_ref, start, lead, *, tokens: int, m: int, block: int):
    """The [block, mp, mp] raw comb entries mix[t, 2m + i*m + j] and base[2m + i*m + j] (0 outside the real
    [tokens, m, m])."""
    mp = next_pow2(m)

    def entries(shape, a, b):  # (flat comb column 2m + i*m + j, inside the real [m, m]) over a tile
        i, j = lax.broadcasted_iota(jnp.int32, shape, a), lax.broadcasted_iota(jnp.int32, shape, b)
        real = (i < m) & (j < m)
        return 2 * m + jnp.where(real, i * m + j, 0), real

    col, real = entries((block, mp, mp), 1, 2)
    t = start + lax.broadcasted_iota(jnp.int32, (block, mp, mp), 0)
    live = real & (t < tokens)
    raw = _backend.load_at(mix_ref, (jnp.where(live, t, 0), col), live)
    base_col, base_real = entries((mp, mp), 0, 1)
    base = _backend.load_at(base_ref, (*(jnp.full((mp, mp), i, jnp.int32) for i in lead), base_col), base_real)
    return raw, base


def _kernel(*refs, tokens: int, m: int, e: int, block: int, chunk: int, chunks: int, iters: int, hc_eps: float,
            rms_eps: float, head: bool, stacked: bool):
    if stacked:  # the layer index first, then the operands as below with stacked scale / base / norm_weight
        layer_ref, refs = refs[0], refs[1:]
        lead = (layer_ref[0],)
    else:
        lead = ()
    mix_ref, x_ref, scale_ref, base_ref, w_ref, *out_refs = refs
    out_ref = out_refs[-1]
    start = pl.program_id(0) * block
    mp = next_pow2(m)
    t_edge, m_edge, e_edge = edge_bound(tokens, block), None if mp == m else m, edge_bound(e, chunk)
    resident = chunks <= MAX_RESIDENT_CHUNKS  # the token's streams stay in registers: loaded once

    def at(c):  # a chunk's first column, as a traced index: a static one past e - chunk (the masked last chunk)
        return jnp.int32(c) * chunk  # would fail the interpreter's static bounds check

    def streams(c):  # [block, mp, chunk] f32
        return _backend.load_tile(x_ref, (start, 0, at(c)), (block, mp, chunk), (t_edge, m_edge, e_edge)
                                  ).astype(jnp.float32)

    def sum_sq(v):  # [block, ...] -> [block]
        v = v * v
        while v.ndim > 1:
            v = jnp.sum(v, axis=-1)
        return v

    def over_chunks(body, init):  # sum of body(c) over the chunks: unrolled when resident, else an scf.for
        if resident:
            return functools.reduce(lambda acc, c: acc + body(c), range(chunks), init)
        return lax.fori_loop(0, chunks, lambda c, acc: acc + body(c), init)

    tiles = [streams(c) for c in range(chunks)] if resident else None
    tile = (lambda c: tiles[c]) if resident else streams
    zeros = jnp.zeros((block,), jnp.float32)
    rho = lax.rsqrt(over_chunks(lambda c: sum_sq(tile(c)), zeros) / (m * e) + rms_eps)[:, None]  # [block, 1]

    n_scale = 1 if head else 3
    scale = _backend.load_tile(scale_ref, (0,), (next_pow2(n_scale),), (n_scale,), lead=lead).astype(jnp.float32)

    def gate(col0, k):  # [block, mp]: rho * mix[:, col0 : col0 + m] * scale[k] + base[col0 : col0 + m]
        raw = _backend.load_tile(mix_ref, (start, col0), (block, mp), (t_edge, None if m_edge is None else col0 + m))
        b = _backend.load_tile(base_ref, (col0,), (mp,), (None if m_edge is None else col0 + m,),
                               lead=lead).astype(jnp.float32)
        return raw.astype(jnp.float32) * rho * _pick(scale, k) + b[None, :]

    def weights():  # program (p, 1): post and the Sinkhorn-projected comb of the block's tokens
        post_ref, comb_ref = out_refs[:2]
        _backend.store_tile(post_ref, (start, 0), 2 * jax.nn.sigmoid(gate(m, 1)), (t_edge, m_edge))
        raw, base = _comb_logits(mix_ref, base_ref, start, lead, tokens=tokens, m=m, block=block)
        logits = raw.astype(jnp.float32) * rho[:, :, None] * _pick(scale, 2) + base.astype(jnp.float32)[None]
        comb = project_tile(logits, m=m, iters=iters, eps=hc_eps)
        _backend.store_tile(comb_ref, (start, 0, 0), comb, (t_edge, m_edge, m_edge))

    def collapse():  # program (p, 0): the collapsed stream, normalised
        pre = (jax.nn.sigmoid(gate(0, 0)) + hc_eps)[:, :, None]  # [block, mp, 1]; padded streams load as 0
        dtype = out_ref.dtype

        def collapsed(c):  # [block, chunk] f32, rounded through X's dtype as the model casts it
            return jnp.sum(pre * tile(c), axis=1).astype(dtype).astype(jnp.float32)

        parts = [collapsed(c) for c in range(chunks)] if resident else None
        part = (lambda c: parts[c]) if resident else collapsed
        inv = lax.rsqrt(over_chunks(lambda c: sum_sq(part(c)), zeros) / e + rms_eps)[:, None]

        def write(c):
            w = _backend.load_tile(w_ref, (at(c),), (chunk,), (e_edge,), lead=lead).astype(jnp.float32)
            _backend.store_tile(out_ref, (start, at(c)), (w[None, :] * (part(c) * inv)).astype(dtype),
                                (t_edge, e_edge))
            return zeros

        over_chunks(write, zeros)

    if head:
        collapse()
        return
    # The Sinkhorn's rounds are a serial chain on a few values; the collapse streams the hidden dim: as two
    # programs (on two SMs) their latencies overlap instead of adding up.
    pl.when(pl.program_id(1) == 0)(collapse)
    pl.when(pl.program_id(1) == 1)(weights)


@functools.partial(jax.jit, static_argnames=("iters", "hc_eps", "rms_eps", "head", "block_sizes", "interpret"))
def mhc_pre(mix, x, scale, base, norm_weight, *, iters: int, hc_eps: float, rms_eps: float, head: bool = False,
            layer=None, block_sizes: BlockSizes | None = None, interpret: bool = False):
    """The mHC pre-step of every token (see `reference`): one launch after the caller's mix = flat(x) @ fn.

    Args:
      mix: [..., 2m + m*m] (head: [..., m]) the unnormalised streams' projection, f32.
      x: [..., m, e] the residual streams (any float dtype; the output has it). Leading dims are tokens.
      scale: [3] (head: [1]); base: [2m + m*m] (head: [m]); norm_weight: [e] the sub-layer's RMSNorm weight.
      iters: Sinkhorn rounds; hc_eps, rms_eps: the model's epsilons (static). head: the final hyper-connection.
      layer: None, or an int32 scalar (traced): scale, base and norm_weight are then stacks ([layers, ...] of the
        shapes above) and the kernel reads their layer `layer`. Not checked against the stacks' depth in the
        kernel (it would read another layer's or no memory): callers pass a scan's own counter.
      block_sizes: `BlockSizes` (static) or None. interpret: Pallas interpreter.
    Returns:
      (post [..., m] f32, comb [..., m, m] f32, out [..., e] x.dtype); head: out only.
    """
    validate_mhc_pre_static(mix, x, scale, base, norm_weight, iters, hc_eps, rms_eps, head, layer)
    lead, (m, e) = x.shape[:-2], x.shape[-2:]
    tokens = math.prod(lead)
    shapes = ([] if head else [jax.ShapeDtypeStruct((tokens, m), jnp.float32),
                               jax.ShapeDtypeStruct((tokens, m, m), jnp.float32)]) + [
        jax.ShapeDtypeStruct((tokens, e), x.dtype)]
    if tokens == 0:
        outs = [jnp.zeros(lead + s.shape[1:], s.dtype) for s in shapes]
        return outs[0] if head else tuple(outs)
    bs = block_sizes or BlockSizes.get_default(x.dtype)
    block, chunk, chunks = launch_tiles(bs, tokens, m, e)
    args = (mix.reshape(tokens, -1), x.reshape(tokens, m, e), scale, base, norm_weight)  # bitcasts
    stacked = layer is not None
    if stacked:
        args = (jnp.asarray(layer, jnp.int32).reshape(1),) + args
    whole = lambda a: pl.BlockSpec(a.shape, lambda p, r: (0,) * len(a.shape))  # noqa: E731
    outs = pl.pallas_call(
        functools.partial(_kernel, tokens=tokens, m=m, e=e, block=block, chunk=chunk, chunks=chunks,
                          iters=int(iters or 1), hc_eps=float(hc_eps), rms_eps=float(rms_eps), head=head,
                          stacked=stacked),
        grid=(cdiv(tokens, block), 1 if head else 2),
        in_specs=[whole(a) for a in args],
        out_specs=[whole(s) for s in shapes],
        out_shape=shapes,
        compiler_params=_backend.compiler_params(num_warps=bs.num_warps, num_stages=bs.num_stages,
                                                 interpret=interpret),
        interpret=interpret,
        name="mhc_head" if head else "mhc_pre",
    )(*args)
    outs = [o.reshape(lead + o.shape[1:]) for o in outs]
    return outs[0] if head else tuple(outs)
