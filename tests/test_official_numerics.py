"""The official rounding recipes (`ds4jax.model.official_numerics`, spec §7.2) against an independent numpy /
ml_dtypes implementation: power-of-two scales (exact ceil of log2, the 1/448 and 1/6 products rounded in float32
first), FP8 and FP4 block fake quantisation (round trips, zero blocks, negatives, partial blocks, the e2m1 grid
with its ties), the Sylvester Hadamard; and the `Numerics` choice as an argument."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from ds4jax.errors import ArgumentError, ConfigError
from ds4jax.model import official_numerics as on
from ds4jax.model.config import Numerics, tiny

E2M1_GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


# ---- an independent implementation ------------------------------------------------------------------------------

def np_pow2_scale(amax: np.ndarray, top: float) -> np.ndarray:
    """2^ceil(log2(float32(amax * float32(1 / top)))) by frexp: y = m 2^e with m in [0.5, 1)."""
    y = (amax.astype(np.float32) * np.float32(1.0 / top)).astype(np.float32)
    m, e = np.frexp(y.astype(np.float64))
    return np.ldexp(1.0, np.where(m == 0.5, e - 1, e)).astype(np.float32)


def np_round(x: np.ndarray, block: int, top: float, floor: float, fmt) -> np.ndarray:
    d = x.shape[-1]
    block = min(block, d)
    xp = np.pad(x.astype(np.float32), [(0, 0)] * (x.ndim - 1) + [(0, -d % block)])
    g = xp.reshape(*xp.shape[:-1], -1, block)
    amax = np.maximum(np.abs(g).max(-1, keepdims=True), np.float32(floor))
    s = np_pow2_scale(amax, top)
    q = np.clip(g / s, -top, top).astype(fmt).astype(np.float32)
    return (q * s).reshape(xp.shape)[..., :d]


def np_fp8(x, block):
    return np_round(x, block, 448.0, 1e-4, ml_dtypes.float8_e4m3fn)


def np_fp4(x, block=32):
    return np_round(x, block, 6.0, 6.0 * 2.0**-126, ml_dtypes.float4_e2m1fn)


def samples(seed=0, width=256):
    """Rows of every kind: normal, huge, tiny, all zero, mixed signs with exact e4m3 / e2m1 values and -0."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((7, width)).astype(np.float32)
    x[1] *= 1e4
    x[2] *= 1e-6
    x[3] = 0.0
    x[4, :10] = [448.0, -448.0, 6.0, -6.0, 0.25, -0.75, -0.0, 3e-5, -2.5, 1.0]
    x[5] = -np.abs(x[5])
    x[6, :128] = 0.0  # a zero block next to a normal one
    return x


# ---- scales ---------------------------------------------------------------------------------------------------

def test_pow2_scale_is_the_exact_ceil_of_log2():
    amax = np.concatenate([np.float32(448.0) * 2.0 ** np.arange(-20, 20, dtype=np.float32),  # exact powers x 448
                           np.random.default_rng(1).uniform(1e-4, 1e5, 5000).astype(np.float32),
                           np.nextafter(np.float32(448.0), np.float32(0)) * np.ones(1, np.float32),
                           np.nextafter(np.float32(448.0), np.float32(1e9)) * np.ones(1, np.float32)])
    for top in (448.0, 6.0):
        got = np.asarray(jax.jit(on.pow2_scale, static_argnums=1)(jnp.asarray(amax), 1.0 / top))
        np.testing.assert_array_equal(got, np_pow2_scale(amax, top))
        assert (np.log2(got) == np.round(np.log2(got))).all()  # powers of two (UE8M0-representable)
        y = amax * np.float32(1.0 / top)
        assert (got >= y).all() and (got / 2 < y).all()  # the smallest power of two at or above amax / top


