"""mhc_pre kernel (the fused hyper-connection pre-step) vs its reference: one token, token tails, a chunked hidden
dim with a ragged last chunk, m = 2 / 3 (padded) / 4, bf16 streams, the head's variant; NaN-poisoned tokens never
reach another token and every output is written (the Pallas interpreter starts outputs as NaN). The reference is
checked against the model's own `mhc.hc_pre_normed` / `hc_head` + `rms_norm`.

`TestMhcPreInterpret` runs on CPU (interpret mode); `TestMhcPreDevice` (marker `device`) compiles the kernel on a
GPU at decode and prefill token counts and Flash's hidden size.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_util import stack_with_poison

from pallas_kernels.mhc_pre import BlockSizes, mhc_pre, mhc_pre_reference
from pallas_kernels.mhc_pre.blocks import launch_tiles

ITERS, HC_EPS, RMS_EPS = 20, 1e-6, 1e-6  # DeepSeek-V4's


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    tokens: tuple[int, ...]  # leading dims
    m: int
    e: int
    block_sizes: BlockSizes | None = None  # None = the default tiles
    dtype: str = "float32"
    head: bool = False
    poisoned: tuple[int, ...] = ()  # flat token ids whose streams are NaN (padding rows of a step)

    def __str__(self):
        return self.name


CASES = [
    Case("one_token", (1,), 4, 64),
    Case("one_token_chunked", (1,), 4, 256, BlockSizes(tile_elements=256)),
    Case("token_tail_ragged_chunks", (11,), 4, 100, BlockSizes(block_tokens=4, tile_elements=128), poisoned=(0, 9)),
    Case("batch_dims", (3, 2), 4, 48, BlockSizes(block_tokens=2)),
    Case("m2", (5,), 2, 32, poisoned=(4,)),
    Case("m3_padded", (6,), 3, 40, BlockSizes(block_tokens=4, tile_elements=64), poisoned=(2,)),
    Case("bf16_streams", (9,), 4, 64, BlockSizes(block_tokens=4, tile_elements=256), dtype="bfloat16"),
    Case("head", (7,), 4, 96, BlockSizes(block_tokens=4, tile_elements=128), head=True, poisoned=(3,)),
    Case("head_one_chunk_bf16", (2,), 2, 32, head=True, dtype="bfloat16"),
]


def make_inputs(case: Case):
    """(mix, x, scale, base, norm_weight) at the scales a trained model has: mixes of a few units, a norm weight
    around 1; mix is computed from the un-poisoned streams (a poisoned token's streams are NaN, its mix too)."""
    m, e = case.m, case.e
    n = m if case.head else 2 * m + m * m
    k = jax.random.split(jax.random.key(len(case.name) + 7 * m + e), 5)
    x = np.array(jax.random.normal(k[0], case.tokens + (m, e)), np.float32)
    flat = x.reshape(-1, m, e)
    flat[list(case.poisoned)] = np.nan
    x = jnp.asarray(flat.reshape(x.shape), case.dtype)
    fn = jax.random.normal(k[1], (m * e, n)) * (2.0 / np.sqrt(m * e))
    mix = jnp.einsum("...i,io->...o", x.reshape(case.tokens + (m * e,)).astype(jnp.float32), fn,
                     precision=jax.lax.Precision.HIGHEST)
    scale = jax.random.uniform(k[2], (1 if case.head else 3,), minval=0.5, maxval=2.0)
    base = jax.random.normal(k[3], (n,))
    weight = 1.0 + 0.1 * jax.random.normal(k[4], (e,))
    return mix, x, scale, base, weight


def _tolerances(dtype: str):
    # f32: the kernel's sums run in another order than XLA's (a few ulp); bf16: the collapsed stream is rounded to
    # bf16 before its norm, so a sum that lands on the other side of a rounding boundary moves one bf16 ulp
    return (dict(rtol=2e-5, atol=2e-6) if dtype == "float32" else dict(rtol=1.6e-2, atol=1.6e-2))


class MhcPreTestBase:
    INTERPRET = True

    def check_stacked(self, case: Case, layer: int = 1):
        """The stacked form (scale / base / norm_weight as [3, ...] stacks, NaN outside `layer`) gives the
        unstacked kernel's outputs (to a few ulp: XLA may order the interpreter's sums differently), finite."""
        mix, x, scale, base, weight = make_inputs(case)
        kw = dict(iters=ITERS, hc_eps=HC_EPS, rms_eps=RMS_EPS, head=case.head, block_sizes=case.block_sizes,
                  interpret=self.INTERPRET)
        want = mhc_pre(mix, x, scale, base, weight, **kw)
        stacks = [stack_with_poison(a, layer, 3) for a in (scale, base, weight)]
        got = mhc_pre(mix, x, *stacks, layer=jnp.int32(layer), **kw)
        ref = mhc_pre_reference(mix, x, *stacks, layer=jnp.int32(layer), **kw)
        for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):  # NaN only where the tokens are poisoned
            finite = lambda a: np.isfinite(np.asarray(a, np.float32))  # noqa: E731
            np.testing.assert_array_equal(finite(g), finite(w))
        chex.assert_trees_all_close(got, want, **_tolerances("float32"))
        chex.assert_trees_all_close(ref, mhc_pre_reference(mix, x, scale, base, weight, **kw))

    def check(self, case: Case):
        args = make_inputs(case)
        kw = dict(iters=ITERS, hc_eps=HC_EPS, rms_eps=RMS_EPS, head=case.head)
        got = mhc_pre(*args, block_sizes=case.block_sizes, interpret=self.INTERPRET, **kw)
        want = mhc_pre_reference(*args, **kw)
        got, want = (got,) if case.head else got, (want,) if case.head else want
        lead, m, e = case.tokens, case.m, case.e
        shapes = ((lead + (e,),) if case.head else (lead + (m,), lead + (m, m), lead + (e,)))
        live = np.ones(int(np.prod(lead)), bool)
        live[list(case.poisoned)] = False
        for g, w, shape in zip(got, want, shapes):
            chex.assert_shape(g, shape)
            g = np.asarray(g.astype(jnp.float32)).reshape(live.size, -1)
            w = np.asarray(w.astype(jnp.float32)).reshape(live.size, -1)
            assert np.isfinite(g[live]).all(), "a live token was not written or read a poisoned token"
            assert np.isnan(g[~live]).all(), "a poisoned token's outputs should stay its own (NaN)"
            dtype = case.dtype if g.shape[-1] == e else "float32"  # the gates and comb are f32 whatever x is
            np.testing.assert_allclose(g[live], w[live], **_tolerances(dtype))
        assert got[-1].dtype == jnp.dtype(case.dtype)


