"""Write a random DeepSeek-V4 in the published checkpoint layout (FP8 + E8M0 dense, FP4 experts, sharded).

    python scripts/make_official_checkpoint.py DIR [--preset tiny] [--layers N] [--seed 0] [--quantize fp4|fp8]
                                               [--block 128] [--shards 3] [--overwrite]

`--preset flash_slice` with `--layers N` writes `ds4jax.flash_slice(N)` (real Flash shapes: big). Tensor names
carry no ``model.`` prefix, ``compress_ratios`` lists the MTP layer too; see `ds4jax.io.official_format`.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's ds4jax

import ds4jax  # noqa: E402
from ds4jax.io.official_random import write_official_random  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dst")
    p.add_argument("--preset", choices=("tiny", "flash_slice"), default="tiny")
    p.add_argument("--layers", type=int, default=4, help="flash_slice depth")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quantize", choices=("fp4", "fp8"), default="fp4")
    p.add_argument("--block", type=int, default=128, help="FP8 scale block (square)")
    p.add_argument("--shards", type=int, default=3)
    p.add_argument("--overwrite", action="store_true")
    args = p.parse_args(argv)
    cfg = ds4jax.tiny() if args.preset == "tiny" else ds4jax.flash_slice(args.layers)
    write_official_random(args.dst, cfg, seed=args.seed, quantize=args.quantize, block=(args.block, args.block),
                          shards=args.shards, overwrite=args.overwrite)
    print(f"wrote {args.dst}: {cfg.num_layers}-layer DeepSeek-V4, {args.quantize} experts")
    return 0


if __name__ == "__main__":
    sys.exit(main())
