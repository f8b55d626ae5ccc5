"""The engine's compiled programs for prefill and plain decoding (speculative rounds: `spec_rounds.py`).

Every program takes the rows of one step as arrays (`Rows`): which slot each row serves and that request's
sampling state. Padding rows have ``active = False`` and distinct otherwise unused slots; they write nothing.
Token draws use ``fold_in(key(seed), index)`` so a request's tokens never depend on its batch or slot.

* `prefill_call`: one prompt chunk per row (target step, last-token logits), the first token sampled on device
  for rows whose prompt ends in the chunk, and, with a draft, the draft extend over the same rows (row i takes
  the id of token i+1: the next prompt token, or the sampled first token after the prompt's last one).
* `decode_loop`: up to M decode steps in one `lax.while_loop`; it returns early as soon as any row finishes
  (a stop id or its budget) so the host can free the slot and admit the next request.

Per-slot device state (`SlotState`) keeps what a request carries between calls: its last logits (prefix
snapshots) and, when speculating, the draft's last logits and stream.

With ``logprobs=N`` (static; 0 = off, and then the programs are exactly those without it) every program also
returns each emitted token's log-probability and the N most likely alternatives (`sampling.token_logprobs`), in
buffers shaped like its tokens.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from ds4jax.generation import requests
from ds4jax.generation.sampling import TokenLogprobs, sample, token_keys, token_logprobs
from ds4jax.runtime import steps
from ds4jax.runtime.data_parallel import rows_over_data
from ds4jax.runtime.roles import Role
from ds4jax.runtime.executable_cache import cached_jit

MAX_STOP_IDS = 8
MAX_FORCED = requests.MAX_FORCED  # most tokens the host can force into a row at once (requests.py says why there)
NO_LIMIT = 1 << 30


class Rows(NamedTuple):
    """Per-row request state of one call (host-built numpy arrays, all [B] unless noted)."""
    slots: jax.Array  # int32 pool slot
    active: jax.Array  # bool: a real request (padding rows are False)
    cur: jax.Array  # int32 last emitted token (the next step's input)
    n_out: jax.Array  # int32 tokens emitted so far
    max_new: jax.Array  # int32 token budget
    stop_ids: jax.Array  # [B, MAX_STOP_IDS] int32 (-1 = none)
    temperature: jax.Array  # float32 (0 = greedy)
    top_p: jax.Array  # float32
    top_k: jax.Array  # int32 (0 = off)
    key_data: jax.Array  # [B, 2] uint32 the request's seed key
    k_cap: jax.Array  # int32 speculative: most drafts a round may accept for this request
    limit: jax.Array  # int32 most tokens the row may emit in this call (a thinking budget's end; NO_LIMIT)
    forced: jax.Array  # [B, MAX_FORCED] int32 tokens the row must emit next, in order
    n_forced: jax.Array  # int32 how many of them
    # bool: the call returns after the step (round) in which this row finishes, so the host can give its slot to
    # a waiting request. False: a finished row just stops taking steps and the others go on to the call's end
    # (with nothing waiting, returning early only adds calls: each row finishing would end one)
    wake: jax.Array
    # [B, lookup.WINDOW] int32 each row's last tokens, the pending one last (-1 before the first): speculative calls
    # with lookup drafting only (`ds4jax.generation.lookup`); None everywhere else
    history: jax.Array | None = None


class SlotState(NamedTuple):
    last_logits: jax.Array  # [S, v] float32 logits after the slot's last prefilled token
    last_stream: jax.Array  # [S, m, e] the target's final streams of that token (the draft's input for it)
    draft_logits: jax.Array  # [S, v] draft prediction for the position after the slot's pending token
    draft_stream: jax.Array  # [S, m, e] draft streams of its last row


def is_stop(tokens: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """tokens [B, ...], stop_ids [B, S] -> bool [B, ...]."""
    extra = tokens.ndim - 1
    stops = stop_ids.reshape(stop_ids.shape[:1] + (1,) * extra + stop_ids.shape[1:])
    return jnp.any((tokens[..., None] == stops) & (stops >= 0), axis=-1)


def set_rows(table: jax.Array, slots: jax.Array, where: jax.Array, values: jax.Array) -> jax.Array:
    """table[slots] = values on the rows where `where` [B] holds; the other rows keep their entries."""
    where = where.reshape(where.shape + (1,) * (values.ndim - 1))
    return table.at[slots].set(jnp.where(where, values.astype(table.dtype), table[slots]))


def logprob_buffers(shape: tuple[int, ...], n: int) -> TokenLogprobs | None:
    """Empty per-token log-probability buffers for `shape` tokens (None when `n` is 0: logprobs off)."""
    if not n:
        return None
    return TokenLogprobs(jnp.zeros(shape, jnp.float32), jnp.zeros(shape + (n,), jnp.int32),
                         jnp.zeros(shape + (n,), jnp.float32))


def first_logprobs(logits, first, n: int) -> TokenLogprobs | None:
    """The first tokens' log-probabilities [B] (None when logprobs are off)."""
    return token_logprobs(logits, first, n) if n else None


