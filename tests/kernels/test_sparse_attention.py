"""sparse_attention kernel vs its reference: ragged paged lists, -1 holes, empty lists, NaN-poisoned pools.

The base class holds the grid; `TestSparseAttentionInterpret` runs it on CPU (interpret mode) and
`TestSparseAttentionDevice` (marker `device`) compiles it on a GPU whenever one is present (conftest).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_util import has_gpu, paged_rows, poison_unused, quantize_rows

from pallas_kernels import SparseAttentionBlockSizes as BlockSizes
from pallas_kernels import (
    finalize_partials,
    merge_partials,
    sparse_attention,
    sparse_attention_reference,
    validate_sparse_attention_dynamic,
    validate_sparse_attention_static,
)
from pallas_kernels.sparse_attention import attention_partials_reference

# Jitted references: eager op-by-op dispatch would dominate the CPU test time.
reference = jax.jit(sparse_attention_reference, static_argnames=("scale",))
partials_reference = jax.jit(attention_partials_reference, static_argnames=("scale",))

TOL = {"float32": {"atol": 2e-5, "rtol": 2e-5}, "bfloat16": {"atol": 1e-2, "rtol": 1e-2}}


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    t: int
    h: int
    d: int
    na: int  # window slots (sliding window + drafts)
    nb: int  # compressed slots (0: no list B)
    dtype: str = "float32"
    dense_b: bool = False  # HCA-like (all visible entries, in order) vs CSA-like (random subset)
    page: int = 8
    holes: bool = True  # interior -1 slots
    empty_rows: tuple[int, ...] = ()  # tokens whose lists are all -1
    block_sizes: BlockSizes | None = None
    seed: int = 0
    kv_dtype: str = ""  # "float8_e4m3fn" / "float8_e4m3fnuz": both pools FP8 with row scales (the FP8 KV cache)

    def __str__(self):
        return self.name


def case_inputs(case: Case):
    """(args, scale kwargs): `make_inputs`, with the pools quantized to case.kv_dtype when it is set (the unused
    rows then hold NaN values and NaN scales)."""
    q, kv_a, idx_a, kv_b, idx_b, sink = make_inputs(case)
    if not case.kv_dtype:
        return (q, kv_a, idx_a, kv_b, idx_b, sink), {}
    (kv_a, scale_a), (kv_b, scale_b) = quantize_rows(kv_a, case.kv_dtype), quantize_rows(kv_b, case.kv_dtype)
    return (q, kv_a, idx_a, kv_b, idx_b, sink), dict(kv_a_scale=scale_a, kv_b_scale=scale_b)


def make_inputs(case: Case):
    """A ragged batch of tokens from 3 requests; rows reached through random page tables."""
    rng = np.random.default_rng(case.seed)
    n_req = 3
    max_pos = 4 * max(case.nb, 1) + case.na + 8
    ra = n_req * -(-max_pos // case.page) * case.page
    rb = n_req * -(-(max_pos // 4 + 1) // case.page) * case.page
    pages_a, pages_b = list(range(ra // case.page)), list(range(rb // case.page))
    rows_a = [paged_rows(rng, max_pos, case.page, pages_a) for _ in range(n_req)]
    rows_b = [paged_rows(rng, max_pos // 4 + 1, case.page, pages_b) for _ in range(n_req)]
    idx_a = np.full((case.t, case.na), -1, np.int32)
    idx_b = np.full((case.t, case.nb), -1, np.int32)
    for i in range(case.t):
        req, pos = i % n_req, int(rng.integers(0, max_pos))
        window = np.arange(max(0, pos - case.na + 1), pos + 1)
        idx_a[i, : len(window)] = rows_a[req][window]
        visible = (pos + 1) // 4
        if case.nb:
            ents = np.arange(min(visible, case.nb)) if case.dense_b else rng.permutation(visible)[: case.nb]
            idx_b[i, : len(ents)] = rows_b[req][ents]
    if case.holes:
        idx_a[rng.random(idx_a.shape) < 0.15] = -1
        idx_b[rng.random(idx_b.shape) < 0.15] = -1
    idx_a[list(case.empty_rows)] = -1
    idx_b[list(case.empty_rows)] = -1

    kv_a = poison_unused(rng.standard_normal((ra, case.d)).astype(np.float32), idx_a)
    kv_b = poison_unused(rng.standard_normal((rb, case.d)).astype(np.float32), idx_b)
    q = rng.standard_normal((case.t, case.h, case.d)).astype(np.float32)
    sink = rng.standard_normal(case.h).astype(np.float32)
    dt = jnp.dtype(case.dtype)
    return (
        jnp.asarray(q, dt),
        jnp.asarray(kv_a, dt),
        jnp.asarray(idx_a),
        jnp.asarray(kv_b, dt),
        jnp.asarray(idx_b),
        jnp.asarray(sink),
    )


CPU_CASES = [
    Case("tiny", t=3, h=4, d=32, na=8, nb=4),
    Case("tiny_nb0", t=3, h=4, d=32, na=8, nb=0, block_sizes=BlockSizes(block_k=4)),
    Case(
        "mid_paged_bf16",
        t=6,
        h=8,
        d=64,
        na=20,
        nb=24,
        dtype="bfloat16",
        empty_rows=(2,),
        block_sizes=BlockSizes(block_k=8, num_splits=1),
    ),
    Case(
        "mid_hca_split",
        t=5,
        h=8,
        d=64,
        na=20,
        nb=40,
        dense_b=True,
        empty_rows=(0,),
        block_sizes=BlockSizes(block_h=4, block_k=8, num_splits=3),
    ),
    Case(
        "mid_split_bf16",
        t=4,
        h=8,
        d=64,
        na=12,
        nb=16,
        dtype="bfloat16",
        block_sizes=BlockSizes(block_k=8, num_splits=4),
    ),
    Case(  # no prefetch: gather and use in one loop step
        "mid_no_prefetch",
        t=5,
        h=8,
        d=64,
        na=20,
        nb=40,
        dense_b=True,
        empty_rows=(1,),
        block_sizes=BlockSizes(block_h=4, block_k=8, prefetch=0, num_splits=2),
    ),
    Case(  # deeper prefetch than some splits have blocks
        "mid_prefetch3",
        t=4,
        h=8,
        d=64,
        na=12,
        nb=30,
        block_sizes=BlockSizes(block_k=4, prefetch=3, num_splits=3),
    ),
    # the FP8 KV cache: E4M3 pools (OCP, and MI300's FNUZ bytes decoded with integer ops) with NaN-poisoned rows
    Case("fp8_ocp_bf16", t=6, h=8, d=64, na=20, nb=24, dtype="bfloat16", empty_rows=(2,),
         block_sizes=BlockSizes(block_k=8, num_splits=1), kv_dtype="float8_e4m3fn"),
    Case("fp8_fnuz_split", t=5, h=8, d=64, na=20, nb=40, dense_b=True, empty_rows=(0,),
         block_sizes=BlockSizes(block_h=4, block_k=8, num_splits=3), kv_dtype="float8_e4m3fnuz"),
    Case("fp8_ocp_prefetch_nb0", t=3, h=4, d=32, na=8, nb=0, block_sizes=BlockSizes(block_k=4, prefetch=2),
         kv_dtype="float8_e4m3fn"),
]

DEVICE_CASES = [
    Case("flash_csa_bf16", t=8, h=64, d=512, na=128, nb=512, dtype="bfloat16", page=64),
    Case(
        "flash_hca_split_bf16",
        t=2,
        h=64,
        d=512,
        na=130,
        nb=1024,
        dtype="bfloat16",
        dense_b=True,
        page=64,
        empty_rows=(1,),
    ),
    Case(
        "flash_csa_f32",
        t=4,
        h=64,
        d=512,
        na=128,
        nb=256,
        page=64,
        block_sizes=BlockSizes(block_h=16, block_k=16, num_splits=1),
    ),
    Case("tiny_padded_heads", t=3, h=4, d=32, na=8, nb=4),
    Case("flash_csa_fp8", t=8, h=64, d=512, na=128, nb=512, dtype="bfloat16", page=64, kv_dtype="float8_e4m3fn"),
]


class SparseAttentionTestBase:
    INTERPRET = True

    def check(self, case: Case):
        args, scales = case_inputs(case)
        scale = case.d**-0.5
        validate_sparse_attention_dynamic(*args, scale=scale, **scales)
        out = sparse_attention(*args, scale=scale, **scales, block_sizes=case.block_sizes, interpret=self.INTERPRET)
        ref = reference(*args, scale=scale, **scales)
        assert out.shape == ref.shape and out.dtype == args[0].dtype
        assert not np.isnan(np.asarray(out, np.float32)).any(), "a NaN-poisoned unused row leaked into the output"
        np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32), **TOL[case.dtype])
        empty = np.asarray((args[2] < 0).all(axis=1) & (args[4] < 0).all(axis=1))
        assert (np.asarray(out, np.float32)[empty] == 0).all(), "a token without rows must output 0"


class TestSparseAttentionInterpret(SparseAttentionTestBase):
    INTERPRET = True

    @pytest.mark.parametrize("case", CPU_CASES, ids=str)
    def test_matches_reference(self, case):
        self.check(case)

    def test_all_unused(self):
        case = Case("all_unused", t=2, h=4, d=32, na=8, nb=8, empty_rows=(0, 1))
        q, kv_a, idx_a, kv_b, idx_b, sink = make_inputs(case)
        out = sparse_attention(q, kv_a, idx_a, kv_b, idx_b, sink, scale=0.1, interpret=True)
        assert (np.asarray(out) == 0).all()

    @pytest.mark.parametrize("splits", [1, 2])
    def test_a_base(self, splits):
        """List A's rows counted from a_base (a layer of a stacked pool) read what the offset rows read, and
        the same as the reference; the rows before a_base are NaN-poisoned (never read)."""
        case = Case("a_base", t=3, h=4, d=32, na=8, nb=8)
        q, kv_a, idx_a, kv_b, idx_b, sink = make_inputs(case)
        base = 5
        stacked = jnp.concatenate([jnp.full((base, kv_a.shape[1]), jnp.nan, kv_a.dtype), kv_a])
        shifted = jnp.where(idx_a >= 0, idx_a + base, -1)
        tiles = BlockSizes(block_k=8, num_splits=splits)
        want = sparse_attention(q, stacked, shifted, kv_b, idx_b, sink, scale=0.1, block_sizes=tiles, interpret=True)
        got = sparse_attention(q, stacked, idx_a, kv_b, idx_b, sink, scale=0.1, a_base=jnp.int32(base),
                               block_sizes=tiles, interpret=True)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        ref = sparse_attention_reference(q, stacked, idx_a, kv_b, idx_b, sink, scale=0.1, a_base=base)
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32), rtol=1e-5, atol=1e-5)
        validate_sparse_attention_dynamic(q, stacked, idx_a, kv_b, idx_b, sink, scale=0.1, a_base=base)

    def test_no_tokens(self):
        q = jnp.zeros((0, 4, 32))
        kv, idx = jnp.zeros((5, 32)), jnp.zeros((0, 3), jnp.int32)
        out = sparse_attention(q, kv, idx, kv, idx, jnp.zeros(4), scale=0.1, interpret=True)
        assert out.shape == (0, 4, 32)


@pytest.mark.device
class TestSparseAttentionDevice(SparseAttentionTestBase):
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_gpu(self):
        if not has_gpu():
            pytest.skip("needs a GPU")

    @pytest.mark.parametrize("case", DEVICE_CASES, ids=str)
    def test_matches_reference(self, case):
        self.check(case)


def test_merge_of_partials_equals_whole():
    """The log-sum-exp merge rule on its own: A and B partials (one empty token) + sink == reference."""
    q, kv_a, idx_a, kv_b, idx_b, sink = make_inputs(Case("merge", t=4, h=4, d=32, na=8, nb=8, empty_rows=(3,)))

    @jax.jit
    def merged(q, kv_a, idx_a, kv_b, idx_b, sink):
        parts = [partials_reference(q, kv_a, idx_a, scale=0.2), partials_reference(q, kv_b, idx_b, scale=0.2)]
        acc, m, den = merge_partials(*(jnp.stack(x) for x in zip(*parts, strict=True)), axis=0)
        return finalize_partials(acc, m, den, sink, q.dtype)

    out = merged(q, kv_a, idx_a, kv_b, idx_b, sink)
    ref = reference(q, kv_a, idx_a, kv_b, idx_b, sink, scale=0.2)
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), atol=1e-6, rtol=1e-6)
    assert (np.asarray(out[3]) == 0).all()


def test_sink_only_in_denominator():
    """One row with logit 0 and sink 0: p = 1 / (1 + 1), so out = K / 2."""
    k = jnp.arange(8, dtype=jnp.float32)[None, :]
    q = jnp.zeros((1, 1, 8))
    out = reference(q, k, jnp.array([[0]], jnp.int32), k[:0], jnp.zeros((1, 0), jnp.int32), jnp.zeros(1), scale=1.0)
    np.testing.assert_allclose(np.asarray(out[0, 0]), np.asarray(k[0]) / 2)


@pytest.mark.parametrize(
    "bad, name",
    [
        ({"idx_a": jnp.zeros((3, 8), jnp.float32)}, "idx_a"),
        ({"sink": jnp.zeros((5,))}, "sink"),
        ({"kv_b": jnp.zeros((4, 16))}, "kv_b"),
        ({"q": jnp.zeros((3, 4, 32), jnp.float16)}, "q"),
    ],
)
def test_static_validation_names_argument(bad, name):
    q, kv_a, idx_a, kv_b, idx_b, sink = make_inputs(Case("v", t=3, h=4, d=32, na=8, nb=4))
    args = {"q": q, "kv_a": kv_a, "idx_a": idx_a, "kv_b": kv_b, "idx_b": idx_b, "sink": sink} | bad
    with pytest.raises(ValueError, match=name):
        validate_sparse_attention_static(**args, scale=0.1)


def test_fp8_reference_dequantizes_each_row():
    """The reference over an FP8 pool equals the reference over that pool dequantized by hand (value * row
    scale, ml_dtypes): the kernel tests above compare against a reference that reads the format right."""
    case = Case("fp8_ref", t=3, h=4, d=32, na=8, nb=4, kv_dtype="float8_e4m3fnuz")
    (q, kv_a, idx_a, kv_b, idx_b, sink), scales = case_inputs(case)
    dequant = lambda v, s: jnp.asarray(np.asarray(v).astype(np.float32) * np.asarray(s)[:, None])
    want = reference(q, dequant(kv_a, scales["kv_a_scale"]), idx_a, dequant(kv_b, scales["kv_b_scale"]), idx_b, sink,
                     scale=0.2)
    got = reference(q, kv_a, idx_a, kv_b, idx_b, sink, scale=0.2, **scales)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("bad, match", [
    (dict(kv_a_scale=None), "kv_a dtype float8_e4m3fn must equal q dtype"),
    (dict(kv_b_scale=jnp.zeros((3,))), "kv_b_scale must be f32"),
])
def test_fp8_validation_names_argument(bad, match):
    (q, kv_a, idx_a, kv_b, idx_b, sink), scales = case_inputs(Case("v", t=3, h=4, d=32, na=8, nb=4,
                                                                   kv_dtype="float8_e4m3fn"))
    with pytest.raises(ValueError, match=match):
        validate_sparse_attention_static(q, kv_a, idx_a, kv_b, idx_b, sink, scale=0.1, **(scales | bad))
    with pytest.raises(ValueError, match="kv_a must be float8"):
        validate_sparse_attention_static(q, q[0], idx_a, kv_b, idx_b, sink, scale=0.1, kv_a_scale=jnp.zeros(4),
                                         kv_b_scale=scales["kv_b_scale"])


def test_dynamic_validation_catches_out_of_range_row():
    q, kv_a, idx_a, kv_b, idx_b, sink = make_inputs(Case("v", t=3, h=4, d=32, na=8, nb=4))
    with pytest.raises(ValueError, match="idx_b"):
        validate_sparse_attention_dynamic(q, kv_a, idx_a, kv_b, idx_b.at[0, 0].set(kv_b.shape[0]), sink, scale=0.1)
