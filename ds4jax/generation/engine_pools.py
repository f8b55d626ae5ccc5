"""The engine's pool specs, host books and fresh per-slot state, on one device or a mesh."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from ds4jax.generation.loops import SlotState
from ds4jax.model.handle import Model
from ds4jax.runtime.data_parallel import local_spec
from ds4jax.runtime.pool_spec import PoolSpec, configure
from ds4jax.runtime.pools import PoolBook
from ds4jax.runtime.roles import Role


def default_page_size(cfg) -> int:
    """The peers' 256-token page, or the smallest multiple of both compression ratios above it."""
    step = math.lcm(cfg.csa_ratio, cfg.hca_ratio)
    return -(-256 // step) * step


def pool_dtype(model: Model) -> str:
    return jnp.dtype(model.params["embed"].dtype).name


def pool_spec(model: Model, role: Role, data: int, **common) -> PoolSpec:
    """Pool spec of a role; on a mesh `memory_budget_bytes` is per device and every data shard gets an equal share
    of the slots and pages."""
    layout, budget = model.layout, common.pop("memory_budget_bytes")
    if layout is not None and budget is not None:
        spec, _ = layout.configure(model.config, role=role, memory_budget_bytes=budget,
                                   params_dtype=model.params["embed"].dtype, **common)
    else:
        spec = configure(model.config, role=role, memory_budget_bytes=budget, **common)
    local_spec(spec, data)  # slots and pages divisible by data, or a PoolError naming them
    return spec


def book(spec: PoolSpec, vocab_size: int, data: int) -> PoolBook:
    if data > 1:
        from ds4jax.runtime.mesh_steps import ShardedPoolBook

        return ShardedPoolBook(spec, vocab_size, data)
    return PoolBook(spec, vocab_size)


def slot_state_zeros(cfg, spec: PoolSpec) -> SlotState:
    """Per-slot state of `spec`'s slots: logits in float32, streams in the model's activation dtype (one program
    for all four arrays, as `pools._filled`)."""
    return _slot_state_zeros(spec.max_slots, cfg.hc_mult, cfg.hidden_size, cfg.vocab_size, jnp.dtype(spec.dtype).name)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3, 4))
def _slot_state_zeros(slots: int, hc_mult: int, hidden_size: int, vocab_size: int, stream: str) -> SlotState:
    hidden = lambda: jnp.zeros((slots, hc_mult, hidden_size), stream)  # noqa: E731
    logits = lambda: jnp.zeros((slots, vocab_size), jnp.float32)  # noqa: E731
    return SlotState(logits(), hidden(), logits(), hidden())
