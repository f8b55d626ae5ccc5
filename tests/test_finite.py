"""Numerics guard: NaN/Inf logits become `NonFiniteError` naming the first layer that produced them."""

import jax
import jax.numpy as jnp
import pytest

from ds4jax.errors import NonFiniteError
from ds4jax.generation.generate import SamplingParams, generate
from ds4jax.io.default_model import random_model as default_model, random_tokenizer as default_tokenizer
from ds4jax.model.finite import first_nonfinite
from ds4jax.model.handle import Model


def test_nan_logits_name_the_first_layer():
    model = default_model(jnp.float32)
    ids = default_tokenizer().encode("Hello", add_bos=True)  # the CLI tests' prompt shape: shared programs
    params = jax.tree.map(lambda x: x, model.params)
    params["layers"][1]["attn"]["wq_a"] = jnp.full_like(params["layers"][1]["attn"]["wq_a"], jnp.nan)
    poisoned = Model(config=model.config, params=params)
    with pytest.raises(NonFiniteError) as e:
        generate(poisoned, ids, SamplingParams(max_new_tokens=2), check_finite=True)
    assert e.value.name == "layer 1" and "generated token 0" in str(e.value)
    assert first_nonfinite(model, ids) is None
    assert len(generate(poisoned, ids, SamplingParams(max_new_tokens=2))[0]) == 2  # off: no check, no error
