"""Speculative decoding (`ds4jax.speculative`) on CPU, fp32, tiny 3-layer configs, ragged batches.

The test model (`spec_helpers.agreeable_model`) makes the MTP draft agree with the target often but not always,
so rounds mix full acceptance and rejections.

Compilation dominates the cost on CPU, and pytest-xdist (`-n 2`) hands single tests to workers, so every
compiled program has exactly one test using it: `test_greedy_speculative[k]` runs all greedy checks for one k
on the same runs (one loop program per k) and `test_sampled_distribution_matches_target` both sampling settings
(one program). Each check is a `check_*` function below.
"""

from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

import ds4jax
from ds4jax import SamplingParams, greedy_generate
from ds4jax.errors import ArgumentError
from ds4jax.generation import buckets
from ds4jax.runtime.pool_spec import PoolSpecError
from ds4jax.runtime.pools import PoolError
from ds4jax.generation.sampling import filter_logits
from ds4jax.generation.speculative import MAX_STOP_IDS, speculative_generate, speculative_loop
from spec_helpers import (CompileCounter, agreeable_model, capture_loop, chi_square_pvalue, compare_draft_rings,
                          compare_target_pools, plain_reference, plain_spec, reference_accepts, round_spans, tiny3)

K_VALUES = (1, 2, 3)
MAX_NEW = 32  # new-token bucket 32; prompts up to 19 tokens -> max_context bucket 64 for every k <= 3
# prefill chunk per k: k = 2 prefills the 11- and 19-token prompts over 2 and 3 ragged chunks; k = 1, 3 every
# prompt in one chunk (one prefill program fewer to compile each)
CHUNK = {1: 19, 2: 8, 3: 19}
# plain decoding runs with a budget of REF_NEW >= MAX_NEW + k tokens: every plain reference below (including
# the pool reference, which decodes up to k - 1 tokens past the budget) shares ds4jax.generate's compiled steps
REF_NEW = MAX_NEW + 4
REF_CHUNK = 8
_rng = np.random.default_rng(7)
# ragged: 5 (< window), 11, 19 (> 2 windows) tokens; decoding crosses SWA-ring wraps and C4/C128 windows
PROMPTS = [_rng.integers(0, 256, n).tolist() for n in (5, 11, 19)]
# other prompts of PROMPTS' buckets (3-4 prompts -> 4 rows; longest + 32 + k + 1 <= 64) and chunk shapes
OTHER_PROMPTS = [[_rng.integers(0, 256, n).tolist() for n in lengths] for lengths in ((14, 3, 9), (19, 7, 12, 1))]


@pytest.fixture(autouse=True)
def exact_rings(monkeypatch):
    """Pools sized exactly for each k (swa_rows = window + k, the tightest ring: a verify's last write lands on the
    row just before the oldest one its queries still read), not for the one-shot engines' bucket of k
    (`buckets.draft_bucket`, tested in test_draft_bucket.py), which would give k = 1..3 one looser ring."""
    monkeypatch.setattr(buckets, "draft_bucket", lambda k, most=None: k)


@pytest.fixture(scope="module")
def model():
    return agreeable_model(tiny3(), seed=0, damp=0.3, stream_gain=2.0)


@pytest.fixture(scope="module")
def reference_long(model):
    """Greedy plain decoding (ds4jax.greedy_generate) of PROMPTS, REF_NEW tokens."""
    return greedy_generate(model, PROMPTS, REF_NEW, prefill_chunk=REF_CHUNK)


def plain(model, max_new: int, stop_ids=()):
    """ds4jax.greedy_generate on PROMPTS with `max_new` tokens (run with a budget of REF_NEW and cut: greedy
    decoding with a smaller budget is the prefix, and one plain pool spec serves every call)."""
    return [r[:max_new] for r in greedy_generate(model, PROMPTS, REF_NEW, prefill_chunk=REF_CHUNK,
                                                 stop_ids=stop_ids)]


def _emission_rounds(res, row: int) -> list[int]:
    """Round index of every emitted token of `row` (-1 for t0, emitted by the prefill)."""
    owner = [-1]
    for r, a in enumerate(res.accepted_per_round[row]):
        owner += [r] * (a + 1)
    return owner


def _mid_round(res, row: int, index: int) -> bool:
    """Whether emitted token `index` of `row` has more tokens after it in the same round."""
    owner = _emission_rounds(res, row)
    return index + 1 < len(owner) and owner[index] >= 0 and owner[index + 1] == owner[index]


# ---- checks on one greedy run (shared prompts, MAX_NEW tokens, no stop ids) ---------------------------------------

