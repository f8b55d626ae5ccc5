"""Running the model stage by stage on a `MeshLayout` (the C++ peer's layer-split backend, on jax meshes).

Stage s runs layers [lo, hi) as one jitted program on its own sub-mesh; the full hyper-connection state
``[b, t, hc, hidden]`` is handed to the next stage with `jax.device_put` (a device-to-device copy). The first
stage also embeds, the last also projects to the vocabulary. Without a layer split this is one program.
"""

from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.model.config import Config
from ds4jax.model.forward import block, embed, logits_from_streams
from ds4jax.model.layers.attention import attention_sequence
from ds4jax.model import layer_stack


@functools.partial(jax.jit, static_argnames=("cfg", "rules", "lo", "first", "last"))
def _stage(params, layers, token_ids, x, *, cfg: Config, rules, lo: int, first: bool, last: bool):
    with nn.logical_axis_rules(rules):
        if first:
            x = embed(params, token_ids, cfg)

        def layer(x, p, at):
            attention = lambda h: attention_sequence(h, p["attn"], cfg, at.attention)
            return block(x, token_ids, p, cfg, at.mlp, attention)[0], None

        x, _ = layer_stack.run(cfg, layers, x, layer, offset=lo)
        if last:
            return logits_from_streams(x, params["hc_head"], params["norm"], params["head"], cfg)
        return x


def forward_logits(layout, model, token_ids) -> jax.Array:
    """`ds4jax.forward_logits` on a mesh: token_ids [b, t] (or [t]) -> float32 logits [b, t, v] (or [t, v])."""
    cfg, params = model.config, model.params
    # host ids stay numpy until placed (`jnp.asarray` / `[None]` on the device would each compile a program per shape)
    traced = isinstance(token_ids, jax.core.Tracer)
    ids = jnp.asarray(token_ids, jnp.int32) if traced else np.asarray(token_ids, np.int32)
    squeeze = ids.ndim == 1
    ids = ids[None] if squeeze else ids
    ranges = layout.stage_ranges(cfg.num_layers)
    x = None
    for s, (lo, hi) in enumerate(ranges):
        first, last = s == 0, s == len(ranges) - 1
        ids_s = jax.device_put(ids, layout.batch_sharding(ids.shape, s))
        if x is not None:  # hand the hyper-connection state to this stage's devices
            x = jax.device_put(x, layout.batch_sharding(x.shape, s))
        top = {k: params[k] for k in (("embed",) if first else ()) + (("hc_head", "norm", "head") if last else ())}
        with layout.active(s):
            x = _stage(top, layer_stack.layer_range(params["layers"], lo, hi), ids_s, x, cfg=cfg, rules=layout.rules, lo=lo, first=first,
                       last=last)
    return x[0] if squeeze else x
