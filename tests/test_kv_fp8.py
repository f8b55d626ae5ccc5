"""The FP8 KV cache (`kv_dtype="fp8"`, issue 26 item 2): the number format against ml_dtypes (OCP and MI300's
FNUZ, the factor-of-2 pitfall included), the pool table and its bytes, the option reaching the kernels, and the
fp8-KV model against the unquantized-KV path on a tiny random config (logits and indexer selections)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import pallas_kernels
from ds4jax.errors import ArgumentError, PoolSpecError
from ds4jax.model import params as P
from ds4jax.model.config import flash
from ds4jax.runtime import kernels, kv_quant, pools, steps, target
from ds4jax.runtime.pool_spec import PoolSpec, bytes_per_token, fp8_capacity_gain, shapes
from ds4jax.runtime.pools import PoolBook
from ds4jax.runtime.roles import Role
from pallas_kernels import _fp8
from steps_helpers import CFG, SPEC

FORMATS = ("float8_e4m3fn", "float8_e4m3fnuz")


# ---- the number format ------------------------------------------------------------------------------------------

def _rows(seed=0):
    """Rows of every kind: normal, huge, tiny (values landing in E4M3's subnormals), an all-zero row, mixed signs."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((6, 64)).astype(np.float32)
    x[1] *= 1e4
    x[2] *= 1e-6
    x[3] = 0.0
    x[4, :8] = [1e3, -1e-3, 5e-5, 0, -0.0, 3, -448, 240]
    return x


@pytest.mark.parametrize("fmt", FORMATS)
def test_values_that_round_to_zero_are_never_nan(fmt):
    """FNUZ has no -0 (0x80 is NaN): negative values that round to zero, and -0 itself, must store as +0 whatever
    XLA:CPU emitter compiles the cast (the suite runs the loop emitters, which wrote 0x80 before `cast_e4m3`)."""
    x = np.array([-0.0, -2.0**-11, -2.0**-12, 2.0**-11, -2.0**-10, -3e-4, -1e-30, 1.5, -240.0], np.float32)
    got = np.asarray(jax.jit(kv_quant.cast_e4m3, static_argnums=1)(jnp.asarray(x), jnp.dtype(fmt)))
    np.testing.assert_array_equal(got.view(np.uint8), x.astype(getattr(ml_dtypes, fmt)).view(np.uint8))
    assert not np.isnan(got.astype(np.float32)).any()


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_matches_ml_dtypes(fmt):
    """Values are ml_dtypes' round-to-nearest of x / scale (scale = max|x| / 448 OCP, / 240 FNUZ), the row's largest
    value lands exactly on the format's max (no NaN from rounding past it), and the round trip is within half an
    E4M3 step of every value."""
    x = _rows()
    values, scales = jax.jit(kv_quant.quantize, static_argnums=1)(jnp.asarray(x), jnp.dtype(fmt))
    values, scales = np.asarray(values), np.asarray(scales)
    fmax = float(ml_dtypes.finfo(getattr(ml_dtypes, fmt)).max)
    assert fmax == kv_quant.FP8_MAX[fmt] and values.dtype == getattr(ml_dtypes, fmt)
    amax = np.abs(x).max(-1)
    np.testing.assert_allclose(scales, np.where(amax > 0, amax / fmax, 1.0), rtol=3e-7)  # XLA may round 1 ulp off
    expect = np.clip(x / scales[:, None], -fmax, fmax).astype(getattr(ml_dtypes, fmt))
    np.testing.assert_array_equal(values.view(np.uint8), expect.view(np.uint8))
    assert not np.isnan(values.astype(np.float32)).any()
    assert (np.abs(values.astype(np.float32)).max(-1)[amax > 0] == fmax).all()
    back = np.asarray(kv_quant.dequantize(jnp.asarray(values), jnp.asarray(scales)))
    smallest = float(ml_dtypes.finfo(getattr(ml_dtypes, fmt)).smallest_subnormal)
    bound = np.abs(x) * 2.0**-4 + scales[:, None] * smallest / 2  # half a step: 3 mantissa bits, or the subnormals
    assert (np.abs(back - x) <= bound * (1 + 1e-6)).all()
    assert (back[3] == 0).all()


def test_fnuz_decode_and_the_factor_of_two():
    """The kernels' integer FNUZ decode (MI300: Pallas' Triton lowering has no FNUZ conversion) equals ml_dtypes on
    every byte but FNUZ's NaN, and the same byte read as OCP is exactly twice as large: a cache written in one
    format and read in the other would double (or halve) every key."""
    b = np.arange(256, dtype=np.uint8)
    fnuz = b.view(ml_dtypes.float8_e4m3fnuz).astype(np.float32)
    ocp = b.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    decoded = np.asarray(jax.jit(_fp8.e4m3fnuz_to_float)(jnp.asarray(b)))
    real = ~np.isnan(fnuz)
    assert b[~real].tolist() == [0x80]
    np.testing.assert_array_equal(decoded[real], fnuz[real])
    both = real & ~np.isnan(ocp) & (b != 0) & (b != 0x80)
    np.testing.assert_array_equal(ocp[both], 2 * fnuz[both])
    # so the FNUZ quantizer's bytes, read as OCP, are 2x off: the decode under test is not interchangeable
    x = jnp.asarray(_rows()[:1])
    values, scales = kv_quant.quantize(x, jnp.float8_e4m3fnuz)
    as_ocp = jax.lax.bitcast_convert_type(jax.lax.bitcast_convert_type(values, jnp.uint8), jnp.float8_e4m3fn)
    wrong, right = np.asarray(kv_quant.dequantize(as_ocp, scales)), np.asarray(kv_quant.dequantize(values, scales))
    lost = np.isnan(wrong)  # FNUZ's +-240 (0x7F / 0xFF) are OCP's NaN
    assert lost.any() and (np.abs(np.asarray(values, np.float32))[lost] == 240).all()
    np.testing.assert_allclose(wrong[~lost], 2 * right[~lost])
    np.testing.assert_array_equal(np.asarray(_fp8.to_compute(_fp8.kernel_operand(values), jnp.float32)),
                                  np.asarray(values.astype(jnp.float32)))


# ---- the option and the pool table ---------------------------------------------------------------------------------

def test_kv_dtype_resolves_from_the_device(monkeypatch):
    assert SPEC.kv_dtype == "auto" and not SPEC.kv_scaled and SPEC.kv_storage_dtype == "float32"
    assert SPEC.replace(kv_dtype="fp8").kv_dtype == "float8_e4m3fn"  # the CPU: OCP
    monkeypatch.setattr(target, "device_target", lambda: target.Target("rocm", "gfx942"))
    assert SPEC.replace(kv_dtype="fp8").kv_dtype == "float8_e4m3fnuz"  # MI300: FNUZ only
    monkeypatch.setattr(target, "device_target", lambda: target.Target("rocm", "gfx950"))
    assert SPEC.replace(kv_dtype="fp8").kv_dtype == "float8_e4m3fn"
    spec = SPEC.replace(kv_dtype="float8_e4m3fnuz")  # explicit: another target's pools
    assert hash(spec) != hash(SPEC) and spec == SPEC.replace(kv_dtype=jnp.float8_e4m3fnuz)


@pytest.mark.parametrize("bad", ["fp16", "bfloat16", "e4m3", 8])
def test_bad_kv_dtype_is_named(bad):
    with pytest.raises(PoolSpecError, match=r"PoolSpec\.kv_dtype: expected one of 'auto', 'fp8'"):
        SPEC.replace(kv_dtype=bad)
    with pytest.raises(ArgumentError, match="kv_dtype"):
        kv_quant.check_argument(bad)


def test_pool_table_shapes_and_bytes():
    fp8 = SPEC.replace(kv_dtype="fp8")
    got, plain = shapes(fp8), shapes(SPEC)
    for name in ("swa_kv", "c4_kv", "indexer_kv", "c128_kv"):
        assert got[name] == (plain[name][0], "float8_e4m3fn")
    assert got["swa_kv_scale"] == ((CFG.num_layers, SPEC.max_slots, SPEC.swa_rows), "float32")
    assert got["c4_kv_scale"] == ((2, SPEC.c4_entries), "float32") == got["indexer_kv_scale"]
    assert got["c128_kv_scale"] == ((1, SPEC.c128_entries), "float32")
    assert all(got[n] == plain[n] for n in plain if "state" in n or n in ("page_table", "lengths"))  # rings stay
    assert all(np.prod(plain[n][0]) == 0 for n in plain if n.endswith("_scale"))
    # Flash: 21 CSA layers (a 512-wide entry and a 128-wide key per 4 tokens), 20 HCA layers (512 per 128 tokens),
    # each row 1 byte per value + a 4-byte scale
    spec = PoolSpec.for_role(flash(), role=Role.TARGET, max_slots=4, max_context=1 << 20, kv_dtype="fp8")
    per_token = bytes_per_token(spec)
    assert per_token["c4_kv"] == 21 * (512 + 4) / 4 and per_token["indexer"] == 21 * (128 + 4) / 4
    assert per_token["c128_kv"] == 20 * (512 + 4) / 128 and per_token["total"] == 3482.625
    assert fp8_capacity_gain(spec) == fp8_capacity_gain(spec.replace(kv_dtype="auto")) == 6880 / 3482.625
    assert "float8_e4m3fn + a float32 scale per row: 1.98x the paged tokens" in spec.describe()


def test_pools_fresh_reset_and_poisoned():
    fp8 = SPEC.replace(kv_dtype="fp8")
    pool = pools.zeros(fp8)
    assert pool.c4_kv.dtype == jnp.float8_e4m3fn and pool.c4_kv_scale.dtype == jnp.float32
    assert np.isnan(np.asarray(pools.poisoned(fp8).swa_kv, np.float32)).all()
    pool = pool.replace(swa_kv=jnp.ones_like(pool.swa_kv), swa_kv_scale=jnp.ones_like(pool.swa_kv_scale))
    reset = pools.reset_slots(pool, [1])
    assert (np.asarray(reset.swa_kv_scale)[:, 1] == 0).all() and (np.asarray(reset.swa_kv_scale)[:, 0] == 1).all()


# ---- the option reaches the kernels ---------------------------------------------------------------------------

@pytest.mark.parametrize("impl", [kernels.Impl.REFERENCE, kernels.Impl.PALLAS_INTERPRET])
def test_fp8_pools_reach_the_kernels(monkeypatch, impl):
    """Inside the step, the attention and indexer kernels receive the FP8 pools themselves with their row scales
    (no dequantized copy), for the SWA list, the compressed pools and the indexer keys alike."""
    seen = []
    module = pallas_kernels
    for name in ("sparse_attention", "indexer_topk", "sparse_attention_reference", "indexer_topk_reference"):
        original = getattr(module, name)

        def record(*args, _name=name, _original=original, **kw):
            keys = args[1:4:2] if _name.startswith("sparse") else args[2:3]  # kv_a, kv_b or keys
            scales = [kw.get(k) for k in ("kv_a_scale", "kv_b_scale", "key_scale") if k in kw]
            seen.append((_name, [jnp.dtype(a.dtype).name for a in keys], [s is not None for s in scales]))
            return _original(*args, **kw)

        monkeypatch.setattr(module, name, record)
    fp8 = SPEC.replace(kv_dtype="fp8")
    params = jax.eval_shape(lambda k: P.init(CFG, k, jnp.float32), jax.random.key(0))
    batch = steps.StepBatch(*(jax.ShapeDtypeStruct(s, jnp.int32) for s in ((2,), (2, 1), (2,))))
    jax.eval_shape(functools.partial(steps.step, cfg=CFG, spec=fp8, role=Role.TARGET, logits=steps.Logits.LAST,
                                     kernels=impl), params, pools.abstract(fp8), batch, None)
    attention = [s for s in seen if s[0].startswith("sparse")]
    indexer = [s for s in seen if s[0].startswith("indexer")]
    assert len(attention) == CFG.num_layers and len(indexer) == 2  # CSA, HCA, CSA
    for name, dtypes, scaled in attention:
        assert dtypes == ["float8_e4m3fn", "float8_e4m3fn"] and scaled == [True, True], (name, dtypes, scaled)
    assert all(d == ["float8_e4m3fn"] and s == [True] for _, d, s in indexer)
    assert all((n in ("sparse_attention", "indexer_topk")) == (impl is kernels.Impl.PALLAS_INTERPRET)
               for n, _, _ in seen)


# ---- the model: fp8 KV against the unquantized KV path -------------------------------------------------------------

CHUNK, CHUNKS = 7, 9  # one prefill program per spec (width 7: test_steps compiles it for SPEC too); 63 tokens wrap the
# SWA ring and close 15 C4 / 7 C128 windows, windows straddling chunks included
# Measured on this config (3 layers: CSA, HCA, CSA; random f32 weights; 2 x 63 tokens): logits cosine per token
# mean 0.9988, 5th percentile 0.9931, min 0.983 (tokens whose indexer picks changed), max |error| / max |logit|
# median 2.1 %; greedy argmax agreeing on 95 % of tokens; 92-94 % of the indexer's picks kept on average.
# Random weights give flat logits and near-tied indexer scores, the worst case for flips. Asserted with margin:
MIN_MEAN_COSINE = 0.995
MIN_P5_COSINE = 0.98
MIN_ARGMAX_AGREEMENT = 0.85
MIN_INDEXER_OVERLAP = 0.85


@functools.lru_cache(maxsize=None)
def _params():
    # eagerly, leaf by leaf: the ops compile per leaf shape in a few seconds, one jitted init program of the
    # whole config costs several times that in XLA
    return P.init(CFG, jax.random.key(0))


@functools.lru_cache(maxsize=None)
def _run(spec: PoolSpec):
    """Logits [2, 64, v] and indexer selections of two requests prefilled in 16-token chunks."""
    params = _params()
    ids = np.random.default_rng(1).integers(0, CFG.vocab_size, (2, CHUNK * CHUNKS)).astype(np.int32)
    book, pool = PoolBook(spec, CFG.vocab_size), pools.zeros(spec)
    for slot in (0, 1):
        book.admit(slot)
        book.reserve(slot, CHUNK * CHUNKS)
    pool = book.sync(pool)
    logits, selections = [], []
    for c in range(CHUNKS):
        batch = steps.StepBatch(jnp.asarray([0, 1], jnp.int32), jnp.asarray(ids[:, c * CHUNK:(c + 1) * CHUNK]),
                                jnp.asarray([CHUNK, CHUNK], jnp.int32))
        out, pool = steps.prefill(params, pool, batch, cfg=CFG, spec=spec, all_logits=True, kernels="reference")
        book.commit([0, 1], [CHUNK, CHUNK])
        logits.append(np.asarray(out.logits))
        selections.append([np.asarray(s) for s in out.selections])
    return (np.concatenate(logits, 1), [np.concatenate(s, 1) for s in zip(*selections)],
            jax.tree.map(lambda a: jnp.dtype(a.dtype).name, pool))


def test_fp8_kv_logits_and_selections_close_to_the_unquantized_path():
    want, want_sel, _ = _run(SPEC)
    got, got_sel, dtypes = _run(SPEC.replace(kv_dtype="fp8"))
    assert dtypes.c4_kv == dtypes.swa_kv == dtypes.indexer_kv == dtypes.c128_kv == "float8_e4m3fn"
    assert not np.array_equal(got, want)  # the cache really is quantized
    x, y = want.reshape(-1, want.shape[-1]), got.reshape(-1, got.shape[-1])
    cosine = (x * y).sum(-1) / np.linalg.norm(x, axis=-1) / np.linalg.norm(y, axis=-1)
    assert cosine.mean() >= MIN_MEAN_COSINE and np.percentile(cosine, 5) >= MIN_P5_COSINE, cosine
    assert (x.argmax(-1) == y.argmax(-1)).mean() >= MIN_ARGMAX_AGREEMENT
    for a, b in zip(want_sel, got_sel):  # [2, 64, k] logical entry ids, -1 = none
        kept = [len(set(r[r >= 0]) & set(s[s >= 0])) / max((r >= 0).sum(), 1)
                for r, s in zip(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]))]
        assert np.mean(kept) >= MIN_INDEXER_OVERLAP, np.mean(kept)
        assert ((a >= 0).sum(-1) == (b >= 0).sum(-1)).all()  # as many picks: the same visible entries


