"""Scanned vs unrolled layers on one device, in the published format (FP8 dense + FP4 experts): the logits of one
decode step (after a 2048-token prefill) through the Pallas kernels and through the jnp reference kernels, each on
the scanned (`lax.scan`) and the unrolled layout of the same weights. The four pairwise cosines tell a fault of the
scanned path (scanned differs from unrolled under the same kernels) from the kernels' own numerics drifting with
depth (Pallas differs from reference the same way in both layouts).

Usage (GPU): python scripts/scan_parity.py --layers 8 --out $OUT/scan_parity.json
Exit status 1 when scanned and unrolled disagree (cosine < --min-cosine) under either kernel set.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402

import ds4jax  # noqa: E402
import e2e_common as common  # noqa: E402
from bench_quantized import cases, check_logits  # noqa: E402
from e2e_common import compare  # noqa: E402
from e2e_ds4jax import Bench  # noqa: E402
from ds4jax.model.quantize import random_quantized_model  # noqa: E402
from ds4jax.runtime.target import device_target  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--case", default="decode_b1_ctx2048")
    ap.add_argument("--min-cosine", type=float, default=0.999)
    ap.add_argument("--smoke", action="store_true", help="the tiny config, interpreted kernels (CPU)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    cfg = ds4jax.tiny() if args.smoke else ds4jax.flash_slice(args.layers)
    case = next(c for c in cases(args.smoke) if c.name == args.case)
    pallas = "pallas_interpret" if args.smoke else "pallas"
    t0 = time.perf_counter()
    model = random_quantized_model(cfg, jax.random.key(common.SEED), "fp4", fp8_dtype=device_target().fp8_dtype)
    logits = {}
    for layout in ("scanned", "unrolled"):
        m = model if layout == "scanned" else model.unrolled()
        for kernels in (pallas, "reference"):
            key = f"{layout}/{'pallas' if kernels != 'reference' else 'reference'}"
            logits[key] = check_logits(Bench(m, kernels, max_context=2048 + 512, max_slots=8), case)
            print(key, f"{time.perf_counter() - t0:.1f} s", flush=True)
        del m
        gc.collect()
    names = sorted(logits)
    pairs = {f"{a} vs {b}": compare(logits[a], logits[b]) for i, a in enumerate(names) for b in names[i + 1:]}
    failures = [k for k in ("scanned/pallas vs unrolled/pallas", "scanned/reference vs unrolled/reference")
                if not (pairs[k]["finite"] and pairs[k]["cosine"] >= args.min_cosine)]  # a NaN cosine fails
    res = {"layers": args.layers, "case": args.case, "device": str(jax.devices()[0]), "jax": jax.__version__,
           "scanned_segments": str(model.params["layers"].segments) if hasattr(model.params["layers"], "segments")
           else None, "pairs": pairs, "failures": failures, "seconds": time.perf_counter() - t0}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(json.dumps(res, default=str)[:3000])
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