def check_matches_plain(model, res, tspec, reference, k):
    """Greedy speculative output == greedy plain decoding, token for token; the accept paths are exercised
    (mixed accept lengths incl. full acceptance and rejections); rounds straddle C4 and C128 window ends and the
    SWA ring's wrap point, both with accepted tokens after the boundary and with the boundary in the rejected
    part of a verify (windows closed and ring rows wrapped by tokens that get rejected)."""
    assert res.tokens == reference
    accepted = np.concatenate([np.asarray(a) for a in res.accepted_per_round])
    hist = np.bincount(accepted, minlength=k + 1)
    assert 0 < accepted.mean() < k and hist[k] > 0 and hist[:k].sum() > 0, hist
    for row, toks in enumerate(res.tokens):
        assert len(toks) == MAX_NEW
        assert res.rounds[row] == len(res.accepted_per_round[row])
        assert sum(a + 1 for a in res.accepted_per_round[row]) + 1 >= MAX_NEW  # t0 + every round's tokens
        assert res.mean_accepted[row] == pytest.approx(np.mean(res.accepted_per_round[row]))
    swa_rows = tspec.swa_rows
    assert swa_rows == model.config.sliding_window + k
    cover = {}
    for period in (model.config.csa_ratio, model.config.hca_ratio, swa_rows):
        committed = rejected = 0
        for row, p in enumerate(PROMPTS):
            for start, n, _ in round_spans(len(p), res.accepted_per_round[row]):
                ends = [q for q in range(start, start + k) if q % period == period - 1]  # q + 1 also verified
                committed += any(q < start + n - 1 for q in ends)
                rejected += any(q >= start + n - 1 for q in ends) and n < k + 1
        cover[period] = (committed, rejected)
    print(f"\nk={k}: rounds {res.rounds}, mean accepted per row {np.round(res.mean_accepted, 2).tolist()}, overall "
          f"{accepted.mean():.2f}, accept-length histogram {hist.tolist()}; rounds crossing (accepted, rejected) "
          f"boundaries by period {cover}")
    assert all(c and r for c, r in cover.values()), cover


