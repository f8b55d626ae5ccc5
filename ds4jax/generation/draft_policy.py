"""How many draft tokens a speculative call proposes per round: fixed (`Engine(speculative=k)`), or chosen per call
by `Adaptive` (`Engine(speculative=k, adaptive=True)`) so that speculation is never the slower choice.

The adaptive choice compares expected tokens per second. A request's drafts are accepted one after another with
probability a (its acceptance rate), so a round of k drafts yields E(k) = 1 + a + ... + a^k tokens; a call of
R rows at draft length k yields sum_r E_r(k) tokens per round for the cost of a round, c(rows, k), against R
tokens per plain step for c(rows, 0). The call runs the k in {0} + `ks` with the most tokens per second.

* Acceptance: per request, accepted drafts S and rejections F (a round that accepted fewer than it could) give
  a = S / (S + F), starting from the engine-wide estimate (the same counts over every request, decayed so it
  follows the workload) weighted as `prior_rounds` rounds. A request never speculated has the global estimate.
* Costs: `costs` fixes c(., k) relative to a plain step (deterministic, for tests and for costs measured
  elsewhere); otherwise every call's wall time per step (device work and host work alike) updates a running
  mean per (row bucket, k), and a k not measured yet at a row bucket is priced as the plain step times
  `1 + draft_cost * k`.
* Draining: when no request waits for a slot (`Rows.wake` off), the rows' batch ends with its slowest row, and
  rows that finish early idle until then. The call then scores each option by the time its slowest row needs
  for the tokens it has left (at most `max_new_tokens` - emitted, divided by its E_r(k)) instead of by the sum
  of the rows' tokens per round: a long draft that most rows accept but one row keeps rejecting leaves the
  batch waiting for that row. (On the H200 at batch 32, 128 tokens each, nothing waiting, k=4 needed 64
  rounds for what its mean acceptance says takes 34, and gave 1.10x plain where k=1 gave 1.29x and the
  throughput score chose k=4; `docs/benchmarks/engine.md`.)
* Hysteresis: a call keeps the draft length the last call at its row bucket chose unless another option's
  expected tokens per second beats it by `switch_gain` (10 %). Where plain and speculation are close (a full
  batch), running costs measured from a few calls each differ by more than the options do, and flipping between
  them costs by itself: the draft cache of rows decoded plainly falls behind, and a plain call run ahead is read
  early. (On the H200 at batch 32 a run that flipped, 16 plain and 36 k=3 calls, gave 0.93x plain; how much of that
  was the flipping is not known: fixed k=3 varied from 0.90x to 1.13x between runs.)
* Exploration: with measured costs, each option (plain and every k of `ks`) runs once per row bucket before any
  is priced by a guess: a guessed draft cost decided the first calls wrongly both ways (on the default model a
  k=3 round costs 1.3 plain steps, not the 1.9 the guess says, so a run of 8 calls never speculated where k=3
  is 1.6x faster). Once plain wins, estimates stop moving (plain calls accept nothing); every `probe_every`-th
  call of speculative-capable rows that would run plain runs the cheapest k instead, so a workload whose drafts
  turn good is noticed. With drafts that are never accepted this costs about
  (c(., ks[0]) / c(., 0) - 1) / probe_every of the plain throughput (e.g. 1 % for a 1.3x round and 32).

Greedy outputs do not depend on the choice (each round's tokens are the target's); a request decoded plainly
for a while rejoins speculation with its draft cache behind (the draft's lengths catch up with the target's),
which lowers acceptance for a window, never correctness.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Mapping, Sequence

from ds4jax.errors import ArgumentError


@dataclasses.dataclass(frozen=True)
class Adaptive:
    """Settings of the adaptive draft length (see the module docstring).

    ks: the draft lengths a call may use besides 0 (each is one compiled speculative program per row bucket);
    default (1, ceil(k/2), k) of the engine's k. costs: {k: cost of a round with k drafts, 0: a plain step}
    relative to each other, fixed; None measures them. prior: acceptance assumed before any round."""

    ks: tuple[int, ...] | None = None
    costs: Mapping[int, float] | None = None
    prior: float = 0.5
    prior_rounds: float = 4.0
    decay: float = 0.98  # weight of the global counts kept per observed round
    draft_cost: float = 0.3
    probe_every: int = 32
    switch_gain: float = 0.1  # another option must promise this much more tokens/s to replace the last choice

    def draft_lengths(self, k: int) -> tuple[int, ...]:
        out = checked_lengths(self.ks if self.ks is not None else (1, -(-k // 2), k), k, "Adaptive.ks", self.ks)
        if self.costs is not None and any(x not in self.costs or not self.costs[x] > 0 for x in (0,) + out):
            raise ArgumentError(f"needs a positive cost for 0 (a plain step) and each of {out}",
                                name="Adaptive.costs", value=self.costs)
        return out


def checked_lengths(ks, k: int, name: str, value=None) -> tuple[int, ...]:
    """Draft lengths `ks`, sorted and distinct, each in 1..k (`ArgumentError` naming `name` otherwise)."""
    out = tuple(sorted({int(x) for x in ks}))
    if not out or out[0] < 1 or out[-1] > k:
        raise ArgumentError(f"draft lengths must lie in 1..{k} (the engine's speculative=k)", name=name,
                            value=ks if value is None else value)
    return out


def tokens_per_round(a: float, k: int) -> float:
    """E(k) = 1 + a + ... + a^k: tokens a round of k drafts yields at acceptance rate a."""
    return float(k + 1) if a >= 1 else (1 - a ** (k + 1)) / (1 - a)


class Fixed:
    """Every speculative-capable row speculates with the engine's k (each row up to its own cap; a call runs the
    program of the fewest drafts in `ks` that serves its rows' caps, else the longest). `ks` defaults to (k,);
    `Engine(draft_lengths=...)` gives others (a one-shot engine: pools for a bucket of k, one program of its k)."""

    def __init__(self, k: int, ks: Sequence[int] | None = None):
        self.ks = tuple(ks) if ks is not None else ((k,) if k else ())
        self.k = k

    def choose(self, live: Sequence, rows: int, drain: bool = False) -> int:
        return self.k

    def observe_rounds(self, lv, accepted: Sequence[int], cap: int, finished: bool = False) -> None:
        pass

    def keeps(self, k: int, rows: int) -> bool:
        return True

    def observe_cost(self, rows: int, k: int, seconds: float, steps: int) -> None:
        pass


class AdaptivePolicy:
    """The running estimates and the per-call choice of `Adaptive` settings."""

    def __init__(self, settings: Adaptive, k: int):
        self.settings, self.ks = settings, settings.draft_lengths(k)
        self.accepted = self.rejected = 0.0  # global counts (decayed)
        self._cost: dict[tuple[int, int], float] = {}  # (rows, k) -> running mean seconds per step / round
        self._plain_streak = 0
        self._last: dict[int, int] = {}  # row bucket -> the draft length its last call chose (probes aside)
        self.choices: dict[int, int] = {}  # k -> calls that chose it (0 = plain)
        # the last choices with what decided them: (row bucket, live rows, {k: expected tokens/s}, chosen k)
        self.trace: collections.deque = collections.deque(maxlen=256)

    # ---- estimates ----------------------------------------------------------------------------------------------
    def global_rate(self) -> float:
        s = self.settings
        return (self.accepted + s.prior * s.prior_rounds) / (self.accepted + self.rejected + s.prior_rounds)

    def rate(self, lv) -> float:
        s, g = self.settings, self.global_rate()
        return (lv.drafts_accepted + g * s.prior_rounds) / (lv.drafts_accepted + lv.drafts_rejected + s.prior_rounds)

    def cost(self, rows: int, k: int) -> float:
        fixed = self.settings.costs
        if fixed is not None:
            return float(fixed[k])
        if (rows, k) in self._cost:
            return self._cost[(rows, k)]
        plain = self._cost.get((rows, 0), 1.0)
        return plain * (1 + self.settings.draft_cost * k)

    def observe_rounds(self, lv, accepted: Sequence[int], cap: int, finished: bool = False) -> None:
        """One request's accepted drafts per round of a call that offered it `cap` drafts per round. `finished`:
        the request ended in this call, so its last round may have been cut by its token limit or a stop, not
        by a rejected draft: that round's accepted drafts count, its shortfall does not. (Counted as a
        rejection, every request's last round pulled the decayed global rate down just as a batch ended, and
        the next batch's requests started from it.)"""
        for i, a in enumerate(accepted):
            miss = 1 if a < cap and not (finished and i == len(accepted) - 1) else 0
            lv.drafts_accepted += a
            lv.drafts_rejected += miss
            d = self.settings.decay
            self.accepted, self.rejected = self.accepted * d + a, self.rejected * d + miss

    def observe_cost(self, rows: int, k: int, seconds: float, steps: int) -> None:
        if self.settings.costs is None and steps > 0:
            per = seconds / steps
            old = self._cost.get((rows, k))
            self._cost[(rows, k)] = per if old is None else 0.8 * old + 0.2 * per

    # ---- the choice ---------------------------------------------------------------------------------------------
    def choose(self, live: Sequence, rows: int, drain: bool = False) -> int:
        """The draft length for a call over `live` (speculative-capable rows) padded to `rows` rows. `drain`:
        no request waits for a slot, so these rows' batch ends with its slowest row (module docstring)."""
        unmeasured = self._unmeasured(rows)
        if unmeasured is not None:
            return self._chose(unmeasured)
        rates = [self.rate(lv) for lv in live]
        if drain:  # the tokens left over the time the slowest row needs for its share
            left = [max(lv.request.max_new_tokens - len(lv.result.tokens), 1) for lv in live]
            speed = {0: sum(left) / (max(left) * self.cost(rows, 0))}
            for k in self.ks:
                slowest = max(n / tokens_per_round(a, min(k, lv.k)) for n, a, lv in zip(left, rates, live))
                speed[k] = sum(left) / (slowest * self.cost(rows, k))
        else:  # expected tokens per second of each option
            speed = {0: len(live) / self.cost(rows, 0)}
            for k in self.ks:
                speed[k] = sum(tokens_per_round(a, min(k, lv.k)) for a, lv in zip(rates, live)) / self.cost(rows, k)
        best = max(speed, key=speed.get)
        last = self._last.get(rows)
        if last in speed and speed[best] < speed[last] * (1 + self.settings.switch_gain):
            best = last  # not enough better to switch (see the module docstring)
        self._last[rows] = best
        if best == 0:
            self._plain_streak += 1
            if self._plain_streak >= self.settings.probe_every:
                best = self.ks[0]
        self.trace.append((rows, len(live), {k: round(v, 1) for k, v in speed.items()}, best))
        return self._chose(best)

    def keeps(self, k: int, rows: int) -> bool:
        """Whether the next call at `rows` rows would likely run k drafts again: k is the bucket's last choice made
        on its merits, not an exploration or a probe (one-off calls). The engine starts a speculative call ahead
        of reading the last one only then (`run_ahead`): one started for a probe would be a second probe."""
        return self._last.get(rows) == k

    def _unmeasured(self, rows: int) -> int | None:
        """The first option not yet measured at `rows` (None: all are, or the costs are fixed)."""
        if self.settings.costs is not None:
            return None
        return next((k for k in (0,) + self.ks if (rows, k) not in self._cost), None)

    def _chose(self, k: int) -> int:
        if k:
            self._plain_streak = 0
        self.choices[k] = self.choices.get(k, 0) + 1
        return k


def policy(k: int, adaptive, draft_lengths=None) -> Fixed | AdaptivePolicy:
    """The engine's policy: `adaptive` False (fixed k; its programs' draft lengths `draft_lengths`, default
    (k,)), True (default `Adaptive`) or an `Adaptive`."""
    if adaptive and not k:
        raise ArgumentError("needs speculative=k > 0 (the most drafts per round)", name="adaptive", value=adaptive)
    if draft_lengths is not None:
        if adaptive:
            raise ArgumentError("is for a fixed draft length; an adaptive engine takes them as Adaptive.ks",
                                name="draft_lengths", value=draft_lengths)
        if not k:
            raise ArgumentError("needs speculative=k > 0 (the most drafts per round)", name="draft_lengths",
                                value=draft_lengths)
    if not adaptive:
        return Fixed(k, None if draft_lengths is None else checked_lengths(draft_lengths, k, "draft_lengths"))
    return AdaptivePolicy(adaptive if isinstance(adaptive, Adaptive) else Adaptive(), k)
