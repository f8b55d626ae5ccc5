"""indexer_topk kernel vs its reference: exact indices, ragged n_valid, paged entry->row maps, ties,
NaN-poisoned rows of invisible entries, garbage map entries beyond n_valid.

The base class holds the grid; `TestIndexerTopkInterpret` runs it on CPU (interpret mode) and
`TestIndexerTopkDevice` (marker `device`) compiles it on a GPU whenever one is present (conftest).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_util import has_gpu, paged_rows, poison_unused, quantize_rows

from pallas_kernels import IndexerTopkBlockSizes as BlockSizes
from pallas_kernels import (
    indexer_topk,
    indexer_topk_reference,
    validate_indexer_topk_dynamic,
    validate_indexer_topk_static,
)
from pallas_kernels.indexer_topk import select_topk

reference = jax.jit(indexer_topk_reference, static_argnames=("k",))


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    t: int
    h: int
    d: int
    c: int
    k: int
    n_valid: tuple[int, ...]  # one per token
    dtype: str = "float32"
    integer_valued: bool = False  # small integers: exact arithmetic, many exact ties
    page: int = 8
    block_sizes: BlockSizes | None = None
    seed: int = 0
    kv_dtype: str = ""  # "float8_e4m3fn" / "float8_e4m3fnuz": an FP8 key pool with row scales (the FP8 KV cache)

    def __str__(self):
        return self.name


def case_inputs(case: Case):
    """(args, scale kwargs): `make_inputs`, the key pool quantized to case.kv_dtype when set (NaN rows stay NaN)."""
    q, w, keys, key_rows, n_valid = make_inputs(case)
    if not case.kv_dtype:
        return (q, w, keys, key_rows, n_valid), {}
    keys, key_scale = quantize_rows(keys, case.kv_dtype)
    return (q, w, keys, key_rows, n_valid), dict(key_scale=key_scale)


def make_inputs(case: Case):
    """Tokens of 3 requests; entry j of a request lives at a paged pool row; map beyond n_valid is garbage."""
    rng = np.random.default_rng(case.seed)
    n_req = 3
    pages_per_req = -(-case.c // case.page)
    r = n_req * pages_per_req * case.page
    free = list(range(n_req * pages_per_req))
    req_rows = [paged_rows(rng, case.c, case.page, free) for _ in range(n_req)]
    n_valid = np.asarray(case.n_valid, np.int32)
    key_rows = rng.integers(-1, r + 7, (case.t, case.c)).astype(np.int32)  # garbage: never dereferenced
    for i in range(case.t):
        key_rows[i, : n_valid[i]] = req_rows[i % n_req][: n_valid[i]]
    visible = np.arange(case.c)[None, :] < n_valid[:, None]

    if case.integer_valued:
        q = rng.integers(-1, 2, (case.t, case.h, case.d)).astype(np.float32)
        keys = rng.integers(-1, 2, (r, case.d)).astype(np.float32)
        w = rng.choice(np.array([-1.0, 1.0, 2.0], np.float32), (case.t, case.h))
    else:
        q = rng.standard_normal((case.t, case.h, case.d)).astype(np.float32)
        keys = rng.standard_normal((r, case.d)).astype(np.float32)
        w = rng.standard_normal((case.t, case.h)).astype(np.float32)
    keys = poison_unused(keys, np.where(visible, key_rows, -1))
    dt = jnp.dtype(case.dtype)
    return jnp.asarray(q, dt), jnp.asarray(w), jnp.asarray(keys, dt), jnp.asarray(key_rows), jnp.asarray(n_valid)


def brute_force_topk(q, w, keys, key_rows, n_valid, k):
    """Independent numpy oracle of the documented order: sort by (-score, j)."""
    q, keys = np.asarray(q, np.float64), np.asarray(keys, np.float64)
    out = np.full((q.shape[0], k), -1, np.int32)
    for i in range(q.shape[0]):
        n = int(n_valid[i])
        rows = keys[np.asarray(key_rows[i, :n])]  # [n, d]
        score = np.asarray(w[i], np.float64) @ np.maximum(q[i] @ rows.T, 0.0) * q.shape[-1] ** -0.5
        order = sorted(range(n), key=lambda j: (-score[j], j))[:k]
        out[i, : len(order)] = order
    return out


def assert_same_selection_up_to_near_ties(args, out, ref, k, rel_tol=1e-4):
    """Each token selects min(k, n_valid) distinct visible entries in (-score, j) order, and the two selections
    differ only in entries whose exact score (f64 from the same bf16 inputs) lies within rel_tol * max |score| of
    the k-th best: a swap anywhere else is a wrong kernel, not rounding."""
    q, w, keys, key_rows, n_valid = (np.asarray(a) for a in args)
    q, keys = q.astype(np.float64), keys.astype(np.float64)
    for i in range(q.shape[0]):
        n = int(n_valid[i])
        score = w[i].astype(np.float64) @ np.maximum(q[i] @ keys[key_rows[i, :n]].T, 0.0) * q.shape[-1] ** -0.5
        got, want = out[i][out[i] >= 0], ref[i][ref[i] >= 0]
        assert len(got) == len(set(got.tolist())) == min(k, n) and (got < n).all(), f"token {i}: bad indices"
        if n == 0:
            continue
        tol = rel_tol * np.abs(score).max()
        kth = np.sort(score)[::-1][min(k, n) - 1]
        swapped = np.setxor1d(got, want)
        assert (np.abs(score[swapped] - kth) <= tol).all(), (
            f"token {i}: selections differ beyond near-ties at the k-th score {kth}: "
            f"{sorted(swapped.tolist())} with scores {score[swapped]}")
        assert (np.diff(score[got]) <= tol).all(), f"token {i}: not in descending score order"


CPU_CASES = [
    Case("tiny", t=4, h=4, d=32, c=40, k=8, n_valid=(40, 0, 5, 23)),
    Case(
        "mid_bf16",
        t=6,
        h=8,
        d=64,
        c=96,
        k=16,
        n_valid=(96, 0, 15, 16, 17, 61),
        dtype="bfloat16",
        block_sizes=BlockSizes(block_c=16, num_splits=1),
    ),
    Case(
        "mid_split_ragged",
        t=5,
        h=8,
        d=64,
        c=130,
        k=12,
        n_valid=(130, 129, 3, 64, 100),
        block_sizes=BlockSizes(block_c=8, num_splits=4),
    ),
    Case(  # several splits each longer than k: the radix select + tie rule inside a split
        "multi_split_select",
        t=4,
        h=8,
        d=32,
        c=200,
        k=10,
        n_valid=(200, 150, 33, 0),
        block_sizes=BlockSizes(block_c=8, max_split=64, rank_block=16),
    ),
    Case(
        "ties_many_splits",
        t=3,
        h=4,
        d=16,
        c=300,
        k=24,
        n_valid=(300, 97, 250),
        integer_valued=True,
        block_sizes=BlockSizes(block_c=16, max_split=64, rank_block=32),
    ),
    Case(
        "no_prefetch",
        t=3,
        h=8,
        d=32,
        c=150,
        k=10,
        n_valid=(150, 70, 9),
        block_sizes=BlockSizes(block_c=16, max_split=64, prefetch=0),
    ),
    Case("k_above_c", t=3, h=4, d=32, c=10, k=16, n_valid=(10, 4, 0)),
    Case("fp8_ocp", t=4, h=8, d=32, c=150, k=10, n_valid=(150, 70, 9, 0),
         block_sizes=BlockSizes(block_c=16, max_split=64), kv_dtype="float8_e4m3fn"),
    Case("fp8_fnuz_bf16_prefetch0", t=3, h=8, d=64, c=96, k=16, n_valid=(96, 15, 61), dtype="bfloat16",
         block_sizes=BlockSizes(block_c=16, num_splits=1, prefetch=0), kv_dtype="float8_e4m3fnuz"),
]

DEVICE_CASES = [
    Case("flash_decode_bf16", t=4, h=64, d=128, c=4096, k=512, n_valid=(4096, 3000, 100, 0), dtype="bfloat16", page=64),
    Case(
        "flash_split_f32",
        t=2,
        h=64,
        d=128,
        c=8192,
        k=512,
        n_valid=(8192, 5000),
        page=64,
        block_sizes=BlockSizes(num_splits=4),
    ),
    Case("ties_f32", t=4, h=64, d=128, c=2048, k=512, n_valid=(2048, 1500, 511, 513), integer_valued=True, page=64),
    Case("flash_decode_fp8", t=4, h=64, d=128, c=4096, k=512, n_valid=(4096, 3000, 100, 0), dtype="bfloat16", page=64,
         kv_dtype="float8_e4m3fn"),
]


class IndexerTopkTestBase:
    INTERPRET = True

    def check(self, case: Case):
        args, scales = case_inputs(case)
        validate_indexer_topk_dynamic(*args, k=case.k, **scales)
        out = indexer_topk(*args, k=case.k, **scales, block_sizes=case.block_sizes, interpret=self.INTERPRET)
        ref = reference(*args, k=case.k, **scales)
        assert out.shape == (case.t, case.k) and out.dtype == jnp.int32
        if self.INTERPRET or (case.dtype == "float32" and not case.kv_dtype):
            np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
        else:  # compiled bf16: the two sum in different orders, so near-ties at the k-th score may swap
            if scales:  # the oracle below scores dequantized keys
                q, w, keys, key_rows, n_valid = args
                keys = np.asarray(keys).astype(np.float32) * np.asarray(scales["key_scale"])[:, None]
                args = (q, w, keys, key_rows, n_valid)
            assert_same_selection_up_to_near_ties(args, np.asarray(out), np.asarray(ref), case.k)
        n_sel = np.minimum(np.asarray(args[4]), case.k)
        assert ((np.asarray(out) >= 0).sum(axis=1) == n_sel).all(), "min(k, n_valid) entries, then -1"


class TestIndexerTopkInterpret(IndexerTopkTestBase):
    INTERPRET = True

    @pytest.mark.parametrize("case", CPU_CASES, ids=str)
    def test_matches_reference(self, case):
        self.check(case)

    def test_ties_lower_entry_first(self):
        """Integer inputs: exact scores, many equal (incl. ReLU zeros; one token scores -0.0 everywhere)."""
        case = Case(
            "ties",
            t=4,
            h=4,
            d=16,
            c=64,
            k=16,
            n_valid=(64, 40, 17, 9),
            integer_valued=True,
            block_sizes=BlockSizes(block_c=8, num_splits=2, rank_block=8),
        )
        q, w, keys, key_rows, n_valid = make_inputs(case)
        args = (q.at[3].set(0.0), w.at[3].set(-1.0), keys, key_rows, n_valid)  # token 3: every score is -0.0
        expect = brute_force_topk(*(np.asarray(a) for a in args), case.k)
        assert (expect[3] == np.arange(9).tolist() + [-1] * 7).all()
        np.testing.assert_array_equal(np.asarray(reference(*args, k=case.k)), expect)
        np.testing.assert_array_equal(
            np.asarray(indexer_topk(*args, k=case.k, block_sizes=case.block_sizes, interpret=True)), expect
        )

    def test_empty(self):
        q, w, keys, key_rows, n_valid = make_inputs(Case("e", t=2, h=4, d=32, c=16, k=4, n_valid=(0, 0)))
        out = indexer_topk(q[:0], w[:0], keys, key_rows[:0], n_valid[:0], k=4, interpret=True)
        assert out.shape == (0, 4)
        out = indexer_topk(q, w, keys, key_rows[:, :0], n_valid * 0, k=4, interpret=True)
        assert (np.asarray(out) == -1).all()


@pytest.mark.device
class TestIndexerTopkDevice(IndexerTopkTestBase):
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_gpu(self):
        if not has_gpu():
            pytest.skip("needs a GPU")

    @pytest.mark.parametrize("case", DEVICE_CASES, ids=str)
    def test_matches_reference(self, case):
        self.check(case)


def test_select_topk_folds_negative_zero():
    scores = jnp.array([[-0.0, 0.0, -jnp.inf, -0.0, 1.0]])
    ids = jnp.array([[4, 1, 0, 2, 3]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(select_topk(scores, ids, 6)), [[3, 1, 2, 4, -1, -1]])


@pytest.mark.parametrize(
    "bad, name",
    [
        ({"w": jnp.zeros((4, 3))}, "w"),
        ({"key_rows": jnp.zeros((4, 40), jnp.float32)}, "key_rows"),
        ({"n_valid": jnp.zeros((5,), jnp.int32)}, "n_valid"),
        ({"keys": jnp.zeros((8, 16))}, "keys"),
    ],
)
def test_static_validation_names_argument(bad, name):
    q, w, keys, key_rows, n_valid = make_inputs(CPU_CASES[0])
    args = {"q": q, "w": w, "keys": keys, "key_rows": key_rows, "n_valid": n_valid} | bad
    with pytest.raises(ValueError, match=name):
        validate_indexer_topk_static(**args, k=8)


def test_fp8_key_validation_names_argument():
    (q, w, keys, key_rows, n_valid), scales = case_inputs(Case(
        "v", t=4, h=4, d=32, c=40, k=8, n_valid=(40, 0, 5, 23), kv_dtype="float8_e4m3fnuz"))
    with pytest.raises(ValueError, match="keys dtype float8_e4m3fnuz must equal q dtype"):
        validate_indexer_topk_static(q, w, keys, key_rows, n_valid, k=8)
    with pytest.raises(ValueError, match="key_scale must be f32"):
        validate_indexer_topk_static(q, w, keys, key_rows, n_valid, k=8, key_scale=scales["key_scale"][:-1])


def test_dynamic_validation_catches_bad_n_valid():
    q, w, keys, key_rows, n_valid = make_inputs(CPU_CASES[0])
    with pytest.raises(ValueError, match="n_valid"):
        validate_indexer_topk_dynamic(q, w, keys, key_rows, n_valid.at[0].set(41), k=8)
