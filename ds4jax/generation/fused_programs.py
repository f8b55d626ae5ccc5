"""The engine's programs on one device and on one-stage meshes: every call is one fused compiled program
(`loops.prefill_call` / `decode_loop` / `restore_call`, `spec_rounds.speculative_loop`, `snapshots.extract` /
`inject`).

`FusedPrograms` and the layer split's `stage_programs.StagePrograms` implement the same `programs.Programs`
interface, so the engine never asks which one it holds. Here a target pool is one `KVPool`, and `logprobs=N`
(static, the engine's) makes every call also return its tokens' log-probabilities (`loops`' module docstring).
"""

from __future__ import annotations

import contextlib
import functools
import os

import jax
import numpy as np

from ds4jax.generation import loops, snapshots, spec_rounds
from ds4jax.generation.loops import Rows, SlotState
from ds4jax.runtime import pools
from ds4jax.runtime.data_parallel import rows_over_data
from ds4jax.runtime.pool_spec import PoolSpec


@jax.jit
def slot_rows(state: SlotState, slot):
    """A slot's saved last logits and stream (a snapshot's last rows)."""
    return state.last_logits[slot], state.last_stream[slot]


@functools.partial(jax.jit, donate_argnames=("state",))
def set_slot_rows(state: SlotState, slot, logits, stream) -> SlotState:
    return rows_over_data(state._replace(
        last_logits=state.last_logits.at[slot].set(logits),
        last_stream=state.last_stream.at[slot].set(stream.astype(state.last_stream.dtype))))


def target_params(params: dict) -> dict:
    """The weights without the MTP block, which plain decode steps never read. Parking the draft leaves
    params["mtp"] None, a different argument structure: with the block in the arguments, the plain decode program
    compiled again (or was traced and loaded again) for the first call after `park("draft")`."""
    return {k: v for k, v in params.items() if k != "mtp"}


