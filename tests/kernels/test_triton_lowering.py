"""Pallas -> Triton IR lowering of the kernels at Flash dims, checked on a CPU host (no GPU needed).

Lowering for platform 'cuda' / 'rocm' runs Pallas' Triton lowering rules, which interpret mode never
touches: it catches unsupported primitives and operand forms (e.g. a jaxpr literal yielded from a
`lax.cond` branch). It does not run Triton's own compiler (layouts, registers, shared memory).

Dump the IR with DS4JAX_DUMP_TTIR=<dir>; a pip `triton` then compiles it on a CPU host:
  triton.compile(path, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=8, num_stages=2))
(`.metadata.shared` = shared memory; `cuobjdump --dump-resource-usage` on `.asm["cubin"]` = registers, spills).
"""

from __future__ import annotations

import functools
import os
import pathlib

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels import (IndexerTopkBlockSizes, SparseAttentionBlockSizes, grouped_matmul, indexer_topk, sinkhorn,
                            sparse_attention)
from pallas_kernels.fp8_matmul import fp8_matmul
from pallas_kernels.grouped_matmul_fp4 import grouped_matmul_fp4
from pallas_kernels.grouped_matmul_fp8 import grouped_matmul_fp8
from pallas_kernels.mhc_pre import mhc_pre

S = jax.ShapeDtypeStruct
T, H, D, HI, DI = 4, 64, 512, 64, 128


def _sparse(dtype, block_sizes):
    fn = functools.partial(sparse_attention, scale=D**-0.5, block_sizes=block_sizes)
    args = (
        S((T, H, D), dtype),
        S((4096, D), dtype),
        S((T, 130), jnp.int32),
        S((8192, D), dtype),
        S((T, 512), jnp.int32),
        S((H,), jnp.float32),
    )
    return fn, args


def _indexer(dtype, block_sizes):
    fn = functools.partial(indexer_topk, k=512, block_sizes=block_sizes)
    args = (
        S((T, HI, DI), dtype),
        S((T, HI), jnp.float32),
        S((100_000, DI), dtype),
        S((T, 32768), jnp.int32),
        S((T,), jnp.int32),
    )
    return fn, args


def _sparse_fp8(kv_dtype):
    """The sparse attention over an FP8 cache: E4M3 pools (OCP or FNUZ) with one f32 scale per row."""
    fn = functools.partial(sparse_attention, scale=D**-0.5)
    args = (S((T, H, D), jnp.bfloat16), S((4096, D), kv_dtype), S((T, 130), jnp.int32), S((8192, D), kv_dtype),
            S((T, 512), jnp.int32), S((H,), jnp.float32))
    scales = dict(kv_a_scale=S((4096,), jnp.float32), kv_b_scale=S((8192,), jnp.float32))
    return (lambda *a, kv_a_scale, kv_b_scale: fn(*a, kv_a_scale=kv_a_scale, kv_b_scale=kv_b_scale)), (args, scales)


def _indexer_fp8(kv_dtype):
    fn = functools.partial(indexer_topk, k=512)
    args = (S((T, HI, DI), jnp.bfloat16), S((T, HI), jnp.float32), S((100_000, DI), kv_dtype),
            S((T, 32768), jnp.int32), S((T,), jnp.int32))
    return (lambda *a, key_scale: fn(*a, key_scale=key_scale)), (args, dict(key_scale=S((100_000,), jnp.float32)))


def _grouped(rows, tiles, n_w, k, n):
    """Routed experts at Flash dims (256 experts): decode (6 one-row tiles) and prefill (448 tiles of 64 rows)."""
    return grouped_matmul, (S((rows, k), jnp.bfloat16), tuple(S((256, k, n), jnp.bfloat16) for _ in range(n_w)),
                            S((tiles,), jnp.int32))


