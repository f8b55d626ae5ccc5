"""Loading a safetensors checkpoint straight into the shards of a `MeshLayout`.

Every parameter becomes ``jax.make_array_from_callback(shape, sharding, read_block)``: JAX asks for the block of
each device this process holds (so a multi-host launch reads host-locally, and no host ever holds more than its
devices' share), and `read_block` reads exactly that block from the file: a slice of the tensor for plain
weights (transposed / regrouped into the params layout), the covering 128x128 blocks for FP8 and the covering
32-column groups for FP4 (dequantized, then cropped), only the experts in the block for routed experts.
Blocks a process needs twice (replicated parameters) are read once. Header validation is the single-device
loader's (`safetensors_layout.resolve` / `validate`), so the same errors name the same tensors.
"""

from __future__ import annotations

import collections
import os
from contextlib import ExitStack
from typing import Any

import jax
import numpy as np

from ds4jax.io import quant_formats as qf
from ds4jax.io import safetensors_layout as sl
from ds4jax.model import layer_stack
from ds4jax.model.handle import Model
from ds4jax.model.params import abstract


class ReadCounter:
    """Bytes read from the checkpoint files, per tensor name (raw, i.e. quantized, bytes plus their scales)."""

    def __init__(self):
        self.by_tensor: dict[str, int] = collections.Counter()
        self.reads: list[tuple[str, tuple, int]] = []

    def add(self, key: str, index: tuple, nbytes: int) -> None:
        self.by_tensor[key] += nbytes
        self.reads.append((key, index, nbytes))

    @property
    def total(self) -> int:
        return sum(self.by_tensor.values())


def _read(shard, key: str, index: tuple, counter: ReadCounter | None) -> np.ndarray:
    a = shard.read(key, index)
    if counter is not None:
        counter.add(key, index, a.nbytes)
    return a


def _region(loc, rows: tuple[int, int], cols: tuple[int, int] | None, block, counter, target,
            check_finite: bool = False) -> np.ndarray:
    """Rows x cols of a source in checkpoint orientation, checked as the single-device loader checks a whole one:
    dequantized if stored quantized (scales finite, their values fitting `target`), in `target` if floating point,
    with `check_finite` every value finite there."""
    region = _raw_region(loc, rows, cols, block, counter, target)
    return sl.as_loaded(region, target, loc.shard, loc.key, check_finite)


