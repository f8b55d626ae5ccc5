"""Load and save DeepSeek-V4 safetensors checkpoints in the `ds4jax.params` layout.

Naming schemes accepted by `load` (spec §5.1, §5.3), mixed freely as long as no tensor appears twice:

* upstream DeepSeek names: ``embed.weight``, ``layers.{i}.attn.wq_a.weight``, ``layers.{i}.ffn.experts.{x}.w1.weight``,
  ``mtp.0.*`` (also accepted under a ``model.`` prefix);
* transformers' in-memory names: ``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_a_proj.weight``,
  fused ``model.layers.{i}.mlp.experts.gate_up_proj`` [x, 2f, e] (rows = concat(w1, w3)) and ``down_proj`` [x, e, f],
  ``lm_head.weight``;
* what ``DeepseekV4ForCausalLM.save_pretrained`` writes in transformers 5.24: its reverse rename map is applied but the
  ``^``-anchored rules miss under the ``model.`` prefix, so it writes ``model.`` + upstream name, except
  ``head.weight`` (no prefix), ``model.embed_tokens.weight``, ``model.hc_head.hc_{fn,base,scale}``, and the attention
  kv-norm as ``model.layers.{i}.attn.norm.weight`` (the reverse of HF's ``.norm.`` -> ``.kv_norm.`` rule is lossy).

Quantized linears are dequantized at load with ``weights="bf16"`` and kept as stored with ``weights="checkpoint"``
(`ds4jax.io.quantized_load`; spec §5.2): FP8 = ``X.weight`` F8_E4M3 + block scales (``X.scale`` or HF's
``X.weight_scale_inv``; E8M0 bytes or float) over 128x128 blocks (``quantization_config.weight_block_size``);
FP4 = ``X.weight`` I8 [out, in/2] (low nibble = even element) + ``X.scale`` E8M0 [out, in/32].

Everything is validated against the headers before any tensor data is read; tensors are then read, dequantized and
converted one parameter leaf at a time, so at most one leaf's raw data is on the host at once.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from contextlib import ExitStack
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np
from safetensors.numpy import save_file

from ds4jax.compilation_cache import ensure_compilation_cache
from ds4jax.errors import ArgumentError, CheckpointError  # CheckpointError: importable from here too
from ds4jax.io import official_format, orbax_checkpoint, packed_params, quantized_load, sharded_load
from ds4jax.io.quant_formats import dequant_fp4, dequant_fp8, e8m0_to_float  # noqa: F401  (re-exported)
from ds4jax.io.safetensors_layout import (CONFIG_FILE, EXPERTS, FP8_WEIGHT, INDEX_FILE, T, WO_A, Leaf, Loc,
                                          as_loaded, check_tid2eid, open_shards, path_of, plan, read_config,
                                          read_scale, read_tensor, resolve, validate)
from ds4jax.model.config import Config, Numerics
from ds4jax.model import footprint, layer_stack
from ds4jax.model.handle import Model
from ds4jax.model.params import abstract
from ds4jax.model.quantized import dequantize_tree, has_quantized
from ds4jax.runtime import memory
from ds4jax.runtime.target import device_target


# ---- reading ------------------------------------------------------------------------------------------------------

def _read_source(loc: Loc, block: tuple[int, int], target: np.dtype, check_finite: bool = False) -> np.ndarray:
    """A source in checkpoint orientation, dequantized if stored quantized (with scales whose values fit
    `target`), in `target` if floating point (checked there with `check_finite`)."""
    dtype, _ = loc.shard.info(loc.key)
    w = read_tensor(loc.shard, loc.key, loc.expert)
    if loc.scale is not None:
        s = read_scale(*loc.scale, loc.expert, dtype, target)
        w = dequant_fp8(w, s, block) if dtype == FP8_WEIGHT else dequant_fp4(w, s)
    w = w if loc.rows is None else w[loc.rows]
    return as_loaded(w, target, loc.shard, loc.key, check_finite)


def _to_layout(a: np.ndarray, layout: str, target: jax.ShapeDtypeStruct) -> np.ndarray:
    if layout == T:
        return a.T
    if layout == WO_A:
        g, hd, o = target.shape
        return a.reshape(g, o, hd).transpose(0, 2, 1)
    return a



def _load_leaf(leaf: Leaf, locs: dict[str, Loc], cfg: Config, block: tuple[int, int],
               check_finite: bool = False, fp8_dtype=None) -> Any:
    """The leaf as a device array in its target dtype, or (with `fp8_dtype`: keeping the checkpoint's formats) as
    a `QuantizedWeight` of the stored bytes when it is stored quantized."""
    fmt = quantized_load.quantized_format(leaf, locs) if fp8_dtype is not None else None
    if fmt is not None:
        return quantized_load.load_quantized(leaf, locs, fmt, block, fp8_dtype, check_finite)
    np_dtype = np.dtype(leaf.target.dtype)
    if leaf.layout == EXPERTS:
        out = np.empty(leaf.target.shape, np_dtype)  # filled expert by expert: one expert's raw data at a time
        for x, name in enumerate(leaf.sources):
            out[x] = _read_source(locs[name], block, np_dtype, check_finite).T  # in np_dtype already
    else:
        loc = locs[leaf.sources[0]]
        a = _read_source(loc, block, np_dtype, check_finite)
        if leaf.integer:
            check_tid2eid(a, loc, cfg)
        out = np.ascontiguousarray(_to_layout(a, leaf.layout, leaf.target).astype(np_dtype, copy=False))
    # a transfer, not `jnp.asarray`: in jax 0.10+ that lifts a numpy array through an identity program compiled
    # once per shape (a checkpoint's leaves have dozens of shapes: as many compiles before the first token)
    return jax.device_put(out)



def check_dtype(dtype: Any) -> Any:
    """The compute dtype, validated: a floating-point dtype (float32, bfloat16, float16, ...)."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise ArgumentError("not a dtype", name="dtype", value=dtype) from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise ArgumentError("the compute dtype must be floating point (float32, bfloat16, float16); the "
                            "checkpoint's own dtypes are converted to it", name="dtype", value=dt.name)
    return dt


