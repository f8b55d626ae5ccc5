"""model/layers/linear.py: a one-token projection is a two-row matmul (XLA:GPU would strength-reduce a vector's dot
into multiply + reduce and write the float32 product to memory; `linear._one_row`), with the same result as the
plain dot; on a GPU (marker `device`) the compiled projection writes no [in, out] product."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.model.layers import linear

IN, OUT = 512, 256


def _dots(fn, *args):
    return [e for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns if e.primitive.name == "dot_general"]


@pytest.mark.parametrize("lead", [(1,), (1, 1), (1, 1, 1)])
def test_one_token_projects_through_two_rows(lead):
    x = jax.random.normal(jax.random.key(0), lead + (IN,), jnp.float32)
    w = jax.random.normal(jax.random.key(1), (IN, OUT), jnp.float32)
    [dot] = _dots(linear.linear_f32, x, w)
    assert dot.invars[0].aval.shape == (2, IN)  # the dispatch itself: a GEMM, not a vector's dot
    y = linear.linear_f32(x, w)
    assert y.shape == lead + (OUT,)
    np.testing.assert_allclose(y, jnp.einsum("...i,io->...o", x, w, precision="highest"), rtol=1e-5, atol=1e-4)


def test_several_tokens_keep_the_plain_dot():
    x = jnp.ones((2, 3, IN), jnp.bfloat16)
    [dot] = _dots(linear.linear, x, jnp.ones((IN, OUT), jnp.bfloat16))
    assert dot.invars[0].aval.shape == (2, 3, IN)


@pytest.mark.parametrize("rows", [1, 3])
def test_grouped_projection_of_one_row_goes_through_two(rows):
    x = jax.random.normal(jax.random.key(2), (4, rows, 32), jnp.float32)
    w = jax.random.normal(jax.random.key(3), (4, 32, 16), jnp.float32)
    [dot] = _dots(linear.grouped_f32, x, w)
    assert dot.invars[0].aval.shape == (4, max(rows, 2), 32)
    y = linear.grouped_f32(x, w)
    np.testing.assert_allclose(y, jnp.einsum("gni,gio->gno", x, w, precision="highest"), rtol=1e-5, atol=1e-4)


@pytest.mark.device
def test_gpu_one_token_projection_writes_no_product():
    x = jax.ShapeDtypeStruct((1, 1, 4096), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((4096, 1024), jnp.bfloat16)  # under XLA's ~10M-element strength-reduction limit
    text = jax.jit(linear.linear).lower(x, w).compile().as_text()
    entry = text[text.index("\nENTRY"):]
    sizes = [np.prod([int(d) for d in dims.split(",")]) for dims in re.findall(r"= f32\[([\d,]+)\]", entry)]
    assert not [s for s in sizes if s >= 4096 * 1024 // 4], entry
