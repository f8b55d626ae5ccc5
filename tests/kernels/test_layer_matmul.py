"""layer_matmul kernel vs its reference: one layer of a bf16 / f32 weight stack whose other layers are NaN, so a
read of any other layer (or past an edge: the interpreter fills masked-off elements with NaN before masking)
poisons the result. Decode row counts (1, 2, 16: one row tile, k splits), prefill-like 100, shapes that are not
multiples of the tiles, and the grouped form (attention's wo_a).

`TestInterpret` runs on CPU (interpret mode); `TestDevice` (marker `device`) compiles the same kind of cases.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest
from kernel_util import stack_with_poison

from pallas_kernels.fp8_matmul import BlockSizes
from pallas_kernels.layer_matmul import layer_matmul, layer_matmul_reference


@dataclasses.dataclass(frozen=True)
class Case:
    """x [m, k] (or [groups, m, k]) times layer `layer` of a `layers`-deep stack of [k, n] weights."""

    name: str
    m: int
    k: int
    n: int
    groups: int = 0  # 0: a 2-D x; else x [groups, m, k]
    dtype: str = "float32"
    layers: int = 3
    layer: int = 1
    block_sizes: BlockSizes | None = None

    def __str__(self):
        return self.name


CASES = [
    Case("m1_ragged_k_splits", 1, 180, 150, block_sizes=BlockSizes(block_k=32, block_n=32, k_splits=3)),
    Case("m2_last_layer", 2, 256, 96, layer=2, block_sizes=BlockSizes(block_k=32, block_n=32)),
    Case("m16_first_layer", 16, 70, 100, layer=0, block_sizes=BlockSizes(block_k=16, block_n=32)),
    Case("m100_prefill_tiles", 100, 130, 70, block_sizes=BlockSizes(tile_m=32, block_k=32, block_n=32)),
    Case("m8_bf16_defaults", 8, 300, 129, dtype="bfloat16"),
    Case("grouped_m2", 2, 96, 40, groups=4, block_sizes=BlockSizes(block_k=32, block_n=16, k_splits=2)),
    Case("grouped_m5_bf16_defaults", 5, 130, 72, groups=3, dtype="bfloat16"),
]


def make_inputs(case: Case, seed: int = 0):
    """(x, the stack with NaN in every layer but `case.layer`, that layer's weight)."""
    rng = np.random.default_rng(seed)
    lead = (case.groups,) if case.groups else ()
    x = jnp.asarray(rng.standard_normal((*lead, case.m, case.k)), case.dtype)
    w = jnp.asarray(rng.standard_normal((*lead, case.k, case.n)) / np.sqrt(case.k), case.dtype)
    return x, stack_with_poison(w, case.layer, case.layers), w


def check(case: Case, interpret: bool):
    x, stack, w = make_inputs(case)
    layer = jnp.int32(case.layer)
    got = np.asarray(layer_matmul(x, stack, layer, block_sizes=case.block_sizes, interpret=interpret))
    want = np.asarray(layer_matmul_reference(x, stack, layer))
    spec = "gmk,gkn->gmn" if case.groups else "mk,kn->mn"
    direct = np.einsum(spec, np.asarray(x, np.float32), np.asarray(w, np.float32))
    assert got.shape == direct.shape and got.dtype == np.float32
    assert np.isfinite(want).all() and np.isfinite(got).all()
    np.testing.assert_allclose(want, direct, rtol=0, atol=1e-5 * np.abs(direct).max())
    # the same products; only the f32 sums reassociate (k splits, tiles)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())


class TestInterpret:
    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_reads_its_layer_only(self, case):
        check(case, interpret=True)

    def test_bad_operands_are_named(self):
        x, stack, _ = make_inputs(CASES[0])
        with pytest.raises(ValueError, match="stack must be"):
            layer_matmul(x, stack[:, :-1], jnp.int32(0), interpret=True)
        with pytest.raises(ValueError, match="stack must be"):
            layer_matmul(x, stack.astype(jnp.float8_e4m3fn), jnp.int32(0), interpret=True)
        with pytest.raises(ValueError, match="layer must be"):
            layer_matmul(x, stack, jnp.float32(0), interpret=True)
        with pytest.raises(ValueError, match="x must be"):
            layer_matmul(x[None, None], stack, jnp.int32(0), interpret=True)


@pytest.mark.device
class TestDevice:
    @pytest.mark.parametrize("case", [
        Case("decode_bf16", 2, 4096, 1000, dtype="bfloat16"),
        Case("decode_ragged_bf16", 1, 1000, 4100, dtype="bfloat16", layer=2),
        Case("decode_grouped_bf16", 2, 1024, 256, groups=8, dtype="bfloat16"),
        Case("prefill_bf16", 300, 1000, 520, dtype="bfloat16"),
        Case("decode_f32", 16, 512, 384),
    ], ids=str)
    def test_reads_its_layer_only(self, case):
        check(case, interpret=False)
