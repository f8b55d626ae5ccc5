"""A one-shot engine sizes its speculative pools for a bucket of the draft length (`buckets.draft_bucket`: k = 1..4
all get pools for 4 drafts), so `speculative_generate` / `generate(speculative=k)` / ``ds4jax generate
--speculative K`` with another k of the bucket reuse the prefill and decode programs: only the speculative program,
static in k, is new. Counted per program with JAX's compile events (`compiles.program_compiles`), on the cheapest
model with an MTP block (small_engine.py: one sliding-window layer; its programs compile in seconds)."""

from __future__ import annotations

import pytest

import ds4jax
from ds4jax.errors import ArgumentError, PoolSpecError
from ds4jax.generation.buckets import DRAFT_MIN, draft_bucket, one_shot
from ds4jax.generation.compiles import program_compiles
from ds4jax.io.default_model import random_config
from ds4jax.runtime.pool_spec import PoolSpec, most_drafts
from ds4jax.runtime.roles import Role
from small_engine import one_layer_model


def shape(k: int, most: int | None = None) -> dict:
    return one_shot([5, 9], 20, speculative=k, data=1, max_position_embeddings=4096, most_drafts=most)


def test_one_shot_pools_depend_only_on_the_draft_bucket():
    assert [draft_bucket(k) for k in range(6)] == [0, DRAFT_MIN, DRAFT_MIN, DRAFT_MIN, DRAFT_MIN, 8]
    four = shape(4)
    assert four["speculative"] == DRAFT_MIN == 4 and four["draft_lengths"] == (4,)
    for k in (1, 2, 3):  # the same engine but for its one speculative program
        assert shape(k) == dict(four, draft_lengths=(k,))
    assert shape(5)["speculative"] == 8 and shape(5)["max_context"] >= four["max_context"]
    assert shape(0)["speculative"] == 0 and shape(0)["draft_lengths"] is None
    # what the model's rings take caps the bucket, never below k itself
    assert draft_bucket(5, most=6) == 6 and draft_bucket(3, most=2) == 3 and draft_bucket(9, most=9) == 9


def test_most_drafts_is_what_the_pool_spec_accepts():
    cfg = random_config()
    most = most_drafts(cfg)
    assert most is not None and most >= DRAFT_MIN  # the default architecture shares k = 1..4
    build = lambda d: PoolSpec.for_role(cfg, role=Role.TARGET, max_slots=1, max_context=64,  # noqa: E731
                                        draft_tokens=d, page_size=16, dtype="float32")
    build(most + 1)
    with pytest.raises(PoolSpecError, match="draft_tokens"):
        build(most + 2)


def test_draft_lengths_are_checked():
    model = one_layer_model()
    with pytest.raises(ArgumentError, match="draft_lengths"):
        ds4jax.Engine(model, max_slots=1, max_context=64, speculative=2, draft_lengths=(3,))
    with pytest.raises(ArgumentError, match="Adaptive.ks"):
        ds4jax.Engine(model, max_slots=1, max_context=64, speculative=2, draft_lengths=(1,), adaptive=True)


def test_another_k_of_the_bucket_compiles_only_its_speculative_program():
    model = one_layer_model()
    assert most_drafts(model.config) is None  # no compressor rings: the bucket is DRAFT_MIN
    prompts, params = [[3, 4, 5, 6, 7], [8, 9, 10]], ds4jax.SamplingParams(max_new_tokens=6)
    three = ds4jax.speculative_generate(model, prompts, params, k=3)
    before = program_compiles()
    two = ds4jax.speculative_generate(model, prompts, params, k=2)
    compiled = program_compiles() - before
    assert compiled == {"jit(speculative_loop)": 1}, compiled  # no prefill_call, decode_loop or anything else
    assert two.tokens == three.tokens  # greedy: the target's tokens whatever k
    assert all(a <= 2 for rounds in two.accepted_per_round for a in rounds)  # the k=2 program ran
