"""Static instruction counts of the FP4 expert kernels' inner loops on sm90 (H100 / H200), on a host without a GPU:
the tile kernel's decodes (prefill and 16-row decode tiles) and the GEMV's (one row per selection; the word-wise
float16 decode also at 2 warps, where each thread holds two rows of a scale group and converts its scales once).

Each variant is lowered for CUDA on this host (`rocm_check.lowering.as_if_on`), its Triton IR compiled by the pip
`triton` wheel for sm90, the cubin disassembled (`nvdisasm`), and the instructions of its innermost loop (the body
between a label and the last backward branch to it) counted by class. The kernels are bound by their decode's ALU
work (docs/benchmarks/fp4_decode_h100/), so fewer loop instructions per weight is the static proxy for speed that
a GPU then has to confirm; nothing here is a timing.

    JAX_PLATFORMS=cpu python scripts/sass_count.py [--out docs/benchmarks/sass_fp4.json]

(`ds4jax` and `pallas_kernels` on the path: run from the repository root with `pip install -e .`.)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import json
import os
import re
import sys

import jax
import jax.numpy as jnp

from ds4jax.rocm_check.compile import compile_module, on_cubin
from ds4jax.rocm_check.extract import triton_kernels
from ds4jax.rocm_check.lowering import as_if_on
from ds4jax.rocm_check.targets import SM90

# instruction classes by opcode prefix (the first match wins; "uniform": the warp-uniform datapath's)
CLASSES = (("tensor", ("HMMA", "HGMMA", "QGMMA", "IMMA")),
           ("convert", ("F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP")),
           ("float", ("FFMA", "FMUL", "FADD", "FMNMX", "HFMA2", "HMUL2", "HADD2", "FSEL", "FSETP", "HMNMX2")),
           ("uniform", ("UIADD", "UMOV", "USEL", "ULEA", "USHF", "USGXT", "UISETP", "ULOP", "UIMAD", "UPRMT")),
           ("integer", ("IMAD", "IADD", "VIADD", "LOP3", "SHF", "PRMT", "ISETP", "SEL", "LEA", "IMNMX", "MOV", "SGXT",
                        "BMSK", "IABS", "I2I", "POPC", "FLO", "BFE", "BFI", "PLOP3")),
           ("memory", ("LDG", "LDS", "STS", "STG", "LDSM", "LDGSTS", "LDGDEPBAR", "DEPBAR", "UBLKCP", "SYNCS",
                       "ULDC", "LDC")),
           ("control", ("BRA", "BAR", "NOP", "EXIT", "WARPSYNC", "BSYNC", "BSSY", "YIELD", "ISBERD", "MEMBAR",
                        "FENCE", "WARPGROUP")))


def classify(op: str) -> str:
    for name, prefixes in CLASSES:
        if op.startswith(prefixes):
            return name
    return "other"


def sass(cubin: bytes) -> str:
    return on_cubin("nvdisasm", ["-c"], cubin)


def innermost_loop(text: str) -> list[str]:
    """Opcodes of the shortest body between a label and a later branch back to it (the innermost loop), the
    one-instruction `BRA` to itself that ends a kernel excepted."""
    lines = text.splitlines()
    labels, ops, best = {}, [], None
    for line in lines:
        m = re.match(r"^\s*\.?(L_x_\d+|\.L_x_\d+):", line)
        if m:
            labels[m.group(1).lstrip(".")] = len(ops)
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\b(.*?);", line)
        if not m:
            continue
        ops.append(m.group(1))
        target = re.search(r"`\(\.?(L_x_\d+)\)", m.group(2))
        if m.group(1).startswith("BRA") and target and target.group(1) in labels:
            body = ops[labels[target.group(1)]:]
            if len(body) > 1 and (best is None or len(body) < len(best)):  # not the `BRA .` after EXIT
                best = body
    return best or []


def count(fn, *args) -> dict:
    """Lower `fn(*args)` (abstract args) for sm90, compile its Triton kernels, count each one's loop."""
    with as_if_on(SM90.target):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(SM90.lowering,))
    out = {}
    for k in triton_kernels(lowered):
        compiled = compile_module(k.name, k.ttir, k.num_warps, k.num_stages, SM90)
        loop = innermost_loop(sass(compiled.asm["cubin"]))
        by_class = collections.Counter(classify(op) for op in loop)
        out[k.name] = {"loop_instructions": len(loop), "by_class": dict(sorted(by_class.items())),
                       "shared_bytes": compiled.metadata.shared, "num_warps": k.num_warps,
                       "num_stages": k.num_stages}
    return out


