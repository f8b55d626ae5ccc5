"""Quantizing a model's weights on the device into the published formats (`QuantizedWeight` leaves).

The same numbers as the host quantizers of `ds4jax.io.quant_formats` (and so as a checkpoint written with
``ds4jax.save(..., quantize=...)`` and loaded with ``weights="checkpoint"``), computed with jnp where the weights
already are: one power-of-two scale per block from the block's largest magnitude, values rounded to nearest
(ties to even) e4m3 or e2m1. `quantize_model` picks the leaves as the published checkpoints do
(`official_format.weight_format`): the FP8 dense linears and the routed experts (FP4, or FP8 for ``"fp8"``);
``wo_a`` stays as it is (upstream dequantizes it too).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from ds4jax.io.quant_formats import FP4_MAX, FP8_MAX
from ds4jax.io.stored_footprint import leaf_formats
from ds4jax.model.handle import Model
from ds4jax.model.quantized import FP4_BLOCK, Format, QuantizedWeight, e2m1_codes
from ds4jax.runtime import kv_quant


def _exponents(amax: jax.Array, top: float) -> jax.Array:
    """Smallest e with amax <= top * 2^e (0 for zero blocks), clipped to E8M0's [-127, 127]; exact (fixed up
    after the float log)."""
    amax = amax.astype(jnp.float32)
    e = jnp.ceil(jnp.log2(jnp.maximum(amax, 1e-38) / top)).astype(jnp.int32)
    e = jnp.where(amax > jnp.ldexp(jnp.float32(top), e), e + 1, e)
    e = jnp.where(amax <= jnp.ldexp(jnp.float32(top), e - 1), e - 1, e)
    return jnp.clip(jnp.where(amax > 0, e, 0), -127, 127)


def quantize_fp8(w: jax.Array, block: tuple[int, int], fp8_dtype=jnp.float8_e4m3fn) -> QuantizedWeight:
    """[..., in, out] float -> FP8 `QuantizedWeight` with `block` = (rows, cols) of the params layout.

    In float8_e4m3fnuz (MI300) the same bytes-equivalent values are stored with doubled scales, as the loader's
    OCP -> FNUZ conversion does."""
    *lead, r, c = w.shape
    br, bc = block
    R, C = -(-r // br), -(-c // bc)
    a = jnp.pad(jnp.abs(w.astype(jnp.float32)), [(0, 0)] * len(lead) + [(0, R * br - r), (0, C * bc - c)])
    e = _exponents(a.reshape(*lead, R, br, C, bc).max(axis=(-3, -1)), FP8_MAX)
    full = jnp.repeat(jnp.repeat(e, br, axis=-2), bc, axis=-1)[..., :r, :c]
    q = jnp.ldexp(w.astype(jnp.float32), -full).astype(jnp.float8_e4m3fn)
    scale = jnp.ldexp(jnp.float32(1), e)
    if jnp.dtype(fp8_dtype) == jnp.dtype(jnp.float8_e4m3fnuz):  # the same value in FNUZ is half the bytes' value
        q, scale = kv_quant.cast_e4m3(q.astype(jnp.float32) / 2, jnp.float8_e4m3fnuz), scale * 2  # -0 -> +0
    return QuantizedWeight(q, scale, Format.FP8, block)


def quantize_fp4(w: jax.Array) -> QuantizedWeight:
    """[..., in, out] float (in % 32 == 0) -> FP4 `QuantizedWeight` (packed along in, E8M0 per 32 inputs)."""
    *lead, k, n = w.shape
    g = w.astype(jnp.float32).reshape(*lead, k // 32, 32, n)
    e = _exponents(jnp.abs(g).max(axis=-2), FP4_MAX)  # [..., k/32, n]
    codes = e2m1_codes(jnp.ldexp(g, -e[..., None, :])).reshape(*lead, k // 2, 2, n)
    packed = (codes[..., 0, :] | (codes[..., 1, :] << 4)).astype(jnp.uint8)
    return QuantizedWeight(packed, (e + 127).astype(jnp.uint8), Format.FP4, FP4_BLOCK)


def _names(path) -> tuple[str, ...]:
    """The dict keys of a params path: the same for a per-layer and a stacked (`LayerStack`) tree."""
    return tuple(k if isinstance(k, str) else k.key for k in path
                 if isinstance(k, str) or isinstance(k, jax.tree_util.DictKey))


class _LeafQuantizer:
    """Quantizes a params leaf by its path as a published ``quantize`` checkpoint stores it (`leaf_formats`):
    FP8 or FP4 `QuantizedWeight`, or the leaf unchanged. `block` is the FP8 block over the checkpoint's [out, in]."""

    def __init__(self, cfg, quantize: str, block: tuple[int, int], fp8_dtype):
        self.formats = {_names(leaf.path): fmt for leaf, fmt in leaf_formats(cfg, jnp.float32, quantize)}
        self.block, self.fp8_dtype = (block[1], block[0]), fp8_dtype
        self.fp4, self.fp8 = jax.jit(quantize_fp4), jax.jit(quantize_fp8, static_argnums=(1, 2))

    def quantizer(self, path):
        """The jitted quantizer of the leaf at `path` (whole leaf -> `QuantizedWeight`), or None (kept as is)."""
        fmt = self.formats[_names(path)]
        if fmt == "fp4":
            return self.fp4
        return (lambda x: self.fp8(x, self.block, self.fp8_dtype)) if fmt == "fp8" else None

    def __call__(self, path, w):
        fn = self.quantizer(path)
        return w if fn is None else by_slice(fn, w)


