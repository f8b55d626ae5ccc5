"""`ds4jax.generate` and ``ds4jax generate`` size their engine from buckets of the prompt length and
`max_new_tokens` (`buckets.one_shot`): a second call whose values fall in the same buckets compiles nothing.

Counted with JAX's compile events (`compile_count`), on the seeded random tiny model of the default architecture.
"""

from __future__ import annotations

import jax.numpy as jnp

import ds4jax
from ds4jax.cli import main
from ds4jax.generation.buckets import ONE_SHOT_MIN, bucket, one_shot
from ds4jax.generation.compiles import compile_count
from ds4jax.io.default_model import random_model
from random_default import random_default  # noqa: F401 (autouse: the random tiny model, cache off)


def test_one_shot_shapes_depend_only_on_the_buckets():
    small = ONE_SHOT_MIN  # prompts and max_new_tokens up to it share one bucket
    base = one_shot([5, 9], 20, speculative=0, data=1, max_position_embeddings=4096)
    assert base == one_shot([small - 3, small], small, speculative=0, data=1, max_position_embeddings=4096)
    assert base["prefill_chunk"] == small and base["max_context"] == bucket(2 * small)
    assert one_shot([5, small + 1], 20, speculative=0, data=1, max_position_embeddings=4096) != base
    assert one_shot([5, 9], small + 1, speculative=0, data=1, max_position_embeddings=4096) != base
    # the model's limit caps the context bucket; data-parallel slots split evenly
    assert one_shot([100], 60, speculative=2, data=1, max_position_embeddings=200)["max_context"] == 200
    assert one_shot([5, 6, 7], 8, speculative=0, data=2, max_position_embeddings=4096)["max_slots"] == 4


def test_generate_within_the_buckets_compiles_nothing():
    model = random_model(jnp.float32)
    first = ds4jax.generate(model, list(range(3, 9)), ds4jax.SamplingParams(max_new_tokens=9))
    assert len(first[0]) == 9
    before = compile_count()
    # another prompt length and max_new_tokens, both in the same power-of-two buckets (ONE_SHOT_MIN)
    again = ds4jax.generate(model, list(range(20, 33)), ds4jax.SamplingParams(max_new_tokens=14))
    assert len(again[0]) == 14
    assert compile_count() == before


def test_cli_generate_within_the_buckets_compiles_nothing(capsys):
    assert main(["generate", "--prompt", "Hello", "--max-new-tokens", "7"]) == 0
    before = compile_count()
    assert main(["generate", "--prompt", "Hello, world", "--max-new-tokens", "12"]) == 0
    assert compile_count() == before
    capsys.readouterr()
