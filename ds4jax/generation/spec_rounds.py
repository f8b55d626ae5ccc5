"""Speculative rounds (MTP draft, EAGLE-style chain) as one compiled program: up to M rounds per host call.

Positions: the target has committed P tokens of a request; `cur` is its pending token at position P. A round:
draft chain of k tokens (d1 from the slot's saved draft logits, d2..dk from k-1 draft decode steps on the
draft's own streams) -> the target verifies [cur, d1..dk] at P..P+k in one step -> accept a drafts plus one
target token (exact match when greedy, rejection sampling otherwise; per row) -> roll both pools back by lengths
(rejected rows are never read: validity is positional) -> draft extend with the a+1 accepted rows and the
target's streams. `speculative_loop` runs rounds until M are done or any row finishes, then returns so the host
can stream tokens, free slots and admit requests. With lookup drafting (`lookup`) a greedy row whose history
repeats drafts from it instead, and a round whose rows all did runs no draft step.

Every step goes through `steps.step` with the engine's `kernels` choice (target and draft alike).
Compiles once per (config, pool specs, k, row bucket, M, kernels, logprobs, lookup). With ``logprobs=N`` the
emitted tokens' log-probabilities come from the verify logits that chose them (position j of the round for its j-th
token), so they are the target's, exactly as plain decoding would report them.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ds4jax.generation import lookup as lookup_mod
from ds4jax.generation.acceptance import accept_choices, accept_sampled
from ds4jax.generation.loops import MAX_FORCED, Rows, SlotState, is_stop, logprob_buffers, set_rows
from ds4jax.generation.sampling import (TokenLogprobs, branch_on_greedy, cheaper_when, filter_logits,
                                       none_sample, token_keys, token_logprobs)
from ds4jax.runtime import steps
from ds4jax.runtime.data_parallel import rows_over_data
from ds4jax.runtime.roles import Role
from ds4jax.runtime.executable_cache import cached_jit

# op scopes of a round's two phases outside the steps (profiles group kernels by them; neither may contain "draft"
# or "layer", which name the steps' own groups in scripts/spec_anatomy.py)
PROPOSE_SCOPE = "round_propose"  # the draft chain: proposals (argmax / draws), lookup, the draft pool's roll-back
ACCEPT_SCOPE = "round_accept"  # acceptance, the draft extend's inputs, emitting, the carry's bookkeeping


class SpecOut(NamedTuple):
    tokens: jax.Array  # [B, M * (k+1)] emitted tokens in order (-1 = none)
    n_out: jax.Array  # [B] tokens emitted so far (after this call)
    done: jax.Array  # [B]
    accepted: jax.Array  # [B, M] accepted drafts per round (-1 = no round for this row)
    rounds: jax.Array  # [] rounds run
    bad: jax.Array  # [B] index of the first emitted token whose target logits were not finite (-1 = none)
    logprobs: TokenLogprobs | None = None  # [B, M * (k+1)] of the tokens (with `logprobs` on)
    # the next call's inputs and the target pool's lengths after this call, as outputs, so the engine can start
    # the next call before it reads this one (`run_ahead`; the pools go to that call); None on a layer split
    cur: jax.Array | None = None  # [B] each row's last token
    live: jax.Array | None = None  # [B] ~done: the rows the next call continues
    lengths: jax.Array | None = None  # [S] the target pool's lengths after the call
    # with lookup drafting (`lookup`): each row's token history after the call (the next call's `Rows.history`),
    # the rounds each row drafted by lookup, and the rounds that skipped the MTP chain's steps
    history: jax.Array | None = None  # [B, WINDOW]
    looked: jax.Array | None = None  # [B]
    skipped: jax.Array | None = None  # []


class RoundCarry(NamedTuple):
    """A call's state between rounds (the `while_loop` carry; a layer split keeps it on its last stage, with
    ``tpool`` None: its target pools live on every stage)."""
    tpool: object
    dpool: object
    cur: jax.Array
    draft_logits: jax.Array
    draft_stream: jax.Array
    n_out: jax.Array
    done: jax.Array
    buf: jax.Array
    n_buf: jax.Array
    accepted: jax.Array
    r: jax.Array
    finished: jax.Array
    fp: jax.Array  # [B] forced tokens consumed
    bad: jax.Array  # [B] see SpecOut.bad
    lp: TokenLogprobs | None = None  # see SpecOut.logprobs (None: logprobs off)
    hist: jax.Array | None = None  # [B, WINDOW] token history, the pending token last (None: lookup off)
    looked: jax.Array | None = None  # see SpecOut.looked
    skipped: jax.Array | None = None  # see SpecOut.skipped


def _rows(streams: jax.Array, index: jax.Array) -> jax.Array:
    """streams [b, c, m, e], index [b] -> [b, m, e]."""
    return jnp.take_along_axis(streams, index[:, None, None, None], axis=1)[:, 0]


class Chain(NamedTuple):
    """A round's draft chain, handed from drafting to verification and settling."""
    drafts: jax.Array  # [B, k] proposed tokens (forced tokens first)
    draft_logps: jax.Array  # [B, k, v] the filtered draft log-probabilities they were drawn from
    pending: jax.Array  # [B] forced tokens still to emit
    n_force: jax.Array  # [B] forced tokens in this round's drafts
    greedy_only: jax.Array  # [] no running row samples: drafts and acceptance skip the sampling machinery
    looked: jax.Array | None = None  # [B] rows whose drafts came from their history (lookup on)
    skipped: jax.Array | None = None  # [] whether the MTP chain's draft steps were skipped (lookup on)

    def verify_batch(self, c: RoundCarry, rows: Rows) -> steps.StepBatch:
        """The target step that verifies the chain: [cur, d1..dk] at positions P..P+k of the active rows."""
        k = self.drafts.shape[1]
        tokens = jnp.concatenate([c.cur[:, None], self.drafts], axis=1)
        return steps.StepBatch(rows.slots, tokens, (~c.done).astype(jnp.int32) * (k + 1))