WEIGHTS = ("checkpoint", "bf16")


def weights_mode(weights: str | None, mesh=None) -> str:
    """`load`'s `weights`, resolved: None = "checkpoint" on a GPU without a mesh, else "bf16"."""
    if weights is None:
        return "checkpoint" if mesh is None and device_target().keeps_checkpoint_formats else "bf16"
    if weights not in WEIGHTS:
        raise ArgumentError(f"must be one of {WEIGHTS}", name="weights", value=weights)
    if weights == "checkpoint" and mesh is not None:
        raise ArgumentError("quantized weights on a mesh are not supported yet: pass weights='bf16' with a mesh",
                            name="weights", value=weights)
    return weights


def load(path: str | os.PathLike, dtype: Any = jnp.bfloat16, *, check_finite: bool = False, mesh=None,
         rules=None, weights: str | None = None, numerics: Numerics | str = Numerics.REFERENCE) -> Model:
    """Load a checkpoint directory (``config.json`` + ``*.safetensors``, optionally with an index, or our Orbax
    format: ``config.json`` + ``params/``, see `ds4jax.io.orbax_checkpoint`, or our packed one: ``config.json`` +
    ``params.safetensors``, see `ds4jax.io.packed_params`) into a `Model`.

    Compute-dtype leaves come back in `dtype`; norms, mHC, sinks, ape and router bias in float32; tid2eid int32.
    Raises `CheckpointError` on any missing / unexpected / mis-shaped / mis-typed tensor, missing shard, bad config,
    non-finite scale, and (with `check_finite`, one pass over the host data) any NaN / Inf weight, naming the
    tensor and its file; `ArgumentError` for a `dtype` that is not floating point.
    With ``mesh=ds4jax.make_mesh(...)`` (and optionally Flax logical-axis ``rules``), each device's block is read
    straight from the files into its shard (`ds4jax.io.sharded_load`) and the model runs on that mesh.
    `weights`: ``"checkpoint"`` keeps FP8 / FP4 weights in their stored format on the device
    (`ds4jax.model.quantized.QuantizedWeight`, `ds4jax.io.quantized_load`), ``"bf16"`` dequantizes them into
    `dtype`; default: "checkpoint" on a GPU, "bf16" on a CPU and on a mesh (no quantized sharding yet).
    Unquantized checkpoints load the same either way.
    `numerics`: ``"reference"`` (HF transformers' numbers) or ``"official"`` (the official inference code's FP8 /
    FP4 fake quantisation of KV, indexer and GEMM inputs; `ds4jax.model.official_numerics`), checked before any
    file is read.
    """
    numerics = Numerics.parse(numerics)
    model = _load(path, dtype, check_finite=check_finite, mesh=mesh, rules=rules, weights=weights)
    return model if numerics is model.config.numerics else model.with_numerics(numerics)


