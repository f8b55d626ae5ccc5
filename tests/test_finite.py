"""Numerics guard: NaN/Inf logits become `NonFiniteError` naming the first layer that produced them."""

import jax
import jax.numpy as jnp
import pytest

from ds4jax.errors import NonFiniteError
from ds4jax.generation.generate import SamplingParams, generate
from ds4jax.io.default_model import random_model as default_model, random_tokenizer as default_tokenizer
from ds4jax.model import layer_stack
from ds4jax.model.finite import first_nonfinite
from ds4jax.model.handle import Model


def test_nan_logits_name_the_first_layer():
    model = default_model(jnp.float32)
    ids = default_tokenizer().encode("Hello", add_bos=True)  # the CLI tests' prompt shape: shared programs
    params = layer_stack.unstacked_params(model.params)  # per-layer dicts to edit (a Model stacks its layers)
    params["layers"][1]["attn"]["wq_a"] = jnp.full_like(params["layers"][1]["attn"]["wq_a"], jnp.nan)
    poisoned = Model(config=model.config, params=params)
    with pytest.raises(NonFiniteError) as e:
        generate(poisoned, ids, SamplingParams(max_new_tokens=2), check_finite=True)
    assert e.value.name == "layer 1" and "generated token 0" in str(e.value)
    assert first_nonfinite(model, ids) is None
    assert len(generate(poisoned, ids, SamplingParams(max_new_tokens=2))[0]) == 2  # off: no check, no error


def test_speculative_rounds_flag_nonfinite_logits():
    """A token whose embedding overflows layer 0 is forced into a speculative round (a thinking budget's close
    id): the round's verify logits are NaN/Inf and the result names the token; the cache-free forward names the
    layer."""
    from ds4jax import Budget, Request
    from small_engine import one_layer_model, small_engine

    model = one_layer_model()
    poison = 77
    params = dict(model.params, embed=model.params["embed"].at[poison].set(3e38))  # finite, but overflows
    poisoned = Model(config=model.config, params=params)
    budget = Budget(max_tokens=1, close_ids=(poison,))  # token 1 is forced; token 2 comes from its logits
    res = small_engine(poisoned).generate([Request(prompt=[5, 6, 7], max_new_tokens=6, budget=budget)])[0]
    assert res.accepted_per_round is not None and res.tokens[1] == poison
    assert res.nonfinite_at == 2
    assert first_nonfinite(poisoned, [5, 6, 7] + res.tokens[:2]) == "layer 0"