class FusedPrograms:
    """What `Engine` runs when a step fits one program: one device, or a mesh of one stage (`layout`)."""

    precompiles = True  # warm-up lowers these programs first and compiles them side by side
    supports_lookup = True

    @property
    def runs_ahead(self) -> bool:
        """Whether the engine may start a decode call (plain or speculative) from the previous one's outputs before
        reading it (`run_ahead`): on one device, where those outputs are the next call's inputs as they are.
        DS4JAX_RUN_AHEAD=0 turns it off (to compare, or to rule it out when debugging)."""
        return self.layout is None and os.environ.get("DS4JAX_RUN_AHEAD", "1") != "0"

    def __init__(self, layout, cfg, params, logprobs: int = 0):
        self.layout, self.cfg, self.logprobs = layout, cfg, logprobs
        self._params = params  # only read for the weights' device (see `committed`)

    def committed(self, tree):
        """`tree` committed to the weights' device. A jitted program keys its executable on whether each argument
        is committed; fresh arrays are not, a step's outputs are (when the weights are): without this, warmup
        (on fresh pools) and serving (on step outputs) would compile the same program twice."""
        sharding = getattr(self._params.get("embed"), "sharding", None)
        if not isinstance(sharding, jax.sharding.SingleDeviceSharding):
            return tree
        return jax.device_put(tree, sharding)

    def active(self):
        """Trace and run under the model's mesh and rules (nothing on one device)."""
        return contextlib.nullcontext() if self.layout is None else self.layout.active()

    # ---- pools and per-slot state ----------------------------------------------------------------------------
    def zeros(self, spec: PoolSpec) -> pools.KVPool:
        return self.committed(pools.allocate(spec)) if self.layout is None else self.layout.pool_zeros(spec)

    draft_zeros = zeros

    def sync(self, book, pool: pools.KVPool, spec: PoolSpec) -> pools.KVPool:
        return book.sync(pool)

    def placed(self, pool: pools.KVPool, spec: PoolSpec) -> pools.KVPool:
        """`pool` on its canonical placement (a program run outside the steps, e.g. the slot reset, may return
        zero-size arrays replicated; the steps would then compile again for that input)."""
        return pool if self.layout is None else jax.device_put(pool, self.layout.pool_shardings(spec))

    draft_placed = placed

    def reset(self, pool, slots, spec: PoolSpec):
        return self.placed(pools.reset_slots(pool, slots), spec)

    draft_reset = reset

    @staticmethod
    def lengths(pool: pools.KVPool) -> jax.Array:
        return pool.lengths

    @staticmethod
    def lost(pool: pools.KVPool) -> bool:
        """Whether a failed call took the donated pool with it."""
        return pool.lengths.is_deleted()

    def slot_state(self, state: SlotState) -> SlotState:
        if self.layout is not None:  # slot rows beside their pools (over data)
            state = jax.tree.map(lambda a: jax.device_put(a, self.layout.batch_sharding(a.shape)), state)
        return self.committed(state)

    def drop_draft_params(self) -> None:
        """Nothing to free: the draft reads the weights where they are."""

    # ---- prefix snapshots --------------------------------------------------------------------------------------
    def extract(self, pool, slot: int, spec: PoolSpec) -> dict:
        return snapshots.extract(pool, np.int32(slot), ratios=snapshots.entries_per_page(self.cfg, spec))

    def inject(self, pool, slot: int, arrays: dict, n_pages: int, length: int, spec: PoolSpec):
        return snapshots.inject(pool, np.int32(slot), arrays, np.int32(n_pages), np.int32(length),
                                ratios=snapshots.entries_per_page(self.cfg, spec))

    @staticmethod
    def extract_draft(dpool, slot: int) -> dict:
        return snapshots.extract(dpool, np.int32(slot), ratios=())

    @staticmethod
    def inject_draft(dpool, slot: int, arrays: dict, length: int, dspec: PoolSpec):
        return snapshots.inject(dpool, np.int32(slot), arrays, np.int32(0), np.int32(length), ratios=())

    @staticmethod
    def slot_rows(state: SlotState, slot: int):
        return slot_rows(state, np.int32(slot))

    def set_slot_rows(self, state: SlotState, slot: int, logits, stream) -> SlotState:
        return set_slot_rows(state, np.int32(slot), logits, stream)

    # ---- the calls ---------------------------------------------------------------------------------------------
    def prefill(self, params, tpool, dpool, slot_state: SlotState, rows: Rows, token_ids, n_tokens, next_ids,
                finishing, *, spec: PoolSpec, dspec: PoolSpec | None, kernels):
        """One prefill chunk. Returns (first tokens, tpool, dpool, slot_state, their logprobs or None)."""
        with self.active():
            return loops.prefill_call(params, tpool, dpool, slot_state, rows, token_ids, n_tokens, next_ids,
                                      finishing, cfg=self.cfg, tspec=spec, dspec=dspec, kernels=kernels,
                                      logprobs=self.logprobs)

    def decode(self, params, tpool, rows: Rows, *, spec: PoolSpec, kernels, max_steps: int):
        """Up to `max_steps` plain decode steps. Returns (DecodeOut, tpool). The rows go to the device first, as
        committed arrays: a call run ahead takes the previous call's outputs (committed), and a jitted program
        compiles apart for host and committed inputs."""
        with self.active():
            return loops.decode_loop(target_params(params), tpool, self.committed(rows), cfg=self.cfg, spec=spec,
                                     kernels=kernels, max_steps=max_steps, logprobs=self.logprobs)

    def speculate(self, params, tpool, dpool, slot_state: SlotState, rows: Rows, *, spec: PoolSpec,
                  dspec: PoolSpec, k: int, kernels, max_rounds: int, lookup: int = 0):
        """Up to `max_rounds` speculative rounds of k drafts (`lookup` > 0: drafts from each row's history where
        it repeats, `rows.history`). Returns (SpecOut, tpool, dpool, slot_state)."""
        with self.active():  # rows committed as in `decode`: a call run ahead takes the last one's outputs
            return spec_rounds.speculative_loop(params, tpool, dpool, slot_state, self.committed(rows), cfg=self.cfg,
                                                tspec=spec, dspec=dspec, k=k, kernels=kernels, max_rounds=max_rounds,
                                                logprobs=self.logprobs, lookup=lookup)

    def restore(self, params, dpool, slot_state: SlotState, rows: Rows, sampled, next_ids, *, dspec, kernels):
        """First tokens from the saved logits and the draft's pending row. Returns (first, dpool, slot_state, their
        logprobs or None)."""
        with self.active():
            return loops.restore_call(params, dpool, slot_state, rows, sampled, next_ids, cfg=self.cfg, dspec=dspec,
                                      kernels=kernels, logprobs=self.logprobs)
