"""Routed experts through the grouped-matmul kernel: selections sorted by expert into row tiles.

The n·k (token, expert) selections are sorted by expert and padded so every tile of `tile_m` rows has one expert;
`pallas_kernels.grouped_matmul` then reads each used expert's weights once per tile — at decode exactly the
selected experts, nothing else — for the gate and up projections together, then the down projection. The
result, weighted, is scattered back to the tokens (padding rows are dropped). Decode-sized batches skip the
sort: one token's k selections take a tile each (`one_token_tiles`), 2 to 16 tokens a tile per used expert with
a row per token (`shared_tiles`), and their products are gathered back and weighted without a scatter. Quantized
experts (a checkpoint loaded with ``weights="checkpoint"``) are read as stored: FP4 through
`pallas_kernels.grouped_matmul_fp4` (packed bytes), FP8 (base checkpoints) through
`pallas_kernels.grouped_matmul_fp8` (E4M3 + block scales).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.model.config import Config
from ds4jax.model.layer_of import LayerOf
from ds4jax.model.layers.moe import Routing, swiglu
from ds4jax.model.quantized import Format, dense, is_quantized

DECODE_TILE = 16  # Triton's smallest matmul extent: a decode selection fills one row of a 16-row tile
PREFILL_TILE = 64
PREFILL_ABOVE = 256  # selections above which tiles of 64 rows pay off (several tokens per expert)
GEMV_SELECTIONS = 64  # FP4 experts: up to this many selections (decode up to batch 10 at k=6) one row each
SHARED_TILE_SELECTIONS = 96  # up to this many selections of <= 16 tokens: `shared_tiles`, no sort


def tile_rows(selections: int) -> int:
    return PREFILL_TILE if selections > PREFILL_ABOVE else DECODE_TILE


def sort_into_tiles(experts: jax.Array, num_experts: int, tile_m: int) -> tuple[jax.Array, jax.Array]:
    """experts [S] -> (src [tiles * tile_m]: selection of each row, -1 = padding; tile_group [tiles], -1 = empty).

    tiles = min(S, ceil(S / tile_m) + min(E, S)) bounds sum_e ceil(size_e / tile_m) statically."""
    s = experts.shape[0]
    tiles = min(s, -(-s // tile_m) + min(num_experts, s))
    order = jnp.argsort(experts, stable=True).astype(jnp.int32)
    sorted_e = experts[order]
    sizes = jnp.bincount(experts, length=num_experts)
    padded = (sizes + tile_m - 1) // tile_m * tile_m
    ends = jnp.cumsum(padded)
    dest = (ends - padded)[sorted_e] + jnp.arange(s) - (jnp.cumsum(sizes) - sizes)[sorted_e]
    src = jnp.full((tiles * tile_m,), -1, jnp.int32).at[dest].set(order, mode="drop")
    first_row = jnp.arange(tiles, dtype=jnp.int32) * tile_m
    # compare_all: one fused comparison (the default binary search is a device while loop: many tiny kernels)
    group = jnp.searchsorted(ends, first_row, side="right", method="compare_all").astype(jnp.int32)
    return src, jnp.where(first_row < ends[-1], group, -1)


def one_token_tiles(experts: jax.Array, tile_m: int) -> tuple[np.ndarray, jax.Array]:
    """`sort_into_tiles` for one token's k selections, without the sort: tile i holds selection i in its first row
    (the grouped kernels need no order between tiles). At decode batch 1 the sort, counts, searches and scatters
    were ~9 kernel launches a layer for 6 selections. The row map depends on shapes only: a NumPy constant (as an
    iota comparison XLA:GPU computed it in a kernel of its own, which every layer's row copy then read)."""
    rows = np.arange(experts.shape[0] * tile_m, dtype=np.int32)
    return np.where(rows % tile_m == 0, rows // tile_m, -1).astype(np.int32), experts.astype(jnp.int32)


def _all_fp4(ws: tuple) -> bool:
    return all(is_quantized(w) and w.format is Format.FP4 for w in ws)


def _grouped(x: jax.Array, ws: tuple, tile_group: jax.Array, interpret: bool, arch: str | None = None
             ) -> tuple[jax.Array, ...]:
    """The grouped matmul for the weights' storage: FP4 experts through the kernel that reads the packed bytes,
    FP8 experts (base checkpoints) through the one that reads E4M3 + block scales; arrays as they are (a mix of
    formats, which no checkpoint has, would be dequantized whole first)."""
    import pallas_kernels  # here, not at the top: see __getattr__ below
    tile_m = x.shape[0] // tile_group.shape[0]
    if _all_fp4(ws):
        tiles = pallas_kernels.GroupedMatmulFp4BlockSizes.get_default(x.dtype, tile_m, arch=arch)
        return pallas_kernels.grouped_matmul_fp4(x, tuple((w.values, w.scales) for w in ws), tile_group,
                                                 block_sizes=tiles, interpret=interpret)
    if all(is_quantized(w) and w.format is Format.FP8 and w.block == ws[0].block for w in ws):
        return pallas_kernels.grouped_matmul_fp8(x, tuple((w.values, w.scales) for w in ws), tile_group,
                                                 block=ws[0].block, interpret=interpret)
    tiles = pallas_kernels.GroupedMatmulBlockSizes.get_default(x.dtype, tile_m, arch=arch)
    return pallas_kernels.grouped_matmul(x, tuple(dense(w, x.dtype) for w in ws), tile_group, block_sizes=tiles,
                                         interpret=interpret)


def _in_place(p: dict) -> tuple[dict, jax.Array | int]:
    """The experts' weights as the grouped kernels take them, and the offset of this layer's experts on their
    expert axis: a scanned layer's `LayerOf`s (the stacks, not a copied slice: layer_of.py) with the layer axis
    merged into the expert axis (a free reshape), per-layer weights as they are (offset 0)."""
    ws = {name: p[name] for name in ("w1", "w2", "w3")}
    if not any(isinstance(w, LayerOf) for w in ws.values()):
        return ws, 0
    merged = {name: w.merged() for name, w in ws.items()}
    return {name: m for name, (m, _) in merged.items()}, merged["w1"][1]


def routed_experts_grouped(x: jax.Array, routing: Routing, p: dict, cfg: Config, *, interpret: bool,
                           arch: str | None = None) -> jax.Array:
    """[n, e] -> [n, e] float32, the same sum as `moe.routed_experts`. A scanned layer's experts (`LayerOf`) are
    read in place in their stacks: the selections' expert ids are offset to this layer's."""
    p, offset = _in_place(p)
    n, k = routing.experts.shape
    if n * k <= GEMV_SELECTIONS and _all_fp4((p["w1"], p["w3"], p["w2"])):
        return _fp4_selections(x, routing, p, cfg, interpret, arch, offset)
    tile_m = tile_rows(n * k)
    if 1 < n <= tile_m and n * k <= SHARED_TILE_SELECTIONS:
        return _few_tokens(x, routing, p, cfg, interpret, arch, offset, tile_m)
    if n == 1:
        src, tile_group = one_token_tiles(routing.experts[0], tile_m)
    else:
        src, tile_group = sort_into_tiles(routing.experts.reshape(-1), cfg.num_routed_experts, tile_m)
    if not isinstance(offset, int):  # a scanned layer: this layer's experts on the merged axis (-1 stays empty)
        tile_group = jnp.where(tile_group >= 0, tile_group + offset, -1)
    live = src >= 0
    token = jnp.where(live, src // k, n)  # padding rows: out of range, dropped by the scatter below
    # (one token's row broadcast in the kernel instead of this copy saved a launch a layer, but failed its device
    # test on an H100 in session 31: reverted, docs/benchmarks/step_kernels_deviceless/README.md)
    xs = jnp.where(live[:, None], x[jnp.minimum(token, n - 1)], 0).astype(x.dtype)
    gate, up = _grouped(xs, (p["w1"], p["w3"]), tile_group, interpret, arch)
    h = swiglu(gate, up, cfg.swiglu_limit).astype(x.dtype)
    (y,) = _grouped(h, (p["w2"],), tile_group, interpret, arch)
    if n == 1:  # tile i's first row is selection i
        return weighted_sum(y.reshape(1, k, tile_m, -1)[:, :, 0], routing.weights)
    weight = jnp.where(live, routing.weights.reshape(-1)[jnp.maximum(src, 0)], 0.0)
    return jnp.zeros((n, x.shape[-1]), jnp.float32).at[token].add(y * weight[:, None], mode="drop")


def shared_tiles(experts: jax.Array, tile_m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A few tokens' selections experts [n, k] (n <= tile_m) as tiles without a sort: tile s belongs to selection
    s's expert and is live where s is that expert's first selection; row r of a live tile is token r, live where
    token r chose that expert (a token's k experts are distinct, so an expert has at most n <= tile_m rows).
    Returns (tile_group [n*k]: the expert, -1 = not its first selection; rows [n*k, tile_m] bool; first [n*k]: the
    tile holding each selection's product)."""
    n, k = experts.shape
    flat = experts.reshape(-1).astype(jnp.int32)
    s = jnp.arange(n * k, dtype=jnp.int32)
    first = jnp.min(jnp.where(flat[:, None] == flat[None, :], s[None, :], n * k), axis=1)
    live = first == s
    chose = jnp.any(experts[None, :, :] == flat[:, None, None], axis=-1)  # [n*k, n]
    rows = jnp.pad(chose, ((0, 0), (0, tile_m - n))) & live[:, None]
    return jnp.where(live, flat, -1), rows, first


def _few_tokens(x: jax.Array, routing: Routing, p: dict, cfg: Config, interpret: bool, arch: str | None,
                offset: jax.Array | int, tile_m: int) -> jax.Array:
    """`routed_experts_grouped` for 2..tile_m tokens (decode at a few rows, a speculative verify's k + 1 tokens):
    tiles from `shared_tiles` instead of `sort_into_tiles`, each used expert read once as there, and each token's
    products gathered back by index and weighted in selection order instead of a scatter-add. The sort, its
    counts, searches and scatters were ~9 kernel launches a layer at these sizes (`scripts/step_kernels.py`)."""
    n, k = routing.experts.shape
    tile_group, rows, first = shared_tiles(routing.experts, tile_m)
    if not isinstance(offset, int):  # a scanned layer: this layer's experts on the merged axis (-1 stays empty)
        tile_group = jnp.where(tile_group >= 0, tile_group + offset, -1)
    xp = jnp.pad(x, ((0, tile_m - n), (0, 0)))
    xs = jnp.where(rows[..., None], xp[None], 0).astype(x.dtype).reshape(n * k * tile_m, -1)
    gate, up = _grouped(xs, (p["w1"], p["w3"]), tile_group, interpret, arch)
    h = swiglu(gate, up, cfg.swiglu_limit).astype(x.dtype)
    (y,) = _grouped(h, (p["w2"],), tile_group, interpret, arch)
    # token t's product with its j-th expert: row t of the tile of that expert's first selection
    picked = y.reshape(n * k, tile_m, -1)[first.reshape(n, k), jnp.arange(n)[:, None]]  # [n, k, e]
    return weighted_sum(picked, routing.weights)


def weighted_sum(y: jax.Array, weights: jax.Array) -> jax.Array:
    """A few tokens' routed outputs: each token's k selections' rows y [n, k, e] weighted by weights [n, k] and
    added up, [n, e] float32, as k-1 elementwise adds (k is small) in selection order. XLA fuses them with the
    shared expert's add into one elementwise kernel; the scatter-add onto zero rows it replaced was a kernel of its
    own, and XLA folded the shared expert's output into the scatter's initial value, a convert kernel more (two
    launches a layer at decode batch 1, `scripts/step_kernels.py`)."""
    w = weights.astype(jnp.float32)
    return sum(y[:, j].astype(jnp.float32) * w[:, j:j + 1] for j in range(y.shape[1]))


def _fp4_selections(x: jax.Array, routing: Routing, p: dict, cfg: Config, interpret: bool,
                    arch: str | None = None, offset: jax.Array | int = 0) -> jax.Array:
    """FP4 experts at decode: one row per (token, expert) selection through the GEMV kernel (no tiles, no sort):
    the tile kernel's 16-row dots left it ALU-bound at decode, far from the packed bytes' floor. Its tiles and
    decode are `arch`'s (`gemv_block_sizes`: the word-wise float16 decode)."""
    import pallas_kernels

    n, k = routing.experts.shape
    experts = routing.experts.reshape(-1).astype(jnp.int32) + offset  # on the (merged) expert axis
    pairs = lambda *ws: tuple((w.values, w.scales) for w in ws)  # noqa: E731
    tiles = pallas_kernels.gemv_block_sizes(arch)
    gate, up = pallas_kernels.grouped_gemv_fp4(jnp.repeat(x, k, axis=0), pairs(p["w1"], p["w3"]), experts,
                                               block_sizes=tiles, interpret=interpret)
    h = swiglu(gate, up, cfg.swiglu_limit).astype(x.dtype)
    (y,) = pallas_kernels.grouped_gemv_fp4(h, pairs(p["w2"]), experts, block_sizes=tiles, interpret=interpret)
    if n == 1:
        return weighted_sum(y[None], routing.weights)
    return jnp.sum((y * routing.weights.reshape(-1)[:, None].astype(jnp.float32)).reshape(n, k, -1), axis=1)


def __getattr__(name: str):
    """``<this module>.pallas_kernels``, for callers and tests that reach the kernels through it: the package is
    imported where a program is traced (a cached ``ds4jax generate`` traces none: tests/test_startup_imports.py)."""
    if name == "pallas_kernels":
        import pallas_kernels

        return pallas_kernels
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
