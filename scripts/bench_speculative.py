"""Speculative (MTP) vs plain decoding: acceptance and tokens/s on the tiny config (random weights).

Random weights give near-zero acceptance; this measures the machinery (one compiled loop per k) and reports
what it reaches. Writes JSON + markdown to --out.

    python scripts/bench_speculative.py --out docs/benchmarks [--ks 1,2,3] [--new 64] [--batch 4]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import ds4jax
from ds4jax.model import params as P
from ds4jax.generation.generate import SamplingParams, generate
from ds4jax.model.handle import Model
from ds4jax.generation.speculative import speculative_generate
from ds4jax.runtime.kernels import resolve


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=48)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    # fp32 tiny model: GPU matmuls default to TF32, whose rounding differs between the 1-token and the
    # (k+1)-token step shapes; exact greedy agreement needs true fp32 products.
    jax.config.update("jax_default_matmul_precision", "highest")
    cfg = ds4jax.tiny()
    model = Model(cfg, P.init(cfg, jax.random.key(0), jnp.float32))
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(3, cfg.vocab_size, args.prompt_len + 7 * i)) for i in range(args.batch)]
    sp = SamplingParams(max_new_tokens=args.new)
    # generate and speculative_generate both build an Engine with kernels=None: this is what each of them runs.
    kernels = resolve(None).value
    results = {"device": str(jax.devices()[0]), "jax": jax.__version__, "config": "tiny", "batch": args.batch,
               "new_tokens": args.new, "kernels": {"plain": kernels, "speculative": kernels}, "runs": {}}

    generate(model, prompts, sp)  # compile
    t = time.perf_counter()
    plain = generate(model, prompts, sp)
    secs = time.perf_counter() - t
    results["runs"]["plain"] = {"seconds": secs, "tokens_per_s": sum(map(len, plain)) / secs}
    print("plain", results["runs"]["plain"], flush=True)
    for k in [int(x) for x in args.ks.split(",")]:
        speculative_generate(model, prompts, sp, k=k)  # compile
        res = speculative_generate(model, prompts, sp, k=k)
        results["runs"][f"k{k}"] = {
            "seconds": res.seconds, "tokens_per_s": res.tokens_per_second, "rounds": res.rounds,
            "mean_accepted": res.mean_accepted, "mean_tokens_per_round": res.mean_tokens_per_round,
            "equals_plain_greedy": res.tokens == plain}
        print(f"k{k}", results["runs"][f"k{k}"], flush=True)
    with open(os.path.join(args.out, "speculative_tiny.json"), "w") as f:
        json.dump(results, f, indent=1)
    lines = ["| run | tokens/s | mean accepted / round | tokens / round | equals plain greedy |", "|---|---|---|---|---|"]
    for name, r in results["runs"].items():
        acc = np.mean(r.get("mean_accepted", [0])) if "mean_accepted" in r else "-"
        tpr = np.mean(r.get("mean_tokens_per_round", [1])) if "mean_tokens_per_round" in r else 1
        lines.append(f"| {name} | {r['tokens_per_s']:.1f} | {acc if isinstance(acc, str) else f'{acc:.2f}'} | "
                     f"{tpr:.2f} | {r.get('equals_plain_greedy', '-')} |")
    with open(os.path.join(args.out, "speculative_tiny.md"), "w") as f:
        f.write(f"# Speculative vs plain decoding, tiny config, {results['device']}\n\n"
                f"batch {args.batch}, {args.new} new tokens, random weights (acceptance near 0 is expected); "
                f"kernels: {kernels} for plain and speculative (every target and draft step goes through the "
                f"engine's kernel dispatcher); jax {jax.__version__}\n\n"
                + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
