"""The adaptive draft length (`Engine(speculative=k, adaptive=...)`, `generation/draft_policy.py`): the choice on
crafted estimates, and live engines with fixed costs (deterministic): drafts that are never accepted run plain
calls, good drafts turn speculation back on, and greedy tokens equal plain decoding's either way."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from small_engine import MAX_CONTEXT, one_layer_model
from spec_helpers import agreeable_model

from ds4jax import Engine, Request
from ds4jax.errors import ArgumentError
from ds4jax.generation import run_ahead
from ds4jax.generation.draft_policy import Adaptive, AdaptivePolicy, tokens_per_round
from ds4jax.io.tokenizer import ByteTokenizer

COSTS = {0: 1.0, 1: 1.3}  # a round of one draft costs 1.3 plain steps


def rows(n, k=3, accepted=0, rejected=0):
    return [SimpleNamespace(k=k, drafts_accepted=accepted, drafts_rejected=rejected) for _ in range(n)]


def test_expected_tokens_per_round():
    assert tokens_per_round(0.0, 3) == 1.0 and tokens_per_round(1.0, 3) == 4.0
    assert tokens_per_round(0.5, 2) == pytest.approx(1.75)


def test_the_choice_follows_acceptance_and_cost():
    costs = {0: 1.0, 1: 1.2, 2: 1.4, 3: 1.6}
    p = AdaptivePolicy(Adaptive(ks=(1, 2, 3), costs=costs, probe_every=3), 3)
    assert p.choose(rows(4, accepted=90, rejected=10), 4) == 3  # a = 0.9: 3.44 tokens per 1.6
    assert p.choose(rows(4, accepted=1, rejected=99), 4) == 0  # a ~ 0: plain
    assert p.choose(rows(4, k=1, accepted=90, rejected=10), 4) == 1  # capped requests: k = 1 is enough
    # a cheaper verify makes a mediocre draft worth it; a dearer one does not
    mid = rows(4, accepted=30, rejected=70)
    assert AdaptivePolicy(Adaptive(ks=(1,), costs={0: 1.0, 1: 1.1}), 1).choose(mid, 4) == 1
    assert AdaptivePolicy(Adaptive(ks=(1,), costs={0: 1.0, 1: 2.0}), 1).choose(mid, 4) == 0
    # plain wins on and on: every probe_every-th call probes the cheapest k
    p = AdaptivePolicy(Adaptive(ks=(1, 2, 3), costs=costs, probe_every=3), 3)
    bad = rows(2, accepted=0, rejected=50)
    assert [p.choose(bad, 2) for _ in range(6)] == [0, 0, 1, 0, 0, 1]


def _row(k=4, accepted=0, rejected=0, left=128):
    return SimpleNamespace(k=k, drafts_accepted=accepted, drafts_rejected=rejected,
                           request=SimpleNamespace(max_new_tokens=left), result=SimpleNamespace(tokens=[]))


def test_a_draining_batch_is_scored_by_its_slowest_row():
    """With nothing waiting for a slot (drain) the batch ends with its slowest row: seven rows accept 90 % of
    their drafts and one 40 %, round costs as measured on the H200 at batch 32 (per plain step 1.06 ms, k = 1 /
    2 / 4 rounds 1.28 / 1.34 / 1.95 ms). By the sum of tokens per round k = 4 wins (the fast rows make 4.1
    tokens a round); draining, the slow row's 1.65 tokens a round at k = 4 make the batch wait, and k = 2 (1.56
    tokens a round for 1.34 ms) ends it first. A row with few tokens left does not hold the batch up, and a
    uniform batch drains as it streams."""
    costs = {0: 1.06, 1: 1.28, 2: 1.34, 4: 1.95}
    batch = [_row(accepted=900, rejected=100) for _ in range(7)] + [_row(accepted=400, rejected=600)]
    p = lambda: AdaptivePolicy(Adaptive(ks=(1, 2, 4), costs=costs, switch_gain=0.0), 4)
    assert p().choose(batch, 8) == 4
    assert p().choose(batch, 8, drain=True) == 2
    nearly_done = batch[:7] + [_row(accepted=400, rejected=600, left=8)]  # the slow row's 8 tokens take no time
    assert p().choose(nearly_done, 8, drain=True) == 4
    uniform = [_row(accepted=900, rejected=100) for _ in range(8)]
    assert p().choose(uniform, 8, drain=True) == p().choose(uniform, 8) == 4


def test_keeps_only_a_choice_made_on_its_merits():
    """`keeps(k, rows)`: whether a speculative call may be started ahead of reading the last one (`run_ahead`):
    for a draft length the bucket chose on its merits, not for a probe or an exploration call."""
    costs = {0: 1.0, 1: 1.2, 2: 1.4, 3: 1.6}
    p = AdaptivePolicy(Adaptive(ks=(1, 2, 3), costs=costs, probe_every=2), 3)
    assert p.choose(rows(4, accepted=90, rejected=10), 4) == 3 and p.keeps(3, 4) and not p.keeps(1, 4)
    bad = rows(4, accepted=0, rejected=50)
    assert [p.choose(bad, 4) for _ in range(2)] == [0, 1]  # the second is a probe of k = 1
    assert not p.keeps(1, 4) and p.keeps(0, 4)
    measuring = AdaptivePolicy(Adaptive(ks=(1,)), 1)  # costs measured: each option explored once first
    assert measuring.choose(bad, 4) == 0 and not measuring.keeps(0, 4)


def test_a_close_call_keeps_the_last_choice():
    """Hysteresis: switching needs `switch_gain` more expected tokens/s than the last choice at that row bucket."""
    p = AdaptivePolicy(Adaptive(ks=(1,), costs={0: 1.0, 1: 1.5}), 1)
    poor, fair = rows(4, accepted=40, rejected=60), rows(4, accepted=56, rejected=44)
    good = rows(4, accepted=90, rejected=10)
    assert p.choose(poor, 4) == 0  # E(1) = 1.4 per 1.5: 0.93 of plain
    assert p.choose(fair, 4) == 0  # 1.56 / 1.5 = 1.04x plain: not 10 % better, plain stays
    assert p.choose(good, 4) == 1  # 1.9 / 1.5 = 1.27x: switch
    assert p.choose(fair, 4) == 1  # plain would be 0.96x of k=1: k=1 stays
    assert p.choose(poor, 4) == 1  # plain is 1.07x of k=1: still too close to switch back
    assert p.choose(rows(4, accepted=5, rejected=95), 4) == 0  # drafts gone bad: plain 1.4x, switch
    assert AdaptivePolicy(Adaptive(ks=(1,), costs={0: 1.0, 1: 1.5}, switch_gain=0.0), 1).choose(fair, 4) == 1


def test_estimates_and_measured_costs():
    p = AdaptivePolicy(Adaptive(ks=(1, 2)), 2)
    lv = rows(1, k=2)[0]
    assert p.rate(lv) == pytest.approx(0.5)  # the prior
    p.observe_rounds(lv, [2, 2, 2, 1], cap=2)  # 7 accepted, one rejection
    assert (lv.drafts_accepted, lv.drafts_rejected) == (7, 1) and p.rate(lv) > p.global_rate() > 0.5
    before = p.global_rate()
    p.observe_rounds(lv, [2, 0], cap=2, finished=True)  # the request's last round, cut by its token limit
    assert (lv.drafts_accepted, lv.drafts_rejected) == (9, 1) and p.global_rate() > before
    p.observe_rounds(lv, [0, 2], cap=2, finished=True)  # a short round before the last one is a rejection
    assert (lv.drafts_accepted, lv.drafts_rejected) == (11, 2)
    p.observe_cost(4, 0, 0.010, 10)
    assert p.cost(4, 0) == pytest.approx(0.001) and p.cost(4, 2) == pytest.approx(0.001 * 1.6)  # priced
    p.observe_cost(4, 2, 0.012, 10)
    assert p.cost(4, 2) == pytest.approx(0.0012)  # measured


def test_measured_costs_try_every_option_once_per_row_bucket():
    """No guessed cost decides: plain and each k run once at a row bucket, then the measured figures choose."""
    p = AdaptivePolicy(Adaptive(ks=(1, 3)), 3)
    live = rows(2)
    tried = []
    for per_step in (0.001, 0.0011, 0.0013):  # plain, k=1, k=3: drafts are cheap here
        tried.append(p.choose(live, 2))
        p.observe_cost(2, tried[-1], per_step * 10, 10)
    assert tried == [0, 1, 3]
    assert p.choose(live, 2) == 3  # prior acceptance 0.5: E(3) = 1.875 tokens for 1.3 plain steps
    assert p.choose(rows(4), 4) == 0  # a new row bucket is measured anew
    many = AdaptivePolicy(Adaptive(ks=(1, 3)), 3)
    for k, per_step in ((0, 0.001), (1, 0.003), (3, 0.009)):  # drafts dear: plain wins once measured
        many.observe_cost(2, k, per_step, 1)
    assert many.choose(live, 2) == 0


def test_bad_settings_are_named():
    with pytest.raises(ArgumentError, match="Adaptive.ks"):
        Adaptive(ks=(5,)).draft_lengths(3)
    with pytest.raises(ArgumentError, match="Adaptive.costs"):
        Adaptive(ks=(1,), costs={1: 1.0}).draft_lengths(1)
    with pytest.raises(ArgumentError, match="adaptive"):
        Engine(one_layer_model(), max_slots=4, max_context=MAX_CONTEXT, adaptive=True)


PROMPTS = [list(range(3 + i, 9 + 2 * i)) for i in range(6)]


def engine(model, adaptive) -> Engine:
    """small_engine's shapes (its programs), speculative k=1."""
    return Engine(model, max_slots=4, max_context=MAX_CONTEXT, speculative=1, prefill_chunk=8, row_buckets=(4,),
                  steps_per_call=4, tokenizer=ByteTokenizer(), snapshot_bytes=0, adaptive=adaptive)