_PREFILL_STATIC = ("cfg", "tspec", "dspec", "kernels", "logprobs")


@cached_jit
@functools.partial(jax.jit, static_argnames=_PREFILL_STATIC, donate_argnames=("tpool", "dpool", "slot_state"))
def prefill_call(params, tpool, dpool, slot_state: SlotState, rows: Rows, token_ids, n_tokens, next_ids, finishing,
                 *, cfg, tspec, dspec, kernels, logprobs: int = 0):
    """One prefill chunk. Returns (first tokens [B] (valid where `finishing`), tpool, dpool, slot_state, their
    `TokenLogprobs` [B] or None).

    token_ids / next_ids [B, C] (next_ids: the id of token i+1 for the draft; the last one of a finishing row
    is replaced by the sampled first token); n_tokens [B]; finishing [B] bool."""
    batch = steps.StepBatch(rows.slots, token_ids, n_tokens)
    out, tpool = steps.step(params, tpool, batch, None, cfg=cfg, spec=tspec, role=Role.TARGET,
                             logits=steps.Logits.LAST, kernels=kernels)
    first, slot_state = first_tokens(out, slot_state, rows, n_tokens)
    if dspec is not None:
        dpool, slot_state = draft_prefill(params, dpool, slot_state, rows, out.streams, first, token_ids, n_tokens,
                                          next_ids, finishing, cfg=cfg, dspec=dspec, kernels=kernels)
    return (flag_nonfinite(first, out.logits), tpool, dpool, rows_over_data(slot_state),
            first_logprobs(out.logits, first, logprobs))


def draft_prefill(params, dpool, slot_state: SlotState, rows: Rows, streams, first, token_ids, n_tokens, next_ids,
                  finishing, *, cfg, dspec, kernels):
    """The draft extend over a prefill chunk's rows, on the target's final `streams` of the chunk (row i takes
    the id of token i+1; a finishing row's last one is its sampled `first` token); the slot state keeps the
    draft's logits and stream of finishing rows. Returns (dpool, slot_state)."""
    last = jnp.maximum(n_tokens - 1, 0)
    col = jnp.arange(token_ids.shape[1], dtype=jnp.int32)[None, :]
    ids = jnp.where(finishing[:, None] & (col == last[:, None]), first[:, None], next_ids)
    dout, dpool = steps.step(params, dpool, steps.StepBatch(rows.slots, ids, n_tokens), streams, cfg=cfg,
                              spec=dspec, role=Role.DRAFT, logits=steps.Logits.LAST, kernels=kernels)
    stream = jnp.take_along_axis(dout.streams, last[:, None, None, None], axis=1)[:, 0]
    return dpool, slot_state._replace(
        draft_logits=set_rows(slot_state.draft_logits, rows.slots, finishing, dout.logits),
        draft_stream=set_rows(slot_state.draft_stream, rows.slots, finishing, stream))


