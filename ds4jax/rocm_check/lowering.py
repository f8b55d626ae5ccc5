"""Lower the real serving steps on this (CPU) host as if on a GPU target, and list the Triton kernels in them.

`as_if_on(target)` makes trace-time device queries answer for the target: the kernel dispatcher's architecture
(tile defaults) and `jax.default_backend()` (Pallas kernels rather than the references; the GPU MoE strategies).
Both are trace-time facts that jit's cache keys do not carry, so JAX's caches are cleared on entry and exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from unittest import mock

import jax
import jax.numpy as jnp

from ds4jax.model import params as model_params
from ds4jax.model.config import AttentionType, Config, MlpType, flash, pro
from ds4jax.model.quantize import abstract_quantized
from ds4jax.rocm_check.extract import TritonKernel, triton_kernels
from ds4jax.rocm_check.targets import GpuTarget
from ds4jax.runtime import kernels as dispatch, pools, steps, target as device
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.roles import Role
from ds4jax.runtime.target import Target

MAX_CONTEXT = 131072  # 128k: the indexer scores 32k C4 entries, HCA attends to 1k C128 entries


@contextlib.contextmanager
def as_if_on(target: Target):
    jax.clear_caches()
    try:
        with mock.patch.object(device, "device_target", lambda: target), \
                mock.patch.object(jax, "default_backend", lambda: "gpu"):
            yield
    finally:
        jax.clear_caches()


def layers_of(full: Config, attention: tuple[AttentionType, ...], mlp: tuple[MlpType, ...]) -> Config:
    """A model's real per-layer dimensions with one layer of each kind it has (each kind dispatches its kernels)."""
    return full.replace(num_layers=len(attention), attention_types=attention, mlp_types=mlp)


A, M = AttentionType, MlpType
MODELS = {
    "Flash": functools.partial(layers_of, flash(), (A.SLIDING, A.CSA, A.HCA), (M.HASH, M.HASH, M.TOPK)),
    "Pro": functools.partial(layers_of, pro(), (A.HCA, A.CSA), (M.HASH, M.TOPK)),  # Pro has no sliding-only layer
}
DTYPES = {"bf16": jnp.bfloat16, "fp32": jnp.float32}
# (batch rows, tokens per row): decode at batch 8 (few programs: split-K partials), a 512-token prefill chunk.
SHAPES = {"decode": (8, 1), "prefill": (1, 512)}


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    dtype: str
    shape: str
    kv_dtype: str = "auto"  # "fp8": the FP8 KV cache, resolved for the target (FNUZ on gfx942)
    weights: str = "bf16"  # "published": FP8 dense + FP4 experts as the checkpoint stores them (`quantize_model`'s
    # leaves; the FP8 in the target's variant: FNUZ on gfx942), read by the FP8 matmul and the FP4 grouped kernels

    @property
    def label(self) -> str:
        """The report's dtype column: the compute dtype, and the weights when they are not in it."""
        return self.dtype + (", FP8 + FP4 weights" if self.weights == "published" else "")


CASES = tuple(Case(m, d, s) for m in MODELS for d in DTYPES for s in SHAPES)
FP8_KV_CASES = (Case("Flash", "bf16", "decode", kv_dtype="fp8"),)  # checked, not in the report's tables
# Flash in its published format: decode at batch 8 (48 expert selections: the FP4 GEMV) and a 512-token prefill
# (the FP4 tile kernel), the dense linears through the FP8 matmul
PUBLISHED_CASES = tuple(Case("Flash", "bf16", s, weights="published") for s in SHAPES)


def _abstract_batch(rows: int, tokens: int) -> steps.StepBatch:
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)  # noqa: E731
    return steps.StepBatch(s(rows), s(rows, tokens), s(rows))


def spec_for(case: Case) -> PoolSpec:
    return PoolSpec.for_role(MODELS[case.model](), role=Role.TARGET, max_slots=max(SHAPES[case.shape][0], 8),
                             max_context=MAX_CONTEXT, dtype=jnp.dtype(DTYPES[case.dtype]).name, kv_dtype=case.kv_dtype)


@functools.lru_cache(maxsize=4)
def lower_step(case: Case, gpu: GpuTarget) -> jax.stages.Lowered:
    """The target step of `case` (decode or prefill) lowered for `gpu`, with the tiles the dispatcher picks there.
    The last few are kept: a check that reads a lowering's text and then its kernels (`kernels_of`) traces and
    lowers the Flash step once, not twice (~1.5 CPU s each)."""
    cfg, dtype = MODELS[case.model](), DTYPES[case.dtype]
    rows, tokens = SHAPES[case.shape]
    step = steps.decode if case.shape == "decode" else steps.prefill
    with as_if_on(gpu.target):
        spec = spec_for(case)  # on the target: kv_dtype "fp8" is its FP8 variant
        params = model_params.abstract(cfg, dtype)
        if case.weights == "published":
            params = abstract_quantized(cfg, params, "fp4", fp8_dtype=gpu.target.fp8_dtype)
        traced = jax.jit(functools.partial(step, cfg=cfg, spec=spec)).trace(
            params, pools.abstract(spec), _abstract_batch(rows, tokens))
        return traced.lower(lowering_platforms=(gpu.lowering,))


_LOWERED: dict = {}  # (case, lowering platform, tiles) -> kernels: gfx942 and gfx950 share fp32 lowerings


def kernels_of(case: Case, gpu: GpuTarget) -> list[TritonKernel]:
    """The Triton kernels of `case` on `gpu`; targets that share a lowering platform and tiles share one lowering."""
    dtype = jnp.dtype(DTYPES[case.dtype])
    key = (case, gpu.lowering, tuple(dispatch.block_sizes(op, dtype, gpu.name)
                                     for op in ("sparse_attention", "indexer_topk", "mhc_pre")))
    if case.weights != "bf16":  # the FP8 variant and the FP4 GEMV's decode are the architecture's own
        key += (gpu.name,)
    if key not in _LOWERED:
        _LOWERED[key] = triton_kernels(lower_step(case, gpu))
    return _LOWERED[key]
