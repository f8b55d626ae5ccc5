"""Compile every Pallas kernel of the Flash and Pro steps for MI300 (gfx942), MI355 (gfx950) and H200 (sm90) on a
CPU host with the pip `triton` wheel, and write the resource report (no GPU needed).

    JAX_PLATFORMS=cpu python scripts/rocm_kernels.py [--out docs/benchmarks] [--targets gfx942,gfx950,sm90]

Writes rocm_kernels.md and rocm_kernels.json; exits 1 if a kernel exceeds a target's LDS / shared memory.
The JSON also records every compiled kernel's resources by `kernel_key` (its Triton IR, launch parameters, target
and Triton version): `tests/rocm/` compiles only kernels whose key is not recorded, and a sample of the recorded
ones again to check the records.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys

from tqdm import tqdm

from ds4jax.rocm_check import compile as triton_compile
from ds4jax.rocm_check.compile import TRITON_VERSION
from ds4jax.rocm_check.lowering import CASES, FP8_KV_CASES, PUBLISHED_CASES
from ds4jax.rocm_check.report import check, render, rows_for, tile_comparison
from ds4jax.rocm_check.targets import TARGETS


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--targets", default=",".join(TARGETS))
    args = ap.parse_args(argv)
    names = args.targets.split(",")
    rows = {}
    fp8 = []
    with tqdm(total=len(names) * (len(CASES) + len(PUBLISHED_CASES) + len(FP8_KV_CASES)),
              desc="lower + compile") as bar:
        for name in names:
            rows[name] = []
            for case in CASES + PUBLISHED_CASES:
                rows[name] += rows_for(TARGETS[name], [case])
                bar.update()
            for case in FP8_KV_CASES:
                fp8 += rows_for(TARGETS[name], [case])
                bar.update()
    comparison = tile_comparison()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "rocm_kernels.md"), "w") as f:
        f.write(render(rows, comparison))
    with open(os.path.join(args.out, "rocm_kernels.json"), "w") as f:
        resources = {k: dataclasses.asdict(v) for k, v in sorted(triton_compile.compiled.items())}
        json.dump(dict(triton=TRITON_VERSION, rows=[r.as_dict() for rs in rows.values() for r in rs],
                       resources=resources), f, indent=1)
    problems = check([r for rs in rows.values() for r in rs] + fp8)
    for p in problems:
        print("FAIL:", p, file=sys.stderr)
    print(f"{sum(map(len, rows.values()))} kernels compiled; wrote {args.out}/rocm_kernels.md")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
