"""MTP speculative decoding (EAGLE-style chain) compiled as one program.

Flow per request (positions: the target has committed P tokens; `cur` is the sampled token at position P):

* prefill (host-driven chunks): target prefill -> sample t0 -> draft extend on the prefill path (row i takes the
  target's streams of token i and the id of token i+1, the last row takes t0);
* rounds inside one `lax.while_loop` (pools carried and donated):
  draft chain of k tokens (d1 from the last draft logits, d2..dk from k-1 draft decode steps on the draft's own
  streams) -> the target verifies [cur, d1..dk] at positions P..P+k in one step -> accept a drafts plus one
  target token -> roll both pools back by lengths (rejected rows are never read: validity is positional) ->
  draft extend on the decode path with the a+1 accepted rows and the target's streams.

Compiles once per (config, pool specs, k, batch bucket, rounds bucket, greedy/sampled).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.runtime import steps
from ds4jax.runtime.executable_cache import cached_jit
from ds4jax.generation.acceptance import accept_greedy, accept_sampled
from ds4jax.model.inputs import check_int
from ds4jax.generation.generate import SamplingParams, check_prompts, check_stop_ids, default_page_size, keep_rows, pool_dtype, prompt_chunks
from ds4jax.model.handle import Model
from ds4jax.runtime.kernels import Impl, resolve
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.pools import PoolBook, PoolError, zeros
from ds4jax.runtime.roles import Role
from ds4jax.generation.sampling import filter_logits, sample

MAX_STOP_IDS = 8


class LoopState(NamedTuple):
    target_pool: object
    draft_pool: object
    cur: jax.Array  # [b] token at the target's next position
    draft_logits: jax.Array  # [b, v] draft prediction for the position after `cur`
    draft_stream: jax.Array  # [b, m, e] draft streams of its last row (input of the next chain step)
    out: jax.Array  # [b, N] generated tokens (-1 = empty)
    n_out: jax.Array  # [b]
    done: jax.Array  # [b] bool
    accepted: jax.Array  # [b, max_rounds] accepted drafts per round (-1 = no round)
    rounds: jax.Array  # [] int32
    keys: jax.Array  # [b] typed PRNG keys


@dataclasses.dataclass(frozen=True)
class SpecResult:
    tokens: list[list[int]]
    accepted_per_round: list[list[int]]  # per request
    rounds: list[int]
    mean_accepted: list[float]  # mean accepted drafts per round
    mean_tokens_per_round: list[float]  # tokens emitted per round (accepted + 1 unless a stop cut the round)
    seconds: float
    tokens_per_second: float


def _rows(state_stream: jax.Array, index: jax.Array) -> jax.Array:
    """streams [b, c, m, e], index [b] -> [b, m, e]."""
    return jnp.take_along_axis(state_stream, index[:, None, None, None], axis=1)[:, 0]


def _round(params, st: LoopState, temperature, top_p, max_new, stop_ids, *, cfg, tspec, dspec, k, greedy, kernels):
    b = st.cur.shape[0]
    slots = jnp.arange(b, dtype=jnp.int32)
    active = ~st.done
    one = active.astype(jnp.int32)
    round_keys = jax.vmap(lambda kk: jax.random.fold_in(kk, st.rounds))(st.keys)
    chain_keys = jax.vmap(lambda kk: jax.random.split(kk, k + 1))(round_keys)  # [b, k+1]

    def propose(logits, j):
        if greedy:
            return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
        logp = filter_logits(logits, jnp.where(temperature > 0, temperature, 1.0), top_p)
        return jax.vmap(jax.random.categorical)(chain_keys[:, j], logp).astype(jnp.int32), logp

    # ---- draft chain: k proposals, k-1 draft decode steps, then roll the draft back ----------------------------
    draft_len = st.draft_pool.lengths
    d, logq = propose(st.draft_logits, 0)
    drafts, draft_logps = [d], [logq]
    dpool, stream = st.draft_pool, st.draft_stream
    for j in range(1, k):
        batch = steps.StepBatch(slots, d[:, None], one)
        out, dpool = steps._step(params, dpool, batch, stream[:, None], cfg=cfg, spec=dspec, role=Role.DRAFT,
                                 logits=steps.Logits.LAST, kernels=kernels)
        stream = out.streams[:, 0]
        d, logq = propose(out.logits, j)
        drafts.append(d)
        draft_logps.append(logq)
    dpool = dpool.replace(lengths=draft_len)
    drafts = jnp.stack(drafts, axis=1)  # [b, k]

    # ---- verify k+1 positions ---------------------------------------------------------------------------------
    target_len = st.target_pool.lengths
    tokens = jnp.concatenate([st.cur[:, None], drafts], axis=1)
    verify, tpool = steps._step(params, st.target_pool, steps.StepBatch(slots, tokens, one * (k + 1)), None,
                                cfg=cfg, spec=tspec, role=Role.TARGET, logits=steps.Logits.ALL, kernels=kernels)
    if greedy:
        acc = accept_greedy(drafts, verify.logits)
    else:
        t_logp = filter_logits(verify.logits, jnp.where(temperature > 0, temperature, 1.0)[:, None],
                               top_p[:, None])
        acc = accept_sampled(drafts, jnp.stack(draft_logps, axis=1), t_logp, chain_keys[:, k])
    a = jnp.where(active, acc.accepted, 0)
    tpool = tpool.replace(lengths=jnp.where(active, target_len + a + 1, target_len))

    # ---- draft extend with the accepted rows ------------------------------------------------------------------
    j = jnp.arange(k + 1, dtype=jnp.int32)[None, :]
    shifted = jnp.concatenate([drafts, jnp.zeros((b, 1), jnp.int32)], axis=1)
    ext_ids = jnp.where(j < a[:, None], shifted, acc.next_token[:, None])
    ext, dpool = steps._step(params, dpool, steps.StepBatch(slots, ext_ids, one * (a + 1)), verify.streams,
                             cfg=cfg, spec=dspec, role=Role.DRAFT, logits=steps.Logits.LAST, kernels=kernels)

    # ---- emit [d1..da, next], truncated at stop ids and the token budget ----------------------------------------
    emitted = ext_ids  # row j < a: d_{j+1}; row a: the target's token
    is_stop = jnp.any(emitted[..., None] == stop_ids[None, None, :], axis=-1) & (j <= a[:, None])
    first_stop = jnp.where(jnp.any(is_stop, axis=1), jnp.argmax(is_stop, axis=1) + 1, a + 1)
    count = jnp.where(active, jnp.minimum(jnp.minimum(a + 1, first_stop), max_new - st.n_out), 0)
    write = jnp.where(j < count[:, None], emitted, -1)
    out = jax.vmap(lambda o, w, n: jax.lax.dynamic_update_slice(o, w, (n,)))(st.out, write, st.n_out)
    n_out = st.n_out + count
    done = st.done | (n_out >= max_new) | (active & jnp.any(is_stop & (j < count[:, None]), axis=1))
    accepted = st.accepted.at[:, st.rounds].set(jnp.where(active, a, -1))
    return LoopState(tpool, dpool, acc.next_token, ext.logits, _rows(ext.streams, jnp.maximum(a, 0)), out, n_out,
                     done, accepted, st.rounds + 1, st.keys)


@cached_jit
@functools.partial(jax.jit, static_argnames=("cfg", "tspec", "dspec", "k", "greedy", "kernels"),
                   donate_argnames=("state",))
def speculative_loop(params, state: LoopState, temperature, top_p, max_new, stop_ids, *, cfg, tspec, dspec, k,
                     greedy, kernels: Impl = Impl.REFERENCE):
    """Run rounds until every request is done (or the rounds buffer is full). Returns the final LoopState.
    `kernels`: the steps' kernel implementation (`speculative_generate` passes the dispatcher's default)."""
    max_rounds = state.accepted.shape[1]

    def cond(st):
        return (st.rounds < max_rounds) & jnp.any(~st.done)

    body = functools.partial(_round, params, temperature=temperature, top_p=top_p, max_new=max_new,
                             stop_ids=stop_ids, cfg=cfg, tspec=tspec, dspec=dspec, k=k, greedy=greedy,
                             kernels=kernels)
    return jax.lax.while_loop(cond, lambda st: body(st), state)


def _bucket(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def specs_for(model: Model, *, max_slots: int, max_context: int, k: int, page_size: int | None = None):
    cfg = model.config
    page = page_size or default_page_size(cfg)
    common = dict(max_slots=max_slots, max_context=max_context, draft_tokens=k + 1, page_size=page,
                  dtype=pool_dtype(model))
    return (PoolSpec.for_role(cfg, role=Role.TARGET, **common), PoolSpec.for_role(cfg, role=Role.DRAFT, **common))


def speculative_generate(model: Model, prompt_ids, params: SamplingParams = SamplingParams(), *, k: int = 2,
                         prefill_chunk: int | None = None) -> SpecResult:
    """Speculative generation with the model's MTP block as the draft (k draft tokens per round)."""
    cfg = model.config
    if not model.has_mtp:
        raise PoolError("speculative decoding needs the MTP block; this checkpoint has no mtp.* tensors")
    check_int(k, "k", low=1)
    if len(params.stop_ids) > MAX_STOP_IDS:
        raise PoolError(f"at most {MAX_STOP_IDS} stop ids are supported, got {len(params.stop_ids)}")
    prompts = check_prompts(prompt_ids, cfg, params.max_new_tokens + k + 1)
    check_stop_ids(params.stop_ids, cfg.vocab_size)
    if prefill_chunk is not None:
        check_int(prefill_chunk, "prefill_chunk", low=1)
    rows = _bucket(len(prompts))
    max_new = params.max_new_tokens
    if max_new < 1:
        raise PoolError(f"max_new_tokens must be >= 1, got {max_new}")
    new_bucket = _bucket(max_new)
    longest = max(len(p) for p in prompts)
    # verification writes up to k+1 positions past the committed length
    max_context = _bucket(longest + new_bucket + k + 1)
    tspec, dspec = specs_for(model, max_slots=rows, max_context=max_context, k=k)
    tbook, dbook = PoolBook(tspec, cfg.vocab_size), PoolBook(dspec, cfg.vocab_size)
    for r in range(rows):
        tbook.admit(r)
        dbook.admit(r)
    padded = prompts + [[0]] * (rows - len(prompts))  # padding rows run one token and are done at once
    for r, p in enumerate(padded):
        tbook.reserve(r, len(p) + max_new + k + 1)
    tpool, dpool = tbook.sync(zeros(tspec)), dbook.sync(zeros(dspec))

    keys = jax.random.split(jax.random.key(params.seed), rows)
    temperature = jnp.full((rows,), params.temperature, jnp.float32)
    top_p = jnp.full((rows,), params.top_p, jnp.float32)
    start = time.perf_counter()
    t0, draft_logits, draft_stream, tpool, dpool = _prefill_both(
        model, tpool, dpool, tbook, dbook, tspec, dspec, padded, prefill_chunk or longest, keys, temperature, top_p)

    n_buf = new_bucket + k + 1
    out = jnp.full((rows, n_buf), -1, jnp.int32).at[:, 0].set(t0)
    stop = np.full((MAX_STOP_IDS,), -1, np.int32)
    stop[: len(params.stop_ids)] = params.stop_ids
    stop = jnp.asarray(stop)
    real = jnp.arange(rows) < len(prompts)
    done = ~real | (max_new <= 1) | jnp.any(t0[:, None] == stop[None, :], axis=1)
    state = LoopState(tpool, dpool, t0, draft_logits, draft_stream, out, jnp.ones((rows,), jnp.int32), done,
                      jnp.full((rows, new_bucket), -1, jnp.int32), jnp.zeros((), jnp.int32), keys)
    state = speculative_loop(model.params, state, temperature, top_p, jnp.int32(max_new), stop, cfg=cfg,
                             tspec=tspec, dspec=dspec, k=k, greedy=params.temperature == 0,
                             kernels=resolve(None))
    out = np.asarray(state.out)
    seconds = time.perf_counter() - start
    accepted = np.asarray(state.accepted)
    tokens = [[int(t) for t in out[r] if t >= 0] for r in range(len(prompts))]
    per_round = [[int(a) for a in accepted[r] if a >= 0] for r in range(len(prompts))]
    total = sum(len(t) for t in tokens)
    return SpecResult(
        tokens=tokens,
        accepted_per_round=per_round,
        rounds=[len(a) for a in per_round],
        mean_accepted=[float(np.mean(a)) if a else 0.0 for a in per_round],
        # tokens actually emitted per round (the first token comes from prefill; stop ids and the budget can cut
        # a round's accepted tokens short, so this is not mean(accepted) + 1)
        mean_tokens_per_round=[(len(t) - 1) / len(a) if a else 0.0 for t, a in zip(tokens, per_round)],
        seconds=seconds,
        tokens_per_second=total / seconds if seconds > 0 else float("inf"),
    )