# ---- block fake quantisation ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("block", [64, 128])
def test_fp8_round_matches_numpy(block):
    x = samples()
    got = np.asarray(jax.jit(on.fp8_round, static_argnums=1)(jnp.asarray(x), block))
    want = np_fp8(x, block)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got[4, :7]), np.signbit(want[4, :7]))
    assert (got[3] == 0).all() and (got[6, :128] == 0).all()  # zero blocks stay zero (the amax floor, no NaN)
    np.testing.assert_array_equal(got[4, :2], [448.0, -448.0])
    # a round trip: within half an e4m3 step of every value (3 mantissa bits), or the scaled subnormal step
    g = x.reshape(7, -1, block)
    s = np_pow2_scale(np.maximum(np.abs(g).max(-1, keepdims=True), 1e-4), 448.0)
    err = np.abs(got.reshape(g.shape) - g)
    assert (err <= np.maximum(np.abs(g) * 2.0**-4, s * 2.0**-10) * (1 + 1e-6)).all()
    # rounding twice changes nothing: every rounded value is exact in the block's format
    np.testing.assert_array_equal(np.asarray(on.fp8_round(jnp.asarray(got), block)), got)


def test_fp8_round_partial_block_and_dtype():
    x = samples(width=48)  # narrower than a block: one block of 48 (a tiny config's non-rope dims)
    got = on.fp8_round(jnp.asarray(x, jnp.bfloat16), 64)
    assert got.dtype == jnp.bfloat16
    want = np_fp8(np.asarray(jnp.asarray(x, jnp.bfloat16), np.float32), 64)
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)  # exact in bfloat16: no second rounding


def test_e2m1_grid_and_ties_to_even():
    """Every grid value maps to itself; midpoints go to the neighbour with the even code (0, 1, 2, 4)."""
    grid = np.array(E2M1_GRID + [-v for v in E2M1_GRID], np.float32)
    np.testing.assert_array_equal(np.asarray(on.e2m1(jnp.asarray(grid))), grid)
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32)
    want = np.array([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0], np.float32)
    np.testing.assert_array_equal(np.asarray(on.e2m1(jnp.asarray(mids))), want)
    np.testing.assert_array_equal(np.asarray(on.e2m1(jnp.asarray(-mids))), -want)
    x = np.random.default_rng(2).uniform(-6, 6, 20000).astype(np.float32)
    x = np.concatenate([x, mids, -mids, np.nextafter(mids, 0), np.nextafter(mids, 9)])
    np.testing.assert_array_equal(np.asarray(on.e2m1(jnp.asarray(x))),
                                  x.astype(ml_dtypes.float4_e2m1fn).astype(np.float32))


def test_fp4_round_matches_numpy():
    x = samples(width=128)
    got = np.asarray(jax.jit(on.fp4_round)(jnp.asarray(x)))
    np.testing.assert_array_equal(got, np_fp4(x))
    assert (got[3] == 0).all() and not np.isnan(got).any()
    g, q = x.reshape(7, 4, 32), got.reshape(7, 4, 32)
    s = np_pow2_scale(np.maximum(np.abs(g).max(-1, keepdims=True), 6.0 * 2.0**-126), 6.0)
    assert set(np.unique(np.abs(q / s))) <= set(E2M1_GRID)  # every value on the grid times its block's scale
    assert ((q < 0) <= (g < 0)).all()  # no sign flips
    np.testing.assert_array_equal(np.asarray(on.fp4_round(jnp.asarray(got))), got)


# ---- the Hadamard ------------------------------------------------------------------------------------------------

def test_sylvester_hadamard_is_orthonormal_and_in_natural_order():
    for n in (1, 2, 32, 128):
        h = on.sylvester(n).astype(np.float64)
        np.testing.assert_allclose(h @ h.T, np.eye(n), atol=1e-6)
        np.testing.assert_array_equal(h, h.T)
        # Sylvester order: entry (i, j) = (-1)^popcount(i & j) / sqrt(n)
        i, j = np.meshgrid(np.arange(n), np.arange(n), indexing="ij")
        sign = np.vectorize(lambda v: (-1) ** bin(v).count("1"))(i & j)
        np.testing.assert_allclose(h, sign / np.sqrt(n), rtol=1e-6)
    with pytest.raises(ValueError, match="power-of-two"):
        on.sylvester(96)