def _forced_at(rows: Rows, fp, j):
    idx = jnp.minimum(fp + j, MAX_FORCED - 1)
    return jnp.take_along_axis(rows.forced, idx[:, None], axis=1)[:, 0]


def round_key(rows: Rows, n_out, k: int, j: int) -> jax.Array:
    """[B] typed keys of a round's position j (j < k: draft j's draw; k: the acceptance draws), from each request's
    seed and tokens emitted so far. Derived inside the branches a sampling row takes (each proposal's draw, the
    acceptance), so an all-greedy round derives none and takes no conditional for them: a conditional is a node
    of its own in the loop's command-buffer graph (docs/benchmarks/spec_anatomy_h100_dab9779/)."""
    return jax.vmap(lambda kk: jax.random.split(kk, k + 1)[j])(token_keys(rows.key_data, n_out))


def draft_chain(params, c: RoundCarry, rows: Rows, *, cfg, dspec, k, kernels, lookup: int = 0) -> tuple[Chain, object]:
    """k proposals from the draft (d1 from the slot's saved draft logits, d2..dk from k-1 draft decode steps on
    the draft's own streams), then the draft pool rolled back. With `lookup` (the shortest suffix that may match,
    0 = off) a greedy row whose history repeats its last tokens takes the tokens that followed instead
    (`ds4jax.generation.lookup`), and when every running row did, the draft steps do not run. Returns (Chain,
    draft pool)."""
    slots = rows.slots
    one = (~c.done).astype(jnp.int32)
    greedy = rows.temperature <= 0
    safe_t = jnp.where(greedy, 1.0, rows.temperature)
    # forced tokens (a thinking budget's close ids) replace the first drafts and are accepted whatever the
    # target says; the token after them is the target's (greedy: its argmax; sampled: drawn from p itself)
    pending = jnp.maximum(rows.n_forced - c.fp, 0)  # [b]
    greedy_only = none_sample(rows.temperature, ~c.done)

    def propose(logits, j):
        top = jnp.argmax(logits, axis=-1).astype(jnp.int32)

        def drawn():
            logp = filter_logits(logits, safe_t, rows.top_p, rows.top_k)
            tok = jax.vmap(jax.random.categorical)(round_key(rows, c.n_out, k, j), logp).astype(jnp.int32)
            return jnp.where(greedy, top, tok), logp

        # all greedy: the log-probabilities are never read (acceptance takes the same branch), zeros stand in
        tok, logp = cheaper_when(greedy_only, lambda: (top, jnp.zeros(logits.shape, jnp.float32)), drawn)
        return jnp.where(j < pending, _forced_at(rows, c.fp, j), tok), logp

    def mtp_chain(dpool, stream):
        d, logq = propose(c.draft_logits, 0)
        drafts, draft_logps = [d], [logq]
        for j in range(1, k):
            out, dpool = steps.step(params, dpool, steps.StepBatch(slots, d[:, None], one), stream[:, None],
                                     cfg=cfg, spec=dspec, role=Role.DRAFT, logits=steps.Logits.LAST, kernels=kernels)
            stream = out.streams[:, 0]
            d, logq = propose(out.logits, j)
            drafts.append(d)
            draft_logps.append(logq)
        return jnp.stack(drafts, axis=1), jnp.stack(draft_logps, axis=1), dpool

    draft_len = c.dpool.lengths
    looked = skipped = None
    if lookup:
        found_drafts, found = lookup_mod.propose(c.hist, k, lookup)
        # greedy rows only (acceptance by exact match: any draft is exact), and not while forced tokens are due
        looked = found & greedy & (pending == 0) & ~c.done
        skipped = jnp.all(looked | c.done)

        def without_chain():
            return found_drafts, jnp.zeros(c.draft_logits.shape[:1] + (k,) + c.draft_logits.shape[1:]), c.dpool

        # where branching is not free (`cheaper_when`: a host round trip per round), the chain runs anyway and
        # the looked-up drafts replace its proposals; its draft-pool writes past the rolled-back lengths are never
        # read, and no row it drafted for uses its log-probabilities (greedy rows accept by match)
        drafts, draft_logps, dpool = cheaper_when(skipped, without_chain,
                                                  lambda: mtp_chain(c.dpool, c.draft_stream))
        drafts = jnp.where(looked[:, None], found_drafts, drafts)
        skipped = skipped & branch_on_greedy()  # what the stats count: rounds that really ran no draft step
    else:
        drafts, draft_logps, dpool = mtp_chain(c.dpool, c.draft_stream)
    chain = Chain(drafts, draft_logps, pending, jnp.minimum(pending, k), greedy_only, looked, skipped)
    return chain, dpool.replace(lengths=draft_len)