def _variant(fn, args, weights_per_step: int, num_warps: int) -> dict:
    (got,) = count(fn, *args).values()
    got["instructions_per_weight_per_thread"] = got["loop_instructions"] / (weights_per_step / (32 * num_warps))
    return got


def tile_variants(rows: int, k: int = 4096, n: int = 2048, experts: int = 256,
                  decodes: tuple[str, ...] = ("bits", "arith", "f16")) -> dict:
    """The tile kernel's `decodes` for gate + up at Flash dims, `rows` rows in tiles of 16 (decode) or 64 (prefill)."""
    import pallas_kernels
    from pallas_kernels.grouped_matmul_fp4 import BlockSizes

    S = jax.ShapeDtypeStruct
    tile_m = 16 if rows <= 16 else 64
    tiles = max(rows // tile_m, 1)
    w = (S((experts, k // 2, n), jnp.uint8), S((experts, k // 32, n), jnp.uint8))
    args = (S((tiles * tile_m, k), jnp.bfloat16), (w, w), S((tiles,), jnp.int32))
    res = {}
    for decode in decodes:
        bs = dataclasses.replace(BlockSizes.get_default(jnp.bfloat16, tile_m), decode=decode)
        fn = functools.partial(pallas_kernels.grouped_matmul_fp4, block_sizes=bs)
        # a step: block_j packed rows x block_n columns, two nibbles each, gate and up
        res[f"tile_{decode}"] = _variant(fn, args, 2 * 2 * bs.block_j * bs.block_n, bs.num_warps)
    return res


def gemv_variants(selections: int, k: int = 4096, n: int = 2048, experts: int = 256) -> dict:
    """The GEMV's decodes for gate + up at Flash dims (`gemv_block_sizes`' tiles, each decode)."""
    import pallas_kernels
    from pallas_kernels.grouped_matmul_fp4 import gemv

    S = jax.ShapeDtypeStruct
    w = (S((experts, k // 2, n), jnp.uint8), S((experts, k // 32, n), jnp.uint8))
    args = (S((selections, k), jnp.bfloat16), (w, w), S((selections,), jnp.int32))
    res = {}
    for decode, num_warps in (("bits", 4), ("quarter", 4), ("fp8", 4), ("f16", 4), ("f16", 2)):
        bs = dataclasses.replace(gemv.GEMV_DEFAULT, decode=decode, num_warps=num_warps)
        fn = functools.partial(pallas_kernels.grouped_gemv_fp4, block_sizes=bs)
        # a step ("group" dots): one scale group, 16 packed rows x block_n columns, two nibbles each, gate and up
        name = f"gemv_{decode}" + ("" if num_warps == gemv.GEMV_DEFAULT.num_warps else f"_{num_warps}_warps")
        res[name] = _variant(fn, args, 2 * 2 * gemv.ROWS_PER_SCALE * bs.block_n, bs.num_warps)
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    res = {"target": "sm90", "triton": __import__("triton").__version__,
           "tile_gate_up_prefill_64_rows": tile_variants(512), "tile_gate_up_decode_16_rows": tile_variants(16),
           "gemv_gate_up_8_selections": gemv_variants(8)}
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
        with open(args.out[:-len(".json")] + ".md", "w") as f:
            f.write(markdown(res, os.path.basename(args.out)))
    return 0


def markdown(res: dict, json_name: str) -> str:
    lines = [f"# FP4 expert kernels: static instruction counts of the inner loop ({res['target']})", "",
             f"Written by `scripts/sass_count.py` from `{json_name}` (pip triton {res['triton']}, no GPU: counts, "
             "not timings). Per loop step: the instructions one thread issues, and per weight it decodes.", "",
             "| kernel and shape | variant | loop instructions | per weight per thread | by class |",
             "|---|---|---|---|---|"]
    for shape, variants in res.items():
        if not isinstance(variants, dict):
            continue
        for name, r in variants.items():
            classes = ", ".join(f"{k} {v}" for k, v in r["by_class"].items())
            lines.append(f"| {shape} | {name} | {r['loop_instructions']} | "
                         f"{r['instructions_per_weight_per_thread']:.2f} | {classes} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
