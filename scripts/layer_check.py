"""The kernels against the jnp reference kernels one layer at a time, on the same inputs: a check that holds at depth.

Comparing a deep model's logits fails for reasons that are no fault of a kernel: on random Flash weights the
router's top-6 of 256 experts has near ties, a last-bit difference upstream flips one, and the flips add up over
the layers (kernels vs reference, same weights: cosine 0.9996 at 4 layers, 0.989 at 8, 0.972-0.976 at 16;
docs/benchmarks/scan_in_place/). Here every layer runs as a model of its own (`mesh_steps.stage_config`, the
layer split's one-layer stages) on the reference path's own input to it, once with the kernels under test and
once with the reference kernels, from the same pool; each layer's update to the hyper-connection streams (output
minus input: the streams themselves are mostly the residual) is compared, and the head's logits on the last
layer's reference output. A kernel's fault shows in its layer, however deep; a flip stays one layer's.

Layer by layer, the layer's pool is filled by a prefill through the reference kernels (the same chunks for every
layer, on the previous layer's reference outputs), then one decode step feeds `token` to every row (or the prefill's
last chunk is the step checked); one layer's params copy and pool exist at a time. The embedding and the head run
outside the layer programs (the head's logits by each kernel set on its own last streams), so every layer's program
is its kind's (their one-layer configs and params trees are equal): Flash's 4 kinds compile up to 3 programs each (the
reference fill, the reference step, the kernels' step) at any depth. A layer of a scanned segment runs here as its
own copy (`layer_range` of one layer), so this checks the kernels on every layer's real weights, not the scanned
body's in-place reads (`LayerOf`, `QuantizedLayerOf`): those are checked against the unrolled layout by
tests/test_layer_of.py.
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.model import layer_stack
from ds4jax.model.forward import embed
from ds4jax.runtime import steps
from ds4jax.runtime.kernels import resolve
from ds4jax.runtime.mesh_steps import stage_config, stage_spec
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.pools import PoolBook, zeros
from ds4jax.runtime.roles import Role
from e2e_common import compare  # scripts/: beside this file

_STATIC = ("cfg", "spec", "logits", "kernels")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _layer_step(params, pool, batch, x, *, cfg, spec, logits, kernels):
    """One layer (`cfg` its one-layer view) as `steps.step`; the pool is not donated: both kernel sets read it."""
    return steps.step(params, pool, batch, x, cfg=cfg, spec=spec, role=Role.TARGET, logits=logits, kernels=kernels)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _embed(params, ids, *, cfg):
    return embed(params, ids, cfg)


@functools.partial(jax.jit, static_argnames=("cfg", "kernels"))
def _head(params, streams, batch, *, cfg, kernels):
    return steps.head_logits(params, streams, batch, cfg=cfg, mode=steps.Logits.LAST, kernels=kernels)


def _score(c: dict) -> float:
    """A comparison's cosine, or -1 when it is not a number (non-finite inputs, an all-zero side): never passes."""
    return c["cosine"] if c["finite"] and np.isfinite(c["cosine"]) else -1.0


def check_layers(model, kernels, *, rows: int, ctx: int, chunk: int, token: int, prompt: np.ndarray,
                 max_context: int, decode: bool = True, max_slots: int = 8, dtype: str = "bfloat16",
                 min_cosine: float = 0.99, on_layer=None) -> dict:
    """{"layers": [per layer: {"layer", "kind", "cosine", "rel_err", "finite"}], "logits": {...}, "worst": the
    lowest cosine, "failures": [...]} for a decode step feeding `token` after a `ctx`-token prefill of `prompt`
    ([rows, ctx], in chunks of `chunk`), or with `decode` False for the prefill's last chunk. `on_layer(row)` is
    called as each layer's comparison is done (with its seconds): a long check shows its progress."""
    cfg, params = model.config, model.params
    kernels, reference = resolve(kernels), resolve("reference")
    spec = PoolSpec.for_role(cfg, role=Role.TARGET, max_slots=max_slots, max_context=max_context, dtype=dtype)
    n = cfg.num_layers
    slots = jnp.arange(rows, dtype=jnp.int32)
    chunks = [jnp.asarray(prompt[:, s:s + chunk]) for s in range(0, ctx, chunk)]
    as_batch = lambda ids: steps.StepBatch(slots, ids, jnp.full((rows,), ids.shape[1], jnp.int32))  # noqa: E731
    fill = chunks if decode else chunks[:-1]  # the pools' contents: reference kernels
    batch = as_batch(jnp.full((rows, 1), token, jnp.int32) if decode else chunks[-1])  # the step checked
    res = {"step": "decode" if decode else f"prefill chunk of {chunks[-1].shape[1]}", "layers": []}
    # each layer's reference input for the fill chunks and for the step checked (the first layer's: the embedding)
    xs, x = [_embed(params, ids, cfg=cfg) for ids in fill], _embed(params, batch.token_ids, cfg=cfg)
    top = {k: params[k] for k in ("hc_head", "norm", "head")}
    for i in range(n):  # layer by layer: one copy of a scanned layer's params, one layer's pool at a time
        t = time.perf_counter()
        view = stage_config(cfg, i, i + 1)
        sp = stage_spec(spec, view)
        book = PoolBook(sp, cfg.vocab_size)
        for r in range(rows):
            book.admit(r)
            book.reserve(r, ctx + 1)
        pool = book.sync(zeros(sp))
        run = functools.partial(_layer_step, {"layers": layer_stack.layer_range(params["layers"], i, i + 1)},
                                cfg=view, spec=sp, logits=steps.Logits.NONE)
        for j, ids in enumerate(fill):
            out, pool = run(pool, as_batch(ids), xs[j], kernels=reference)
            xs[j] = out.streams
            book.commit(range(rows), [ids.shape[1]] * rows)
        ref, _ = run(pool, batch, x, kernels=reference)
        got, _ = run(pool, batch, x, kernels=kernels)
        base = np.asarray(x, np.float64)
        row = compare(np.asarray(got.streams, np.float64) - base, np.asarray(ref.streams, np.float64) - base)
        row = {"layer": i, "kind": f"{cfg.attention_types[i].value}/{cfg.mlp_types[i].value}", **row}
        res["layers"].append(row)
        if on_layer is not None:
            on_layer(dict(row, seconds=time.perf_counter() - t))
        if i == n - 1:
            res["logits"] = compare(_head(top, got.streams, batch, cfg=cfg, kernels=kernels),
                                    _head(top, ref.streams, batch, cfg=cfg, kernels=reference))
        x = ref.streams
    checked = res["layers"] + [dict(res["logits"], layer="logits")]
    res["worst"] = min(_score(r) for r in checked)
    res["failures"] = [f"layer {r['layer']}: cosine {r['cosine']:.4f} < {min_cosine} or non-finite"
                       for r in checked if _score(r) < min_cosine]
    return res