def _load(path, dtype, *, check_finite: bool, mesh, rules, weights) -> Model:
    ensure_compilation_cache()  # casting and placing the weights compiles too (ds4jax.compilation_cache)
    dtype = check_dtype(dtype)
    keep = weights_mode(weights, mesh) == "checkpoint"
    ckpt_dir = os.fspath(path)
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError("is not a directory" if os.path.exists(ckpt_dir) else "does not exist",
                              source=ckpt_dir)
    if mesh is not None and rules is not None:
        mesh = dataclasses.replace(mesh, rules=tuple(rules))
    # our formats: packed (the default model's; checked first, its file is also a *.safetensors) and Orbax
    ours = packed_params if packed_params.is_packed(ckpt_dir) else \
        orbax_checkpoint if orbax_checkpoint.is_orbax(ckpt_dir) else None
    if ours is not None:
        model = ours.load(ckpt_dir, dtype, layout=mesh)
        if check_finite:
            for key_path, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]:
                a = np.asarray(leaf)
                if not np.issubdtype(a.dtype, np.integer) and not np.isfinite(a).all():
                    raise CheckpointError(f"non-finite value in the {ours.FORMAT_NAME} params", source=ckpt_dir,
                                          name=jax.tree_util.keystr(key_path))
        return model
    if mesh is not None:
        return sharded_load.load_sharded(ckpt_dir, dtype, mesh, check_finite=check_finite)
    cfg, block = read_config(ckpt_dir)
    if not keep:  # dequantized weights: their size from the config, before any tensor is read
        memory.check_fits(*footprint.weights(cfg, dtype))
    with ExitStack() as stack:
        where = open_shards(ckpt_dir, stack)
        leaves, locs, raws = resolve(cfg, plan(cfg, dtype), where, ckpt_dir)
        for raw in raws:
            validate(raw, block)
        fp8_dtype = device_target().fp8_dtype if keep else None
        if keep:  # their size as kept (each leaf's format known now), before any tensor is read
            memory.check_fits(*quantized_load.kept_bytes(leaves, locs))
        arrays = {leaf.path: _load_leaf(leaf, locs, cfg, block, check_finite, fp8_dtype) for leaf in leaves}
    tree = abstract(cfg, dtype)
    if not any(p[0] == "mtp" for p in arrays):
        tree.pop("mtp", None)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    params = jax.tree_util.tree_unflatten(treedef, [arrays[path_of(kp)] for kp, _ in flat])
    return Model(config=cfg, params=layer_stack.for_loader(cfg, params))


# ---- saving -------------------------------------------------------------------------------------------------------

def _export(cfg: Config, params: dict) -> Iterator[tuple[str, Any, str, int | None]]:
    """(upstream name, leaf array, layout, expert index) for every tensor to write."""
    leaves = {leaf.path: leaf for leaf in plan(cfg, jnp.float32)}
    for key_path, array in jax.tree_util.tree_flatten_with_path(params)[0]:
        leaf = leaves[path_of(key_path)]
        if leaf.layout == EXPERTS:
            for x, name in enumerate(leaf.sources):
                yield name, array, leaf.layout, x
        else:
            yield leaf.sources[0], array, leaf.layout, None


def _checkpoint_array(array: Any, layout: str, expert: int | None) -> np.ndarray:
    a = np.asarray(array)
    if expert is not None:
        a = a[expert].T
    elif layout == T:
        a = a.T
    elif layout == WO_A:  # ours [g, h*d/g, o] -> [g*o, h*d/g]
        g, hd, o = a.shape
        a = a.transpose(0, 2, 1).reshape(g * o, hd)
    if np.issubdtype(a.dtype, np.integer):
        a = a.astype(np.int64)  # upstream stores tid2eid as I64
    return np.ascontiguousarray(a)


def _nbytes(name: str, array: Any, expert: int | None, quantize: str | None) -> int:
    shape = tuple(array.shape[1:]) if expert is not None else tuple(array.shape)
    return official_format.nbytes(name, shape, np.dtype(array.dtype), quantize)


