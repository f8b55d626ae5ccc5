"""How XLA:GPU compiles a one-token projection: whether the dot stays a GEMM (one kernel reading the weight) or is
strength-reduced to multiply + reduce with the [k, n] float32 product written out between two kernels (the
flash_slice(4) decode step at batch 1 does that for wq_a, wkv, the compressors, the router and the shared expert:
`scripts/step_kernels.py`). Each variant is one small program compiled on this device; its optimized HLO is
scanned for launches and for fusions whose output has >= k * n / 4 elements (a materialized product).

    PYTHONPATH=. python scripts/probe_gemv.py --out /tmp/gemv.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

import jax
import jax.numpy as jnp
from jax import lax

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import step_kernels  # noqa: E402  (scripts/: the launch counter)

K, N, N2 = 4096, 1024, 512


def _norm(h):  # rms_norm's shape of work: float32 statistics, one cast back
    h32 = h.astype(jnp.float32)
    return (h32 * lax.rsqrt(jnp.mean(h32 * h32, -1, keepdims=True) + 1e-6)).astype(jnp.bfloat16)


def _pad2(x):  # one token [1, 1, K] -> [2, K], a zero row added
    return jnp.pad(x.reshape(1, K), ((0, 1), (0, 0)))


def variants():
    """name -> (function, example args): the projection of a normed one-token hidden state."""
    x3 = jax.ShapeDtypeStruct((1, 1, K), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((K, N), jnp.bfloat16)
    stacked = jax.ShapeDtypeStruct((1, K, N), jnp.bfloat16)
    stacked2 = jax.ShapeDtypeStruct((1, K, N2), jnp.bfloat16)
    ein = lambda x, w: jnp.einsum("...i,io->...o", x, w, preferred_element_type=jnp.float32)  # noqa: E731
    dot2d = lambda x, w: lax.dot_general(x.reshape(-1, x.shape[-1]), w, (((1,), (0,)), ((), ())),  # noqa: E731
                                         preferred_element_type=jnp.float32).reshape(*x.shape[:-1], w.shape[-1])
    return {
        "einsum": (lambda x, w: ein(x, w), (x3, w)),
        "einsum_normed": (lambda x, w: ein(_norm(x), w), (x3, w)),
        "einsum_normed_stacked": (lambda x, w: ein(_norm(x), w[0]), (x3, stacked)),
        "einsum_normed_stacked_two": (lambda x, w, v: (ein(_norm(x), w[0]), ein(_norm(x), v[0])),
                                      (x3, stacked, stacked2)),
        "dot2d_normed_stacked_two": (lambda x, w, v: (dot2d(_norm(x), w[0]), dot2d(_norm(x), v[0])),
                                     (x3, stacked, stacked2)),
        "einsum_normed_concat": (lambda x, w, v: jnp.split(ein(_norm(x), jnp.concatenate([w[0], v[0]], -1)), [N], -1),
                                 (x3, stacked, stacked2)),
        "pad2_zero": (lambda x, w: dot2d(jnp.pad(_norm(x).reshape(1, K), ((0, 1), (0, 0))), w[0])[:1],
                      (x3, stacked)),
        "pad2_zero_two": (lambda x, w, v: tuple(dot2d(jnp.pad(_norm(x).reshape(1, K), ((0, 1), (0, 0))), m[0])[:1]
                                                for m in (w, v)), (x3, stacked, stacked2)),
        # two rows without a pad kernel of their own: a broadcast (which XLA's Triton GEMM fusion takes into its
        # operand), or the zero row padded on before the norm (the pad fused into the norm's input)
        "broadcast2": (lambda x, w: dot2d(jnp.broadcast_to(_norm(x).reshape(1, K), (2, K)), w[0])[:1], (x3, stacked)),
        "pad2_before_norm": (lambda x, w: dot2d(_norm(_pad2(x)), w[0])[:1], (x3, stacked)),
        "pad2_before_norm_two": (lambda x, w, v: tuple(dot2d(_norm(_pad2(x)), m[0])[:1] for m in (w, v)),
                                 (x3, stacked, stacked2)),
        "concat_self": (lambda x, w: dot2d(jnp.concatenate([_norm(x).reshape(1, K)] * 2), w[0])[:1], (x3, stacked)),
        "dot2d_bf16_out": (lambda x, w: lax.dot_general(_norm(x).reshape(1, K), w[0], (((1,), (0,)), ((), ()))),
                           (x3, stacked)),
        "matvec_transposed": (lambda x, w: lax.dot_general(w[0], _norm(x).reshape(K, 1), (((0,), (0,)), ((), ())),
                                                           preferred_element_type=jnp.float32), (x3, stacked)),
    }


def inspect(text: str) -> dict:
    """Launches per call (`step_kernels.launches`) and the launches whose float32 output has >= K * N2 / 4
    elements."""
    comps, big = step_kernels.parse(text), []
    for comp in step_kernels.scheduled(comps):
        for name, opcode, line in comps[comp]["instrs"]:
            if opcode in step_kernels.FREE_OPCODES:
                continue
            out = line.split("=", 1)[1].split(f" {opcode}(", 1)[0]
            for dims in re.findall(r"f32\[([\d,]+)\]", out):
                if math.prod(int(d) for d in dims.split(",")) >= K * N2 // 4:
                    big.append(f"{name}: f32[{dims}]")
    return {"launches": step_kernels.launches(text)["per_step"], "materialized": big}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    results = {"device": jax.devices()[0].device_kind, "jax": jax.__version__, "variants": {}}
    for name, (fn, ex) in variants().items():
        text = jax.jit(fn).lower(*ex).compile().as_text()
        results["variants"][name] = r = inspect(text)
        print(f"{name:32s} launches {r['launches']:3d}  materialized {r['materialized']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
