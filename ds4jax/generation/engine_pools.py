"""The engine's pool specs, host books and fresh per-slot state, on one device or a mesh."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.generation.loops import SlotState
from ds4jax.model.handle import Model
from ds4jax.runtime.data_parallel import local_spec
from ds4jax.runtime.pool_spec import PoolSpec, configure
from ds4jax.runtime.pools import HOST_FILL_BYTES, PoolBook
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
    """Per-slot state of `spec`'s slots: logits in float32, streams in the model's activation dtype."""
    s, stream = spec.max_slots, jnp.dtype(spec.dtype)
    nbytes = 2 * s * (cfg.hc_mult * cfg.hidden_size * stream.itemsize + cfg.vocab_size * 4)
    # small (a CLI run's): numpy zeros and one transfer, not an eager program per shape (as `pools._filled`)
    host = nbytes <= HOST_FILL_BYTES
    zeros = np.zeros if host else jnp.zeros
    hidden = lambda: zeros((s, cfg.hc_mult, cfg.hidden_size), stream)  # noqa: E731
    logits = lambda: zeros((s, cfg.vocab_size), jnp.float32)  # noqa: E731
    state = SlotState(logits(), hidden(), logits(), hidden())
    return jax.device_put(state) if host else state