def _prefill_both(model: Model, tpool, dpool, tbook, dbook, tspec, dspec, prompts: Sequence[Sequence[int]],
                  chunk: int, keys, temperature, top_p):
    """Chunked target prefill, first token t0, and the draft extend on the prefill path (chunk by chunk)."""
    cfg, prm = model.config, model.params
    rows = len(prompts)
    slots = list(range(rows))
    t0 = np.zeros(rows, np.int32)
    draft_logits = draft_stream = None
    for c in prompt_chunks(prompts, chunk):
        tbook.check_extend(slots, c.tokens, c.n)
        batch = steps.StepBatch(jnp.arange(rows, dtype=jnp.int32), jnp.asarray(c.tokens), jnp.asarray(c.n, jnp.int32))
        out, tpool = steps.prefill(prm, tpool, batch, cfg=cfg, spec=tspec, need_logits=bool(c.finishing))
        tbook.commit(slots, c.n)
        if c.finishing:
            first = np.asarray(sample(out.logits, keys, temperature, top_p))
            for r in c.finishing:
                t0[r] = first[r]
        # the draft row i takes the id of token i+1: the next prompt token, or t0 after the last one
        nxt = np.zeros_like(c.tokens)
        for r, q in enumerate(prompts):
            seq = list(q[c.start[r] + 1 : c.start[r] + c.n[r] + 1])
            if r in c.finishing:
                seq.append(int(t0[r]))
            nxt[r, : c.n[r]] = seq[: c.n[r]]
        dbook.check_extend(slots, nxt, c.n)
        dout, dpool = steps.draft_extend(prm, dpool, steps.StepBatch(batch.slots, jnp.asarray(nxt), batch.n_tokens),
                                         out.streams, cfg=cfg, spec=dspec)
        dbook.commit(slots, c.n)
        if c.finishing:
            last = jnp.maximum(jnp.asarray(c.n, jnp.int32) - 1, 0)
            draft_logits = keep_rows(draft_logits, dout.logits, c.finishing)
            draft_stream = keep_rows(draft_stream, _rows(dout.streams, last), c.finishing)
    return jnp.asarray(t0), draft_logits, draft_stream, tpool, dpool
