"""Small on-disk fixtures for the validation and fuzz tests: a tiny checkpoint written without compiling anything."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.io import checkpoint
from ds4jax.model.config import Config, tiny
from ds4jax.model.handle import Model
from ds4jax.model.params import abstract


def small_config() -> Config:
    """The default model's architecture: `tiny` with the byte tokenizer's vocabulary (259)."""
    return tiny(vocab_size=259, bos_token_id=0, eos_token_id=1)


def numpy_params(cfg: Config, seed: int = 0) -> dict:
    """Random host parameters of `cfg` (float32; tid2eid valid) built with numpy alone."""
    rng = np.random.default_rng(seed)

    def leaf(path, s):
        if jnp.issubdtype(s.dtype, jnp.integer):
            return rng.integers(0, cfg.num_routed_experts, s.shape).astype(np.int32)
        return (rng.standard_normal(s.shape) * 0.02).astype(np.float32)

    return jax.tree_util.tree_map_with_path(leaf, abstract(cfg, jnp.float32))


def write_checkpoint(directory, cfg: Config | None = None, params: dict | None = None) -> str:
    cfg = cfg or small_config()
    directory = os.fspath(directory)
    checkpoint.save(Model(config=cfg, params=params if params is not None else numpy_params(cfg)), directory)
    return directory


def write_json(path, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f)
