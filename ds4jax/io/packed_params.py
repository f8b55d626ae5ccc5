"""Our packed format: ``config.json`` + the params pytree in one safetensors file, ``params.safetensors``.

The tree is the `ds4jax.model.params` layout with per-layer dicts, as in our Orbax format (`orbax_checkpoint`):
each leaf is stored as it is, under its dotted path (``layers.0.attn.wq_a``), in its own dtype; the file's
metadata says ``{"format": "ds4jax-params"}``. It is what the default model ships in (checkpoints/default), because
it loads in one read and one transfer: the header is checked against the config (`orbax_checkpoint.check_stored`:
every leaf's path, shape and dtype, before any data is read), the data is read from the file map, exact widening
casts and the layer stacking are done on the host, and the whole tree goes to the device in one ``jax.device_put``.
Loading the default model this way takes ~0.1 s where the Orbax restore took ~0.85 s on a 2-core CPU (with the
orbax/tensorstore imports, which a ``ds4jax generate`` then skips; docs/benchmarks/cli_startup.md).

Orbax stays the format of large checkpoints (it reads each device's block of a mesh and needs no host copy of the
whole tree); `save` / ``ds4jax convert --to packed`` write this one.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.bounded_read import regular_file
from ds4jax.errors import CheckpointError
from ds4jax.io.orbax_checkpoint import CONFIG_FILE, _flat, _keystr, atomic_directory, check_stored
from ds4jax.io.safetensors_layout import read_config
from ds4jax.model import footprint, layer_stack
from ds4jax.model.handle import Model
from ds4jax.model.quantized import dequantize_tree
from ds4jax.runtime import memory

PARAMS_FILE = "params.safetensors"
FORMAT_NAME = "packed"  # in error messages
FORMAT = "ds4jax-params"


def is_packed(path: str | os.PathLike) -> bool:
    """True when `path` holds a packed params file (``params.safetensors``)."""
    return os.path.isfile(os.path.join(os.fspath(path), PARAMS_FILE))


def write_params(params: Any, directory: str) -> None:
    """Write a params pytree as `directory`/params.safetensors (numpy leaves in their own dtypes, per-layer dicts:
    the stored layout does not depend on how a model runs its layers)."""
    from safetensors.numpy import save_file

    host = layer_stack.unstacked_host(dequantize_tree(params, params["embed"].dtype))
    file = os.path.join(directory, PARAMS_FILE)
    save_file({name: np.ascontiguousarray(a) for name, a in _flat(host).items()}, file, metadata={"format": FORMAT})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(file, 0o666 & ~umask)  # safetensors creates it private; a checkpoint gets ordinary permissions


def save(model: Model, path: str | os.PathLike, overwrite: bool = False) -> None:
    """Write `model` as ``config.json`` + ``params.safetensors`` in the params' own dtypes, atomically."""
    import json

    with atomic_directory(path, overwrite=overwrite) as tmp:
        write_params(model.params, tmp)
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(model.config.to_hf_dict(), f, indent=2)


def stored_metadata(path: str | os.PathLike) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Flat {"layers.0.attn.wq_a": (shape, dtype)} from the file's header (no data read)."""
    file = os.path.join(os.fspath(path), PARAMS_FILE)
    with _opened(file) as f:
        return {name: (tuple(f.get_slice(name).get_shape()), _dtype(f.get_slice(name).get_dtype(), file, name))
                for name in f.keys()}


_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": jnp.bfloat16, "I64": np.int64,
           "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8}


def _dtype(name: str, file: str, key: str) -> np.dtype:
    if name not in _DTYPES:
        raise CheckpointError(f"unsupported dtype {name} in a packed params file", source=file, name=key)
    return np.dtype(_DTYPES[name])


def _opened(file: str):
    from safetensors import safe_open

    regular_file(file, CheckpointError)
    try:
        f = safe_open(file, framework="np")
    except Exception as e:  # corrupt header, not a safetensors file, ...
        raise CheckpointError(f"cannot read safetensors file {file}: {e}") from None
    if (f.metadata() or {}).get("format") != FORMAT:
        raise CheckpointError(f'is not a packed params file (its metadata has no "format": "{FORMAT}")',
                              source=file)
    return f


def load(path: str | os.PathLike, dtype: Any = jnp.bfloat16, layout=None) -> Model:
    """Read a packed checkpoint directory into a `Model` (the dtype rules of the other loaders).

    Without a `layout` the tree is stacked on the host and placed with one ``jax.device_put``; with one
    (`ds4jax.make_mesh`), each leaf is placed with its mesh sharding in that one call, then stacked there."""
    ckpt_dir = os.fspath(path)
    file = os.path.join(ckpt_dir, PARAMS_FILE)
    cfg, _ = read_config(ckpt_dir)
    if layout is None:  # one device holds every weight (a mesh splits them)
        memory.check_fits(*footprint.weights(cfg, dtype))
    with _opened(file) as f:
        stored = {name: (tuple(f.get_slice(name).get_shape()), _dtype(f.get_slice(name).get_dtype(), file, name))
                  for name in f.keys()}
        target, read_as, transposed = check_stored(ckpt_dir, cfg, dtype, stored)
        flat, treedef = jax.tree_util.tree_flatten_with_path(target)
        names = [_keystr(kp) for kp, _ in flat]
        try:  # the data is read here, from the file's map: exact widening casts on the host (check_stored), and
            # the transpose of a leaf in an earlier layout (the default model's file keeps the mHC fn's old one)
            host = [f.get_tensor(name).astype(read_as[name], copy=False) for name in names]
            host = [np.ascontiguousarray(a.T) if name in transposed else a for name, a in zip(names, host)]
        except Exception as e:  # truncated data, I/O errors: safetensors raises its own types
            raise CheckpointError(f"cannot read the tensor data ({type(e).__name__}: {e})", source=file) from None
    tree = jax.tree_util.tree_unflatten(treedef, host)
    if layout is None:
        params = jax.device_put(layer_stack.for_loader(cfg, tree, combine=_host_stack), jax.local_devices()[0])
    else:
        params = layer_stack.for_loader(cfg, jax.device_put(tree, layout.param_shardings(cfg, target)), layout)
    # narrowing casts (a float32 leaf into bfloat16) stay with XLA, as in the Orbax loader
    params = jax.tree.map(lambda a, t: a if a.dtype == t.dtype else a.astype(t.dtype), params,
                          layer_stack.for_loader(cfg, target, combine=_stacked_struct))
    return Model(config=cfg, params=params, layout=layout)


def _host_stack(*xs: np.ndarray) -> np.ndarray:
    """`for_loader`'s combine on the host: one leaf of every repetition (numpy's own `stack` takes a sequence)."""
    return np.stack(xs)


def _stacked_struct(*xs: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    """`for_loader`'s combine for the abstract target tree: the stacked leaf's shape and dtype."""
    return jax.ShapeDtypeStruct((len(xs), *xs[0].shape), xs[0].dtype)
