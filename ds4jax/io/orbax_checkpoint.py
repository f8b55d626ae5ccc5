"""Our own checkpoint format: ``config.json`` + the params pytree written by Orbax under ``params/``.

The tree is the `ds4jax.model.params` layout itself (linears ``[in, out]``, experts stacked), so nothing is renamed
or transposed; `load` checks every leaf's path, shape and dtype against the config before reading any data and
raises `CheckpointError` naming the first mismatch. A directory is written next to its destination and renamed
into place at the end (see `atomic_directory`), so an interrupted save never leaves a directory that loads.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.bounded_read import regular_files
from ds4jax.errors import CheckpointError
from ds4jax.io.safetensors_layout import read_config
from ds4jax.model import footprint, layer_stack
from ds4jax.model.handle import Model
from ds4jax.model.params import abstract
from ds4jax.model.quantized import dequantize_tree
from ds4jax.runtime import memory

PARAMS_DIR = "params"
FORMAT_NAME = "Orbax"  # in error messages
CONFIG_FILE = "config.json"


def is_orbax(path: str | os.PathLike) -> bool:
    """True when `path` holds an Orbax params tree (``params/`` with Orbax metadata)."""
    params = os.path.join(os.fspath(path), PARAMS_DIR)
    return any(os.path.exists(os.path.join(params, f)) for f in ("_CHECKPOINT_METADATA", "_METADATA"))


def _error(message: str) -> Exception:
    return CheckpointError(message)  # one error type for every checkpoint format


def _keystr(key_path) -> str:
    return ".".join(str(k.key if hasattr(k, "key") else k.idx) for k in key_path)


def _flat(tree: Any) -> dict[str, Any]:
    return {_keystr(kp): leaf for kp, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike, overwrite: bool = False) -> Iterator[str]:
    """Yield a fresh temporary directory beside `path`; on success rename it to `path`, on any error delete it.

    ``config.json`` is what makes a directory a checkpoint: writers put it last, and the temporary name starts
    with a dot, so even a killed process leaves only a hidden directory without a complete checkpoint name."""
    final = os.path.abspath(os.fspath(path))
    if os.path.exists(final) and (not overwrite or not os.path.isdir(final)):
        raise _error(f"{final} already exists; pass overwrite to replace it")
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.partial-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the checkpoint gets ordinary permissions
    try:
        yield tmp
        if os.path.exists(final):
            old = tempfile.mkdtemp(prefix=f".{os.path.basename(final)}.old-", dir=parent)
            os.rename(final, os.path.join(old, "x"))
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def write_params(params: Any, directory: str) -> None:
    """Orbax write of a params pytree into `directory`/params (synchronous)."""
    import orbax.checkpoint as ocp

    # numpy leaves; a quantized model is stored as its values (Orbax holds the params layout only): no device
    # placement recorded in the checkpoint; per-layer dicts: the stored layout does not depend on how a model runs
    # its layers
    host = layer_stack.unstacked_host(dequantize_tree(params, params["embed"].dtype))
    with ocp.StandardCheckpointer() as ckptr:
        ckptr.save(os.path.join(os.path.abspath(directory), PARAMS_DIR), host)
        ckptr.wait_until_finished()


def save(model: Model, path: str | os.PathLike, overwrite: bool = False) -> None:
    """Write `model` as ``config.json`` + Orbax ``params/`` in the params' own dtypes, atomically."""
    with atomic_directory(path, overwrite=overwrite) as tmp:
        write_params(model.params, tmp)
        with open(os.path.join(tmp, CONFIG_FILE), "w") as f:
            json.dump(model.config.to_hf_dict(), f, indent=2)


def stored_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """Flat {"layers.0.attn.wq_a": ArrayMetadata-like (shape, dtype)} read from the Orbax metadata (no data)."""
    import orbax.checkpoint as ocp

    params = os.path.join(os.path.abspath(os.fspath(path)), PARAMS_DIR)  # Orbax wants absolute paths
    regular_files(params, ("_METADATA", "_CHECKPOINT_METADATA", "_sharding", "manifest.ocdbt"), CheckpointError)
    try:
        with ocp.StandardCheckpointer() as ckptr:
            meta = ckptr.metadata(params)
    except Exception as e:  # Orbax raises assorted types for damaged metadata
        raise _error(f"cannot read Orbax metadata of {params}: {type(e).__name__}: {e}") from None
    tree = getattr(meta, "item_metadata", meta)
    tree = getattr(tree, "tree", tree)
    return _flat(tree)


def stored_transposed(name: str, shape: tuple, want: tuple) -> bool:
    """Whether stored leaf `name` is an mHC ``fn`` in the layout ds4jax wrote before round 3's session 31, [m*e,
    outputs] (now [outputs, m*e], the checkpoint's own: `mhc.raw_mixes`). m*e > outputs always, so the shape alone
    tells the two apart; such a leaf is read, then transposed."""
    return name.rsplit(".", 1)[-1] == "fn" and len(want) == 2 and want[0] != want[1] and tuple(shape) == want[::-1]


