"""Plan DeepSeek-V4 Flash and Pro past one machine, ahead of time and without allocating anything.

Each plan lowers and compiles a sharded decode step and a prefill chunk (``jax.jit(...).lower(abstract, sharded
shapes).compile()``) on forced host CPU devices standing in for GPUs, then reports per-device parameter and pool
bytes (from the shardings), the per-device peak from XLA's memory analysis, and the collectives of one step from
the compiled HLO. Writes docs/benchmarks/mesh_plan.md.

    python scripts/plan_mesh.py                    # Flash on 8 devices, Pro on 16 and 64 (writes the doc)
    python scripts/plan_mesh.py --only flash-ep8   # one plan, printed
    python scripts/plan_mesh.py --smoke            # tiny config on 8 devices (seconds; CI)

The routed-expert strategy is the one a GPU picks for each device's experts (``gather`` for a few tokens, else
``tiles``); attention uses the reference ops (the Pallas kernels compile only for a GPU), so temp bytes are the
XLA reference's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

DEVICES = 64
if "jax" not in sys.modules:  # forced host devices must be set before jax starts
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={DEVICES}")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tqdm.auto import tqdm  # noqa: E402

import ds4jax  # noqa: E402
from ds4jax.model.sharding import default_rules, spec_axes  # noqa: E402
from ds4jax.runtime.mesh import make_mesh  # noqa: E402
from ds4jax.runtime.mesh_plan import Plan, markdown, plan_step, target_spec  # noqa: E402

# name -> (config, mesh, decode slots, context, prefill rows, prefill chunk)
PLANS = {
    "flash-ep8": ("flash", dict(expert=8), 64, 8192, 1, 2048),
    "flash-tp2-ep4": ("flash", dict(tensor=2, expert=4), 64, 8192, 1, 2048),
    "pro-ep16": ("pro", dict(expert=16), 64, 8192, 1, 2048),
    "pro-dp4-ep16": ("pro", dict(data=4, expert=16, rules="experts_over_data"), 256, 8192, 4, 2048),
}
EXTRA = {  # more layouts: --only NAME
    "flash-split2-ep4": ("flash", dict(layer_split=2, expert=4), 64, 8192, 1, 2048),
    "pro-tp2-ep8": ("pro", dict(tensor=2, expert=8), 64, 8192, 1, 2048),
    "pro-ep64": ("pro", dict(expert=64), 256, 8192, 1, 2048),
}
SMOKE = {"tiny-ep8": ("tiny", dict(expert=8), 8, 64, 1, 16),
         "tiny-dp2-tp2-ep2": ("tiny", dict(data=2, tensor=2, expert=2), 8, 64, 2, 16)}


def config(name):
    return {"flash": ds4jax.flash, "pro": ds4jax.pro, "tiny": lambda: ds4jax.tiny(num_heads=8, o_groups=4)}[name]()


def mesh_args(mesh: dict) -> dict:
    kw = dict(mesh)
    if kw.pop("rules", None) == "experts_over_data":  # DP ranks split the experts too
        kw["rules"] = tuple((k, ("data", "expert")) if k == "experts" else (k, v) for k, v in default_rules())
    return kw


def gpu_strategy(cfg, layout, tokens: int) -> str:
    """The routed-expert strategy `moe.moe_strategy` picks on a GPU for one device's experts."""
    local = cfg.num_routed_experts
    for a in spec_axes(layout.param_shardings(cfg)["layers"][0]["ffn"]["experts"]["w1"].spec[0]):
        local //= layout.axis_sizes[a]
    return "gather" if tokens * cfg.num_experts_per_tok <= local // 2 else "tiles"


