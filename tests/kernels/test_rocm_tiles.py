"""The ROCm tile defaults (`BlockSizes.get_default(dtype, arch="gfx942" | "gfx950")`) against the references.

Interpret mode on CPU checks their geometry (head blocks, row blocks crossing list and page boundaries, splits);
the `device` tests compile them at Flash dims on whatever GPU is present (on an NVIDIA GPU that still checks the
arithmetic of the ROCm tiles; on an AMD GPU it is the real thing).
"""

from __future__ import annotations

import dataclasses

import pytest
from kernel_util import has_gpu
from test_indexer_topk import Case as IndexerCase
from test_indexer_topk import IndexerTopkTestBase
from test_sparse_attention import Case as SparseCase
from test_sparse_attention import SparseAttentionTestBase

from pallas_kernels import IndexerTopkBlockSizes, SparseAttentionBlockSizes

ARCHS = ("gfx942", "gfx950")
DTYPES = ("float32", "bfloat16")


def _distinct(cls):
    """(name, dtype, tiles) for each distinct ROCm default (architectures sharing a tile are tested once)."""
    seen = {}
    for arch in ARCHS:
        for dtype in DTYPES:
            seen.setdefault((dtype, cls.get_default(dtype, arch=arch)), arch)
    return [(arch, dtype, bs) for (dtype, bs), arch in seen.items()]


def _sparse_cases(interpret: bool):
    for arch, dtype, bs in _distinct(SparseAttentionBlockSizes):
        if interpret:  # small heads and d; lists cross several row blocks; one split and several
            yield SparseCase(f"{arch}_{dtype}", t=3, h=16, d=64, na=70, nb=3 * bs.block_k + 5, dtype=dtype,
                             empty_rows=(1,), block_sizes=bs)
            yield SparseCase(f"{arch}_{dtype}_split", t=2, h=16, d=64, na=40, nb=4 * bs.block_k, dtype=dtype,
                             dense_b=True, block_sizes=dataclasses.replace(bs, num_splits=3))
        else:
            yield SparseCase(f"{arch}_{dtype}_flash", t=8, h=64, d=512, na=128, nb=512, dtype=dtype, page=64,
                             block_sizes=bs)


def _indexer_cases(interpret: bool):
    for arch, dtype, bs in _distinct(IndexerTopkBlockSizes):
        if interpret:
            c = 2 * bs.block_c + 9
            yield IndexerCase(f"{arch}_{dtype}", t=3, h=8, d=32, c=c, k=16, n_valid=(c, 5, bs.block_c + 1),
                              dtype=dtype, block_sizes=bs)
        else:
            yield IndexerCase(f"{arch}_{dtype}_flash", t=4, h=64, d=128, c=8192, k=512,
                              n_valid=(8192, 600, 4000, 513), dtype=dtype, page=64, block_sizes=bs)


class TestRocmTilesInterpret(SparseAttentionTestBase):
    INTERPRET = True

    @pytest.mark.parametrize("case", list(_sparse_cases(True)), ids=str)
    def test_sparse_attention(self, case):
        self.check(case)

    @pytest.mark.parametrize("case", list(_indexer_cases(True)), ids=str)
    def test_indexer_topk(self, case):
        IndexerTopkTestBase.check(self, case)


@pytest.mark.device
class TestRocmTilesDevice(SparseAttentionTestBase):
    INTERPRET = False

    @pytest.fixture(autouse=True)
    def _needs_gpu(self):
        if not has_gpu():
            pytest.skip("needs a GPU (run with JAX_PLATFORMS=cuda or rocm)")

    @pytest.mark.parametrize("case", list(_sparse_cases(False)), ids=str)
    def test_sparse_attention(self, case):
        self.check(case)

    @pytest.mark.parametrize("case", list(_indexer_cases(False)), ids=str)
    def test_indexer_topk(self, case):
        IndexerTopkTestBase.check(self, case)
