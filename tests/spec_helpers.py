"""Helpers for the speculative-decoding tests: test models whose MTP draft agrees with the target often (but not
always), capture of the speculative loop's final state, a plain-decoding pool reference, pool comparison by
position, compile counting and chi-square utilities."""

from __future__ import annotations

import contextlib
import functools
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from scipy import stats

import ds4jax
from ds4jax.model import params as P
from ds4jax.model import forward as network
from ds4jax.generation import spec_rounds
from ds4jax.runtime import steps
from ds4jax.model.config import AttentionType, Config, MlpType
from ds4jax.generation.generate import default_page_size, pool_dtype
from ds4jax.model.handle import Model
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.pools import PoolBook, zeros
from ds4jax.runtime.roles import Role


def tiny3(**overrides) -> Config:
    """3-layer tiny config (SWA, CSA ratio 4, HCA ratio 8, window 8): every attention kind, cheaper compiles."""
    base = dict(num_layers=3, attention_types=(AttentionType.SLIDING, AttentionType.CSA, AttentionType.HCA),
                mlp_types=(MlpType.HASH, MlpType.TOPK, MlpType.TOPK))
    base.update(overrides)
    return ds4jax.tiny(**base)


def agreeable_model(cfg: Config, *, seed: int = 0, damp: float = 0.3, head_scale: float = 1.0,
                    stream_gain: float = 1.0) -> Model:
    """Random weights reshaped so the MTP draft agrees with the target often but not always.

    Random weights give ~0 acceptance (the draft is an unrelated function). Both networks see the embedding of the
    token whose successor they predict (the target as its input token, the draft through ``e_proj``), so:

    * the draft's ``e_proj`` is the identity and its ``hc_head`` / final ``norm`` are the target's: the two
      share a bigram-like skip path embed -> hc_head -> norm -> head;
    * every block's output projections (attention ``wo_b``, expert and shared ``w2``; target layers and the
      MTP block) are scaled by ``damp``: the smaller, the more the skip path dominates and the more they agree
      (on the 256-vocab tiny3: damp 0.3 -> argmax agreement ~0.6 per token, 1.0 -> ~0.3);
    * ``head_scale`` multiplies the shared vocab head (logit temperature; sharpens the sampling distributions);
    * ``stream_gain`` multiplies the MTP's ``h_proj`` (its hidden-stream input): larger makes the draft's
      proposals depend more on the streams it is fed (so a wrong stream changes them) and agree less.

    Attention, compressors, the indexer and MoE all stay live, so the argmax still depends on context.
    """
    prm = P.init(cfg, jax.random.key(seed))

    def damp_block(blk):
        blk["attn"]["wo_b"] = blk["attn"]["wo_b"] * damp
        blk["ffn"]["experts"]["w2"] = blk["ffn"]["experts"]["w2"] * damp
        blk["ffn"]["shared"]["w2"] = blk["ffn"]["shared"]["w2"] * damp

    for blk in prm["layers"]:
        damp_block(blk)
    mtp = prm["mtp"]
    damp_block(mtp["block"])
    mtp["e_proj"] = jnp.eye(cfg.hidden_size, dtype=mtp["e_proj"].dtype)
    mtp["h_proj"] = mtp["h_proj"] * stream_gain
    mtp["hc_head"] = jax.tree.map(jnp.array, prm["hc_head"])
    mtp["norm"] = jnp.array(prm["norm"])
    prm["head"] = prm["head"] * head_scale
    return Model(cfg, prm)


# ---- the speculative loop's final state ---------------------------------------------------------------------

@contextlib.contextmanager
def capture_loop():
    """Within the block, every `speculative_loop` call the engine makes is recorded as a dict with its static
    arguments (cfg, tspec, dspec, k, kernels, max_rounds), the slots it served (`active_slots`), and in
    `calls.final[slot]` a host copy of both pools as returned by the last call that served the slot (the slot is
    reset when its request finishes, so this is the state a later step of that request would have seen)."""
    calls = _Calls()
    real = spec_rounds.speculative_loop

    def wrapper(params, tpool, dpool, slot_state, rows, **kwargs):
        out, tpool, dpool, slot_state = real(params, tpool, dpool, slot_state, rows, **kwargs)
        slots = [int(s) for s, a in zip(np.asarray(rows.slots), np.asarray(rows.active)) if a]
        host = (jax.tree.map(np.asarray, tpool), jax.tree.map(np.asarray, dpool))
        for s in slots:
            calls.final[s] = host
        calls.append(dict(kwargs, active_slots=slots))
        return out, tpool, dpool, slot_state

    spec_rounds.speculative_loop = wrapper
    try:
        yield calls
    finally:
        spec_rounds.speculative_loop = real


