"""The one bridge from ds4jax to `pallas_kernels`: picks an implementation per op.

| impl              | what runs                                     | default where        |
|-------------------|-----------------------------------------------|----------------------|
| REFERENCE         | the pure-jnp references (XLA)                 | CPU, TPU             |
| PALLAS            | the portable Pallas kernels (Triton backend)  | GPU (CUDA and ROCm)  |
| PALLAS_INTERPRET  | the same kernels in the Pallas interpreter    | tests on CPU         |

Override with the `kernels=` argument of the steps or the environment variable ``DS4JAX_KERNELS``
(``reference`` / ``pallas`` / ``pallas_interpret``). The choice is static: each compiles its own program.
The FP8 dense linears follow it too: a step traces them inside `dense_linears(impl)`, which hands
`model.layers.linear` the FP8 matmul kernel (PALLAS / PALLAS_INTERPRET) or leaves today's dequantize-then-dot
(REFERENCE).

Tiles: the Pallas kernels get the `BlockSizes` default of the device's architecture (`block_sizes`), e.g. MI300's
64 KB LDS and 64-wide wavefronts take other tiles than an H200 (`docs/benchmarks/rocm_kernels.md`).
"""

from __future__ import annotations

import contextlib
import enum
import functools
import os

import jax

from ds4jax.model import sharding
from ds4jax.model import layer_of
from ds4jax.model.layer_of import DenseLayerOf, LayerOf, QuantizedLayerOf
from ds4jax.model.layers import linear, mhc, moe
from ds4jax.runtime import sharded_kernels
from ds4jax.runtime import target as _target
from ds4jax.runtime.routed_experts import routed_experts_grouped


class Impl(enum.Enum):
    REFERENCE = "reference"
    PALLAS = "pallas"
    PALLAS_INTERPRET = "pallas_interpret"


def default_impl() -> Impl:
    env = os.environ.get("DS4JAX_KERNELS")
    if env:
        try:
            return Impl(env.lower())
        except ValueError:
            raise ValueError(f"DS4JAX_KERNELS={env!r}: expected one of {[i.value for i in Impl]}") from None
    return Impl.PALLAS if jax.default_backend() in ("gpu", "cuda", "rocm") else Impl.REFERENCE


def resolve(impl: Impl | str | None) -> Impl:
    if impl is None:
        return default_impl()
    return impl if isinstance(impl, Impl) else Impl(impl)


def kernel_arch(impl: Impl) -> str | None:
    """The architecture whose tiles the kernels use: the device's when compiled, None (generic) when interpreted."""
    return _target.device_target().arch if impl is Impl.PALLAS else None


def block_sizes(op: str, dtype, arch: str | None):
    """The `BlockSizes` the dispatcher hands kernel `op` ("sparse_attention" / "indexer_topk" / "mhc_pre") on
    `arch`."""
    import pallas_kernels  # here, not at the top: see __getattr__ below
    cls = {"sparse_attention": pallas_kernels.SparseAttentionBlockSizes,
           "indexer_topk": pallas_kernels.IndexerTopkBlockSizes,
           "mhc_pre": pallas_kernels.MhcPreBlockSizes}[op]
    return cls.get_default(dtype, arch=arch)


def _given(**scales) -> dict:
    """The optional operands that are present (an FP8 KV cache's row scales, a row offset), by keyword."""
    return {name: value for name, value in scales.items() if value is not None}


def sparse_attention(q, kv_a, idx_a, kv_b, idx_b, sink, *, scale: float, impl: Impl, kv_a_scale=None,
                     kv_b_scale=None, a_base=None):
    """q [t, h, d] attends to rows kv_a[idx_a[t]] and kv_b[idx_b[t]] (-1 = unused) with a sink -> [t, h, d].
    An FP8 pool comes with its row scales (kv_*_scale [rows] f32); the kernels read it as stored. a_base: None
    or an int32 scalar added to idx_a's valid slots."""
    import pallas_kernels  # here, not at the top: see __getattr__ below
    scales = _given(kv_a_scale=kv_a_scale, kv_b_scale=kv_b_scale, a_base=a_base)
    if impl is Impl.REFERENCE:
        return pallas_kernels.sparse_attention_reference(q, kv_a, idx_a, kv_b, idx_b, sink, scale=scale, **scales)

    def kernel(q, kv_a, idx_a, kv_b, idx_b, *rest):
        *given, sink = rest
        return pallas_kernels.sparse_attention(
            q, kv_a, idx_a, kv_b, idx_b, sink, scale=scale, **dict(zip(scales, given)),
            block_sizes=block_sizes("sparse_attention", q.dtype, kernel_arch(impl)),
            interpret=impl is Impl.PALLAS_INTERPRET)
    # shard_map under a mesh
    return sharded_kernels.per_head(kernel, q, kv_a, idx_a, kv_b, idx_b, *scales.values(), sink=sink)


