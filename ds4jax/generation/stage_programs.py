"""The engine's programs on a layer split: the same calls as `loops.prefill_call` / `loops.decode_loop`, run stage
by stage.

A layer split's stages live on disjoint devices, so one fused program cannot hold a step. Every stage runs one
compiled program per step kind (`mesh_steps.stage_step` over its layers; the last stage's program also samples
and keeps the per-slot state, with the very code of the fused programs: `loops.first_tokens`,
`loops.decode_update`), and the hyper-connection state ``[rows, tokens, hc, hidden]`` (float32 or the model's
dtype) moves to the next stage's devices with `jax.device_put`. A decode call is a host loop of single steps: the
tokens each step samples go back from the last stage to every stage for the next one, and the loop returns early
after the step in which a row finishes (one host read per step), as `decode_loop` does on device.

Pools are one `KVPool` per stage (`MeshSteps.stage_specs`), held as one `StagePools`; the per-slot state lives on
the last stage, beside the logits. `StagePrograms` implements the engine's `programs.Programs` interface, as
`fused_programs.FusedPrograms` does for one program per step. Prefix snapshots run `snapshots.extract` /
`snapshots.inject` on every stage's pool and hold the stage
rows with their layer axes concatenated: the one-device snapshot layout, so a snapshot does not depend on the
split.

Speculative decoding keeps the whole MTP draft on the last stage, where the target's final streams and the head
are: its pool, its parameters and a copy of the embedding (the one on the first stage serves the target). A
round is a host round trip of `spec_rounds`' own pieces: `draft_chain` on the last stage, the verify step
through every stage (k+1 positions per row), then `settle` (acceptance, draft extend, emission) fused with the
last stage's verify; the target lengths it settles on go back to every stage's pool, which rolls back their
rejected rows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.generation import fused_programs, loops, snapshots, spec_rounds
from ds4jax.generation.loops import DecodeOut, Rows, SlotState
from ds4jax.generation.spec_rounds import Chain, RoundCarry
from ds4jax.model import params as params_lib
from ds4jax.runtime import pools as pools_lib, steps
from ds4jax.runtime.data_parallel import check_rows, rows_over_data
from ds4jax.runtime.distributed import fetch, put  # host reads / writes of any stage's arrays, in every process
from ds4jax.runtime.mesh_steps import stage_config, stage_step
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.roles import Role
from ds4jax.model import layer_stack


@jax.tree_util.register_pytree_node_class
class StagePools(tuple):
    """A layer split's target pools, one `KVPool` per stage (in stage order). Like a `KVPool` it has `lengths`:
    every stage advances the same ones."""

    @property
    def lengths(self) -> jax.Array:
        return self[0].lengths

    def tree_flatten(self):
        return tuple(self), None

    @classmethod
    def tree_unflatten(cls, _, children):
        return cls(children)


class _Carry(NamedTuple):
    """A decode call's state between steps, on the last stage (`decode_loop`'s loop carry)."""
    cur: jax.Array  # [B] last token
    ids: jax.Array  # [B, 1] the same, as the next step's token ids (moved to every stage)
    n_out: jax.Array  # [B]
    done: jax.Array  # [B] bool
    buf: jax.Array  # [B, M] emitted tokens (-1 = none)
    i: jax.Array  # [] steps run
    stop: jax.Array  # [] bool: a row finished or paused, or every row is done (the host stops the call)
    bad: jax.Array  # [B] first non-finite token index (-1 = none)
    n_next: jax.Array  # [B] int32 tokens each row appends in the next step (1 = still decoding)


_LAST_STATIC = ("cfg", "spec", "rules", "kernels")
_DRAFT_STATIC = ("full_cfg", "dspec")


@functools.partial(jax.jit, static_argnames=_LAST_STATIC + _DRAFT_STATIC,
                   donate_argnames=("pool", "dpool", "slot_state"))
def _last_prefill(params, pool, dparams, dpool, slot_state: SlotState, rows: Rows, batch, x, next_ids, finishing, *,
                  cfg, spec, rules, kernels, full_cfg, dspec):
    """The last stage of a prefill chunk: its layers, the head, the first tokens, the draft extend over the chunk
    (with a draft: `dspec` not None) and the slot state."""
    with nn.logical_axis_rules(rules):
        out, pool = steps.step(params, pool, batch, x, cfg=cfg, spec=spec, role=Role.TARGET,
                               logits=steps.Logits.LAST, kernels=kernels)
        first, slot_state = loops.first_tokens(out, slot_state, rows, batch.n_tokens)
        if dspec is not None:
            dpool, slot_state = loops.draft_prefill(dparams, dpool, slot_state, rows, out.streams, first,
                                                    batch.token_ids, batch.n_tokens, next_ids, finishing,
                                                    cfg=full_cfg, dspec=dspec, kernels=kernels)
        return loops.flag_nonfinite(first, out.logits), pool, dpool, rows_over_data(slot_state)


_ROUND_STATIC = ("k", "kernels", "rules") + _DRAFT_STATIC


@functools.partial(jax.jit, static_argnames=("k", "max_rounds"), donate_argnames=("dpool",))
def _start_rounds(dpool, slot_state: SlotState, rows: Rows, *, k, max_rounds):
    return spec_rounds.initial_carry(None, dpool, slot_state, rows, k=k, max_rounds=max_rounds)


@functools.partial(jax.jit, static_argnames=_ROUND_STATIC, donate_argnames=("c",))
def _draft_chain(dparams, c: RoundCarry, rows: Rows, *, k, kernels, rules, full_cfg, dspec):
    """A round's draft chain on the last stage, and the verify step's token ids and counts for every stage."""
    with nn.logical_axis_rules(rules):
        chain, dpool = spec_rounds.draft_chain(dparams, c, rows, cfg=full_cfg, dspec=dspec, k=k, kernels=kernels)
        c = c._replace(dpool=dpool)
        batch = chain.verify_batch(c, rows)
        return c, chain, batch.token_ids, batch.n_tokens


@functools.partial(jax.jit, static_argnames=_LAST_STATIC + ("k",) + _DRAFT_STATIC,
                   donate_argnames=("pool", "c", "chain"))
def _last_verify(params, pool, dparams, c: RoundCarry, chain: Chain, rows: Rows, batch, x, *, cfg, spec, rules,
                 kernels, k, full_cfg, dspec):
    """The last stage of a verify step (all k+1 logits), then `settle`. Returns ((carry, target lengths, whether
    the call stops), pool at those lengths)."""
    with nn.logical_axis_rules(rules):
        target_len = pool.lengths
        verify, pool = steps.step(params, pool, batch, x, cfg=cfg, spec=spec, role=Role.TARGET,
                                  logits=steps.Logits.ALL, kernels=kernels)
        c, lengths = spec_rounds.settle(dparams, c, rows, chain, verify, target_len, cfg=full_cfg, dspec=dspec,
                                        k=k, kernels=kernels)
        return (c, lengths, c.finished | jnp.all(c.done)), pool.replace(lengths=lengths)


@functools.partial(jax.jit, donate_argnames=("slot_state",))
def _finish_rounds(c: RoundCarry, slot_state: SlotState, rows: Rows):
    return spec_rounds.finish(c, slot_state, rows)


@functools.partial(jax.jit, static_argnames=_LAST_STATIC, donate_argnames=("pool",))
def _last_decode(params, pool, rows: Rows, batch, x, carry: _Carry, *, cfg, spec, rules, kernels):
    """The last stage of a decode step: its layers, the head, then `decode_update` on the carry."""
    with nn.logical_axis_rules(rules):
        out, pool = steps.step(params, pool, batch, x, cfg=cfg, spec=spec, role=Role.TARGET,
                               logits=steps.Logits.LAST, kernels=kernels)
        tok, n_out, done, buf, i, finished, bad = loops.decode_update(
            rows, out.logits, ~carry.done, carry.cur, carry.n_out, carry.done, carry.buf, carry.i, carry.bad)
        tok, n_out, done, buf, bad, n_next = rows_over_data((tok, n_out, done, buf, bad, (~done).astype(jnp.int32)))
        return _Carry(tok, tok[:, None], n_out, done, buf, i, finished | jnp.all(done), bad, n_next), pool


def check_one_process(layout) -> None:
    """Refuse, before anything is built, a layer split whose devices belong to several processes: the stage loop's
    host reads and writes of the last stage's arrays do not run across processes yet (docs/mesh.md), and a job
    that failed mid-step there would leave its peers waiting. `forward_logits` does run on such a split."""
    owners = sorted({d.process_index for stage in layout.stages for d in stage.devices.flat})
    if len(owners) > 1:
        from ds4jax.runtime.mesh import MeshError

        raise MeshError(f"the Engine (and generate, batch, serve) does not run on a layer split across processes yet: "
                        f"this split's {layout.num_stages} stages are on processes {owners}; split the layers "
                        "within each process, or spread the expert / tensor / data axes across processes")


class StagePrograms:
    """What `Engine` runs on a layer split: pools per stage, and prefill / decode calls stage by stage."""

    precompiles = False  # each stage's programs compile on their first warm-up call
    runs_ahead = False  # a decode call is a host loop over stages and steps (`run_ahead`)
    supports_lookup = False  # its rounds are host loops of stage programs without the history (the engine refuses)

    def __init__(self, layout, cfg):
        self.layout, self.cfg = layout, cfg
        self.mesh_steps = layout.steps(cfg)
        self.ranges = layout.stage_ranges(cfg.num_layers)
        self.views = [stage_config(cfg, lo, hi) for lo, hi in self.ranges]
        self.last = len(self.ranges) - 1
        self.data = layout.axis_sizes["data"]
        self._embed = None  # (the first stage's embedding, its copy on the last stage) for the draft

    # ---- pools -----------------------------------------------------------------------------------------------
    def zeros(self, spec: PoolSpec) -> StagePools:
        return StagePools(self.mesh_steps.zeros(spec))

    def sync(self, book, pools: StagePools, spec: PoolSpec) -> StagePools:
        return StagePools(self.mesh_steps.sync(book, pools, spec))

    def placed(self, pools: StagePools, spec: PoolSpec) -> StagePools:
        return StagePools(jax.device_put(p, sh) for p, sh in zip(pools, self.mesh_steps.pool_shardings(spec)))

    def reset(self, pools: StagePools, slots, spec: PoolSpec) -> StagePools:
        return self.placed(tuple(pools_lib.reset_slots(p, slots) for p in pools), spec)

    @staticmethod
    def lengths(pools: StagePools) -> jax.Array:
        return pools.lengths

    @staticmethod
    def lost(pools: StagePools) -> bool:
        """Whether a failed call took donated pools with it (any stage's)."""
        return any(p.lengths.is_deleted() for p in pools)

    # ---- the draft: pool, parameters and embedding copy on the last stage ---------------------------------------
    def draft_zeros(self, dspec: PoolSpec):
        return self.layout.pool_zeros(dspec, self.last)

    def draft_placed(self, dpool, dspec: PoolSpec):
        return jax.device_put(dpool, self.layout.pool_shardings(dspec, self.last))

    def draft_reset(self, dpool, slots, dspec: PoolSpec):
        return self.draft_placed(pools_lib.reset_slots(dpool, slots), dspec)

    @staticmethod
    def extract_draft(dpool, slot: int) -> dict:
        return snapshots.extract(dpool, np.int32(slot), ratios=())

    def inject_draft(self, dpool, slot: int, arrays: dict, length: int, dspec: PoolSpec):
        return self.draft_placed(snapshots.inject(dpool, np.int32(slot), arrays, np.int32(0), np.int32(length),
                                                  ratios=()), dspec)

    def _draft_out(self, dpool, dspec: PoolSpec | None):
        """A program's draft pool on its canonical placement (as `_through` does for the target's pools)."""
        return dpool if dspec is None else self.draft_placed(dpool, dspec)

    def draft_params(self, params) -> dict:
        """What the draft steps read: the MTP block and the head (both on the last stage) and the embedding, copied
        to the last stage once per embedding array (`drop_draft_params` frees the copy)."""
        embed = params["embed"]
        if self._embed is None or self._embed[0] is not embed:
            sharding = self.layout.sharding(embed.shape, params_lib.declare(self.cfg)["embed"].axes, self.last)
            self._embed = (embed, jax.device_put(embed, sharding))
        return {"mtp": params["mtp"], "embed": self._embed[1], "head": params["head"]}

    def drop_draft_params(self) -> None:
        if self._embed is not None and not self._embed[1].is_deleted():
            self._embed[1].delete()
        self._embed = None

    def put(self, tree, stage: int):
        """`tree`'s arrays on a stage: rows over ``data``, the rest replicated."""
        return jax.tree.map(lambda a: put(a, self.layout.batch_sharding(np.shape(a), stage)), tree)

    def slot_state(self, state: SlotState) -> SlotState:
        return self.put(state, self.last)

    @staticmethod
    def slot_rows(state: SlotState, slot: int):
        return fused_programs.slot_rows(state, np.int32(slot))

    def set_slot_rows(self, state: SlotState, slot: int, logits, stream) -> SlotState:
        # canonical placement, as the stage programs return it
        return self.slot_state(fused_programs.set_slot_rows(state, np.int32(slot), logits, stream))

    def _params(self, params, s: int) -> dict:
        lo, hi = self.ranges[s]
        keys = (("embed",) if s == 0 else ()) + (("hc_head", "norm", "head") if s == self.last else ())
        return {**{k: params[k] for k in keys}, "layers": layer_stack.layer_range(params["layers"], lo, hi)}

    # ---- prefix snapshots: every stage's rows of a slot, held as one pool's (layer axes concatenated) -----------
    def _ratios(self, spec: PoolSpec) -> list:
        return [snapshots.entries_per_page(self.cfg, sp) for sp in self.mesh_steps.stage_specs(spec)]

    def extract(self, pools: StagePools, slot: int, spec: PoolSpec) -> dict[str, np.ndarray]:
        """`snapshots.extract` of every stage, on the host, in the one-device layout."""
        parts = fetch([snapshots.extract(p, np.int32(slot), ratios=r)
                                for p, r in zip(pools, self._ratios(spec))])
        names = dict.fromkeys(n for part in parts for n in part)
        # a stage without a layer kind holds zero layers of its arrays (and zero-size rows: left out)
        return {n: np.concatenate([p[n] for p in parts if n in p and p[n].shape[0]]
                                  or [next(p[n] for p in parts if n in p)], axis=0) for n in names}

    def inject(self, pools: StagePools, slot: int, arrays: dict, n_pages: int, length: int,
               spec: PoolSpec) -> StagePools:
        """`snapshots.inject` of every stage: each takes its layers' share of `arrays` (`extract`'s layout)."""
        offset, new = dict.fromkeys(arrays, 0), []
        for pool, ratios in zip(pools, self._ratios(spec)):
            mine = {}
            for name in snapshots.per_slot_names(pool) + [n for n, _ in ratios]:
                a, n = getattr(pool, name), getattr(pool, name).shape[0]
                mine[name] = (arrays[name][offset[name]: offset[name] + n] if n
                              else np.zeros((0,) + a.shape[2:], a.dtype))
                offset[name] += n
            new.append(snapshots.inject(pool, np.int32(slot), mine, np.int32(n_pages), np.int32(length),
                                        ratios=ratios))
        return self.placed(tuple(new), spec)

    def restore(self, params, dpool, slot_state: SlotState, rows: Rows, sampled, next_ids, *, dspec, kernels):
        """`loops.restore_call` on the last stage: first tokens from the saved logits, and the draft's pending row
        when `dspec` is not None. Returns (first tokens, dpool, slot_state, None: no logprobs on a split)."""
        dparams = self.draft_params(params) if dspec is not None else {}
        with self.layout.active(self.last):
            first, dpool, state, _ = loops.restore_call(dparams, dpool, slot_state, self.put(rows, self.last),
                                                        self.put(np.asarray(sampled), self.last),
                                                        self.put(np.asarray(next_ids), self.last), cfg=self.cfg,
                                                        dspec=dspec, kernels=kernels)
        return first, self._draft_out(dpool, dspec), self.slot_state(state), None

    # ---- one step through every stage -----------------------------------------------------------------------
    def _through(self, params, pools: StagePools, slots, token_ids, n_tokens, spec: PoolSpec, kernels, last_call):
        """Every stage but the last (`stage_step`, no logits), then `last_call(params, pool, batch, x)` on the
        last stage's devices. Returns (its result, the pools)."""
        specs, shardings = self.mesh_steps.stage_specs(spec), self.mesh_steps.pool_shardings(spec)
        x, new = None, []
        for s in range(self.last + 1):
            batch = steps.StepBatch(*self.put((slots, token_ids, n_tokens), s))
            if x is not None:  # the hyper-connection state moves to this stage's devices
                x = self.put(x, s)
            with self.layout.active(s):
                if s < self.last:
                    out, pool = stage_step(self._params(params, s), pools[s], batch, x, cfg=self.views[s],
                                           spec=specs[s], rules=self.layout.rules, logits=steps.Logits.NONE,
                                           kernels=kernels)
                    x = out.streams
                else:
                    result, pool = last_call(self._params(params, s), pools[s], batch, x, specs[s])
            # canonical placement: a stage without a layer kind gets its zero-size arrays back replicated, and the
            # next call would compile again for that input (a no-op for every other array)
            new.append(jax.device_put(pool, shardings[s]))
        return result, StagePools(new)

    def prefill(self, params, pools: StagePools, dpool, slot_state: SlotState, rows: Rows, token_ids, n_tokens,
                next_ids, finishing, *, spec: PoolSpec, dspec: PoolSpec | None, kernels):
        """One prefill chunk (`loops.prefill_call`; the draft extend when `dspec` is not None).
        Returns (first tokens, pools, dpool, slot_state, None: no logprobs on a split)."""
        self._check(rows, spec)
        rows_last = self.put(rows, self.last)
        dparams = self.draft_params(params) if dspec is not None else None
        extra = self.put((np.asarray(next_ids), np.asarray(finishing)), self.last)

        def last_call(p, pool, batch, x, sp):
            first, pool, dp, state = _last_prefill(p, pool, dparams, dpool, slot_state, rows_last, batch, x, *extra,
                                                   cfg=self.views[-1], spec=sp, rules=self.layout.rules,
                                                   kernels=kernels, full_cfg=self.cfg, dspec=dspec)
            return (first, dp, state), pool

        (first, dpool, slot_state), pools = self._through(params, pools, rows.slots, token_ids, n_tokens, spec,
                                                          kernels, last_call)
        return first, pools, self._draft_out(dpool, dspec), slot_state, None

    def decode(self, params, pools: StagePools, rows: Rows, *, spec: PoolSpec, kernels, max_steps: int):
        """Up to `max_steps` decode steps, one host round trip each (`loops.decode_loop`'s contract: it returns
        after the step in which a row finishes). The first step always runs (on rows that are all done it writes
        nothing), so warmup compiles every stage's program. Returns (DecodeOut, pools)."""
        self._check(rows, spec)
        b = rows.slots.shape[0]
        done0 = loops.decode_done0(rows)  # on the host: the rows are numpy arrays here
        cur = rows.cur.astype(np.int32)
        carry = _Carry(cur, cur[:, None], rows.n_out.astype(np.int32), done0,
                       np.full((b, max_steps), -1, np.int32), np.int32(0), np.bool_(False),
                       np.full(b, -1, np.int32), (~done0).astype(np.int32))
        carry = self.put(carry, self.last)
        rows_last = self.put(rows, self.last)
        ran = 0
        while ran < max_steps:

            def last_call(p, pool, batch, x, sp, carry=carry):
                return _last_decode(p, pool, rows_last, batch, x, carry, cfg=self.views[-1], spec=sp,
                                    rules=self.layout.rules, kernels=kernels)

            carry, pools = self._through(params, pools, rows.slots, carry.ids, carry.n_next, spec,
                                         kernels, last_call)
            ran += 1
            if bool(fetch(carry.stop)):  # held by the last stage's processes
                break
        return DecodeOut(carry.buf, carry.n_out, carry.done, np.int32(ran), carry.bad), pools

    def speculate(self, params, pools: StagePools, dpool, slot_state: SlotState, rows: Rows, *, spec: PoolSpec,
                  dspec: PoolSpec, k: int, kernels, max_rounds: int, lookup: int = 0):
        """Up to `max_rounds` speculative rounds, one host round trip each (`spec_rounds.speculative_loop`'s
        contract: it returns after the round in which a row finishes). The first round always runs (on rows
        that are all done it writes nothing), so warmup compiles every program.
        Returns (SpecOut, pools, dpool, slot_state). No lookup drafting (`supports_lookup`)."""
        if lookup:
            raise pools_lib.PoolError("lookup drafting does not run on a layer split (its rounds carry no history)")
        self._check(rows, spec)
        rows_last = self.put(rows, self.last)
        dparams = self.draft_params(params)
        common = dict(rules=self.layout.rules, kernels=kernels, full_cfg=self.cfg, dspec=dspec)
        lengths_at = [sh.lengths for sh in self.mesh_steps.pool_shardings(spec)]
        # the carry on one placement whichever program made it (else the second round's programs compile again)
        canonical = lambda c: self.put(c._replace(dpool=None), self.last)._replace(
            dpool=self.draft_placed(c.dpool, dspec))
        with self.layout.active(self.last):
            c = canonical(_start_rounds(dpool, slot_state, rows_last, k=k, max_rounds=max_rounds))
        for _ in range(max_rounds):
            with self.layout.active(self.last):
                c, chain, tokens, n_tokens = _draft_chain(dparams, c, rows_last, k=k, **common)
                c = canonical(c)

            def last_call(p, pool, batch, x, sp, c=c, chain=chain):
                return _last_verify(p, pool, dparams, c, chain, rows_last, batch, x, cfg=self.views[-1], spec=sp,
                                    k=k, **common)

            (c, lengths, stop), pools = self._through(params, pools, rows.slots, tokens, n_tokens, spec, kernels,
                                                      last_call)
            c = canonical(c)
            # the earlier stages verified k+1 rows too: settle them on the accepted lengths (a no-op on the last)
            pools = StagePools(p.replace(lengths=jax.device_put(lengths, at)) for p, at in zip(pools, lengths_at))
            if bool(fetch(stop)):
                break
        with self.layout.active(self.last):
            out, slot_state = _finish_rounds(c, slot_state, rows_last)
        return out, pools, c.dpool, self.slot_state(slot_state)  # c.dpool: placed by `canonical`

    def _check(self, rows: Rows, spec: PoolSpec) -> None:
        if self.data > 1:  # rows ordered by slot shard (the engine's row plan), or a PoolError before anything runs
            check_rows(np.asarray(rows.slots).tolist(), spec.max_slots, self.data)
