"""sinkhorn kernel vs its reference: one token, tails that are not a multiple of the block, leading batch dims,
m = 2 / 4 / 8, bf16 input; NaN-poisoned tokens never reach another token, and every output is written (the
Pallas interpreter starts outputs as NaN, so a token the kernel skipped would come back NaN).

`TestSinkhornInterpret` runs on CPU (interpret mode); `TestSinkhornDevice` (marker `device`) compiles the kernel on
a GPU at decode and prefill token counts.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pallas_kernels.sinkhorn import BlockSizes, sinkhorn, sinkhorn_reference
from pallas_kernels.sinkhorn.blocks import launch_block

ITERS, EPS = 20, 1e-6  # DeepSeek-V4's hc_sinkhorn_iters and hc_eps
# Kernel and reference are each ~2e-6 (relative) from a float64 evaluation: f32 rounding of exp and the sums.
RTOL, ATOL = 4e-6, 1e-7


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    shape: tuple[int, ...]  # [..., m, m]
    block_tokens: int | None = None  # None = the default tiles
    dtype: str = "float32"
    poisoned: tuple[int, ...] = ()  # flat token ids whose logits are NaN (padding rows of a step)

    def __str__(self):
        return self.name


CASES = [
    Case("one_token", (1, 4, 4)),
    Case("tail_of_16_blocks", (37, 4, 4), block_tokens=16, poisoned=(0, 17, 36)),
    Case("default_block_tail", (300, 4, 4), poisoned=(127, 128, 299)),
    Case("batch_dims", (3, 5, 4, 4), block_tokens=8),
    Case("m2", (13, 2, 2), block_tokens=4, poisoned=(12,)),
    Case("m8", (9, 8, 8), block_tokens=4),
    # m not a power of two: the kernel pads its tile to 4 x 4 / 8 x 8 (masked); padding must not reach a sum
    Case("m3_padded", (11, 3, 3), block_tokens=4, poisoned=(6,)),
    Case("m5_padded", (6, 5, 5), block_tokens=8),
    Case("bf16_logits", (20, 4, 4), dtype="bfloat16"),
]


def make_logits(case: Case, scale: float = 3.0) -> jax.Array:
    x = np.asarray(jax.random.normal(jax.random.key(len(case.name)), case.shape), np.float32) * scale
    flat = x.reshape((-1,) + case.shape[-2:])
    flat[list(case.poisoned)] = np.nan
    return jnp.asarray(flat.reshape(case.shape), case.dtype)


def live_tokens(case: Case) -> np.ndarray:
    live = np.ones(int(np.prod(case.shape[:-2])), bool)
    live[list(case.poisoned)] = False
    return live


class SinkhornTestBase:
    INTERPRET = True

    def check(self, case: Case):
        logits = make_logits(case)
        bs = None if case.block_tokens is None else BlockSizes(block_tokens=case.block_tokens)
        got = sinkhorn(logits, iters=ITERS, eps=EPS, block_sizes=bs, interpret=self.INTERPRET)
        want = sinkhorn_reference(logits, iters=ITERS, eps=EPS)
        chex.assert_shape(got, case.shape)
        chex.assert_type(got, jnp.float32)
        m = case.shape[-1]
        got, want = np.asarray(got).reshape(-1, m, m), np.asarray(want).reshape(-1, m, m)
        live = live_tokens(case)
        assert np.isfinite(got[live]).all(), "a live token was not written or read a poisoned token"
        assert np.isnan(got[~live]).all(axis=(1, 2)).all(), "a poisoned token's output should stay its own (NaN)"
        chex.assert_trees_all_close(got[live], want[live], rtol=RTOL, atol=ATOL)


class TestSinkhornInterpret(SinkhornTestBase):
    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_matches_reference(self, case):
        self.check(case)

    def test_doubly_stochastic(self):
        x = make_logits(Case("unit_logits", (64, 4, 4)), scale=1.0)
        c = np.asarray(sinkhorn(x, iters=ITERS, eps=EPS, interpret=True))
        assert (c > 0).all()
        np.testing.assert_allclose(c.sum(-2), 1, atol=1e-5)  # the last step normalises the columns
        np.testing.assert_allclose(c.sum(-1), 1, atol=1e-3)  # rows: converged after 20 rounds at unit-scale logits

    @settings(max_examples=15, deadline=None)
    @given(hnp.arrays(np.float32, (5, 4, 4), elements=st.floats(-30, 30, width=32)), st.sampled_from([1, 2, 20]))
    def test_any_logits(self, x, iters):
        """Extreme logits (softmax underflow to 0 + eps) and short iteration counts: one compile per iters."""
        got = sinkhorn(jnp.asarray(x), iters=iters, eps=EPS, block_sizes=BlockSizes(block_tokens=4), interpret=True)
        want = sinkhorn_reference(jnp.asarray(x), iters=iters, eps=EPS)
        chex.assert_trees_all_close(got, want, rtol=RTOL, atol=ATOL)

    @pytest.mark.parametrize("m", [3, 4])
    def test_eps_zero(self, m):
        """eps = 0: a padded row or column of the m = 3 tile sums to 0 (0 / 0 there must not reach a real entry)."""
        x = make_logits(Case("eps0", (5, m, m)), scale=1.0)
        got = sinkhorn(x, iters=ITERS, eps=0.0, block_sizes=BlockSizes(block_tokens=4), interpret=True)
        chex.assert_trees_all_close(got, sinkhorn_reference(x, iters=ITERS, eps=0.0), rtol=RTOL, atol=ATOL)

    def test_reference_is_the_models_sinkhorn(self):
        """The kernel package may not import ds4jax, so its spec restates `mhc.sinkhorn`: they must agree."""
        from ds4jax.model.layers import mhc

        x = make_logits(Case("spec", (7, 4, 4)))
        chex.assert_trees_all_equal(sinkhorn_reference(x, iters=ITERS, eps=EPS), mhc.sinkhorn(x, ITERS, EPS))


@pytest.mark.device
class TestSinkhornDevice(SinkhornTestBase):
    INTERPRET = False

    @pytest.mark.parametrize("case", [
        Case("decode_b64", (64, 1, 4, 4), poisoned=(5,)),
        Case("decode_b3_tail", (3, 1, 4, 4)),
        Case("prefill_16k", (1, 16384, 4, 4), poisoned=(0, 16383)),
        Case("prefill_tail", (1, 1000, 4, 4)),
    ], ids=str)
    def test_matches_reference(self, case):
        self.check(case)


def test_launch_block():
    assert launch_block(BlockSizes(), 1) == (1, 1)
    assert launch_block(BlockSizes(), 64) == (64, 2)
    assert launch_block(BlockSizes(), 16384) == (128, 4)
    assert BlockSizes.get_default(jnp.float32, arch="gfx942").block_tokens == 256


def test_validation_names_the_argument():
    x = jnp.zeros((3, 4, 4))
    with pytest.raises(ValueError, match="logits must be"):
        sinkhorn(jnp.zeros((3, 4, 5)), iters=2, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="floating"):
        sinkhorn(jnp.zeros((3, 4, 4), jnp.int32), iters=2, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="iters"):
        sinkhorn(x, iters=0, eps=EPS, interpret=True)
    with pytest.raises(ValueError, match="eps"):
        sinkhorn(x, iters=2, eps=-1.0, interpret=True)
    with pytest.raises(ValueError, match="power of two"):
        BlockSizes(block_tokens=96)