def indexer_topk(q, w, keys, key_rows, n_valid, *, k: int, impl: Impl, key_scale=None):
    """Top-k logical entry ids [t, k] (-1 = none) of the lightning-indexer scores; ties go to the lower id.
    FP8 keys come with their row scales (key_scale [rows] f32)."""
    import pallas_kernels  # here, not at the top: see __getattr__ below
    scales = _given(key_scale=key_scale)
    if impl is Impl.REFERENCE:
        return pallas_kernels.indexer_topk_reference(q, w, keys, key_rows, n_valid, k=k, **scales)
    kernel = lambda q, w, keys, key_rows, n_valid, *given: pallas_kernels.indexer_topk(
        q, w, keys, key_rows, n_valid, k=k, **dict(zip(scales, given)),
        block_sizes=block_sizes("indexer_topk", q.dtype, kernel_arch(impl)), interpret=impl is Impl.PALLAS_INTERPRET)
    return sharded_kernels.replicated(kernel, q, w, keys, key_rows, n_valid, *scales.values())  # under a mesh


def routed_experts(x, routing, p, cfg, *, impl: Impl):
    """[n, e] tokens -> [n, e] f32 sum of their selected experts: `moe.routed_experts` (its strategies) or the
    grouped-matmul kernel over expert-sorted tiles (the architecture's tiles: `GroupedMatmulBlockSizes.get_default`)."""
    if impl is Impl.REFERENCE:
        return moe.routed_experts(x, routing, p, cfg)
    return routed_experts_grouped(x, routing, p, cfg, interpret=impl is Impl.PALLAS_INTERPRET, arch=kernel_arch(impl))


def mhc_pre(x, p, norm_weight, *, cfg, impl: Impl):
    """A block's hyper-connection pre-step with its sub-layer's RMSNorm: streams [..., m, e] -> (post [..., m],
    comb [..., m, m], normalised input [..., e]). REFERENCE: `mhc.hc_pre_normed` (the model's own); otherwise an
    XLA matmul for the mixes, then everything else in one kernel (`pallas_kernels.mhc_pre`). Under a mesh the
    kernel sees every token whole: the streams of a step's tokens, no partitioning."""
    if impl is Impl.REFERENCE:
        return mhc.hc_pre_normed(x, p, norm_weight, cfg)
    return _mhc_kernel(x, p, norm_weight, cfg=cfg, impl=impl, head=False)


def mhc_head(x, p, norm_weight, *, cfg, impl: Impl):
    """The final hyper-connection (no Sinkhorn, no post) with the final RMSNorm: [..., m, e] -> [..., e]."""
    if impl is Impl.REFERENCE:
        return mhc.hc_head_normed(x, p, norm_weight, cfg)
    return _mhc_kernel(x, p, norm_weight, cfg=cfg, impl=impl, head=True)


def _mhc_kernel(x, p, norm_weight, *, cfg, impl: Impl, head: bool):
    """The kernel on the mixes XLA computes; a scanned layer's operands (`LayerOf`s: `layer_of.mhc_in_place`) are
    read in their stacks, the layer index passed beside them."""
    import pallas_kernels  # here, not at the top: see __getattr__ below
    operands = (p["scale"], p["base"], norm_weight)
    stacked = isinstance(operands[0], LayerOf)
    if stacked != all(isinstance(a, LayerOf) for a in operands):
        raise TypeError("mhc_pre: scale, base and norm_weight must all be stacks (LayerOf) or all arrays")
    kw = dict(iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, rms_eps=cfg.rms_norm_eps, head=head,
              block_sizes=block_sizes("mhc_pre", x.dtype, kernel_arch(impl)), interpret=impl is Impl.PALLAS_INTERPRET)
    mix = mhc.raw_mixes(x, p["fn"])
    if stacked:
        kernel = lambda layer, *args: pallas_kernels.mhc_pre(*args, layer=layer, **kw)  # noqa: E731
        return sharded_kernels.replicated(kernel, operands[0].index, mix, x, *(a.stacked for a in operands))
    kernel = lambda *args: pallas_kernels.mhc_pre(*args, **kw)  # noqa: E731
    return sharded_kernels.replicated(kernel, mix, x, *operands)