def first_tokens(out: steps.StepOutput, slot_state: SlotState, rows: Rows, n_tokens):
    """After a prefill chunk's target step: each row's first token (sampled from its last-token logits; valid
    where the prompt ends in the chunk) and the slot state with those logits and streams on the rows that wrote
    (a layer split's last stage runs this too, `stage_programs`)."""
    keys = lambda: token_keys(rows.key_data, jnp.zeros_like(rows.n_out))  # noqa: E731  (derived if a row samples)
    wrote = n_tokens > 0
    first = sample(out.logits, keys, rows.temperature, rows.top_p, rows.top_k, live=wrote)
    last = jnp.maximum(n_tokens - 1, 0)
    last_stream = jnp.take_along_axis(out.streams, last[:, None, None, None], axis=1)[:, 0]
    return first, slot_state._replace(last_logits=set_rows(slot_state.last_logits, rows.slots, wrote, out.logits),
                                      last_stream=set_rows(slot_state.last_stream, rows.slots, wrote, last_stream))


def flag_nonfinite(first, logits):
    """-1 where a row's logits are not finite (the numerics guard)."""
    return jnp.where(jnp.isfinite(logits).all(axis=-1), first, -1)


@cached_jit
@functools.partial(jax.jit, static_argnames=("cfg", "dspec", "kernels", "logprobs"),
                   donate_argnames=("dpool", "slot_state"))
def restore_call(params, dpool, slot_state: SlotState, rows: Rows, sampled, next_ids, *, cfg, dspec, kernels,
                 logprobs: int = 0):
    """After a prefix snapshot was written into a slot (target at length L, draft at L-1): the first token is
    sampled from the saved logits (rows with `sampled`: the prompt is exactly the prefix), and the draft runs its
    pending row L-1 (target stream of L-1, id of token L: that first token, or next_ids = the prompt's token L).
    Returns (first tokens [B], dpool, slot_state, their `TokenLogprobs` [B] or None)."""
    logits = slot_state.last_logits[rows.slots]
    keys = lambda: token_keys(rows.key_data, jnp.zeros_like(rows.n_out))  # noqa: E731  (derived if a row samples)
    first = sample(logits, keys, rows.temperature, rows.top_p, rows.top_k, live=rows.active)
    if dspec is not None:
        ids = jnp.where(sampled, first, next_ids)[:, None]
        stream = slot_state.last_stream[rows.slots][:, None]
        dout, dpool = steps.step(params, dpool, steps.StepBatch(rows.slots, ids, rows.active.astype(jnp.int32)),
                                  stream, cfg=cfg, spec=dspec, role=Role.DRAFT, logits=steps.Logits.LAST,
                                  kernels=kernels)
        keep = rows.active & sampled
        slot_state = slot_state._replace(
            draft_logits=set_rows(slot_state.draft_logits, rows.slots, keep, dout.logits),
            draft_stream=set_rows(slot_state.draft_stream, rows.slots, keep, dout.streams[:, 0]))
    return first, dpool, rows_over_data(slot_state), first_logprobs(logits, first, logprobs)


class DecodeOut(NamedTuple):
    tokens: jax.Array  # [B, M] emitted tokens (-1 = none)
    n_out: jax.Array  # [B] tokens emitted so far (after this call)
    done: jax.Array  # [B] finished (stop id or budget)
    steps: jax.Array  # [] steps run
    bad: jax.Array  # [B] index of the first token whose logits were not finite (-1 = none)
    logprobs: TokenLogprobs | None = None  # [B, M] of the tokens (with `logprobs` on)
    # the next call's inputs and the pool's lengths after this call, as outputs, so the engine can start the next
    # call before it reads this one (the pool itself is donated to that call); None on a layer split
    cur: jax.Array | None = None  # [B] each row's last token
    live: jax.Array | None = None  # [B] ~done: the rows the next call continues
    lengths: jax.Array | None = None  # [S] the pool's lengths after the call


