"""What fits where in DeepSeek-V4's published format (FP8 dense + FP4 experts), from the config alone: the largest
`flash_slice(n)` one H200 holds, and Flash's 43 layers on 2 and 8 devices (issue 26). Nothing is read or allocated:
weight bytes from `ds4jax.io.stored_footprint` (checked against quantized models in tests/test_stored_footprint.py),
pool bytes from the engine's pool spec, per-device bytes from the mesh's shardings (`MeshLayout.memory_report`, on
forced host CPU devices standing in for GPUs).

    python scripts/quantized_fit.py            # writes docs/benchmarks/quantized_fit.{json,md}

Device memory: an H200 reports 143,771 MiB; JAX lets a process allocate 75 % of it by default
(``XLA_PYTHON_CLIENT_MEM_FRACTION``), so both 75 % and 95 % are shown. A step's working memory comes on top of
weights and pools; `footprint.step_bytes` gives a lower bound, counted here, and the measured decode of the
largest slice is the GPU's part (not in this script).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

DEVICES = 8
if "jax" not in sys.modules:  # forced host devices must be set before jax starts
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

H200_BYTES = 143_771 * 2**20
FRACTIONS = (0.75, 0.95)
DECODE = dict(max_slots=8, max_context=65536)  # pools of the cases below: 8 requests of 64k tokens
PREFILL_TOKENS = 2048  # the working memory counted: one 2048-token prefill chunk
FORMATS = (None, "fp8", "fp4")
LABEL = {None: "bf16", "fp8": "FP8 dense + FP8 experts", "fp4": "FP8 dense + FP4 experts (as published)"}


def pools_bytes(cfg, kv_dtype: str = "auto") -> int:
    from ds4jax.generation.engine import default_page_size
    from ds4jax.runtime import pool_spec
    from ds4jax.runtime.roles import Role

    spec = pool_spec.PoolSpec.for_role(cfg, role=Role.TARGET, page_size=default_page_size(cfg), dtype="bfloat16",
                                       **DECODE)
    if kv_dtype == "fp8":
        spec = spec.replace(kv_dtype="float8_e4m3fn")
    return pool_spec.total_bytes(spec)


def one_device(n: int, quantized: str | None) -> dict:
    from ds4jax.io.stored_footprint import weight_bytes
    from ds4jax.model import footprint
    from ds4jax.model.config import flash_slice

    cfg = flash_slice(n)
    w = weight_bytes(cfg, "bfloat16", quantized)
    pools = {kv: pools_bytes(cfg, kv) for kv in ("auto", "fp8")}
    step = footprint.step_bytes(cfg, PREFILL_TOKENS, "bfloat16")
    return {"layers": n, "format": LABEL[quantized], "weights": w, "pools_bf16": pools["auto"],
            "pools_fp8": pools["fp8"], "step": step, "total": w + pools["auto"] + step}


def largest(slices: list[dict], quantized: str | None, budget: int) -> int:
    """The most layers of `slices` (`one_device` rows) in format `quantized` whose total fits `budget` (0: none)."""
    return max((r["layers"] for r in slices if r["format"] == LABEL[quantized] and r["total"] <= budget), default=0)


def meshes() -> list[dict]:
    import jax.numpy as jnp

    from ds4jax.generation.engine import default_page_size
    from ds4jax.model.config import flash
    from ds4jax.runtime.mesh import make_mesh
    from ds4jax.runtime.pool_spec import PoolSpec
    from ds4jax.runtime.roles import Role

    cfg = flash()
    rows = []
    for name, axes in (("EP 2", dict(expert=2)), ("EP 8", dict(expert=8)), ("EP 4 x TP 2", dict(expert=4, tensor=2))):
        layout = make_mesh(**axes)
        spec = PoolSpec.for_role(cfg, role=Role.TARGET, page_size=default_page_size(cfg), dtype="bfloat16", **DECODE)
        for q in FORMATS:
            r = layout.memory_report(cfg, spec, jnp.bfloat16, quantized=q)
            rows.append({"layout": name, "devices": r["devices"], "format": LABEL[q], "params": r["params"],
                         "pools": r["pools"], "total": r["total"]})
    return rows


def gib(n: int) -> str:
    from ds4jax.runtime.mesh_plan import format_bytes

    return format_bytes(n)


def markdown(res: dict) -> str:
    lines = ["# What fits where: DeepSeek-V4 Flash in its published format", "",
             "Written by `python scripts/quantized_fit.py` from the config alone (nothing read or allocated; "
             "weight bytes from `ds4jax.io.stored_footprint`, per-device bytes from the mesh's shardings). "
             f"Pools: {DECODE['max_slots']} requests x {DECODE['max_context']} tokens in bf16 (the FP8 KV cache "
             f"halves the compressed pools); working memory: the lower bound of one {PREFILL_TOKENS}-token step "
             "(`footprint.step_bytes`). An H200 has 140.4 GiB; JAX allocates at most 75 % of it unless "
             "`XLA_PYTHON_CLIENT_MEM_FRACTION` says more.", "",
             "## One H200: the largest `flash_slice(n)`", "",
             "| format | n at 75 % (105.3 GiB) | n at 95 % (133.4 GiB) | weights per layer (about) |",
             "|---|---|---|---|"]
    for q in FORMATS:
        lab = LABEL[q]
        per = [r for r in res["slices"] if r["format"] == lab]
        step = (per[-1]["weights"] - per[0]["weights"]) / (per[-1]["layers"] - per[0]["layers"])
        lines.append(f"| {lab} | {res['largest'][lab]['0.75']} | {res['largest'][lab]['0.95']} | {gib(step)} |")
    lines += ["", "| n | format | weights | pools (bf16 / FP8 KV) | step | total |", "|---|---|---|---|---|---|"]
    for r in res["slices"]:
        if r["layers"] in res["shown_layers"]:
            lines.append(f"| {r['layers']} | {r['format']} | {gib(r['weights'])} | {gib(r['pools_bf16'])} / "
                         f"{gib(r['pools_fp8'])} | {gib(r['step'])} | {gib(r['total'])} |")
    lines += ["", "## All 43 layers on a mesh (per device, the busiest)", "",
              "| layout | devices | format | params | pools | total | fits an H200 at 95 % |",
              "|---|---|---|---|---|---|---|"]
    for r in res["meshes"]:
        fits = "yes" if r["total"] <= 0.95 * H200_BYTES else "no"
        lines.append(f"| {r['layout']} | {r['devices']} | {r['format']} | {gib(r['params'])} | {gib(r['pools'])} | "
                     f"{gib(r['total'])} | {fits} |")
    lines += ["", "Not measured here: decode speed of the largest slice (a GPU run of `scripts/bench_quantized.py` "
              "with that n), and the engine's activations beyond the one-step bound."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "docs", "benchmarks",
                                                  "quantized_fit"))
    args = ap.parse_args()
    slices = [one_device(n, q) for q in FORMATS for n in range(1, 44)]
    largest_n = {LABEL[q]: {str(f): largest(slices, q, int(f * H200_BYTES)) for f in FRACTIONS} for q in FORMATS}
    shown = sorted({1, 2, 4, 8, 16, 43, *(n for d in largest_n.values() for n in d.values() if n)})
    res = {"h200_bytes": H200_BYTES, "pools": DECODE, "step_tokens": PREFILL_TOKENS, "largest": largest_n,
           "shown_layers": shown, "slices": slices, "meshes": meshes()}
    with open(args.out + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()
