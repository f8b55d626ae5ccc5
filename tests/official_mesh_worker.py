"""Run by tests/test_official_checkpoint.py in a subprocess with 8 forced host devices (XLA_FLAGS must be set
before jax starts; the suite runs with 4): load an official-layout checkpoint onto an expert=4 x tensor=2 mesh and
compare every leaf with the single-device load. Prints the mismatching leaves (none: "[]") as JSON.

Usage: python tests/official_mesh_worker.py CHECKPOINT_DIR
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's ds4jax
os.environ["JAX_PLATFORMS"] = "cpu"
from cheap_compile import relax_gc, xla_flags  # noqa: E402  (tests/, this script's folder)

os.environ["XLA_FLAGS"] = xla_flags(devices=8)
relax_gc()

import json  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ds4jax  # noqa: E402
from ds4jax.runtime.mesh import make_mesh  # noqa: E402


def main(directory: str) -> None:
    layout = make_mesh(expert=4, tensor=2)
    sharded = ds4jax.load(directory, jnp.float32, mesh=layout)
    single = ds4jax.load(directory, jnp.float32)
    bad = []
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(sharded.params)[0], jax.tree.leaves(single.params)):
        if len(a.sharding.device_set) != 8 or not np.array_equal(np.asarray(a), np.asarray(b)):
            bad.append(jax.tree_util.keystr(path))
    print(json.dumps(bad))


if __name__ == "__main__":
    main(sys.argv[1])
