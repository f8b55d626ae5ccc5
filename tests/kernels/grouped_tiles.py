"""The cases and checks both grouped-matmul kernel tests share (bf16 weights and MXFP4 weights): expert-sorted row
tiles with NaN padding rows, empty tiles (group -1), and the check that live rows match the reference, stay finite
(no poisoned weight or padding row reached them) and that empty tiles come out zero."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    groups: int
    k: int
    n: int
    tile_m: int
    tile_group: tuple[int, ...]  # -1 = empty tile
    live_rows: tuple[int, ...]  # live rows per tile (the rest is padding)
    n_w: int = 2
    dtype: str = "float32"
    block_sizes: object | None = None  # the kernel's own BlockSizes

    def __str__(self):
        return self.name

    @property
    def rows(self) -> int:
        return len(self.tile_group) * self.tile_m


def padded_x(case: Case, rng: np.random.Generator) -> np.ndarray:
    """[rows, k] f32 activations whose padding rows are NaN."""
    x = rng.standard_normal((case.rows, case.k)).astype(np.float32)
    for t, live in enumerate(case.live_rows):
        x[t * case.tile_m + live:(t + 1) * case.tile_m] = np.nan
    return x


def live_mask(case: Case) -> np.ndarray:
    m = np.zeros(case.rows, bool)
    for t, (g, live) in enumerate(zip(case.tile_group, case.live_rows)):
        if g >= 0:
            m[t * case.tile_m:t * case.tile_m + live] = True
    return m


def check_outputs(got, ref, case: Case, *, atol_relative_to_max: bool) -> None:
    """Each output [rows, n] f32 against the reference on live rows; empty tiles exactly zero.
    `atol_relative_to_max`: the absolute tolerance scales with max |reference| (weights at varied scales)."""
    live = live_mask(case)
    empty = np.repeat(np.asarray(case.tile_group) < 0, case.tile_m)
    tol = 1e-5 if case.dtype == "float32" else 2e-2
    assert len(got) == len(ref) == case.n_w
    for y, r in zip(got, ref):
        y, r = np.asarray(y), np.asarray(r)
        assert y.dtype == np.float32 and y.shape == (case.rows, case.n)
        assert np.isfinite(y[live]).all(), "a live row read a poisoned weight, scale or padding row"
        atol = tol * np.abs(r[live]).max() if atol_relative_to_max else tol
        np.testing.assert_allclose(y[live], r[live], rtol=tol, atol=atol)
        assert (y[empty] == 0).all(), "an empty tile wrote something"
