"""A random DeepSeek-V4 written in the published layout: the fixture for testing the official format end to end.

`write_official_random` draws a model (`ds4jax.model.params.init`), quantizes it as a published instruct
(``fp4``) or base (``fp8``) checkpoint and writes it in several shards with ``model.safetensors.index.json``
(`ds4jax.save(..., quantize=...)`). `scripts/make_official_checkpoint.py` is its command line.
"""

from __future__ import annotations

import os

import jax

from ds4jax.io import checkpoint
from ds4jax.model import params as params_lib
from ds4jax.model.config import Config, tiny
from ds4jax.model.handle import Model


def write_official_random(path: str | os.PathLike, cfg: Config | None = None, *, seed: int = 0,
                          quantize: str = "fp4", block: tuple[int, int] = (128, 128), shards: int = 3,
                          overwrite: bool = False) -> Model:
    """Write the checkpoint at `path` (about `shards` files); returns the float32 model it was quantized from."""
    cfg = cfg or tiny()
    model = Model(cfg, params_lib.init(cfg, jax.random.key(seed)))
    total = sum(a.size for a in jax.tree.leaves(model.params))  # about a byte per parameter once quantized
    checkpoint.save(model, path, max_shard_bytes=max(1, total // shards), overwrite=overwrite,
                    quantize=quantize, block=block)
    return model