def test_hadamard_keeps_dot_products():
    """q H . k H = q . k: the rotation alone changes no indexer score; only the FP4 rounding after it does."""
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal((5, 128)).astype(np.float32), rng.standard_normal((7, 128)).astype(np.float32)
    hq, hk = np.asarray(on.hadamard(jnp.asarray(q))), np.asarray(on.hadamard(jnp.asarray(k)))
    np.testing.assert_allclose(hq @ hk.T, q @ k.T, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(hq, q @ on.sylvester(128).astype(np.float64), rtol=1e-5, atol=1e-6)


# ---- where the model applies them -----------------------------------------------------------------------------------

def test_model_roundings_follow_the_config():
    ref, off = tiny(), tiny(numerics=Numerics.OFFICIAL)
    x = jnp.asarray(samples(width=ref.head_dim))
    for f in (on.round_kv, on.round_index, on.round_act):
        assert f(x, ref) is x  # the reference path is untouched: not even a copy in the trace
    kv = np.asarray(on.round_kv(x, off))
    nope = ref.head_dim - ref.rope_head_dim
    np.testing.assert_array_equal(kv[:, :nope], np_fp8(np.asarray(x)[:, :nope], 64))
    np.testing.assert_array_equal(kv[:, nope:], np.asarray(x)[:, nope:])  # rope dims kept
    idx = np.asarray(on.round_index(x, off))
    np.testing.assert_array_equal(idx, np_fp4(np.asarray(on.hadamard(x))))
    np.testing.assert_array_equal(np.asarray(on.round_act(x, off)), np_fp8(np.asarray(x), 128))


def test_numerics_argument():
    assert Numerics.parse("official") is Numerics.OFFICIAL and Numerics.parse(Numerics.REFERENCE) is Numerics.REFERENCE
    with pytest.raises(ArgumentError, match="numerics.*'reference', 'official'"):
        Numerics.parse("bf16")
    assert tiny().numerics is Numerics.REFERENCE and hash(tiny()) != hash(tiny(numerics=Numerics.OFFICIAL))
    assert "numerics" not in str(tiny(numerics=Numerics.OFFICIAL).to_hf_dict())  # a load choice, not architecture
    with pytest.raises(ConfigError, match="power-of-two index_head_dim"):
        tiny(numerics=Numerics.OFFICIAL, index_head_dim=48)
    with pytest.raises(ConfigError, match="Config.numerics"):
        tiny(numerics="official")


# ---- chosen at load ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["generate", "batch", "warmup", "serve"])
def test_cli_numerics_flag(command, capsys):
    from ds4jax import cli

    need = {"generate": ["--prompt", "x"], "batch": ["in.jsonl", "out.jsonl"]}.get(command, [])
    assert cli.build_parser().parse_args([command, *need, "--numerics", "official"]).numerics == "official"
    assert cli.build_parser().parse_args([command, *need]).numerics == "reference"
    assert cli.main([command, *need, "--numerics", "fp8"]) == 2
    assert "invalid choice: 'fp8'" in capsys.readouterr().err


def test_load_options_reach_the_config(tmp_path):
    """`ds4jax.load(..., numerics=...)` checks the value before reading anything; the CLI's loader passes the flag."""
    import argparse

    import ds4jax
    from ds4jax.commands.generate import load_model

    with pytest.raises(ArgumentError, match="numerics"):
        ds4jax.load(str(tmp_path / "missing"), numerics="fp4")  # the argument first, not the missing directory
    args = argparse.Namespace(checkpoint=None, dtype=None, numerics="official", mesh=None)
    model = load_model(args)
    assert model.config.numerics is Numerics.OFFICIAL
    assert model.with_numerics("reference").config == ds4jax.default_model().config