# ---- the engine: snapshots, their file, park / unpark -------------------------------------------------------------

def test_engine_fp8_snapshots_and_parking_carry_the_scales(tmp_path):
    """An engine with kv_dtype="fp8" keeps FP8 pools; a prefix snapshot (C4 / indexer / C128 rows and SWA ring with
    their row scales) restored with no prefill step, also after a trip through its file, and a park / unpark give
    the tokens of a fresh run. A restore without the scales would read entries scaled by 0."""
    from ds4jax import Engine, Request
    from ds4jax.generation.snapshots import SnapshotStore
    from spec_helpers import agreeable_model, tiny3

    model = agreeable_model(tiny3(), seed=0, damp=0.3, stream_gain=2.0)
    engine = Engine(model, max_slots=2, max_context=64, prefill_chunk=8, row_buckets=(2,), steps_per_call=4,
                    kv_dtype="fp8")
    assert engine.tspec.kv_dtype == "float8_e4m3fn" and engine.tpool.c4_kv.dtype == jnp.float8_e4m3fn
    prompt = np.random.default_rng(5).integers(3, 256, 19).tolist()
    run = lambda **kw: engine.generate([Request(prompt=prompt, max_new_tokens=8, **kw)])[0]
    fresh = run().tokens
    assert run(snapshot=True).tokens == fresh and len(engine.snapshots) == 1
    (snap,) = engine.snapshots
    assert snap.arrays["target/c4_kv"].dtype == ml_dtypes.float8_e4m3fn
    assert {"target/swa_kv_scale", "target/c4_kv_scale", "target/indexer_kv_scale",
            "target/c128_kv_scale"} <= set(snap.arrays)
    assert np.asarray(snap.arrays["target/c4_kv_scale"]).any()

    def restored():
        steps_before = engine.stats.prefill_steps
        got = run()
        assert engine.stats.prefill_steps == steps_before and got.prefill_tokens == 0  # restored, not prefilled
        return got.tokens

    assert restored() == fresh
    engine.snapshots.save(str(tmp_path / "snaps.safetensors"))
    engine.snapshots = SnapshotStore(1 << 30)
    assert engine.snapshots.load(str(tmp_path / "snaps.safetensors")) == 1
    (loaded,) = engine.snapshots
    for name, array in snap.arrays.items():
        assert loaded.arrays[name].dtype == array.dtype
        np.testing.assert_array_equal(np.asarray(loaded.arrays[name]).view(np.uint8), np.asarray(array).view(np.uint8))
    assert restored() == fresh
    engine.snapshots.clear()
    engine.park()
    engine.unpark()
    assert engine.tpool.swa_kv.dtype == jnp.float8_e4m3fn and run().tokens == fresh