@cached_jit
@functools.partial(jax.jit, static_argnames=("cfg", "spec", "kernels", "max_steps", "logprobs"),
                   donate_argnames=("pool",))
def decode_loop(params, pool, rows: Rows, *, cfg, spec, kernels, max_steps: int, logprobs: int = 0):
    """Up to `max_steps` decode steps; stops after the step in which any active row finishes."""
    b = rows.slots.shape[0]
    buf = jnp.full((b, max_steps), -1, jnp.int32)

    def cond(c):
        _, _, _, done, _, i, finished, _, _ = c
        return (i < max_steps) & ~finished & jnp.any(~done)

    def body(c):
        pool, cur, n_out, done, buf, i, _, bad, lp = c
        live = ~done
        batch = steps.StepBatch(rows.slots, cur[:, None], live.astype(jnp.int32))
        out, pool = steps.step(params, pool, batch, None, cfg=cfg, spec=spec, role=Role.TARGET,
                                logits=steps.Logits.LAST, kernels=kernels)
        new = decode_update(rows, out.logits, live, cur, n_out, done, buf, i, bad)
        if lp is not None:  # column i: the token this step emitted (rows that did not run leave junk, never read)
            lp = jax.tree.map(lambda a, x: a.at[:, i].set(x), lp, token_logprobs(out.logits, new[0], logprobs))
        return (pool,) + new + (lp,)

    init = (pool, rows.cur, rows.n_out, decode_done0(rows), buf, jnp.zeros((), jnp.int32), jnp.zeros((), bool),
            jnp.full((b,), -1, jnp.int32), logprob_buffers((b, max_steps), logprobs))
    pool, cur, n_out, done, buf, i, _, bad, lp = jax.lax.while_loop(cond, body, init)
    return DecodeOut(buf, n_out, done, i, bad, lp, cur, ~done, pool.lengths), pool


def decode_done0(rows: Rows):
    """Rows that take no decode step in this call (padding, out of budget, paused)."""
    return ~rows.active | (rows.n_out >= rows.max_new) | (rows.limit <= 0)


def decode_update(rows: Rows, logits, live, cur, n_out, done, buf, i, bad):
    """One decode step after its logits: sample (or take a forced token), record it, and mark rows that finished
    (a stop id or max_new) or paused (the call's limit). Returns (tok, n_out, done, buf, i + 1, any finished or
    paused, bad); live = ~done (the rows the step ran). `decode_loop`'s body, and a layer split's last stage
    (`stage_programs`)."""
    b = rows.slots.shape[0]
    tok = sample(logits, lambda: token_keys(rows.key_data, n_out), rows.temperature, rows.top_p, rows.top_k, live=live)
    bad = jnp.where(live & (bad < 0) & ~jnp.isfinite(logits).all(axis=-1), n_out, bad)
    fp = i  # forced tokens are consumed one per step from the call's start
    forced = jnp.take_along_axis(rows.forced, jnp.minimum(fp, MAX_FORCED - 1)[None, None].repeat(b, 0), 1)[:, 0]
    tok = jnp.where(fp < rows.n_forced, forced, tok)
    tok = jnp.where(live, tok, cur)
    buf = buf.at[:, i].set(jnp.where(live, tok, -1))
    n_out = n_out + live.astype(jnp.int32)
    finished = live & (is_stop(tok, rows.stop_ids) | (n_out >= rows.max_new))
    paused = live & (n_out - rows.n_out >= rows.limit)  # the host must look at it (a budget's end)
    return tok, n_out, done | finished | paused, buf, i + 1, jnp.any((finished & rows.wake) | paused), bad