class _Calls(list):
    def __init__(self):
        super().__init__()
        self.final: dict[int, tuple] = {}


class CompileCounter:
    """Counts XLA compilations of jitted functions named `name` while the context is active (JAX reports each
    through `jax.monitoring` as a '/jax/core/compile/backend_compile_duration' event with fun_name 'jit(name)')."""

    EVENT = "/jax/core/compile/backend_compile_duration"

    def __init__(self, name: str):
        self.fun_name = f"jit({name})"
        self.count = 0

    def _listener(self, event, duration, **kwargs):
        if event == self.EVENT and kwargs.get("fun_name") == self.fun_name:
            self.count += 1

    def __enter__(self):
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc):
        jax.monitoring.unregister_event_duration_listener(self._listener)


def round_spans(prompt_len: int, accepted: Sequence[int]) -> list[tuple[int, int, int]]:
    """Per round: (first target position it verifies, tokens it commits (a+1), index of its first emitted token)."""
    spans, pos, emitted = [], prompt_len, 1  # t0 is emitted by the prefill
    for a in accepted:
        spans.append((pos, a + 1, emitted))
        pos += a + 1
        emitted += a + 1
    return spans


# ---- plain decoding reference -------------------------------------------------------------------------------

def plain_spec(model: Model, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> PoolSpec:
    """The pool spec `ds4jax.generate` builds for these prompts and budget (so its compiled steps are shared)."""
    return PoolSpec.for_role(model.config, role=Role.TARGET, max_slots=len(prompts),
                             max_context=max(len(p) for p in prompts) + max_new_tokens,
                             page_size=default_page_size(model.config), dtype=pool_dtype(model))


def plain_reference(model: Model, prompts: Sequence[Sequence[int]], lengths: Sequence[int], *, spec: PoolSpec,
                    chunk: int, draft_width: int):
    """Plain greedy decoding with the pooled steps (the calls `ds4jax.generate` makes: chunked prefill, then one
    decode step per token) until slot s holds `lengths[s]` committed tokens; slot s serves prompts[s].

    Returns (target pool, draft pool, tokens): `tokens[s]` is prompt + greedy tokens up to and including position
    lengths[s] (the token the next step would take); the draft pool is a sliding-window ring filled by one
    `draft_extend` over (target stream p, id of token p+1) for every committed position p (`draft_width` >=
    max(lengths) is the chunk size of that call)."""
    cfg, prm = model.config, model.params
    rows = len(prompts)
    book = PoolBook(spec, cfg.vocab_size)
    for s in range(rows):
        book.admit(s)
        book.reserve(s, lengths[s] + 1)
    pool = book.sync(zeros(spec))
    slots = jnp.arange(rows, dtype=jnp.int32)
    streams = np.zeros((rows, draft_width, cfg.hc_mult, cfg.hidden_size), np.float32)
    seqs = [list(p) for p in prompts]
    cur = np.zeros(rows, np.int32)
    pos = [0] * rows
    while any(p < len(q) for p, q in zip(pos, prompts)):
        n = [min(chunk, len(q) - p) for p, q in zip(pos, prompts)]
        tok = np.zeros((rows, chunk), np.int32)
        for r, q in enumerate(prompts):
            tok[r, : n[r]] = q[pos[r]: pos[r] + n[r]]
        finishing = [r for r in range(rows) if n[r] and pos[r] + n[r] == len(prompts[r])]
        out, pool = steps.prefill(prm, pool, steps.StepBatch(slots, jnp.asarray(tok), jnp.asarray(n, jnp.int32)),
                                  cfg=cfg, spec=spec, need_logits=bool(finishing))
        st = np.asarray(out.streams)
        for r in range(rows):
            streams[r, pos[r]: pos[r] + n[r]] = st[r, : n[r]]
        if finishing:
            first = np.asarray(jnp.argmax(out.logits, axis=-1))
            for r in finishing:
                cur[r] = first[r]
                seqs[r].append(int(first[r]))
        pos = [p + c for p, c in zip(pos, n)]
    length = np.asarray([len(p) for p in prompts])
    target = np.asarray(lengths)
    while (length < target).any():
        step_n = (length < target).astype(np.int32)
        res, pool = steps.decode(prm, pool, steps.StepBatch(slots, jnp.asarray(cur[:, None]), jnp.asarray(step_n)),
                                 cfg=cfg, spec=spec)
        nxt = np.asarray(jnp.argmax(res.logits, axis=-1)).astype(np.int32)
        rs = np.asarray(res.streams)
        for s in np.flatnonzero(step_n):
            streams[s, length[s]] = rs[s, 0]
            seqs[s].append(int(nxt[s]))
            cur[s] = nxt[s]
        length += step_n
    # the draft's rows: position p takes the target stream of p and the id of token p+1
    dspec = PoolSpec.for_role(cfg, role=Role.DRAFT, max_slots=rows, max_context=spec.max_context, draft_tokens=1,
                              page_size=spec.page_size, dtype=spec.dtype)
    dbook = PoolBook(dspec, cfg.vocab_size)
    for s in range(rows):
        dbook.admit(s)
    dpool = dbook.sync(zeros(dspec))
    nxt_ids = np.zeros((rows, draft_width), np.int32)
    for s in range(rows):
        nxt_ids[s, : lengths[s]] = seqs[s][1: lengths[s] + 1]
    _, dpool = steps.draft_extend(prm, dpool, steps.StepBatch(slots, jnp.asarray(nxt_ids), jnp.asarray(target,
                                                                                                        jnp.int32)),
                                  jnp.asarray(streams), cfg=cfg, spec=dspec)
    return pool, dpool, seqs


@functools.partial(jax.jit, static_argnums=0)
def _target_streams(cfg, params, ids):
    return network.forward(cfg, params, ids, return_hidden=True)[1][-1]


@functools.partial(jax.jit, static_argnums=0)
def _mtp_full(cfg, params, streams, next_ids):
    out = network.mtp_forward_full(cfg, params, streams, next_ids)
    return out.logits, out.hidden[0]


def reference_accepts(model: Model, seqs: Sequence[Sequence[int]], rounds: Sequence[tuple[int, int]], k: int, *,
                      width: int = 64, batch: int = 128) -> list[int]:
    """Accepted drafts of greedy rounds, recomputed without caches.

    `seqs[row]` is the greedy token sequence of a row (prompt + generated, at least up to position L + k);
    `rounds` lists (row, L): a round that starts with L committed target tokens and token L pending. The draft
    chain is rebuilt with the full-sequence forwards: the target's last-block streams of positions < L (one
    `forward`), then d1 = argmax of the MTP over rows i < L (row i = stream i, id of token i+1) and d_{j+1} from
    the MTP with row L+j-1 = (the MTP's own output stream of row L+j-2, d_j). The round accepts the longest prefix
    of d1..dk equal to tokens L+1..L+k. Padded to [batch, width] so every k shares one program per function."""
    cfg, prm = model.config, model.params
    assert len(rounds) <= batch and max(L for _, L in rounds) + k <= width
    ids = np.zeros((len(seqs), width), np.int32)
    for r, q in enumerate(seqs):
        ids[r, : min(width, len(q))] = q[:width]
    target = np.asarray(_target_streams(cfg, prm, jnp.asarray(ids)))
    streams = np.zeros((batch, width) + target.shape[2:], np.float32)
    nxt = np.zeros((batch, width), np.int32)
    for i, (row, L) in enumerate(rounds):
        streams[i, :L] = target[row, :L]
        nxt[i, :L] = seqs[row][1: L + 1]
    drafts = np.zeros((len(rounds), k), np.int64)
    for j in range(k):
        logits, out = map(np.asarray, _mtp_full(cfg, prm, jnp.asarray(streams), jnp.asarray(nxt)))
        for i, (row, L) in enumerate(rounds):
            pos = L + j - 1
            drafts[i, j] = int(np.argmax(logits[i, pos]))
            streams[i, pos + 1] = out[i, pos]
            nxt[i, pos + 1] = drafts[i, j]
    accepted = []
    for i, (row, L) in enumerate(rounds):
        a = 0
        while a < k and drafts[i, a] == seqs[row][L + 1 + a]:
            a += 1
        accepted.append(a)
    return accepted


def _entry_rows(page_table: np.ndarray, slot: int, entries: np.ndarray, ratio: int, page_size: int) -> np.ndarray:
    per_page = page_size // ratio
    return page_table[slot, entries // per_page] * per_page + entries % per_page


def compare_target_pools(spec_pool, ref_pool, *, cfg: Config, slot: int, length: int, page_size: int,
                         rtol: float = 1e-4, atol: float = 1e-5) -> dict[str, int]:
    """Assert that two target pools agree on everything a later step of `slot` (committed `length`) can read.

    * SWA rings (every layer): the last `sliding_window` committed positions, row p % rows in each pool;
    * C4 / indexer / C128 entries j < length // ratio, located through each pool's page table;
    * compressor state rings: the committed positions of the windows still open (CSA: previous + current
      window, HCA: current window), row p % rows in each pool.
    The two pools may have different ring sizes (a speculative pool's rings are larger). Returns the number of
    compared rows per array (so callers can check the comparison was not vacuous)."""
    a = jax.tree.map(np.asarray, spec_pool)
    b = jax.tree.map(np.asarray, ref_pool)
    assert int(a.lengths[slot]) == length, (int(a.lengths[slot]), length)
    assert int(b.lengths[slot]) == length, (int(b.lengths[slot]), length)
    counts = {}

    def rows_equal(name, xa, xb, what):
        np.testing.assert_allclose(xa, xb, rtol=rtol, atol=atol, err_msg=f"slot {slot} length {length}: {name} "
                                                                           f"{what}")
        counts[name] = counts.get(name, 0) + int(np.prod(xa.shape[:-1]))

    pos = np.arange(max(0, length - cfg.sliding_window), length)
    rows_equal("swa_kv", a.swa_kv[:, slot, pos % a.swa_kv.shape[2]], b.swa_kv[:, slot, pos % b.swa_kv.shape[2]],
               f"positions {pos.tolist()}")
    for prefix, ratio, states in (("c4", cfg.csa_ratio, ("c4_state_kv", "c4_state_gate")),
                                  ("indexer", cfg.csa_ratio, ("indexer_state_kv", "indexer_state_gate")),
                                  ("c128", cfg.hca_ratio, ("c128_state_kv", "c128_state_gate"))):
        entries = np.arange(length // ratio)
        if getattr(a, f"{prefix}_kv").shape[0] and entries.size:
            ra = _entry_rows(a.page_table, slot, entries, ratio, page_size)
            rb = _entry_rows(b.page_table, slot, entries, ratio, page_size)
            rows_equal(f"{prefix}_kv", getattr(a, f"{prefix}_kv")[:, ra], getattr(b, f"{prefix}_kv")[:, rb],
                       f"entries {entries.tolist()}")
        overlap = prefix != "c128"
        first = max(0, (length // ratio - (1 if overlap else 0)) * ratio)
        pos = np.arange(first, length)
        for name in states:
            xa, xb = getattr(a, name), getattr(b, name)
            if xa.shape[0] and pos.size:
                rows_equal(name, xa[:, slot, pos % xa.shape[2]], xb[:, slot, pos % xb.shape[2]],
                           f"positions {pos.tolist()}")
    return counts


def compare_draft_rings(spec_pool, ref_pool, *, cfg: Config, slot: int, length: int, rtol: float = 1e-4,
                        atol: float = 1e-5) -> int:
    """The draft's sliding-window ring agrees on the last `sliding_window` committed positions."""
    a, b = np.asarray(spec_pool.swa_kv), np.asarray(ref_pool.swa_kv)
    assert int(spec_pool.lengths[slot]) == length and int(ref_pool.lengths[slot]) == length
    pos = np.arange(max(0, length - cfg.sliding_window), length)
    np.testing.assert_allclose(a[:, slot, pos % a.shape[2]], b[:, slot, pos % b.shape[2]], rtol=rtol, atol=atol,
                               err_msg=f"draft ring, slot {slot} length {length}, positions {pos.tolist()}")
    return pos.size


# ---- statistics --------------------------------------------------------------------------------------------

def chi_square_pvalue(samples: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> float:
    """Pearson chi-square goodness of fit of integer samples to `probs` (1-D).

    Zero-probability outcomes must never occur (asserted exactly). Outcomes with expected count below
    `min_expected` are pooled into one bin so the chi-square approximation holds."""
    samples = np.asarray(samples).reshape(-1)
    probs = np.asarray(probs, np.float64).reshape(-1)
    probs = probs / probs.sum()
    counts = np.bincount(samples, minlength=probs.size).astype(np.float64)
    assert counts.size == probs.size, "sample outside the support"
    impossible = probs == 0
    seen = np.flatnonzero(impossible & (counts > 0))
    assert seen.size == 0, f"zero-probability outcomes occurred: {seen.tolist()}"
    expected = probs * counts.sum()
    big = expected >= min_expected
    obs, exp = list(counts[big]), list(expected[big])
    small = ~big & ~impossible
    if small.any():
        if expected[small].sum() >= min_expected or not obs:
            obs.append(counts[small].sum())
            exp.append(expected[small].sum())
        else:  # still too small on its own: merge into the least likely big bin
            i = int(np.argmin(exp))
            obs[i] += counts[small].sum()
            exp[i] += expected[small].sum()
    if len(obs) < 2:
        return 1.0
    return float(stats.chisquare(obs, exp).pvalue)