@pytest.mark.parametrize("command", ["generate", "batch", "warmup", "serve"])
def test_cli_kv_dtype_flag(command, capsys):
    from ds4jax import cli

    need = {"generate": ["--prompt", "x"], "batch": ["in.jsonl", "out.jsonl"]}.get(command, [])
    args = cli.build_parser().parse_args([command, *need, "--kv-dtype", "fp8"])
    assert args.kv_dtype == "fp8"
    assert cli.build_parser().parse_args([command, *need]).kv_dtype == "auto"
    assert cli.main([command, *need, "--kv-dtype", "fp16"]) == 2
    assert "invalid choice: 'fp16'" in capsys.readouterr().err


def test_engine_flags_build_an_fp8_engine(monkeypatch):
    """`--kv-dtype` reaches `Engine(kv_dtype=...)` through the shared engine flags (batch, warmup, serve)."""
    from ds4jax import cli
    from ds4jax.commands import engine_options
    from ds4jax.generation import engine as engine_lib

    seen = {}

    class Stop(Exception):
        pass

    def fake(model, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(engine_lib, "Engine", fake)
    args = cli.build_parser().parse_args(["warmup", "--kv-dtype", "fp8"])
    with pytest.raises(Stop):
        engine_options.build_engine(None, args)
    assert seen["kv_dtype"] == "fp8"