def _grouped_fp4(rows, tiles, n_w, k, n):
    """The same with the checkpoint's FP4 experts: packed [256, k/2, n] + E8M0 scales [256, k/32, n]."""
    w = lambda: (S((256, k // 2, n), jnp.uint8), S((256, k // 32, n), jnp.uint8))
    return grouped_matmul_fp4, (S((rows, k), jnp.bfloat16), tuple(w() for _ in range(n_w)), S((tiles,), jnp.int32))


def _grouped_fp8(rows, tiles, n_w, k, n, fp8_dtype):
    """The same with a base checkpoint's FP8 experts: E4M3 (OCP or FNUZ) [256, k, n] + f32 128x128 block scales;
    k / n not multiples of the tiles in the ragged case (masked edges)."""
    w = lambda: (S((256, k, n), fp8_dtype), S((256, -(-k // 128), -(-n // 128)), jnp.float32))
    return grouped_matmul_fp8, (S((rows, k), jnp.bfloat16), tuple(w() for _ in range(n_w)), S((tiles,), jnp.int32))


def _fp8_dense(m, k, n, fp8_dtype, dtype=jnp.bfloat16):
    """An FP8 dense linear (E4M3 OCP or FNUZ + f32 128x128 block scales) at Flash dims, in / out not multiples of
    the tiles in the ragged case (masked edges)."""
    return fp8_matmul, (S((m, k), dtype), S((k, n), fp8_dtype), S((-(-k // 128), -(-n // 128)), jnp.float32))


def _sinkhorn(tokens, m=4):
    """The mHC projection (20 rounds): decode batch 64 (one program) and a 16k-token prefill (a masked tail)."""
    return functools.partial(sinkhorn, iters=20, eps=1e-6), (S((tokens, m, m), jnp.float32),)


def _mhc_pre(tokens, m=4, e=4096, head=False, dtype=jnp.bfloat16):
    """The fused mHC pre-step at Flash dims: decode (one program, chunked hidden), a prefill tail, m = 3 padded,
    a hidden size that is not a power of two (7168, the full Flash), the head's variant."""
    n = m if head else 2 * m + m * m
    args = (S((tokens, n), jnp.float32), S((tokens, m, e), dtype), S((1 if head else 3,), jnp.float32),
            S((n,), jnp.float32), S((e,), jnp.float32))
    return functools.partial(mhc_pre, iters=20, hc_eps=1e-6, rms_eps=1e-6, head=head), args


CASES = {
    "grouped_decode_gate_up": _grouped(96, 6, 2, 4096, 2048),
    "grouped_prefill_down": _grouped(448 * 64, 448, 1, 2048, 4096),
    "grouped_fp4_decode_gate_up": _grouped_fp4(96, 6, 2, 4096, 2048),
    "grouped_fp4_prefill_down": _grouped_fp4(448 * 64, 448, 1, 2048, 4096),
    "grouped_fp8_decode_gate_up_ocp": _grouped_fp8(96, 6, 2, 4096, 2048, jnp.float8_e4m3fn),
    "grouped_fp8_prefill_down_fnuz": _grouped_fp8(448 * 64, 448, 1, 2048, 4096, jnp.float8_e4m3fnuz),
    "grouped_fp8_ragged_fnuz": _grouped_fp8(64, 4, 2, 1000, 520, jnp.float8_e4m3fnuz),
    "fp8_dense_decode_ocp": _fp8_dense(8, 4096, 1024, jnp.float8_e4m3fn),
    "fp8_dense_decode_fnuz": _fp8_dense(8, 4096, 1024, jnp.float8_e4m3fnuz),
    "fp8_dense_prefill_ragged": _fp8_dense(500, 1000, 4000, jnp.float8_e4m3fn),
    "fp8_dense_f32_fnuz": _fp8_dense(1, 512, 520, jnp.float8_e4m3fnuz, jnp.float32),
    "sparse_bf16_split": _sparse(jnp.bfloat16, None),
    "sparse_bf16_h16_w4": _sparse(jnp.bfloat16, SparseAttentionBlockSizes(block_h=16, num_warps=4, num_splits=1)),
    "sparse_f32_one_split": _sparse(jnp.float32, SparseAttentionBlockSizes(block_h=16, block_k=16, num_splits=1)),
    "indexer_bf16": _indexer(jnp.bfloat16, None),
    "indexer_f32_c32": _indexer(jnp.float32, IndexerTopkBlockSizes(block_c=32, max_split=4096)),
    "sparse_fp8_ocp": _sparse_fp8(jnp.float8_e4m3fn),
    "sparse_fp8_fnuz": _sparse_fp8(jnp.float8_e4m3fnuz),
    "indexer_fp8_ocp": _indexer_fp8(jnp.float8_e4m3fn),
    "indexer_fp8_fnuz": _indexer_fp8(jnp.float8_e4m3fnuz),
    "sinkhorn_decode": _sinkhorn(64),
    "sinkhorn_prefill_tail": _sinkhorn(16384 + 5),
    "sinkhorn_m8": _sinkhorn(100, m=8),
    "sinkhorn_m3_padded": _sinkhorn(100, m=3),
    "mhc_pre_decode": _mhc_pre(1),
    "mhc_pre_prefill_tail": _mhc_pre(2048 + 3),
    "mhc_pre_m3_e7168": _mhc_pre(8, m=3, e=7168),
    "mhc_pre_small_one_chunk": _mhc_pre(5, m=2, e=64, dtype=jnp.float32),
    "mhc_head_decode": _mhc_pre(8, head=True),
}


@pytest.mark.parametrize("platform", ["cuda", "rocm"])
@pytest.mark.parametrize("name", list(CASES))
def test_lowers_to_triton(name, platform):
    fn, args = CASES[name]
    args, kwargs = args if isinstance(args[-1], dict) else (args, {})
    dump = os.environ.get("DS4JAX_DUMP_TTIR")
    with _capture_ttir() if dump else _nothing() as captured:
        text = jax.jit(fn).trace(*args, **kwargs).lower(lowering_platforms=(platform,)).as_text()
    assert text.count("triton") >= 1, "expected one Triton custom call"
    if dump:
        path = pathlib.Path(dump)
        path.mkdir(parents=True, exist_ok=True)
        (path / f"{name}_{platform}.ttir").write_text(captured[-1])


class _nothing:
    def __enter__(self):
        return []

    def __exit__(self, *exc):
        return False


class _capture_ttir:
    """Record the Triton module text (private jax hook: only used when dumping)."""

    def __enter__(self):
        from jax._src.pallas.triton import pallas_call_registration as reg

        self.reg, self.orig, captured = reg, reg.lowering.lower_jaxpr_to_triton_module, []

        def hook(*args, **kwargs):
            result = self.orig(*args, **kwargs)
            captured.append(result.module.operation.get_asm(enable_debug_info=False))
            return result

        reg.lowering.lower_jaxpr_to_triton_module = hook
        return captured

    def __exit__(self, *exc):
        self.reg.lowering.lower_jaxpr_to_triton_module = self.orig
        return False