def settle(params, c: RoundCarry, rows: Rows, chain: Chain, verify: steps.StepOutput, target_len, *, cfg, dspec, k,
           kernels) -> tuple[RoundCarry, jax.Array]:
    """After the target verified the chain (`verify`: all k+1 logits and streams; `target_len`: the target's
    lengths before it): accept a drafts plus one target token per row (exact match when greedy, rejection
    sampling otherwise), draft extend with the a+1 accepted rows and the target's streams, emit.
    Returns (the next carry, its `tpool` field untouched; the target's lengths after the round)."""
    b = rows.slots.shape[0]
    slots = rows.slots
    active = ~c.done
    one = active.astype(jnp.int32)
    greedy = rows.temperature <= 0
    safe_t = jnp.where(greedy, 1.0, rows.temperature)
    drafts, pending, n_force = chain.drafts, chain.pending, chain.n_force
    # a budget's end: emit at most `limit` tokens this call, so accept at most remaining - 1 drafts this round
    remaining = rows.limit - (c.n_out - rows.n_out)
    cap = jnp.where(pending > 0, n_force, jnp.minimum(rows.k_cap, jnp.maximum(remaining - 1, 0)))
    choice = jnp.argmax(verify.logits, axis=-1).astype(jnp.int32)  # [b, k+1] the target's greedy tokens
    by_match = accept_choices(drafts, choice, cap)
    # forced rows: exactly n_force drafts accepted; the token after them from the target at that position
    at = lambda x: jnp.take_along_axis(x, n_force[:, None, None], axis=1)[:, 0]
    greedy_after = jnp.take_along_axis(choice, n_force[:, None], axis=1)[:, 0]

    def sampled():
        t_logp = filter_logits(verify.logits, safe_t[:, None], rows.top_p[:, None], rows.top_k[:, None])
        key = round_key(rows, c.n_out, k, k)  # the acceptance draws' key
        by_sample = accept_sampled(drafts, chain.draft_logps, t_logp, key, cap)
        after = jax.vmap(jax.random.categorical)(key, at(t_logp)).astype(jnp.int32)
        return (jnp.where(greedy, by_match.accepted, by_sample.accepted),
                jnp.where(greedy, by_match.next_token, by_sample.next_token), jnp.where(greedy, greedy_after, after))

    a, nxt, after = cheaper_when(chain.greedy_only, lambda: (by_match.accepted, by_match.next_token, greedy_after),
                                 sampled)
    a = jnp.where(pending > 0, n_force, a)
    nxt = jnp.where(pending > k, _forced_at(rows, c.fp, k), jnp.where(pending > 0, after, nxt))
    a = jnp.where(active, a, 0)
    before = target_len[slots]
    # roll the target back to the accepted rows (rejected rows are never read: validity is positional)
    lengths = target_len.at[slots].set(jnp.where(active, before + a + 1, before))

    # ---- draft extend with the accepted rows ------------------------------------------------------------------
    j = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    shifted = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    ext_ids = jnp.where(j < a[:, None], shifted, nxt[:, None])
    ext, dpool = steps.step(params, c.dpool, steps.StepBatch(slots, ext_ids, one * (a + 1)), verify.streams,
                             cfg=cfg, spec=dspec, role=Role.DRAFT, logits=steps.Logits.LAST, kernels=kernels)

    # ---- emit [d1..da, next], truncated at stop ids and the token budget ----------------------------------------
    emitted = ext_ids  # row j < a: d_{j+1}; row a: the target's token
    stop_hit = is_stop(emitted, rows.stop_ids) & (j <= a[:, None])
    first_stop = jnp.where(jnp.any(stop_hit, axis=1), jnp.argmax(stop_hit, axis=1) + 1, a + 1)
    count = jnp.where(active, jnp.minimum(jnp.minimum(a + 1, first_stop), rows.max_new - c.n_out), 0)
    write = jnp.where(j < count[:, None], emitted, -1)
    put = jax.vmap(lambda o, w, n: jax.lax.dynamic_update_slice(o, w, (n,) + (0,) * (w.ndim - 1)))
    buf = put(c.buf, write, c.n_buf)
    lp = c.lp
    if lp is not None:  # entries past `count` are junk the next round overwrites (and the host never reads)
        n = lp.top.shape[-1]
        lp = jax.tree.map(lambda o, w: put(o, w, c.n_buf), lp, token_logprobs(verify.logits, emitted, n))
    n_out = c.n_out + count
    # numerics guard: the verify logits that chose this round's tokens (positions 0..a) must be finite
    broken = ~jnp.isfinite(verify.logits).all(axis=-1) & (j <= a[:, None])  # [b, k+1]
    bad = jnp.where(active & (c.bad < 0) & broken.any(axis=1), c.n_out + jnp.argmax(broken, axis=1), c.bad)
    finished = active & ((n_out >= rows.max_new) | jnp.any(stop_hit & (j < count[:, None]), axis=1))
    paused = active & (n_out - rows.n_out >= rows.limit)
    now_done = finished | paused
    accepted = c.accepted.at[:, c.r].set(jnp.where(active, a, -1))
    draft_logits = jnp.where(active[:, None], ext.logits, c.draft_logits)
    draft_stream = jnp.where(active[:, None, None], _rows(ext.streams, jnp.maximum(a, 0)).astype(c.draft_stream.dtype),
                             c.draft_stream)
    lookup_state = {}
    if c.hist is not None:  # the history ends with the new pending token again
        lookup_state = dict(hist=lookup_mod.append(c.hist, emitted, count),
                            looked=c.looked + chain.looked.astype(jnp.int32),
                            skipped=c.skipped + chain.skipped.astype(jnp.int32))
    nxt_carry = RoundCarry(c.tpool, dpool, jnp.where(active, nxt, c.cur), draft_logits, draft_stream, n_out,
                           c.done | now_done, buf, c.n_buf + count, accepted, c.r + 1,
                           jnp.any((finished & rows.wake) | paused),
                           c.fp + jnp.where(active, jnp.minimum(pending, a + 1), 0), bad, lp, **lookup_state)
    return nxt_carry, lengths