class TestMhcPreInterpret(MhcPreTestBase):
    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_matches_reference(self, case):
        self.check(case)

    def test_reference_is_the_models_pre_step(self):
        """The kernel package may not import ds4jax, so its spec restates `mhc.hc_pre_normed` / `hc_head_normed`
        (the mixes applied after the matmul instead of before): they must agree, layer and head."""
        import ds4jax
        from ds4jax.model.layers import mhc

        cfg = ds4jax.tiny()
        m, e = cfg.hc_mult, cfg.hidden_size
        for head in (False, True):
            case = Case("spec", (2, 3), m, e, head=head)
            _, x, scale, base, weight = make_inputs(case)
            n = m if head else 2 * m + m * m
            p = {"fn": jax.random.normal(jax.random.key(5), (n, m * e)) * 0.05, "scale": scale, "base": base}
            kw = dict(iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, rms_eps=cfg.rms_norm_eps, head=head)
            got = mhc_pre_reference(mhc.raw_mixes(x, p["fn"]), x, scale, base, weight, **kw)
            if head:
                want = mhc.hc_head_normed(x, p, weight, cfg)
            else:
                want = mhc.hc_pre_normed(x, p, weight, cfg)
            chex.assert_trees_all_close(got, want, rtol=1e-5, atol=1e-6)

    @pytest.mark.parametrize("case", [c for c in CASES if c.name in (
        "one_token", "token_tail_ragged_chunks", "m3_padded", "bf16_streams", "head")], ids=str)
    def test_stacked_reads_its_layer(self, case):
        self.check_stacked(case, layer=2 if case.head else 1)

    def test_no_tokens(self):
        args = make_inputs(Case("empty", (0,), 4, 32))
        post, comb, out = mhc_pre(*args, iters=ITERS, hc_eps=HC_EPS, rms_eps=RMS_EPS, interpret=True)
        assert post.shape == (0, 4) and comb.shape == (0, 4, 4) and out.shape == (0, 32)


