"""The exception hierarchy: old names fold into it, messages name the culprit, errors survive pickling."""

import pickle

import numpy as np

import pytest

import ds4jax
from ds4jax import errors
from ds4jax.errors import ArgumentError, Ds4jaxError, InputError, RuntimeFailure


@pytest.mark.parametrize("cls, where", [
    (errors.ConfigError, "ds4jax.model.config"),
    (errors.CheckpointError, "ds4jax.io.checkpoint"),
    (errors.TokenizerError, "ds4jax.io.tokenizer"),
    (errors.PoolError, "ds4jax.runtime.pools"),
    (errors.PoolSpecError, "ds4jax.runtime.pool_spec"),
])
def test_old_names_are_the_hierarchy(cls, where):
    import importlib

    assert getattr(importlib.import_module(where), cls.__name__) is cls
    assert issubclass(cls, InputError) and issubclass(cls, ValueError) and cls.exit_status == 2


def test_exit_statuses():
    assert errors.UsageError.exit_status == 2 and issubclass(errors.UsageError, ArgumentError)
    for cls in (errors.NonFiniteError, errors.DeviceMemoryError):
        assert issubclass(cls, RuntimeFailure) and issubclass(cls, RuntimeError) and cls.exit_status == 3
    assert ds4jax.Ds4jaxError is Ds4jaxError


def test_message_names_source_name_and_value():
    e = errors.CheckpointError("expected shape (4, 8)", source="ckpt/model.safetensors", name="embed.weight",
                               value=(4, 9))
    assert str(e) == "ckpt/model.safetensors: embed.weight=(4, 9): expected shape (4, 8)"
    assert str(errors.ConfigError("Config.x: must be > 0")) == "Config.x: must be > 0"
    assert str(ArgumentError("must be >= 0", value=-1)) == "got -1: must be >= 0"
    long = str(ArgumentError("bad", name="prompt", value="x" * 10_000))
    assert len(long) < 120 and long.endswith("...: bad")


def test_pickle_keeps_fields():
    e = errors.TokenizerError("not JSON", source="tok.json", name="line 3", value="{")
    back = pickle.loads(pickle.dumps(e))
    assert type(back) is errors.TokenizerError and str(back) == str(e) and back.value == "{"


def test_a_failed_engine_step_is_a_runtime_failure(monkeypatch):
    """generate() over the engine: a step that fails (here: before running) is exit status 3, not "bad input"."""
    from ds4jax.generation import engine
    from ds4jax.generation.generate import SamplingParams, generate
    from ds4jax.io.default_model import random_config
    from ds4jax.model.handle import Model

    def broken(self, *args):
        raise RuntimeError("NOT_FOUND: Function wrapped_slice not found")

    monkeypatch.setattr(engine.Engine, "_prefill_call", broken)
    hollow = Model(random_config(), {"embed": np.zeros((1, 1), np.float32)})  # the patched step never reads it
    with pytest.raises(RuntimeFailure, match="wrapped_slice") as e:
        generate(hollow, [1, 2], SamplingParams(max_new_tokens=2))
    assert not isinstance(e.value, InputError) and e.value.exit_status == 3