def run(names, table, results=None, on_plan=None):
    """Plan `names`; with a `results` JSON-lines file, finished plans are appended as they finish and skipped
    when the script is run again (an interrupted run loses nothing)."""
    done = {}
    if results and os.path.exists(results):
        with open(results) as f:
            for line in f:
                if line.strip():
                    rec = json.loads(line)
                    done[(rec["key"], rec["step"])] = Plan(**{k: v for k, v in rec.items() if k != "key"})
    plans = []
    for name in tqdm(names, desc="plans", unit="plan"):
        model, mesh, slots, context, rows, chunk = table[name]
        cfg = config(model)
        layout = make_mesh(**mesh_args(mesh))
        spec = target_spec(cfg, slots=slots, context=context)
        for n, c in ((slots, 1), (rows, chunk)):
            step = f"{'decode' if c == 1 else f'prefill {c}'} x {n}"
            if (name, step) in done:
                plans.append(done[(name, step)])
                continue
            os.environ["DS4JAX_MOE"] = gpu_strategy(cfg, layout, n * c)
            plan = plan_step(layout, cfg, spec, rows=n, chunk=c, name=f"{name} ({layout.describe()})")
            plans.append(plan)
            tqdm.write(markdown([plan]).splitlines()[-1])
            if results:
                with open(results, "a") as f:
                    f.write(json.dumps({"key": name, **dataclasses.asdict(plan)}) + "\n")
            if on_plan:
                on_plan(plans)
    return plans


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", nargs="*", choices=sorted(PLANS) + sorted(EXTRA) + sorted(SMOKE))
    ap.add_argument("--smoke", action="store_true", help="tiny config on 8 devices")
    ap.add_argument("--out", default=None, help="markdown file (default: docs/benchmarks/mesh_plan.md for a full run)")
    args = ap.parse_args(argv)
    table = {**PLANS, **EXTRA, **SMOKE}
    names = args.only or (list(SMOKE) if args.smoke else list(PLANS))
    out = args.out or (None if args.only or args.smoke else os.path.join("docs", "benchmarks", "mesh_plan.md"))
    t0 = time.perf_counter()

    def write(plans):
        if out:
            with open(out, "w") as f:
                f.write(HEADER.format(devices=DEVICES) + markdown(plans) + FOOTER)

    plans = run(names, table, results=out and os.path.splitext(out)[0] + ".jsonl", on_plan=write)
    write(plans)
    print(markdown(plans))
    print(f"{time.perf_counter() - t0:.0f} s" + (f"; wrote {out}" if out else ""))
    return plans


HEADER = """# Mesh plans: DeepSeek-V4 Flash on 8 devices, Pro on 16 and 64 (ahead of time, nothing allocated)

Written by `python scripts/plan_mesh.py` (CPU, {devices} forced host devices; per-plan results in mesh_plan.jsonl,
resumed when rerun). Each step is lowered and compiled on abstract, sharded shapes; nothing is allocated. To bound
compile time the step is compiled as per-layer programs (layer i alone, the first with the embedding, the last with
the head) and layers of the same (attention, MoE) kind share one program, like iterations of a scan: 6 programs
for Flash and for Pro instead of one 43- or 61-layer program. Columns:

* **params / pools per device**: bytes of the busiest device's shards (bf16 weights, bf16 KV pools, fp32
  compressor state), from the shardings the Flax logical-axis rules give;
* **peak per device**: params + pools + the largest per-layer program's temporaries from XLA's memory analysis
  (CPU backend, reference attention: the Pallas kernels only compile for a GPU; routed experts with the strategy
  a GPU picks for each device's experts);
* **collectives**: ops in the compiled HLO of every layer of one step, with the summed result bytes.

Decode: every slot one token with 8192 tokens of context capacity; prefill: one 2048-token chunk per data rank.

"""
FOOTER = """
Reading the table (an H200 holds about 139 GiB):

* Flash (bf16 weights) fits 8 devices with the experts split 8 ways: EP 8, or EP 4 x TP 2 (experts' FFN columns
  and attention heads over `tensor`, which also splits the attention weights: 73 vs 78 GiB of params, at the
  cost of 130 instead of 44 all-reduces per step). One all-reduce per layer is the expert-parallel MoE; TP adds
  the attention output and shared-expert all-reduces.
* Pro in bf16 does not fit 16 H200s (229 GiB of params per device with EP 16; FP8 experts would halve that).
  On 64 devices, DP 4 x EP 16 with the experts split over data x expert (64 ways) needs 91 GiB of params per
  device; its MoE all-gathers the tokens of the four data ranks (3 all-gathers per layer: activations, expert
  ids, weights) and reduce-scatters the results back.
"""


if __name__ == "__main__":
    main()
