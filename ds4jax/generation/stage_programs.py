"""The engine's programs on a layer split: the same calls as `loops.prefill_call` / `loops.decode_loop`, run stage
by stage.

A layer split's stages live on disjoint devices, so one fused program cannot hold a step. Every stage runs one
compiled program per step kind (`mesh_steps.stage_step` over its layers; the last stage's program also samples
and keeps the per-slot state, with the very code of the fused programs: `loops.first_tokens`,
`loops.decode_update`), and the hyper-connection state ``[rows, tokens, hc, hidden]`` (float32 or the model's
dtype) moves to the next stage's devices with `jax.device_put`. A decode call is a host loop of single steps: the
tokens each step samples go back from the last stage to every stage for the next one, and the loop returns early
after the step in which a row finishes (one host read per step), as `decode_loop` does on device.

Pools are one `KVPool` per stage (`MeshSteps.stage_specs`); the per-slot state lives on the last stage, beside the
logits. Prefix snapshots run `snapshots.extract` / `snapshots.inject` on every stage's pool and hold the stage
rows with their layer axes concatenated: the one-device snapshot layout, so a snapshot does not depend on the
split. Speculative decoding is not supported here (`Engine` says so).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.generation import loops, snapshots
from ds4jax.generation.loops import DecodeOut, Rows, SlotState
from ds4jax.runtime import pools as pools_lib, steps
from ds4jax.runtime.data_parallel import check_rows, rows_over_data
from ds4jax.runtime.mesh_steps import stage_config, stage_step
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.roles import Role


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


@functools.partial(jax.jit, static_argnames=_LAST_STATIC, donate_argnames=("pool", "slot_state"))
def _last_prefill(params, pool, slot_state: SlotState, rows: Rows, batch, x, *, cfg, spec, rules, kernels):
    """The last stage of a prefill chunk: its layers, the head, the first tokens and the slot state."""
    with nn.logical_axis_rules(rules):
        out, pool = steps.step(params, pool, batch, x, cfg=cfg, spec=spec, role=Role.TARGET,
                               logits=steps.Logits.LAST, kernels=kernels)
        first, slot_state = loops.first_tokens(out, slot_state, rows, batch.n_tokens)
        return loops.flag_nonfinite(first, out.logits), pool, rows_over_data(slot_state)


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


class StagePrograms:
    """What `Engine` runs on a layer split: pools per stage, and prefill / decode calls stage by stage."""

    def __init__(self, layout, cfg):
        self.layout, self.cfg = layout, cfg
        self.mesh_steps = layout.steps(cfg)
        self.ranges = layout.stage_ranges(cfg.num_layers)
        self.views = [stage_config(cfg, lo, hi) for lo, hi in self.ranges]
        self.last = len(self.ranges) - 1
        self.data = layout.axis_sizes["data"]

    # ---- pools -----------------------------------------------------------------------------------------------
    def zeros(self, spec: PoolSpec) -> tuple:
        return self.mesh_steps.zeros(spec)

    def sync(self, book, pools: tuple, spec: PoolSpec) -> tuple:
        return self.mesh_steps.sync(book, pools, spec)

    def placed(self, pools: tuple, spec: PoolSpec) -> tuple:
        return tuple(jax.device_put(p, sh) for p, sh in zip(pools, self.mesh_steps.pool_shardings(spec)))

    def reset(self, pools: tuple, slots, spec: PoolSpec) -> tuple:
        return self.placed(tuple(pools_lib.reset_slots(p, slots) for p in pools), spec)

    @staticmethod
    def lengths(pools: tuple) -> jax.Array:
        return pools[0].lengths  # every stage advances the same lengths

    @staticmethod
    def lost(pools: tuple) -> bool:
        """Whether a failed call took donated pools with it (any stage's)."""
        return any(p.lengths.is_deleted() for p in pools)

    def put(self, tree, stage: int):
        """`tree`'s arrays on a stage: rows over ``data``, the rest replicated."""
        return jax.tree.map(lambda a: jax.device_put(a, self.layout.batch_sharding(np.shape(a), stage)), tree)

    def slot_state(self, state: SlotState) -> SlotState:
        return self.put(state, self.last)

    def _params(self, params, s: int) -> dict:
        lo, hi = self.ranges[s]
        keys = (("embed",) if s == 0 else ()) + (("hc_head", "norm", "head") if s == self.last else ())
        return {**{k: params[k] for k in keys}, "layers": params["layers"][lo:hi]}

    # ---- prefix snapshots: every stage's rows of a slot, held as one pool's (layer axes concatenated) -----------
    def _ratios(self, spec: PoolSpec) -> list:
        return [snapshots.entries_per_page(self.cfg, sp) for sp in self.mesh_steps.stage_specs(spec)]

    def extract(self, pools: tuple, slot: int, spec: PoolSpec) -> dict[str, np.ndarray]:
        """`snapshots.extract` of every stage, on the host, in the one-device layout."""
        parts = jax.device_get([snapshots.extract(p, np.int32(slot), ratios=r)
                                for p, r in zip(pools, self._ratios(spec))])
        names = dict.fromkeys(n for part in parts for n in part)
        # a stage without a layer kind holds zero layers of its arrays (and zero-size rows: left out)
        return {n: np.concatenate([p[n] for p in parts if n in p and p[n].shape[0]]
                                  or [next(p[n] for p in parts if n in p)], axis=0) for n in names}

    def inject(self, pools: tuple, slot: int, arrays: dict, n_pages: int, length: int, spec: PoolSpec) -> tuple:
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

    def restore(self, slot_state: SlotState, rows: Rows, sampled, next_ids, *, cfg, kernels):
        """`loops.restore_call` without a draft on the last stage: first tokens from the saved logits."""
        with self.layout.active(self.last):
            first, _, state = loops.restore_call({}, None, slot_state, self.put(rows, self.last),
                                                 self.put(np.asarray(sampled), self.last),
                                                 self.put(np.asarray(next_ids), self.last), cfg=cfg, dspec=None,
                                                 kernels=kernels)
        return first, self.slot_state(state)

    # ---- one step through every stage -----------------------------------------------------------------------
    def _through(self, params, pools: tuple, slots, token_ids, n_tokens, spec: PoolSpec, kernels, last_call):
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
        return result, tuple(new)

    def prefill(self, params, pools: tuple, slot_state: SlotState, rows: Rows, token_ids, n_tokens, *,
                spec: PoolSpec, kernels):
        """One prefill chunk (`loops.prefill_call` without a draft). Returns (first tokens, pools, slot_state)."""
        self._check(rows, spec)
        rows_last = self.put(rows, self.last)

        def last_call(p, pool, batch, x, sp):
            first, pool, state = _last_prefill(p, pool, slot_state, rows_last, batch, x, cfg=self.views[-1],
                                               spec=sp, rules=self.layout.rules, kernels=kernels)
            return (first, state), pool

        (first, slot_state), pools = self._through(params, pools, rows.slots, token_ids, n_tokens, spec, kernels,
                                                   last_call)
        return first, pools, slot_state

    def decode(self, params, pools: tuple, rows: Rows, *, spec: PoolSpec, kernels, max_steps: int):
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
            if bool(carry.stop):
                break
        return DecodeOut(carry.buf, carry.n_out, carry.done, np.int32(ran), carry.bad), pools

    def _check(self, rows: Rows, spec: PoolSpec) -> None:
        if self.data > 1:  # rows ordered by slot shard (the engine's row plan), or a PoolError before anything runs
            check_rows(np.asarray(rows.slots).tolist(), spec.max_slots, self.data)