def quantize_model(model: Model, quantize: str = "fp4", block: tuple[int, int] = (128, 128),
                   fp8_dtype=jnp.float8_e4m3fn) -> Model:
    """`model` with the leaves a published ``quantize`` checkpoint stores quantized replaced by `QuantizedWeight`s
    (`block` is the FP8 block over the checkpoint's [out, in]). Leaf by leaf on the params as they are (stacked
    layers stay stacked), so the peak is the model plus its quantized copy."""
    one = _LeafQuantizer(model.config, quantize, block, fp8_dtype)
    return dataclasses.replace(model, params=jax.tree_util.tree_map_with_path(one, model.params))


def abstract_quantized(cfg, params, quantize: str = "fp4", block: tuple[int, int] = (128, 128),
                       fp8_dtype=jnp.float8_e4m3fn):
    """The shapes of `quantize_model`'s params (`jax.ShapeDtypeStruct` leaves, `QuantizedWeight`s where a published
    ``quantize`` checkpoint stores one) for abstract `params` (`params.abstract`): a quantized model's steps lowered
    with no weight allocated (`ds4jax.rocm_check`)."""
    one = _LeafQuantizer(cfg, quantize, block, fp8_dtype)

    def leaf(path, x):
        fn = one.quantizer(path)
        return x if fn is None else jax.eval_shape(fn, x)

    return jax.tree_util.tree_map_with_path(leaf, params)


def random_quantized_model(cfg, key: jax.Array, quantize: str = "fp4", block: tuple[int, int] = (128, 128),
                           fp8_dtype=jnp.float8_e4m3fn) -> Model:
    """`quantize_model(Model(cfg, params.init(cfg, key, bfloat16)))` built leaf by leaf: each weight is drawn in
    bfloat16 and quantized at once, so the peak is the quantized model plus one leaf (a model too large for the
    device in bfloat16, such as the largest `flash_slice` one H200 holds in the published format,
    docs/benchmarks/quantized_fit.md, can be benchmarked). The same draws as `params.init`, so the same numbers as
    quantizing its model. Layers are drawn straight into the stacked layout `Model` keeps (`layer_stack.for_loader`'s
    unless ``DS4JAX_SCAN_LAYERS=0``): stacking per-layer leaves afterwards held a whole stacked leaf twice, which
    the 28-layer slice on the H200 could not spare (12 GB over, session 16)."""
    from ds4jax.model import layer_stack
    from ds4jax.model import params as params_lib

    one = _LeafQuantizer(cfg, quantize, block, fp8_dtype)
    flat, treedef = jax.tree_util.tree_flatten_with_path(params_lib.declare(cfg), is_leaf=params_lib._is_info)
    keys = jax.random.split(key, len(flat))
    draws = jax.tree_util.tree_unflatten(treedef, [_Draw(path, info, k) for (path, info), k in zip(flat, keys)])
    make = lambda d: one(d.path, d.info.init(d.key, d.info.shape, d.info.dtype(jnp.bfloat16)))  # noqa: E731
    params = jax.tree.map(make, {name: tree for name, tree in draws.items() if name != "layers"})
    if layer_stack.scan_by_default():
        layers = layer_stack.stack(cfg, draws["layers"], combine=lambda *ds: _drawn_into_stack(make, ds))
    else:
        layers = jax.tree.map(make, draws["layers"])
    return Model(cfg, {**params, "layers": layers})


class _Draw:
    """A leaf still to draw: its path in the per-layer tree, its `ParamInfo` and its key (a plain object, so a
    pytree leaf)."""

    def __init__(self, path, info, key):
        self.path, self.info, self.key = path, info, key


_put = jax.jit(lambda stacked, x, i: jax.lax.dynamic_update_index_in_dim(stacked, x, i, 0), donate_argnums=0)


def _drawn_into_stack(make, draws) -> object:
    """One stacked leaf of the repetitions `draws`: each drawn and quantized (`make`) and written into its slice
    of the stacked arrays at once, so the peak is the stack plus one slice."""
    out = None
    for i, d in enumerate(draws):
        x = make(d)
        if out is None:
            out = jax.tree.map(lambda a: jnp.zeros((len(draws),) + a.shape, a.dtype), x)
        out = jax.tree.map(lambda o, a: _put(o, a, i), out, x)
        del x
    return out


def by_slice(quantize, w: jax.Array) -> QuantizedWeight:
    """`quantize(w)` one leading (layer or expert) slice at a time, results stacked: the float32 temporaries of a
    whole stacked expert tensor (4 Flash layers' experts are 17 GB in bf16, their f32 intermediates several times
    that) need not fit beside the model, only one slice's. Every quantizer here works on the last two axes, so a
    leading slice quantizes to the same numbers."""
    if w.ndim < 3:
        return quantize(w)
    parts = [quantize(w[i]) for i in range(w.shape[0])]
    return jax.tree.map(lambda *xs: jnp.stack(xs), *parts)
