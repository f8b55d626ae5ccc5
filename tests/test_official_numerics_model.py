"""``numerics="official"`` on a tiny random model with every layer type (sliding, CSA, HCA; hash and top-k MoE):
the roundings change the logits by a small, bounded amount (and do change them: the option is wired), and the
pooled steps (chunked prefill + decode, reference and Pallas kernels), the fused loops of the Engine and
speculative verification give what the cache-free full forward gives under the same numerics."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ds4jax.model import forward as F
from ds4jax.model import official_numerics as on
from ds4jax.model import params as P
from ds4jax.model.config import Numerics, tiny
from ds4jax.model.handle import Model
from ds4jax.runtime import pools, steps
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.roles import Role

REF = tiny()  # sliding, CSA, HCA, CSA, HCA; two hash layers; MTP
OFF = REF.replace(numerics=Numerics.OFFICIAL)
PROMPT, DECODE, CHUNK = 42, 5, 7  # 42 tokens close 10 C4 and 5 C128 windows and wrap the 8-token window
TOL = 1e-5  # steps vs full forward, the same numerics: max |error| / max |logit| per position (float32)
# official vs reference on these 2 x 47 tokens (measured: cosine mean 0.9967, min 0.967; on 8 x 64 tokens
# docs/benchmarks/official_numerics.md: max |error| / max |logit| per position median 6.2 %, max 49 %). Random
# weights give flat logits and near-tied indexer scores, the worst case. Asserted loosely:
MIN_MEAN_COSINE, MIN_COSINE, MAX_REL = 0.99, 0.9, 0.4


@functools.lru_cache(maxsize=None)
def params():
    # eagerly, leaf by leaf: one jitted init program of this config costs ~17 CPU s of XLA, the per-shape ops ~4
    return P.init(REF, jax.random.key(0))


def ids():
    return np.random.default_rng(1).integers(3, REF.vocab_size, (2, PROMPT + DECODE)).astype(np.int32)


@functools.partial(jax.jit, static_argnums=0)
def full(cfg, p, token_ids):
    out = F.forward_full(cfg, p, token_ids)
    return out.logits, tuple(a.attention for a in out.aux if a.attention is not None)


def rel(got, want):
    return np.abs(got - want).max(-1) / np.abs(want).max(-1)


def test_official_differs_from_reference_by_a_bounded_amount():
    want = np.asarray(full(REF, params(), ids())[0]).reshape(-1, REF.vocab_size)
    got = np.asarray(full(OFF, params(), ids())[0]).reshape(-1, REF.vocab_size)
    assert np.isfinite(got).all() and not np.array_equal(got, want)  # the option reaches the forward
    cosine = (got * want).sum(-1) / np.linalg.norm(got, axis=-1) / np.linalg.norm(want, axis=-1)
    assert cosine.mean() >= MIN_MEAN_COSINE and cosine.min() >= MIN_COSINE, (cosine.mean(), cosine.min())
    assert rel(got, want).max() <= MAX_REL
    assert rel(got, want)[0] > 0  # even position 0 (no compressed entry yet): the KV and GEMM-input roundings


def run_steps(kernels: str, decode: int = DECODE):
    """Two requests prefilled in CHUNK-token chunks (all logits), then `decode` one-token steps, under OFF.

    Returns (logits [2, tokens, v], indexer selections per CSA layer [2, tokens, k], the pool)."""
    spec = PoolSpec.for_role(OFF, role=Role.TARGET, max_slots=2, max_context=64, page_size=16, dtype="float32")
    book, pool = pools.PoolBook(spec, OFF.vocab_size), pools.zeros(spec)
    for slot in (0, 1):
        book.admit(slot)
        book.reserve(slot, PROMPT + decode)
    pool = book.sync(pool)
    tokens, logits, sels = ids(), [], []
    for start, n in [(s, min(CHUNK, PROMPT - s)) for s in range(0, PROMPT, CHUNK)] + [
            (PROMPT + i, 1) for i in range(decode)]:
        chunk = np.zeros((2, CHUNK if start < PROMPT else 1), np.int32)
        chunk[:, :n] = tokens[:, start:start + n]
        batch = steps.StepBatch(jnp.asarray([0, 1], jnp.int32), jnp.asarray(chunk), jnp.asarray([n, n], jnp.int32))
        if start < PROMPT:
            out, pool = steps.prefill(params(), pool, batch, cfg=OFF, spec=spec, all_logits=True, kernels=kernels)
            logits.append(np.asarray(out.logits)[:, :n])
            sels.append([np.asarray(s)[:, :n] for s in out.selections])
        else:
            out, pool = steps.decode(params(), pool, batch, cfg=OFF, spec=spec, kernels=kernels)
            logits.append(np.asarray(out.logits)[:, None])
            sels.append([np.asarray(s) for s in out.selections])
        book.commit([0, 1], [n, n])
    return np.concatenate(logits, 1), [np.concatenate(s, 1) for s in zip(*sels)], pool


@functools.lru_cache(maxsize=None)
def steps_run(kernels: str = "reference", decode: int = DECODE):
    return run_steps(kernels, decode)


def test_pools_hold_the_rounded_values():
    """Every KV row the steps cached is a fixed point of its official rounding (rounding is idempotent, and an
    unrounded float32 row is not one): the SWA ring and the C4 / C128 entries FP8 on their non-rope dims, the
    indexer keys Hadamard-rotated FP4. Deterministic, whatever the float noise of the paths."""
    pool = steps_run()[2]
    nope = OFF.head_dim - OFF.rope_head_dim
    for name in ("swa_kv", "c4_kv", "c128_kv", "indexer_kv"):
        rows = np.asarray(getattr(pool, name), np.float32)
        rows = rows.reshape(-1, rows.shape[-1])
        rows = rows[np.abs(rows).max(-1) > 0]  # the written rows
        assert len(rows) >= 10, name
        part = rows if name == "indexer_kv" else rows[:, :nope]
        again = on.fp4_round(jnp.asarray(part)) if name == "indexer_kv" else on.fp8_round(jnp.asarray(part), 64)
        np.testing.assert_array_equal(np.asarray(again), part, err_msg=name)


def test_chunked_prefill_then_decode_matches_full_forward():
    """The steps and the full forward compute the values they round with float noise of ~1e-7 (other shapes,
    other fusions); a value that lands that close to a rounding boundary (an e4m3 / e2m1 midpoint) rounds to
    neighbouring grid points on the two paths, and the one-step difference then propagates (a cached entry, an
    indexer pick). So equality holds up to such flips: exact over the first chunk, and, over all positions, far
    closer to the official full forward than to the reference one (unwired steps would be as far from both)."""
    want = np.asarray(full(OFF, params(), ids())[0])
    other = np.asarray(full(REF, params(), ids())[0])
    got, got_sel, _ = steps_run()
    assert np.isfinite(got).all()
    err, gap = rel(got, want), rel(got, other)
    assert err[:, :CHUNK].max() <= TOL, err[:, :CHUNK].max()
    assert np.median(err) <= 0.5 * np.median(gap), (np.median(err), np.median(gap))
    assert gap.max() > 100 * TOL  # the steps really ran the official numerics
    want_sel = full(OFF, params(), ids())[1]
    for mine, theirs in zip(got_sel, want_sel):  # the first chunk's picks too (ties to the lower entry)
        np.testing.assert_array_equal(mine[:, :CHUNK], np.asarray(theirs)[:, :CHUNK])


def test_pallas_kernels_read_the_rounded_values():
    """The kernels take the already-rounded keys and queries: the interpreted Pallas kernels give the reference
    kernels' logits (prefill, one decode step), up to rounding-boundary flips as above."""
    want = steps_run("reference", 1)[0]
    got = steps_run("pallas_interpret", 1)[0]
    err = rel(got, want)
    assert err[:, :CHUNK].max() <= TOL and np.median(err) <= TOL, (err[:, :CHUNK].max(), np.median(err))


