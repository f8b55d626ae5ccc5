"""Host inputs reach a program as transfers, not programs of their own: in jax 0.10+ `jnp.asarray` of a numpy array
runs an identity program (`jit(stage)`) compiled once per shape, and an eager index or `[None]` on a device array
one more, so each new prompt length cost a user extra compiles before the one that mattered."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ds4jax
from ds4jax.generation import compiles
from ds4jax.model import params as params_lib
from ds4jax.model.finite import first_nonfinite
from ds4jax.model.handle import Model

CFG = ds4jax.tiny(num_layers=1, attention_types=(ds4jax.AttentionType.SLIDING,), mlp_types=(ds4jax.MlpType.HASH,))


@pytest.fixture(scope="module")
def model():
    return Model(CFG, params_lib.init(CFG, jax.random.key(0), jnp.float32))


def _compiled_by(fn):
    jax.clear_caches()  # a program compiled earlier in this process counts again (a cache hit counts as a compile)
    before = compiles.program_compiles()
    out = fn()
    return out, set(compiles.program_compiles() - before)


@pytest.mark.parametrize("shape", [(7,), (2, 5)])
def test_forward_logits_compiles_only_its_program(model, shape):
    ids = np.arange(np.prod(shape)).reshape(shape) % CFG.vocab_size
    logits, compiled = _compiled_by(lambda: ds4jax.forward_logits(model, ids.tolist()))
    assert compiled == {"jit(_forward)"}, compiled
    assert logits.shape == (*shape, CFG.vocab_size)
    if len(shape) == 1:  # one sequence: the same logits as a batch of one
        np.testing.assert_array_equal(np.asarray(logits), np.asarray(ds4jax.forward_logits(model, ids[None]))[0])


def test_first_nonfinite_compiles_only_its_program(model):
    where, compiled = _compiled_by(lambda: first_nonfinite(model, [3, 1, 4, 1, 5]))
    assert where is None and compiled == {"jit(_finite_per_stage)"}, compiled
