"""The program both dense matmul kernels run (`fp8_matmul`, `layer_matmul`): one (row tile, column block, k split)
of x @ W, streaming [block_k, block_n] weight tiles that the caller loads (and decodes) and accumulating in f32."""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from pallas_kernels import _backend
from pallas_kernels._util import edge_bound


def split_k_program(x_ref, o_ref, load_weight, *, n: int, tile_m: int, block_k: int, block_n: int, steps: int,
                    precision, x_lead: tuple = ()):
    """o[m0 : m0 + tile_m, n0 : n0 + block_n] = the program's k split of x @ W (grid axes 0, 1, 2 = row tile,
    column block, k split). `load_weight(k0, n0, k_edge, n_edge)` -> the [block_k, block_n] tile of W at (k0, n0)
    in x's dtype, its loads masked at the edges given (None = whole tiles). x_ref [..., m, k], `x_lead` the indices
    of its leading dims; o_ref [m, n] (the split's partial). Tiles crossing an edge of x or o are masked too."""
    m, k = x_ref.shape[-2:]
    m0 = pl.program_id(0) * tile_m
    n0 = pl.program_id(1) * block_n
    k_base = pl.program_id(2) * (steps * block_k)
    m_edge, k_edge, n_edge = edge_bound(m, tile_m), edge_bound(k, block_k), edge_bound(n, block_n)

    def body(i, acc):
        k0 = pl.multiple_of(k_base + i * block_k, block_k)
        xk = _backend.load_tile(x_ref, (m0, k0), (tile_m, block_k), (m_edge, k_edge), lead=x_lead)
        w = load_weight(k0, n0, k_edge, n_edge)
        return acc + lax.dot(xk, w, precision=precision, preferred_element_type=jnp.float32)

    # a static trip count: Triton software-pipelines the weight loads
    acc = lax.fori_loop(0, steps, body, jnp.zeros((tile_m, block_n), jnp.float32))
    _backend.store_tile(o_ref, (m0, n0), acc, (m_edge, n_edge))