def _raw_region(loc, rows: tuple[int, int], cols: tuple[int, int] | None, block, counter, target) -> np.ndarray:
    lead = () if loc.expert is None else (loc.expert,)
    offset = 0 if loc.rows is None else loc.rows.start
    r0, r1 = rows[0] + offset, rows[1] + offset
    if cols is None:  # a vector (norms, biases, sinks)
        return _read(loc.shard, loc.key, lead + (slice(r0, r1),), counter)
    c0, c1 = cols
    dtype, shape = loc.shard.info(loc.key)
    if loc.scale is None:
        return _read(loc.shard, loc.key, lead + (slice(r0, r1), slice(c0, c1)), counter)
    scale_shard, scale_key = loc.scale
    to_float = lambda raw: sl.checked_scales(raw, scale_shard, scale_key, dtype, target)  # noqa: E731
    if dtype == sl.FP8_WEIGHT:
        br, bc = block
        R0, C0 = r0 // br * br, c0 // bc * bc
        R1, C1 = min(-(-r1 // br) * br, shape[-2]), min(-(-c1 // bc) * bc, shape[-1])
        raw = _read(loc.shard, loc.key, lead + (slice(R0, R1), slice(C0, C1)), counter)
        s = to_float(_read(scale_shard, scale_key, lead + (slice(R0 // br, -(-R1 // br)),
                                                          slice(C0 // bc, -(-C1 // bc))), counter))
        return qf.dequant_fp8(raw, s, block)[r0 - R0 : r1 - R0, c0 - C0 : c1 - C0]
    g = qf.FP4_BLOCK  # packed [out, in/2], scales [out, in/32]
    C0, C1 = c0 // g * g, -(-c1 // g) * g
    packed = _read(loc.shard, loc.key, lead + (slice(r0, r1), slice(C0 // 2, C1 // 2)), counter)
    s = to_float(_read(scale_shard, scale_key, lead + (slice(r0, r1), slice(C0 // g, C1 // g)), counter))
    return qf.dequant_fp4(packed, s)[:, c0 - C0 : c1 - C0]


def _bounds(index: tuple, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    out = []
    for i, n in enumerate(shape):
        s = index[i] if i < len(index) else slice(None)
        start, stop, step = s.indices(n)
        assert step == 1
        out.append((start, stop))
    return out


def read_block(leaf, locs, cfg, block, index: tuple, counter: ReadCounter | None = None,
               check_finite: bool = False) -> np.ndarray:
    """The block `index` (slices in the params layout) of one params leaf, read from the files (every value
    finite with `check_finite`)."""
    shape = leaf.target.shape
    b = _bounds(index, shape)
    np_dtype = np.dtype(leaf.target.dtype)
    read = lambda *args: _region(*args, counter, np_dtype, check_finite)  # noqa: E731  (loc, rows, cols, block)
    if leaf.layout == sl.EXPERTS:  # ours [x, in, out] <- per expert [out, in]
        (x0, x1), (i0, i1), (o0, o1) = b
        parts = [read(locs[leaf.sources[x]], (o0, o1), (i0, i1), block).T for x in range(x0, x1)]
        return np.stack(parts).astype(np_dtype, copy=False)
    loc = locs[leaf.sources[0]]
    if leaf.layout == sl.T:
        (i0, i1), (o0, o1) = b
        a = read(loc, (o0, o1), (i0, i1), block).T
    elif leaf.layout == sl.WO_A:  # ours [g, h*d/g, o] <- [g*o, h*d/g] with rows group-major
        (g0, g1), (h0, h1), (o0, o1) = b
        o = shape[2]
        a = read(loc, (g0 * o, g1 * o), (h0, h1), block)
        a = a.reshape(g1 - g0, o, h1 - h0).transpose(0, 2, 1)[:, :, o0:o1]
    elif len(shape) == 1:
        a = read(loc, b[0], None, block)
    elif len(shape) == 2:
        a = read(loc, b[0], b[1], block)
    else:
        raise sl.CheckpointError(f"{leaf.path}: no sliced reader for a {len(shape)}-d {leaf.layout} leaf")
    if leaf.integer:
        sl.check_tid2eid(a, loc, cfg)
    return np.ascontiguousarray(np.asarray(a).astype(np_dtype, copy=False))


def _at(tree, path):
    for k in path:
        tree = tree[k]
    return tree


def load_sharded(path: str | os.PathLike, dtype: Any, layout, *, progress: bool = True,
                 counter: ReadCounter | None = None, check_finite: bool = False) -> Model:
    """`ds4jax.load(path, dtype, mesh=layout, check_finite=...)`: every device's block read straight from the
    files (and with `check_finite` checked for NaN / Inf as it is read)."""
    ckpt_dir = os.fspath(path)
    cfg, block = sl.read_config(ckpt_dir)
    layout.stage_ranges(cfg.num_layers)  # a bad layer split fails before anything is read
    with ExitStack() as stack:
        where = sl.open_shards(ckpt_dir, stack)
        leaves, locs, raws = sl.resolve(cfg, sl.plan(cfg, dtype), where, ckpt_dir)
        for raw in raws:
            sl.validate(raw, block)
        from tqdm.auto import tqdm  # here: ds4jax.io.checkpoint (every load) imports this module

        shardings = layout.param_shardings(cfg)
        arrays = {}
        for leaf in tqdm(leaves, desc=f"loading into {layout.describe()}", unit="tensor", disable=not progress):
            cache: dict[tuple, np.ndarray] = {}

            def cb(index, leaf=leaf, cache=cache):
                key = tuple(_bounds(index, leaf.target.shape))
                if key not in cache:
                    cache[key] = read_block(leaf, locs, cfg, block, index, counter, check_finite)
                return cache[key]

            arrays[leaf.path] = jax.make_array_from_callback(leaf.target.shape, _at(shardings, leaf.path), cb)
    tree = abstract(cfg, dtype)
    if not any(p[0] == "mtp" for p in arrays):
        tree.pop("mtp", None)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    params = jax.tree_util.tree_unflatten(treedef, [arrays[sl.path_of(kp)] for kp, _ in flat])
    return Model(config=cfg, params=layer_stack.for_loader(cfg, params, layout), layout=layout)
