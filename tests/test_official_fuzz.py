"""Fuzzed checkpoints in the published layout (FP8 + E8M0 dense linears, I8-packed FP4 experts, shards + index),
through every load path: dequantized into float32 / float16, kept quantized, sharded onto a mesh.

Property: `ds4jax.load(..., check_finite=True)` loads values that are all finite, or raises a `Ds4jaxError`
(anything else fails). A longer, randomized run of this (thousands of examples; round 3, session 26) found the
sharded loader taking NaN scales and ignoring `check_finite`, a finite E8M0 scale of 2^127 loading as a block of
infinities on every path, and float16 loads whose overflow `check_finite` did not see
(`test_official_checkpoint.py` has a regression test for each).
"""

import glob
import json
import os
import shutil
import struct

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import ds4jax
from ds4jax.errors import Ds4jaxError
from ds4jax.io.official_random import write_official_random

CI = settings(derandomize=True, database=None, deadline=None, print_blob=False, max_examples=25,
              suppress_health_check=list(HealthCheck))
PATHS = {
    "float32": dict(dtype=jnp.float32),
    "float16": dict(dtype=jnp.float16, weights="bf16"),
    "kept": dict(dtype=jnp.float32, weights="checkpoint"),
    "kept float16": dict(dtype=jnp.float16, weights="checkpoint"),
    "sharded": dict(dtype=jnp.float32, mesh=dict(tensor=2)),
}


@pytest.fixture(scope="module")
def official(tmp_path_factory):
    directory = tmp_path_factory.mktemp("official_fuzz")
    write_official_random(directory, seed=5)
    return str(directory)


def _header(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw, n, json.loads(raw[8 : 8 + n])


def _mutate(directory: str, kind: str, pick: int, dtype: str, quantized_only: bool) -> None:
    shards = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    path = shards[pick % len(shards)]
    raw, n, header = _header(path)
    names = sorted(k for k in header if k != "__metadata__")
    if quantized_only:
        names = [k for k in names if header[k]["dtype"] in ("F8_E4M3", "F8_E8M0", "I8")] or names
    of = lambda dtypes: [k for k in names if header[k]["dtype"] in dtypes]  # noqa: E731
    body = bytearray(raw[8 + n :])

    def poke(name: str, byte: int, width: int = 1) -> None:  # a byte of one element of `name`
        lo, hi = header[name]["data_offsets"]
        if hi - lo >= width:
            body[lo + (pick % ((hi - lo) // width)) * width + width - 1] = byte

    name = names[pick % len(names)]
    if kind == "dtype":
        header[name]["dtype"] = dtype
    elif kind == "shape" and header[name]["shape"]:
        shape = header[name]["shape"]
        shape[pick % len(shape)] = max(0, shape[pick % len(shape)] + (1 if pick % 2 else -1))
    elif kind == "body":
        poke(name, (pick >> 8) & 0xFF)
    elif kind in ("scale", "huge") and of({"F8_E8M0"}):  # NaN (255), 2^127, 2^-127; huge: float16's limit
        byte = [0xFF, 0xFE, 0x00][pick % 3] if kind == "scale" else 127 + 14 + pick % 4
        poke(of({"F8_E8M0"})[pick % len(of({"F8_E8M0"}))], byte)
    elif kind == "large" and of({"BF16", "F32"}):  # a finite value past float16's range
        target = of({"BF16", "F32"})[pick % len(of({"BF16", "F32"}))]
        poke(target, 0x7E, 2 if header[target]["dtype"] == "BF16" else 4)
    elif kind == "drop":
        del header[name]
    elif kind == "swap":  # two tensors' entries exchanged (dtype, shape, bytes)
        other = names[(pick // 7) % len(names)]
        header[name], header[other] = header[other], header[name]
    elif kind == "index":
        index_path = os.path.join(directory, "model.safetensors.index.json")
        index = json.load(open(index_path))
        key = sorted(index["weight_map"])[pick % len(index["weight_map"])]
        if pick % 3 == 0:
            del index["weight_map"][key]
        else:
            index["weight_map"][key] = "absent.safetensors" if pick % 3 == 1 else os.path.basename(
                shards[(pick + 1) % len(shards)])
        json.dump(index, open(index_path, "w"))
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + bytes(body))


@CI
@given(kind=st.sampled_from(["dtype", "shape", "body", "scale", "huge", "large", "drop", "swap", "index"]),
       pick=st.integers(0, 10**9), path=st.sampled_from(sorted(PATHS)), quantized_only=st.booleans(),
       dtype=st.sampled_from(["F32", "BF16", "F16", "I64", "I8", "U8", "F8_E4M3", "F8_E8M0", "BOOL", ""]))
def test_fuzzed_official_checkpoint_loads_finite_or_raises_ours(official, tmp_path_factory, kind, pick, path,
                                                                quantized_only, dtype):
    directory = str(tmp_path_factory.mktemp("mutated"))
    shutil.copytree(official, directory, dirs_exist_ok=True)
    _mutate(directory, kind, pick, dtype, quantized_only)
    kwargs = dict(PATHS[path])
    if "mesh" in kwargs:
        kwargs["mesh"] = ds4jax.make_mesh(**kwargs["mesh"])
    try:
        model = ds4jax.load(directory, kwargs.pop("dtype"), check_finite=True, **kwargs)
    except Ds4jaxError as e:
        assert str(e)
        return
    for key_path, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]:
        if jnp.issubdtype(leaf.dtype, jnp.floating):
            assert np.isfinite(np.asarray(leaf, np.float32)).all(), (kind, path, jax.tree_util.keystr(key_path))