def _round(params, c: RoundCarry, rows: Rows, *, cfg, tspec, dspec, k, kernels, lookup: int = 0) -> RoundCarry:
    """One round on one program: draft chain -> verify k+1 positions -> settle. The chain and the settling run
    under scopes of their own (``round_propose``, ``round_accept``) so that a profile tells their kernels apart
    from the loop's (scripts/spec_anatomy.py groups by them; the draft steps inside stay ``draft_step``)."""
    with jax.named_scope(PROPOSE_SCOPE):
        chain, dpool = draft_chain(params, c, rows, cfg=cfg, dspec=dspec, k=k, kernels=kernels, lookup=lookup)
    c = c._replace(dpool=dpool)
    target_len = c.tpool.lengths
    verify, tpool = steps.step(params, c.tpool, chain.verify_batch(c, rows), None, cfg=cfg, spec=tspec,
                                role=Role.TARGET, logits=steps.Logits.ALL, kernels=kernels)
    with jax.named_scope(ACCEPT_SCOPE):
        c, lengths = settle(params, c, rows, chain, verify, target_len, cfg=cfg, dspec=dspec, k=k, kernels=kernels)
    return c._replace(tpool=tpool.replace(lengths=lengths))


def initial_carry(tpool, dpool, slot_state: SlotState, rows: Rows, *, k: int, max_rounds: int,
                  logprobs: int = 0, lookup: int = 0) -> RoundCarry:
    """The state before a call's first round (rows done from the start never run)."""
    b = rows.slots.shape[0]
    done0 = ~rows.active | (rows.n_out >= rows.max_new) | (rows.limit <= 0)
    return RoundCarry(tpool, dpool, rows.cur, slot_state.draft_logits[rows.slots], slot_state.draft_stream[rows.slots],
                  rows.n_out, done0, jnp.full((b, max_rounds * (k + 1)), -1, jnp.int32), jnp.zeros((b,), jnp.int32),
                  jnp.full((b, max_rounds), -1, jnp.int32), jnp.zeros((), jnp.int32), jnp.zeros((), bool),
                  jnp.zeros((b,), jnp.int32), jnp.full((b,), -1, jnp.int32),
                  logprob_buffers((b, max_rounds * (k + 1)), logprobs),
                  *((rows.history, jnp.zeros((b,), jnp.int32), jnp.zeros((), jnp.int32)) if lookup else ()))


