"""How fast this machine is today, in the suite's own kind of work: printed by `.ci/run` before the tests, so that
a suite's seconds can be compared across runs on machines (or days) of different speed.

The same tree's suite has taken 686 s one day and 841 s the next on the "same" 2-core CI machine (user CPU 20.5 ->
25.5 min for identical work: `docs/status.md`, session 22). The suite is XLA:CPU compiling and Python tracing, so
the two figures here are one of each, small and fixed: a pure-Python loop, and the trace + lower + compile of a
fixed jitted program (60 chained matmul / tanh / softmax blocks) under the suite's XLA flags (tests/cheap_compile.py).
Best of three each; about 3 s in all.

    JAX_PLATFORMS=cpu python scripts/ci_calibration.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def python_loop_s() -> float:
    t = time.perf_counter()
    total = 0
    for i in range(3_000_000):
        total += i * i % 7
    return time.perf_counter() - t


def xla_compile_s(blocks: int = 60) -> float:
    import jax
    import jax.numpy as jnp

    def program(x, w):
        for i in range(blocks):  # unrolled on purpose: one body per block, as the suite's unrolled layers
            x = jax.nn.softmax(jnp.tanh(x @ w + i), axis=-1)
        return x

    x = jax.ShapeDtypeStruct((8, 64), jnp.float32)
    t = time.perf_counter()
    jax.jit(program).lower(x, x.update(shape=(64, 64))).compile()
    return time.perf_counter() - t


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", help="also write the figures here")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
    import cheap_compile

    os.environ.setdefault("XLA_FLAGS", cheap_compile.xla_flags(devices=4))
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_enable_compilation_cache", False)  # a compile, not a cache hit
    res = {"python_loop_s": min(python_loop_s() for _ in range(3)),
           "xla_compile_s": min(xla_compile_s() for _ in range(3)),
           "cpus": os.cpu_count(), "jax": jax.__version__}
    print(f"machine calibration: python loop {res['python_loop_s']:.3f} s, XLA:CPU trace + compile of the reference "
          f"program {res['xla_compile_s']:.3f} s ({res['cpus']} CPUs, jax {res['jax']}; scripts/ci_calibration.py)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
