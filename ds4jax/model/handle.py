"""`Model`: a loaded checkpoint, i.e. an architecture `Config` plus its parameter pytree."""

from __future__ import annotations

import dataclasses
from typing import Any

from ds4jax.model.config import Config


@dataclasses.dataclass(frozen=True)
class Model:
    """`params` follows the layout of `ds4jax.params` (linears ``[in, out]``, experts stacked).

    The ``"mtp"`` subtree is present only when the checkpoint shipped MTP weights (HF checkpoints do not),
    so `has_mtp` can be False even when ``config.num_mtp_layers == 1``. `layout` is set by
    ``ds4jax.load(..., mesh=...)`` / `MeshLayout.place_model`; the public calls then run on that mesh.
    """

    config: Config
    params: dict[str, Any]
    layout: Any = None  # a `ds4jax.runtime.mesh.MeshLayout` when the params are placed on a mesh

    @property
    def has_mtp(self) -> bool:
        return "mtp" in self.params