def finish(c: RoundCarry, slot_state: SlotState, rows: Rows):
    """A call's outputs after its last round: (SpecOut, slot_state with the draft's last logits and streams)."""
    slot_state = slot_state._replace(
        draft_logits=set_rows(slot_state.draft_logits, rows.slots, rows.active, c.draft_logits),
        draft_stream=set_rows(slot_state.draft_stream, rows.slots, rows.active, c.draft_stream))
    ahead = () if c.tpool is None else (c.cur, ~c.done, c.tpool.lengths)  # a layer split keeps its pools apart
    out = SpecOut(c.buf, c.n_out, c.done, c.accepted, c.r, c.bad, c.lp, *ahead)
    return out._replace(history=c.hist, looked=c.looked, skipped=c.skipped), rows_over_data(slot_state)


@cached_jit
@functools.partial(jax.jit, static_argnames=("cfg", "tspec", "dspec", "k", "kernels", "max_rounds", "logprobs",
                                             "lookup"),
                   donate_argnames=("tpool", "dpool", "slot_state"))
def speculative_loop(params, tpool, dpool, slot_state: SlotState, rows: Rows, *, cfg, tspec, dspec, k, kernels,
                     max_rounds: int, logprobs: int = 0, lookup: int = 0):
    """Up to `max_rounds` rounds; returns after the round in which any row finishes. `lookup` > 0: drafts from
    each row's history where it repeats itself (`rows.history` [B, lookup.WINDOW]; `ds4jax.generation.lookup`).

    Returns (SpecOut, tpool, dpool, slot_state)."""
    if lookup and rows.history is None:
        raise ValueError("lookup drafting needs each row's token history (Rows.history)")
    init = initial_carry(tpool, dpool, slot_state, rows, k=k, max_rounds=max_rounds, logprobs=logprobs,
                         lookup=lookup)

    def cond(c):
        return (c.r < max_rounds) & ~c.finished & jnp.any(~c.done)

    body = functools.partial(_round, params, rows=rows, cfg=cfg, tspec=tspec, dspec=dspec, k=k, kernels=kernels,
                             lookup=lookup)
    c = jax.lax.while_loop(cond, body, init)
    out, slot_state = finish(c, slot_state, rows)
    return out, c.tpool, c.dpool, slot_state
