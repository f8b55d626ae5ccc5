"""The decode-step forms written so that XLA fuses one token's small ops (each cut kernel launches a step,
`scripts/step_kernels.py`): they compute what the plain forms compute, and the dispatch to them really happens.

* `norms.rms_norm_pair`: the query latent's and K=V vector's norms from one reduction;
* `routed_experts.weighted_sum`: one token's routed output without a scatter-add; 2 to 16 tokens' experts without a
  sort (`routed_experts.shared_tiles`);
* the mHC fn as [outputs, m*e] (the checkpoint's layout): its product is a reduction along rows;
* the SWA and compressor state rings written first and read in place at decode (`pooled_attention.SlotRing`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ds4jax
from ds4jax.model import params as P
from ds4jax.model.config import AttentionType, MlpType
from ds4jax.model.layers import attention, mhc, moe, norms
from ds4jax.runtime import routed_experts


def _primitives(fn, *args) -> list[str]:
    return [str(e.primitive) for e in jax.make_jaxpr(fn)(*args).jaxpr.eqns]


def _equations(fn, *args) -> list:
    """Every equation of fn's program, nested jits' included (not a pallas_call's kernel body), in order."""
    found = []

    def walk(jaxpr):
        for e in jaxpr.eqns:
            found.append(e)
            if str(e.primitive) == "pallas_call":
                continue
            for param in e.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        walk(inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return found


def _pallas_operands(fn, *args) -> list[list[tuple]]:
    """The operand shapes of every pallas_call in fn's program, in order."""
    return [[tuple(v.aval.shape) for v in e.invars] for e in _equations(fn, *args) if str(e.primitive) == "pallas_call"]


@pytest.mark.parametrize("lead", [(1, 1), (2, 3)])
@pytest.mark.parametrize("la, lb", [(1024, 512), (128, 64), (96, 64), (24, 40)])
def test_rms_norm_pair_equals_two_norms(la, lb, lead):
    k = jax.random.split(jax.random.key(la + lb), 4)
    a = jax.random.normal(k[0], (*lead, la), jnp.float32) * 3.0
    b = jax.random.normal(k[1], (*lead, lb), jnp.float32) * 0.1
    wa, wb = 1 + 0.1 * jax.random.normal(k[2], (la,)), 1 + 0.1 * jax.random.normal(k[3], (lb,))
    got = norms.rms_norm_pair(a, wa, b, wb, 1e-6)
    want = norms.rms_norm(a, wa, 1e-6), norms.rms_norm(b, wb, 1e-6)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=2e-6, atol=2e-6)
    pieces = (la + lb) // np.gcd(la, lb)
    sums = _primitives(lambda *xs: norms.rms_norm_pair(*xs, 1e-6), a, wa, b, wb).count("reduce_sum")
    # one reduction for both for one token, else (several tokens, or rows that share no piece size that keeps the
    # pieces few) the two norms' own
    assert sums == (1 if pieces <= norms.PAIR_PIECES and lead == (1, 1) else 2), (la, lb, lead, sums)


def test_project_qkv_takes_the_pair():
    """The dispatch: the attention's two norms of one input go through `rms_norm_pair` (one reduce_sum before
    the query's per-head norm) where XLA computes both projections, and give what the two separate norms give."""
    cfg = ds4jax.tiny()
    p = P.init(cfg, jax.random.key(0))["layers"][0]["attn"]
    x = jax.random.normal(jax.random.key(1), (1, 1, cfg.hidden_size))
    pos = jnp.zeros((1, 1), jnp.int32)
    inv = attention.layer_inv_freq(cfg, AttentionType.SLIDING)
    prims = _primitives(lambda x: attention.project_qkv(x, pos, p, cfg, inv), x)
    assert prims.count("reduce_sum") == 2, prims  # the pair's, the query heads'
    # FP8 weights (a kernel's outputs on the GPU: two buffers the concatenation would copy) take the two norms
    from ds4jax.model.quantize import quantize_fp8
    fp8 = dict(p, wq_a=quantize_fp8(p["wq_a"], (32, 32)), wkv=quantize_fp8(p["wkv"], (32, 32)))
    assert _primitives(lambda x: attention.project_qkv(x, pos, fp8, cfg, inv), x).count("reduce_sum") == 3
    q_latent, _, kv = attention.project_qkv(x, pos, p, cfg, inv)
    lin = lambda w: jnp.einsum("...i,io->...o", x, w)  # noqa: E731
    np.testing.assert_allclose(np.asarray(q_latent), np.asarray(norms.rms_norm(lin(p["wq_a"]), p["q_norm"],
                                                                                 cfg.rms_norm_eps)), rtol=1e-5)
    assert kv.shape == (1, 1, cfg.head_dim)


@pytest.mark.parametrize("kind", [MlpType.TOPK, MlpType.HASH])
def test_few_tokens_routed_output_is_a_weighted_sum(kind):
    """One token, and a few (up to a tile's 16 rows), through the grouped kernels (interpreted): the same output
    as the reference strategies, and neither a sort nor a scatter-add in the program (37 tokens keep both)."""
    cfg = ds4jax.tiny()
    params = P.init(cfg, jax.random.key(0))
    p = params["layers"][2 if kind is MlpType.TOPK else 0]["ffn"]
    for rows in (1, 3, 16, 37):
        x = jax.random.normal(jax.random.key(rows), (rows, cfg.hidden_size))
        ids = jax.random.randint(jax.random.key(rows + 1), (rows,), 0, cfg.vocab_size)
        routing = moe.route(x, ids, p, cfg, kind)
        run = lambda x: routed_experts.routed_experts_grouped(x, routing, p["experts"], cfg,  # noqa: E731
                                                              interpret=True)
        want = np.asarray(moe.routed_experts(x, routing, p["experts"], cfg, "ragged"))
        np.testing.assert_allclose(np.asarray(run(x)), want, atol=1e-5 * np.abs(want).max(), rtol=0)
        prims = {str(e.primitive) for e in _equations(run, x)}
        assert ("scatter-add" in prims) == ("sort" in prims) == (rows > 16), (rows, prims)
        # the gate / up call: a tile of 16 rows per selection (1 token), per selection of a used expert (<= 16)
        gate_up_x = _pallas_operands(run, x)[0][1]
        k = cfg.num_experts_per_tok
        assert rows > 16 or gate_up_x == (rows * k * 16, cfg.hidden_size), (rows, gate_up_x)


def test_shared_tiles():
    """Tile s: selection s's expert where s is its first selection, rows = the tokens that chose it; `first` maps
    every selection to that tile. A repeated expert within a token (a hash table may have one) is one row."""
    experts = jnp.array([[3, 1], [1, 4], [3, 3]], jnp.int32)
    group, rows, first = routed_experts.shared_tiles(experts, 4)
    np.testing.assert_array_equal(np.asarray(group), [3, 1, -1, 4, -1, -1])
    np.testing.assert_array_equal(np.asarray(first), [0, 1, 1, 3, 0, 0])
    want = np.zeros((6, 4), bool)
    want[0, [0, 2]] = want[1, [0, 1]] = want[3, 1] = True
    np.testing.assert_array_equal(np.asarray(rows), want)


def test_weighted_sum():
    y = jnp.arange(12.0).reshape(3, 4)
    w = jnp.array([0.5, -1.0, 2.0])
    np.testing.assert_array_equal(np.asarray(routed_experts.weighted_sum(y[None], w[None])), np.asarray((w @ y)[None]))
    two = routed_experts.weighted_sum(jnp.stack([y, 2 * y]), jnp.stack([w, -w]))  # each token its own weights
    np.testing.assert_array_equal(np.asarray(two), np.asarray(jnp.stack([w @ y, -2 * (w @ y)])))


def test_mhc_fn_is_outputs_by_inputs():
    """[outputs, m*e] as the checkpoint stores it; the mixes are fn @ flat(x)."""
    cfg = ds4jax.tiny()
    m, e = cfg.hc_mult, cfg.hidden_size
    tree = P.abstract(cfg)
    assert tree["layers"][0]["hc_attn"]["fn"].shape == (2 * m + m * m, m * e)
    assert tree["hc_head"]["fn"].shape == (m, m * e)
    fn = jax.random.normal(jax.random.key(0), (2 * m + m * m, m * e))
    x = jax.random.normal(jax.random.key(1), (2, m, e))
    np.testing.assert_allclose(np.asarray(mhc.raw_mixes(x, fn)), np.asarray(x.reshape(2, -1) @ fn.T), rtol=1e-5,
                               atol=1e-5)


def _pooled_logits(model, spec, ids, lengths, decode_steps: int) -> list[np.ndarray]:
    """Logits of a prefill of two requests (ids [2, T], lengths) and `decode_steps` greedy decode steps, on
    NaN-poisoned pools."""
    from ds4jax.runtime import pools, steps

    book, pool = pools.PoolBook(spec, model.config.vocab_size), pools.poisoned(spec)
    for s in (0, 1):
        book.admit(s)
        book.reserve(s, spec.max_context)
    pool = book.sync(pool)
    run = dict(cfg=model.config, spec=spec)
    rows = jnp.asarray([0, 1])
    out, pool = steps.prefill(model.params, pool, steps.StepBatch(rows, jnp.asarray(ids), jnp.asarray(lengths)), **run)
    book.commit([0, 1], list(lengths))
    logits = [np.asarray(out.logits)]
    for _ in range(decode_steps):
        nxt = jnp.argmax(out.logits, -1).astype(jnp.int32)[:, None]
        out, pool = steps.decode(model.params, pool, steps.StepBatch(rows, nxt, jnp.asarray([1, 1])), **run)
        book.commit([0, 1], [1, 1])
        logits.append(np.asarray(out.logits))
    return logits


def test_rings_in_place_at_decode(monkeypatch):
    """A decode step writes its token's rows into the SWA ring and the compressors' state rings first and reads
    them in place (`pooled_attention.SlotRing`); a chunk the ring has no room for beyond the window (a prefill, a
    verify on a ring of window rows) gathers the slot's ring as before. The dispatch per layer kind, and the same
    logits either way over a prefill and enough decode steps to wrap the SWA ring (window 8) and close compressor
    windows (ratios 4 and 128: the C4 ones), on NaN-poisoned pools."""
    from ds4jax.model.handle import Model
    from ds4jax.runtime import pools, steps
    from ds4jax.runtime.pool_spec import PoolSpec

    cfg = ds4jax.tiny()
    spec = PoolSpec.for_role(cfg, role=ds4jax.Role.TARGET, max_slots=2, max_context=64, page_size=16,
                             dtype="float32")
    pool = pools.abstract(spec)
    states = {"state_kv", "state_gate"}
    want = {AttentionType.SLIDING: {"ring", "ring_scale"}, AttentionType.HCA: {"ring", "ring_scale"} | states,
            AttentionType.CSA: {"ring", "ring_scale"} | states | {"index_state_kv", "index_state_gate"}}
    for kind, fields in want.items():
        assert steps._in_place_rings(pool, kind, cfg, 1, jnp.float32) == fields, kind
        assert "ring" not in steps._in_place_rings(pool, kind, cfg, 2, jnp.float32), kind  # no room for 2
    # an SWA ring of another dtype than the step's (a bf16 pool under an f32 model) keeps the snapshot, which
    # reads the fresh keys unrounded; the compressors' state rings (f32 in such a pool) hold f32 exactly
    bf16 = pools.abstract(PoolSpec.for_role(cfg, role=ds4jax.Role.TARGET, max_slots=2, max_context=64,
                                            page_size=16, dtype="bfloat16"))
    assert steps._in_place_rings(bf16, AttentionType.CSA, cfg, 1, jnp.float32) == want[AttentionType.CSA] - {
        "ring", "ring_scale"}

    model = Model(cfg, P.init(cfg, jax.random.key(2)))
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 20)).astype(np.int32)
    jax.clear_caches()  # the choice is made at trace time: no program traced the other way may be reused
    in_place = _pooled_logits(model, spec, ids, [20, 13], decode_steps=10)
    jax.clear_caches()
    monkeypatch.setattr(steps, "_in_place_rings", lambda *a: frozenset())
    gathered = _pooled_logits(model, spec, ids, [20, 13], decode_steps=10)
    jax.clear_caches()
    for a, b in zip(in_place, gathered):
        assert np.isfinite(a).all()
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