def check_stop_and_budget(model, res, reference, k):
    """Stop ids hit mid-round and a token budget ending mid-round truncate exactly like plain decoding."""
    candidates = [(t, row, i) for row, toks in enumerate(reference) for i, t in enumerate(toks)
                  if toks.index(t) == i and i > 0 and _mid_round(res, row, i)]
    assert candidates, "no token is emitted mid-round: the test model accepts too little"
    stop, row, index = candidates[0]
    absent = next(t for t in range(model.config.vocab_size) if all(t not in r for r in reference))
    got = speculative_generate(model, PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, stop_ids=(absent, stop)), k=k,
                               prefill_chunk=CHUNK[k], lookup=0)
    assert got.tokens == plain(model, MAX_NEW, stop_ids=(absent, stop))
    assert got.tokens[row] == reference[row][: index + 1]  # cut inside a round, the stop token included
    # stats count tokens actually emitted, not the drafts a stop cut off
    assert got.mean_tokens_per_round[row] == pytest.approx((len(got.tokens[row]) - 1) / got.rounds[row])

    budgets = [m for m in range(MAX_NEW // 2 + 1, MAX_NEW)
               if any(_mid_round(res, r, m - 1) for r in range(len(PROMPTS)))]
    assert budgets
    got = speculative_generate(model, PROMPTS, SamplingParams(max_new_tokens=budgets[0]), k=k, prefill_chunk=CHUNK[k],
                               lookup=0)
    assert got.tokens == plain(model, budgets[0])


def check_accept_lengths(model, res, reference_long, k):
    """Per-round accept lengths equal those of the draft chain recomputed with the cache-free full-sequence
    target and MTP forwards: the draft's prefill-path extend, its decode-path extend with the accepted rows and
    its top-1 chain over its own streams are positioned correctly (greedy output alone cannot show this: it
    never depends on the draft)."""
    seqs = [p + r for p, r in zip(PROMPTS, reference_long)]
    rounds = [(row, start) for row, p in enumerate(PROMPTS)
              for start, _, _ in round_spans(len(p), res.accepted_per_round[row])]
    got = [a for row in range(len(PROMPTS)) for a in res.accepted_per_round[row]]
    assert got == reference_accepts(model, seqs, rounds, k)


def check_pools(model, res, final, tspec, k):
    """Rejected drafts leave no trace: everything a later step can read from the target's pools (SWA rings,
    C4 / indexer / C128 entries, compressor state rows of the open windows) and from the draft's ring equals
    plain decoding of the committed tokens, for every request (each at the end of its last round; the engine
    serves request r in slot r here)."""
    cfg = model.config
    lengths = [int(final[row][0].lengths[row]) for row in range(len(PROMPTS))]
    for row in range(len(PROMPTS)):
        assert int(final[row][1].lengths[row]) == lengths[row]
    for row, p in enumerate(PROMPTS):
        # every emitted token but the pending last one is committed; a truncated last round commits all a+1
        assert len(p) + MAX_NEW - 1 <= lengths[row] <= len(p) + MAX_NEW - 1 + k
    spec = plain_spec(model, PROMPTS, REF_NEW)
    assert max(lengths) < spec.max_context
    target_ref, draft_ref, seqs = plain_reference(model, PROMPTS, lengths, spec=spec, chunk=REF_CHUNK,
                                                  draft_width=spec.max_context)
    for row, p in enumerate(PROMPTS):
        assert seqs[row][len(p): len(p) + MAX_NEW] == res.tokens[row]
        tpool, dpool = final[row]
        counts = compare_target_pools(tpool, target_ref, cfg=cfg, slot=row, length=lengths[row],
                                      page_size=tspec.page_size)
        assert counts["swa_kv"] and counts["c4_kv"] and counts["c128_kv"] and counts["c128_state_kv"]
        assert compare_draft_rings(dpool, draft_ref, cfg=cfg, slot=row, length=lengths[row]) == 8


@pytest.mark.parametrize("k", K_VALUES)
def test_greedy_speculative(model, reference_long, k):
    """Greedy speculative decoding for k drafts per round on a ragged batch of three prompts.

    1. output == ds4jax.greedy_generate token for token, incl. stop ids and budgets hit mid-round;
    2. the final target (and draft) pools equal plain decoding's at committed positions;
    3. per-round accept lengths match a cache-free recomputation of the draft chain;
    4. the loop compiles once per (spec, k, batch bucket): this k's first call compiles one new program (so a
       different k compiles its own); stop ids, budgets of the same max-new bucket, seeds and other prompts of
       the same batch and context buckets compile nothing.
    The engine returns from the loop whenever a request finishes, so one generation makes several loop calls.
    The MTP chain alone drafts here (lookup=0: step 3 recomputes its chain; tests/test_lookup.py has lookup's)."""
    reference = [r[:MAX_NEW] for r in reference_long]
    with capture_loop() as calls, CompileCounter("speculative_loop") as first:
        res = speculative_generate(model, PROMPTS, SamplingParams(max_new_tokens=MAX_NEW), k=k,
                                   prefill_chunk=CHUNK[k], lookup=0)
    assert first.count == 1 and calls
    call = calls[0]
    assert all(c["k"] == k for c in calls)
    size = speculative_loop._cache_size()

    check_matches_plain(model, res, call["tspec"], reference, k)
    check_accept_lengths(model, res, reference_long, k)
    check_pools(model, res, calls.final, call["tspec"], k)
    with CompileCounter("speculative_loop") as again:
        check_stop_and_budget(model, res, reference, k)
        for seed, prompts in enumerate(OTHER_PROMPTS):
            got = speculative_generate(model, prompts, SamplingParams(max_new_tokens=20 + seed, seed=seed), k=k,
                                       prefill_chunk=CHUNK[k], lookup=0)
            assert [len(t) for t in got.tokens] == [20 + seed] * len(prompts)
    assert again.count == 0
    assert speculative_loop._cache_size() == size


# ---- sampling: speculative samples follow the target distribution ------------------------------------------------

SAMPLE_ROWS = 1024
SAMPLE_K = 2
SAMPLE_PROMPT = [3, 1, 4, 1, 5, 9, 2]
# (temperature, top_p, seed): different seeds and filters run the same compiled program
SAMPLE_SETTINGS = ((1.0, 1.0, 1234), (0.7, 0.8, 99))
# the 7-token prompt in one chunk of 8: the one-shot engine's default chunk (the 32-token prompt bucket) made every
# prefill call compute 1024 x 32 positions, most of this test's run time on the CPU
SAMPLE_CHUNK = 8


def test_sampled_distribution_matches_target():
    """1024 rows of one prompt with independent per-row keys, k=2, three new tokens x1 x2 x3 (vocab 16).

    x1 comes from the prefill, x2 from the first round (an accepted draft or the correction), x3 from the first
    round (accepted draft or bonus) or the second (after a correction at x2). Their joint law must be the
    target's: p(x1) p(x2 | x1) p(x3 | x1, x2), from one full-sequence forward over prompt + [a, b] for all 256
    pairs (a, b), filtered with the same temperature / top-p. Pearson chi-square on the pair laws (x1, x2),
    (x1, x3) and (x2, x3) (256 cells each, cells with expected count < 5 pooled), each at p < 1e-3: the
    false-failure rate is <= 3e-3 per setting, <= 6e-3 for the test (union bound); the seeds are fixed, so the
    outcome is deterministic. Impossible (top-p filtered) tokens must never occur (exact check).
    Power: scoring drafts drawn at T = 0.7 as if drawn at T = 1 fails at p ~ 1e-7; drawing the correction from
    p instead of the residual fails at p ~ 1e-10.

    Both settings (different seeds, temperatures and top-p) run one compiled loop program."""
    # vocab 16; sharper logits (head x10) and a weaker skip path so p and q differ (per-token TV ~0.26)
    model = agreeable_model(tiny3(vocab_size=16), seed=1, damp=0.7, head_scale=10.0)
    v = model.config.vocab_size
    results = {}
    with CompileCounter("speculative_loop") as compiles:
        for temperature, top_p, seed in SAMPLE_SETTINGS:
            params = SamplingParams(max_new_tokens=3, temperature=temperature, top_p=top_p, seed=seed)
            results[temperature, top_p] = speculative_generate(model, [SAMPLE_PROMPT] * SAMPLE_ROWS, params,
                                                               k=SAMPLE_K, prefill_chunk=SAMPLE_CHUNK)
    assert compiles.count == 1

    seqs = jnp.asarray([SAMPLE_PROMPT + [a, b] for a in range(v) for b in range(v)], jnp.int32)
    logits = ds4jax.forward_logits(model, seqs)
    failures = {}
    for (temperature, top_p), res in results.items():
        toks = np.asarray(res.tokens)
        assert toks.shape == (SAMPLE_ROWS, 3)
        accepted = np.concatenate([np.asarray(a) for a in res.accepted_per_round])
        hist = np.bincount(accepted, minlength=SAMPLE_K + 1)
        assert (hist > 0).all(), hist
        probs = np.exp(np.asarray(filter_logits(logits, jnp.full(logits.shape[:2], temperature),
                                                jnp.full(logits.shape[:2], top_p)), np.float64))
        p1 = probs[0, -3]  # [x1]
        p2 = probs[::v, -2]  # [x1, x2]
        p3 = probs[:, -1].reshape(v, v, v)  # [x1, x2, x3]
        joint = p1[:, None, None] * p2[:, :, None] * p3
        pvalues = {
            "x1,x2": chi_square_pvalue(toks[:, 0] * v + toks[:, 1], joint.sum(2).reshape(-1)),
            "x1,x3": chi_square_pvalue(toks[:, 0] * v + toks[:, 2], joint.sum(1).reshape(-1)),
            "x2,x3": chi_square_pvalue(toks[:, 1] * v + toks[:, 2], joint.sum(0).reshape(-1)),
        }
        print(f"\nT={temperature} top_p={top_p}: accept-length histogram {hist.tolist()}, mean "
              f"{accepted.mean():.2f}; chi-square p-values " + ", ".join(f"({k}) {p:.3f}" for k, p in pvalues.items()))
        if min(pvalues.values()) <= 1e-3:
            failures[temperature, top_p] = pvalues
    assert not failures, failures


# ---- errors ---------------------------------------------------------------------------------------------------------

def test_errors(model):
    """Bad requests fail before anything compiles."""
    with CompileCounter("speculative_loop") as compiles:
        no_mtp = ds4jax.Model(model.config, {k: v for k, v in model.params.items() if k != "mtp"})
        with pytest.raises(PoolError, match="MTP"):
            speculative_generate(no_mtp, PROMPTS, SamplingParams(max_new_tokens=4), k=2)
        for k in (0, -1):
            with pytest.raises(ArgumentError, match=f"k={k}: must be in"):
                speculative_generate(model, PROMPTS, SamplingParams(max_new_tokens=4), k=k)
        with pytest.raises(PoolError, match="stop ids"):
            speculative_generate(model, PROMPTS, SamplingParams(max_new_tokens=4,
                                                                stop_ids=tuple(range(MAX_STOP_IDS + 1))), k=2)
        with pytest.raises(ArgumentError, match="max_new_tokens"):
            speculative_generate(model, PROMPTS, SamplingParams(max_new_tokens=0), k=2)
        with pytest.raises(ArgumentError, match="prompt_ids\\[1\\]=.*empty"):
            speculative_generate(model, [[1, 2], []], SamplingParams(max_new_tokens=4), k=2)
        # k must fit the compressor state rings' write pad (16-row C4 ring, 8-token window: pad 10 -> k + 1 <= 10)
        with pytest.raises(PoolSpecError, match="draft_tokens"):
            speculative_generate(model, PROMPTS, SamplingParams(max_new_tokens=4), k=10)
    assert compiles.count == 0
