"""`Engine` pool sizing: `max_slots` x `max_context` exactly, or the same pools from a memory budget (target and
draft together); a budget one byte short is refused (no step runs here)."""

from __future__ import annotations

import pytest

from ds4jax import Engine
from ds4jax.errors import PoolSpecError
from ds4jax.runtime.pool_spec import total_bytes
from spec_helpers import agreeable_model, tiny3

SHAPE = dict(max_slots=2, max_context=64, speculative=2, prefill_chunk=8)


def test_pools_from_a_memory_budget_equal_the_explicit_ones():
    model = agreeable_model(tiny3(), seed=0, damp=0.3, stream_gain=2.0)
    explicit = Engine(model, **SHAPE)
    budget = total_bytes(explicit.tspec) + total_bytes(explicit.dspec)
    sized = Engine(model, **SHAPE, memory_budget_bytes=budget)
    assert (sized.tspec, sized.dspec) == (explicit.tspec, explicit.dspec)
    assert explicit.tspec.num_pages == 2 * explicit.tspec.pages_per_slot and explicit.dspec.draft_tokens == 3
    with pytest.raises(PoolSpecError, match=f"memory_budget_bytes: {budget - 1:,} B holds"):
        Engine(model, **SHAPE, memory_budget_bytes=budget - 1)