def _partitioned_automatically() -> bool:
    """Whether a dense linear traced now would be split over an automatic mesh axis: GSPMD cannot split a custom
    call, and the dense linears are sharded by their params' specs, so the kernels give way to XLA's dot."""
    act = sharding.active()
    return act is not None and any(act.sizes[a] > 1 for a in act.auto)


def fp8_linear(x, w, *, impl: Impl):
    """x [m, in] @ an FP8 `QuantizedWeight` [in, out] -> [m, out] f32: dequantize next to the dot (the reference,
    and whenever the call would be partitioned over an automatic mesh axis: GSPMD cannot split a custom call, and
    the dense linears are sharded by their params' specs), or the FP8 matmul kernel reading the stored bytes (a
    scanned layer's `QuantizedLayerOf` in its stack: the kernel takes the layer index)."""
    import pallas_kernels  # here, not at the top: see __getattr__ below
    if impl is Impl.REFERENCE or _partitioned_automatically():
        w = w.get() if isinstance(w, QuantizedLayerOf) else w
        return pallas_kernels.fp8_matmul_reference(x, w.values, w.scales, block=w.block)
    layer = w.layer if isinstance(w, QuantizedLayerOf) else None
    return pallas_kernels.fp8_matmul(
        x, w.values, w.scales, block=w.block, interpret=impl is Impl.PALLAS_INTERPRET, layer=layer,
        block_sizes=pallas_kernels.Fp8MatmulBlockSizes.get_default(x.dtype, x.shape[0], arch=kernel_arch(impl)))


def layer_linear(x, w: DenseLayerOf, *, impl: Impl):
    """x [m, in] (or [g, m, in]) @ layer `w.index` of a scanned layer's stacked bf16 / f32 weight -> f32: the layer
    matmul kernel reading the stack in place, or (partitioned over an automatic mesh axis, as in `fp8_linear`)
    the reference on the layer's slice."""
    import pallas_kernels
    if _partitioned_automatically():
        return pallas_kernels.layer_matmul_reference(x, w.stacked, w.index)
    return pallas_kernels.layer_matmul(
        x, w.stacked, w.index, interpret=impl is Impl.PALLAS_INTERPRET,
        block_sizes=pallas_kernels.Fp8MatmulBlockSizes.get_default(x.dtype, x.shape[-2], arch=kernel_arch(impl)))


# Interpreted (CPU), a scanned layer's dense weights below this many bytes a layer stay slices: the math is the
# same either way, and every interpreted Pallas call is slow to compile, which test models (all of whose weights are
# small) paid in every scanned test (the mesh worker's first group 45 -> 67 s). On a GPU every one is read in place:
# a slice's copy is a launch of its own, which at decode costs more than the bytes it saves.
INTERPRET_IN_PLACE_MIN_BYTES = 1 << 20


@contextlib.contextmanager
def dense_linears(impl: Impl):
    """Trace a step's dense linears with `impl`: under PALLAS / PALLAS_INTERPRET the FP8 ones through the FP8
    matmul kernel (`linear.fp8_matmul`) and a scanned layer's bf16 / f32 ones read in their stacks by the layer
    matmul kernel (`linear.layer_matmul`), as are a scanned layer's mHC operands by the mHC kernel
    (`layer_of.mhc_in_place`); under REFERENCE nothing is installed (dequantize next to the dot, and slice a
    scanned layer's weights out of their stacks, as always)."""
    if impl is Impl.REFERENCE:
        yield
        return
    with linear.fp8_matmul(functools.partial(fp8_linear, impl=impl)), \
            linear.layer_matmul(functools.partial(layer_linear, impl=impl),
                                min_bytes=INTERPRET_IN_PLACE_MIN_BYTES if impl is Impl.PALLAS_INTERPRET else 0), \
            layer_of.mhc_in_place():  # the mHC kernel's small operands too (`_mhc_kernel`)
        yield


def __getattr__(name: str):
    """``<this module>.pallas_kernels``, for callers and tests that reach the kernels through it: the package is
    imported where a program is traced (a cached ``ds4jax generate`` traces none: tests/test_startup_imports.py)."""
    if name == "pallas_kernels":
        import pallas_kernels

        return pallas_kernels
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