def check_stored(ckpt_dir: str, cfg, dtype: Any, stored: dict[str, tuple]
                 ) -> tuple[dict, dict[str, np.dtype], frozenset[str]]:
    """Check a stored params tree (flat name -> (shape, dtype)) against the config, before any data is read:
    every leaf's path, shape and integer-ness; the MTP block may be absent. Returns the target tree (abstract, in
    `dtype`'s per-leaf dtypes, without "mtp" when it is absent), per name the dtype to read the data as (the
    target's for an exact (widening) float cast, which the reader does on the host: it saves an eager convert
    program per leaf shape, ~0.5 s of a cached `ds4jax generate`; else the stored one, narrowing casts staying with
    XLA), and the names stored in an earlier layout that the reader transposes (`stored_transposed`). Shared by the
    Orbax and the packed (`ds4jax.io.packed_params`) formats."""
    target = abstract(cfg, dtype)
    if not any(k.startswith("mtp.") for k in stored):
        target.pop("mtp", None)  # like safetensors checkpoints, the MTP block is optional
    wanted = _flat(target)
    missing = sorted(set(wanted) - set(stored))
    unexpected = sorted(set(stored) - set(wanted))
    if missing or unexpected:
        raise _error(f"{ckpt_dir}: params tree does not match config.json: missing {missing[:5]}, "
                     f"unexpected {unexpected[:5]}")
    read_as, transposed = {}, set()
    for name, want in wanted.items():
        shape, have = tuple(stored[name][0]), np.dtype(stored[name][1])
        if stored_transposed(name, shape, tuple(want.shape)):
            transposed.add(name)
        elif shape != tuple(want.shape):
            raise _error(f"{ckpt_dir}: tensor {name} has shape {shape}, config.json implies {tuple(want.shape)}")
        if jnp.issubdtype(want.dtype, jnp.integer) != jnp.issubdtype(have, jnp.integer):
            raise _error(f"{ckpt_dir}: tensor {name} has dtype {have}, expected {np.dtype(want.dtype)}")
        widen = jnp.issubdtype(have, jnp.floating) and jnp.issubdtype(want.dtype, jnp.floating) and \
            np.dtype(want.dtype).itemsize >= have.itemsize
        read_as[name] = np.dtype(want.dtype) if widen else have
    return target, read_as, frozenset(transposed)


def load(path: str | os.PathLike, dtype: Any = jnp.bfloat16, layout=None) -> Model:
    """Read an Orbax checkpoint directory into a `Model` (same dtype rules as the safetensors loader).

    With a `layout` (`ds4jax.make_mesh`), each leaf is restored with its mesh sharding: Orbax reads only the
    chunks of each device's block (host-local when several processes share the mesh)."""
    import orbax.checkpoint as ocp

    ckpt_dir = os.fspath(path)
    cfg, _ = read_config(ckpt_dir)
    if layout is None:  # one device holds every weight (a mesh splits them)
        memory.check_fits(*footprint.weights(cfg, dtype))
    stored = stored_metadata(ckpt_dir)
    target, read_as, transposed = check_stored(ckpt_dir, cfg, dtype,
                                               {k: (m.shape, m.dtype) for k, m in stored.items()})
    wanted = _flat(target)
    device = jax.local_devices()[0]
    placed = {} if layout is None else _flat(layout.param_shardings(cfg, target))
    restore_as = {}
    for name, want in wanted.items():
        sharding = placed.get(name) or jax.sharding.SingleDeviceSharding(device)  # an mHC fn: replicated
        shape = tuple(want.shape)[::-1] if name in transposed else tuple(want.shape)
        restore_as[name] = jax.ShapeDtypeStruct(shape, read_as[name], sharding=sharding)
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    restore_tree = jax.tree_util.tree_unflatten(treedef, [restore_as[_keystr(kp)] for kp, _ in flat])
    try:
        with ocp.StandardCheckpointer() as ckptr:
            raw = ckptr.restore(os.path.join(os.path.abspath(ckpt_dir), PARAMS_DIR), restore_tree)
    except Exception as e:
        raise _error(f"cannot restore {ckpt_dir}/{PARAMS_DIR}: {type(e).__name__}: {e}") from None
    if transposed:
        raw = jax.tree_util.tree_map_with_path(lambda kp, a: a.T if _keystr(kp) in transposed else a, raw)
    params = jax.tree.map(lambda a, t: a if a.dtype == t.dtype else jnp.asarray(a).astype(t.dtype), raw, target)
    return Model(config=cfg, params=layer_stack.for_loader(cfg, params, layout), layout=layout)
