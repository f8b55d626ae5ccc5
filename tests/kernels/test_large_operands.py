"""Operands between 2 and 4 GiB on the GPU: Pallas' Triton lowering indexes an operand with 32-bit offsets unless it
exceeds 2^32 bytes (`_compute_offsets_from_indices`), and Triton's pointer arithmetic sign-extends a 32-bit offset.
A one-byte operand of 2-4 GiB then has elements whose offsets do not fit a signed 32-bit integer: the scanned
layers' expert stacks reach that size (three Flash layers of FP4 gate weights, merged for the grouped kernels, are
3 GiB: ds4jax/model/layer_of.py). This reads such elements and compares them with XLA's own slice.

`pallas_kernels._wide_offsets` makes the lowering take 64-bit offsets for such operands: checked on the CPU host
from the lowered Triton IR, and (marker `device`, a GPU with ~6 GiB free) by reading them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from pallas_kernels import _backend



ROW = 1 << 30  # bytes a row: three rows are 3 GiB
WIDTH = 256


def _read(big, row, col):
    """big[row, col : col + WIDTH] through a Pallas kernel (Triton, as every kernel here) indexing the whole operand:
    `_backend.compiler_params` is what installs the wide offsets."""
    def kernel(r_ref, c_ref, big_ref, o_ref):
        o_ref[...] = big_ref[r_ref[0], pl.ds(pl.multiple_of(c_ref[0], WIDTH), WIDTH)]

    whole = lambda a: pl.BlockSpec(a.shape, lambda i: (0,) * a.ndim)  # noqa: E731
    r, c = jnp.asarray([row], jnp.int32), jnp.asarray([col], jnp.int32)
    return pl.pallas_call(kernel, grid=(1,), in_specs=[whole(r), whole(c), whole(big)],
                          out_specs=pl.BlockSpec((WIDTH,), lambda i: (0,)),
                          out_shape=jax.ShapeDtypeStruct((WIDTH,), big.dtype),
                          compiler_params=_backend.compiler_params(num_warps=4, num_stages=1, interpret=False),
                          )(r, c, big)


@pytest.mark.device  # on the GPU (conftest), else skipped
@pytest.mark.parametrize("rows", [3, 5], ids=["3GiB", "5GiB"])
def test_elements_past_2_gib_are_read_where_they_are(rows):
    @functools.partial(jax.jit, static_argnums=0)
    def pattern(n):  # byte i of row r: (r * 131 + i // 4096) mod 251, different in every 4 KiB of every row
        i = jax.lax.broadcasted_iota(jnp.uint32, (n, ROW), 1)
        r = jax.lax.broadcasted_iota(jnp.uint32, (n, ROW), 0)
        return ((r * 131 + i // 4096) % 251).astype(jnp.uint8)

    big = pattern(rows)
    try:
        for row, col in [(0, 0), (1, ROW - WIDTH), (2, 12345 * WIDTH), (rows - 1, ROW - WIDTH)]:
            got = np.asarray(_read(big, row, col))
            want = np.asarray(big[row, col:col + WIDTH])
            np.testing.assert_array_equal(got, want, err_msg=f"row {row}, column {col} of {rows} GiB")
    finally:
        big.delete()


def _lowered_offsets(nbytes: int) -> str:
    """The Triton IR of `_read` on a uint8 operand of `nbytes` (abstract: nothing allocated), lowered for CUDA."""
    from ds4jax.rocm_check.extract import triton_kernels

    big = jax.ShapeDtypeStruct((nbytes // ROW, ROW), jnp.uint8)
    lowered = jax.jit(lambda b: _read(b, 0, 0)).trace(big).lower(lowering_platforms=("cuda",))
    (kernel,) = triton_kernels(lowered)
    return kernel.ttir


@pytest.mark.parametrize("gib", [1, 2, 3, 4, 5])
def test_offsets_are_64_bit_past_2_gib_of_bytes(gib):
    """Lowered on the CPU host: a one-byte operand of more than 2^31 elements is addressed with 64-bit offsets (JAX
    alone switches only past 2^32 bytes), one of at most 2^31 (the last offset 2^31 - 1) keeps 32-bit offsets."""
    ttir = _lowered_offsets(gib * ROW)
    wide = "tt.addptr" in ttir and any("i64" in line for line in ttir.splitlines() if "tt.addptr" in line)
    assert wide == (gib * ROW > 2**31), ttir[-2000:]