def _greedy_ok(model, prompt, new):
    """Each generated token is the full forward's argmax (or within 1e-4 of it: a random model's near-ties).
    The sequence is row 0 of a batch shaped like `ids()` (row 1: filler), so `full` runs the program the tests
    above compiled instead of compiling one more shape. So do the params: the model's are `params()` stacked for
    its scanned layers (the same arrays; another pytree, so another program), `full` takes the per-layer ones."""
    assert model.config == OFF
    seq = np.asarray(prompt + new, np.int32)
    assert seq.shape == (PROMPT + DECODE,)
    logits = np.asarray(full(OFF, params(), np.stack([seq, ids()[1]]))[0])[0, len(prompt) - 1:-1]
    chosen = np.take_along_axis(logits, np.asarray(new)[:, None], -1)[:, 0]
    assert (logits.max(-1) - chosen <= 1e-4 * np.abs(logits).max(-1)).all()


NEW = 8  # generated tokens: the first (prefill) and two calls of up to 4 decode steps or rounds


@functools.lru_cache(maxsize=None)
def engine():
    """One engine of the shape `ds4jax.generate(..., speculative=2)` builds for the prompt below, serving both
    parametrizations (a request with speculative=0 decodes plainly): its prefill program is compiled once."""
    from ds4jax import Engine
    from ds4jax.generation import buckets

    shape = buckets.one_shot([PROMPT + DECODE - NEW], NEW, speculative=2, data=1, prefill_chunk=16, steps_per_call=4,
                             max_position_embeddings=OFF.max_position_embeddings)
    return Engine(Model(config=OFF, params=params()), **shape)


@pytest.mark.parametrize("speculative", [0, 2])
def test_engine_fused_loops_and_verification(speculative):
    """The Engine `ds4jax.generate` builds (fused decode loops; with speculative=2 the MTP drafts and verify
    steps) on the official model: greedy tokens of the official full forward, and as many as asked."""
    from ds4jax import Request

    eng = engine()
    # pools for the draft bucket of k=2 (buckets.draft_bucket: 4 drafts), rounds of the one program's 2 drafts
    assert eng.model.has_mtp and eng.tspec.draft_tokens == 5 and eng.policy.ks == (2,)
    prompt = ids()[0, :PROMPT + DECODE - NEW].tolist()  # 39 tokens: chunks of 16, 16 and 7
    result = eng.generate([Request(prompt=prompt, max_new_tokens=NEW, speculative=speculative)])[0]
    assert result.ok and len(result.tokens) == NEW
    assert (result.accepted_per_round is None) == (speculative == 0)  # plain steps, or speculative rounds
    _greedy_ok(eng.model, prompt, result.tokens)