def run(eng, speculative=None):
    return [r.tokens for r in eng.generate([Request(prompt=p, max_new_tokens=24, speculative=speculative)
                                            for p in PROMPTS])]


def test_random_drafts_run_plain_calls():
    model = one_layer_model()  # random weights: the draft is an unrelated function, acceptance ~0
    eng = engine(model, Adaptive(costs=COSTS, probe_every=8))
    plain = run(eng, speculative=0)
    before = (eng.stats.spec_calls, eng.stats.decode_calls)
    assert run(eng) == plain
    spec, dec = eng.stats.spec_calls - before[0], eng.stats.decode_calls - before[1]
    assert dec >= 4 * spec and spec <= 4, (spec, dec)  # a first try, then plain but for the probes
    assert eng.policy.global_rate() < 0.2


def test_good_drafts_turn_speculation_back_on(monkeypatch):
    """...and once speculation is chosen on its merits, its calls run ahead of the host (`run_ahead`)."""
    model = agreeable_model(one_layer_model().config, seed=3, damp=0.1)
    eng = engine(model, Adaptive(costs=COSTS, prior=0.0, probe_every=2))  # starts pessimistic: plain first
    plain = run(eng, speculative=0)
    eng.policy.choices.clear()
    ahead = []

    class Counting(run_ahead.Ahead):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            ahead.append(self.k)

    monkeypatch.setattr(run_ahead, "Ahead", Counting)
    assert run(eng) == plain
    assert eng.policy.global_rate() > 0.5
    assert eng.policy.choices.get(1, 0) > 2 * eng.policy.choices.get(0, 0), eng.policy.choices
    assert 1 in ahead, ahead  # the adaptive engine's speculative calls ran ahead