@pytest.mark.device
class TestMhcPreDevice(MhcPreTestBase):
    INTERPRET = False

    @pytest.mark.parametrize("case", [
        Case("decode_b1_flash", (1, 1), 4, 4096, dtype="bfloat16"),
        Case("decode_b8_flash", (8, 1), 4, 4096, dtype="bfloat16", poisoned=(5,)),
        Case("prefill_tail_flash", (1, 1000), 4, 4096, dtype="bfloat16", poisoned=(0, 999)),
        Case("full_flash_hidden_f32", (3,), 4, 7168),
        Case("m3_padded", (5,), 3, 200),
        Case("head_b8", (8,), 4, 4096, head=True, dtype="bfloat16"),
    ], ids=str)
    def test_matches_reference(self, case):
        self.check(case)

    @pytest.mark.parametrize("case", [Case("decode_b1_flash", (1, 1), 4, 4096, dtype="bfloat16"),
                                      Case("head_b8", (8,), 4, 4096, head=True, dtype="bfloat16")], ids=str)
    def test_stacked_reads_its_layer(self, case):
        self.check_stacked(case)


def test_launch_tiles():
    assert launch_tiles(BlockSizes(), 1, 4, 4096) == (1, 2048, 2)  # Flash decode: a token a program, 2 chunks
    assert launch_tiles(BlockSizes(), 8, 4, 4096) == (1, 2048, 2)
    assert launch_tiles(BlockSizes(), 5, 4, 64) == (1, 64, 1)
    assert launch_tiles(BlockSizes(), 3, 3, 7168) == (1, 2048, 4)  # the full Flash's hidden: 4 chunks, masked
    assert launch_tiles(BlockSizes(block_tokens=8), 8, 4, 4096) == (8, 256, 16)


def test_validation_names_the_argument():
    mix, x, scale, base, weight = make_inputs(Case("v", (2,), 4, 32))
    kw = dict(iters=ITERS, hc_eps=HC_EPS, rms_eps=RMS_EPS, interpret=True)
    with pytest.raises(ValueError, match="mix must be"):
        mhc_pre(mix[:, :4], x, scale, base, weight, **kw)
    with pytest.raises(ValueError, match="scale must be"):
        mhc_pre(mix, x, scale[:1], base, weight, **kw)
    with pytest.raises(ValueError, match="norm_weight"):
        mhc_pre(mix, x, scale, base, weight[:5], **kw)
    with pytest.raises(ValueError, match="floating"):
        mhc_pre(mix, x.astype(jnp.int32), scale, base, weight, **kw)
    with pytest.raises(ValueError, match="iters"):
        mhc_pre(mix, x, scale, base, weight, **{**kw, "iters": 0})
    with pytest.raises(ValueError, match="hc_eps"):
        mhc_pre(mix, x, scale, base, weight, **{**kw, "hc_eps": float("nan")})
    with pytest.raises(ValueError, match="power of two"):
        BlockSizes(tile_elements=1000)
    stacks = [jnp.stack([a, a]) for a in (scale, base, weight)]
    with pytest.raises(ValueError, match="leading layer axis"):
        mhc_pre(mix, x, stacks[0], base, stacks[2], layer=jnp.int32(0), **kw)
    with pytest.raises(ValueError, match="layer must be an integer scalar"):
        mhc_pre(mix, x, *stacks, layer=jnp.zeros(2, jnp.int32), **kw)