def _check_savable(model: Model) -> None:
    """Every leaf the config declares is present with its shape (an MTP block may be absent), and nothing else."""
    if not isinstance(model, Model) or not isinstance(model.params, dict):
        raise ArgumentError("must be a ds4jax Model (config + params dict)", name="model", value=type(model).__name__)
    expected = {leaf.path: leaf.target.shape for leaf in plan(model.config, jnp.float32)}
    per_layer = jax.eval_shape(layer_stack.unstacked_params, model.params) if layer_stack.is_stacked(model.params) \
        else model.params
    got = {path_of(kp): getattr(a, "shape", None) for kp, a in jax.tree_util.tree_flatten_with_path(per_layer)[0]}
    if not any(p[0] == "mtp" for p in got):
        expected = {p: v for p, v in expected.items() if p[0] != "mtp"}
    for path in sorted(set(expected) | set(got), key=str):
        name = "params" + "".join(f"[{k!r}]" for k in path)
        if path not in got:
            raise ArgumentError("is missing", name=name)
        if path not in expected:
            raise ArgumentError("is not a parameter of this config", name=name)
        if tuple(got[path] or ()) != tuple(expected[path]):
            raise ArgumentError(f"has shape {got[path]}, the config needs {tuple(expected[path])}", name=name)


def save(model: Model, path: str | os.PathLike, max_shard_bytes: int = 5 * 1024**3, overwrite: bool = False,
         quantize: str | None = None, block: tuple[int, int] = (128, 128)) -> None:
    """Write `model` as an upstream-named checkpoint: ``config.json`` + safetensors in the params' dtypes.

    Linears are written ``[out, in]`` (bf16 or fp32, unquantized), experts one tensor per expert, tid2eid as I64.
    ``quantize="fp4"`` writes the published instruct format instead (FP8 E4M3 dense linears with E8M0 scales over
    `block`, FP4 routed experts, BF16/F32 elsewhere, upstream config keys; `ds4jax.io.official_format`),
    ``"fp8"`` the base format (FP8 experts too).
    Shards are cut before exceeding `max_shard_bytes` (a tensor larger than the limit gets a shard of its own);
    more than one shard also writes ``model.safetensors.index.json``. Refuses a directory that already holds
    safetensors files unless `overwrite` (which deletes them first).
    """
    out_dir = os.fspath(path)
    official_format.check_quantize(quantize)
    if isinstance(model, Model) and has_quantized(model.params):  # written as their values (re-encoded with
        model = dataclasses.replace(model, params=dequantize_tree(model.params, model.params["embed"].dtype))  # quantize)
    _check_savable(model)  # before anything is created or deleted
    created = not os.path.isdir(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    stale = glob.glob(os.path.join(out_dir, "*.safetensors")) + glob.glob(os.path.join(out_dir, INDEX_FILE))
    if stale and not overwrite:
        raise CheckpointError(f"{out_dir} already holds a checkpoint ({os.path.basename(stale[0])}); pass overwrite")
    for f in stale:
        os.remove(f)
    written: list[str] = []
    try:
        _write(model, out_dir, max_shard_bytes, quantize, block, written)
    except BaseException:  # a tensor that cannot be encoded, a full disk: no half-written checkpoint stays behind
        for f in written:
            if os.path.exists(f):
                os.remove(f)
        if created and not os.listdir(out_dir):
            os.rmdir(out_dir)
        raise


def _write(model: Model, out_dir: str, max_shard_bytes: int, quantize: str | None, block: tuple[int, int],
           written: list[str]) -> None:
    """`save`'s files, each path appended to `written` before it is opened."""
    shards: list[list[tuple[str, Any, str, int | None]]] = [[]]
    size = 0
    for entry in _export(model.config, layer_stack.unstacked_host(model.params)):
        n = _nbytes(entry[0], entry[1], entry[3], quantize)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map, total = {}, 0
    for fname, entries in zip(names, shards):
        tensors = {}
        for name, a, layout, x in entries:
            tensors.update(official_format.encode(name, _checkpoint_array(a, layout, x), quantize, block))
        written.append(os.path.join(out_dir, fname))
        save_file(tensors, written[-1], metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update({name: fname for name in tensors})
        del tensors
    if len(shards) > 1:
        written.append(os.path.join(out_dir, INDEX_FILE))
        with open(written[-1], "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    written.append(os.path.join(out_dir, CONFIG_FILE))
    with open(written[-1], "w") as f:
        json.dump(official_format.official_config(model.config, quantize, block), f, indent=2)
