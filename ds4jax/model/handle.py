"""`Model`: a loaded checkpoint, i.e. an architecture `Config` plus its parameter pytree."""

from __future__ import annotations

import dataclasses
from typing import Any

from ds4jax.model.config import Config


@dataclasses.dataclass(frozen=True)
class Model:
    """`params` follows the layout of `ds4jax.params` (linears ``[in, out]``, experts stacked).

    The ``"mtp"`` subtree is present only when the checkpoint shipped MTP weights (HF checkpoints do not),
    so `has_mtp` can be False even when ``config.num_mtp_layers == 1``.
    """

    config: Config
    params: dict[str, Any]

    @property
    def has_mtp(self) -> bool:
        return "mtp" in self.params
