"""grouped_matmul kernel vs its reference: decode-like (one row per tile, k splits) and prefill-like tiles,
empty tiles, several weights; NaN-poisoned weights of unused groups and NaN padding rows never reach a live row.

`TestGroupedMatmulInterpret` runs on CPU (interpret mode); `TestGroupedMatmulDevice` (marker `device`) compiles
the same cases on a GPU.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.grouped_matmul import BlockSizes, grouped_matmul, grouped_matmul_reference
from pallas_kernels.grouped_matmul.blocks import choose_k_splits
from grouped_tiles import Case, check_outputs, padded_x

CASES = [
    Case("decode_b1", groups=8, k=64, n=32, tile_m=16, tile_group=(5, 1), live_rows=(1, 1),
         block_sizes=BlockSizes(block_n=16, block_k=16, k_splits=2)),
    Case("decode_dup_and_empty", groups=8, k=64, n=32, tile_m=16, tile_group=(0, 3, -1, -1), live_rows=(2, 1, 0, 0),
         block_sizes=BlockSizes(block_n=16, block_k=16)),
    Case("prefill_tiles", groups=6, k=32, n=64, tile_m=32, tile_group=(2, 2, 4, 0, -1), live_rows=(32, 7, 30, 1, 0),
         n_w=1, block_sizes=BlockSizes(block_n=32, block_k=16, k_splits=1)),
    Case("bf16_default_blocks", groups=4, k=128, n=128, tile_m=16, tile_group=(3, 0, 1), live_rows=(3, 16, 5),
         dtype="bfloat16"),
]


def make_inputs(case: Case):
    rng = np.random.default_rng(0)
    x = padded_x(case, rng)
    used = {g for g in case.tile_group if g >= 0}
    ws = []
    for _ in range(case.n_w):
        w = (rng.standard_normal((case.groups, case.k, case.n)) / np.sqrt(case.k)).astype(np.float32)
        w[[g for g in range(case.groups) if g not in used]] = np.nan  # weights nobody selected
        ws.append(jnp.asarray(w, case.dtype))
    return jnp.asarray(x, case.dtype), tuple(ws), jnp.asarray(case.tile_group, jnp.int32)


class GroupedMatmulTestBase:
    INTERPRET = True

    def check(self, case: Case):
        x, ws, tg = make_inputs(case)
        got = grouped_matmul(x, ws, tg, block_sizes=case.block_sizes, interpret=self.INTERPRET)
        ref = grouped_matmul_reference(x, ws, tg)
        check_outputs(got, ref, case, atol_relative_to_max=False)

class TestGroupedMatmulInterpret(GroupedMatmulTestBase):
    @pytest.mark.parametrize("case", CASES, ids=str)
    def test_matches_reference(self, case):
        self.check(case)


@pytest.mark.device
class TestGroupedMatmulDevice(GroupedMatmulTestBase):
    INTERPRET = False

    @pytest.mark.parametrize("case", [
        Case("flash_decode", groups=16, k=1024, n=512, tile_m=16, tile_group=(3, 9, 1, 15, 0, -1), live_rows=(1,) * 6,
             dtype="bfloat16"),
        Case("flash_prefill", groups=8, k=512, n=256, tile_m=64, tile_group=(0, 0, 5, 7, -1),
             live_rows=(64, 9, 64, 3, 0), dtype="bfloat16"),
    ], ids=str)
    def test_matches_reference(self, case):
        self.check(case)


def test_k_splits_heuristic_divides_k():
    assert choose_k_splits(None, tiles=6, n_blocks=32, k_blocks=64) == 2  # 528 programs / 192 -> 3 -> 2 (divides)
    assert choose_k_splits(None, tiles=448, n_blocks=32, k_blocks=64) == 1
    assert choose_k_splits(3, tiles=1, n_blocks=1, k_blocks=8) == 2
    assert choose_k_splits(None, tiles=1, n_blocks=1, k_blocks=2) == 1


def test_validation_names_the_argument():
    x = jnp.zeros((32, 16))
    w = jnp.zeros((4, 16, 16))
    with pytest.raises(ValueError, match="whole number of tiles"):
        grouped_matmul(x, (w,), jnp.zeros((3,), jnp.int32), interpret=True)
    with pytest.raises(ValueError, match=r"ws\[1\]"):
        grouped_matmul(x, (w, jnp.zeros((4, 16, 8))), jnp.zeros((2,), jnp.int32), interpret=True)


def test_prefill_tiles_per_architecture():
    """Hopper's wide prefill tile (221 KB of shared memory) only where a block can have it; decode tiles and f32
    everywhere the same; every other target (ROCm's 64 KB LDS, sm80, consumer sm120) the tile that fits 64 KB."""
    from pallas_kernels.grouped_matmul.blocks import BlockSizes

    wide = BlockSizes(block_n=256, block_k=64, num_warps=8, num_stages=3)
    narrow = BlockSizes(block_k=64, num_stages=2)
    for arch in ("sm90", "sm100"):
        assert BlockSizes.get_default("bfloat16", 64, arch=arch) == wide
        assert BlockSizes.get_default("bfloat16", 16, arch=arch) == BlockSizes(block_k=64)
        assert BlockSizes.get_default("float32", 64, arch=arch) == BlockSizes(block_k=32, num_stages=2)
    for arch in ("gfx942", "gfx950", "sm80", "sm120", None):
        assert BlockSizes.get_default("bfloat16", 64, arch=arch) == narrow
