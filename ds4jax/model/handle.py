"""`Model`: a loaded checkpoint, i.e. an architecture `Config` plus its parameter pytree."""

from __future__ import annotations

import dataclasses
from typing import Any

from ds4jax.model import layer_stack
from ds4jax.model.config import Config, Numerics


@dataclasses.dataclass(frozen=True)
class Model:
    """`params` follows the layout of `ds4jax.model.params` (linears ``[in, out]``, experts stacked).

    The ``"mtp"`` subtree is present only when the checkpoint shipped MTP weights (HF checkpoints do not),
    so `has_mtp` can be False even when ``config.num_mtp_layers == 1``. `layout` is set by
    ``ds4jax.load(..., mesh=...)`` / `MeshLayout.place_model`; the public calls then run on that mesh.

    ``params["layers"]`` is a `layer_stack.LayerStack` (layers of one kind stacked, run under `lax.scan`: compile
    time flat in depth) unless `scan_layers` is False, which keeps a list of per-layer dicts run unrolled (for
    debugging; the outputs are the same; ``DS4JAX_SCAN_LAYERS=0`` makes that the default). On a layer split (a
    layout with several stages) the stack is planned stage by stage (`layer_stack.plan_stages`): each stage's
    program scans its own repeated segments. Either layout given is converted on construction.
    """

    config: Config
    params: dict[str, Any]
    layout: Any = None  # a `ds4jax.runtime.mesh.MeshLayout` when the params are placed on a mesh
    scan_layers: bool = dataclasses.field(default_factory=layer_stack.scan_by_default, kw_only=True)

    def __post_init__(self):
        if self.scan_layers:
            params = layer_stack.stacked_params(self.config, self.params,
                                                layer_stack.stage_ranges(self.config, self.layout))
        else:
            params = layer_stack.unstacked_params(self.params)
        object.__setattr__(self, "params", params)

    @property
    def has_mtp(self) -> bool:
        return "mtp" in self.params

    def with_numerics(self, numerics: Numerics | str) -> "Model":
        """The same weights under another rounding recipe (``"reference"`` or ``"official"``: `Numerics`,
        docs/official_numerics.md); every program then compiles for it (the config is their static argument)."""
        return dataclasses.replace(self, config=self.config.replace(numerics=Numerics.parse(numerics)))

    def unrolled(self) -> "Model":
        """The same model with per-layer params (unrolled programs)."""
        return dataclasses.replace(self, scan_layers=False)
