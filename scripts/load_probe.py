"""Where loading the default model goes in a fresh process (issue 22: 2.1 s on an H200 host, 0.11 s on a 2-core CPU).

    PYTHONPATH=. python scripts/load_probe.py --out load_probe.json

Times, in one process after the backend is up: the whole `default_model()` (first and second call), its parts (the
host read, the host stacking, the one ``jax.device_put`` of the tree, waiting for the transfers), then the same
tree placed again (a warm allocator), leaf by leaf, and as one byte buffer; and a cProfile of a third load
(tottime, top 25). Run it once as it is and once with ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` to see whether the
first allocation (75 % of the card by default) is what the first load pays.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, round(time.perf_counter() - t, 4)


def block(tree):
    import jax

    return jax.block_until_ready(tree)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--label", default="")
    args = ap.parse_args()
    t0 = time.perf_counter()
    import jax
    import numpy as np

    rec = {"label": args.label, "env": {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_"))}}
    rec["import_jax_s"] = round(time.perf_counter() - t0, 4)
    devices, rec["backend_s"] = timed(jax.devices)
    rec["device"] = str(devices[0].device_kind)
    from ds4jax.io import packed_params
    from ds4jax.io.default_model import default_checkpoint
    from ds4jax.model import layer_stack

    path = default_checkpoint()
    model, rec["first_load_s"] = timed(lambda: block(packed_params.load(path, np.float32)))
    _, rec["second_load_s"] = timed(lambda: block(packed_params.load(path, np.float32)))
    leaves = [np.asarray(x) for x in jax.tree.leaves(model.params)]
    rec["leaves"], rec["bytes"] = len(leaves), int(sum(x.nbytes for x in leaves))
    _, rec["tree_put_s"] = timed(lambda: block(jax.device_put(leaves, devices[0])))
    _, rec["tree_put_again_s"] = timed(lambda: block(jax.device_put(leaves, devices[0])))
    _, rec["leaf_by_leaf_put_s"] = timed(lambda: block([jax.device_put(x, devices[0]) for x in leaves]))
    flat = np.concatenate([x.reshape(-1).view(np.uint8) for x in leaves])
    _, rec["one_buffer_put_s"] = timed(lambda: block(jax.device_put(flat, devices[0])))
    host, rec["host_stack_s"] = timed(lambda: layer_stack.unstacked_host(model.params))
    del host
    prof = cProfile.Profile()
    prof.enable()
    _, rec["profiled_load_s"] = timed(lambda: block(packed_params.load(path, np.float32)))
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    rec["profile_tottime"] = text.getvalue().splitlines()[-40:]
    stats = devices[0].memory_stats() or {}
    rec["memory"] = {k: stats.get(k) for k in ("bytes_limit", "bytes_reserved", "bytes_in_use", "pool_bytes")}
    with open(args.out, "w") as f:
        json.dump(rec, f, indent=1)
    print(json.dumps({k: v for k, v in rec.items() if k != "profile_tottime"}, indent=1))
    print("\n".join(rec["profile_tottime"]))


if __name__ == "__main__":
    main()
