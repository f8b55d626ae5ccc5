"""End-to-end prefill / decode benchmark of the pooled steps on a Flash-shaped slice (random bf16 weights).

Same workload as the HF transformers anchor in shared/research/hf_gpu_baseline.md: `flash_slice(4)`, prefill of
2048 (and 8192) tokens with last-token logits, greedy decode of 32 tokens after a 2048-token prompt at batch 1
and 8. Reports ms/step, tokens/s, the HBM roofline (bytes a step must read / measured copy bandwidth) and the
ratio to HF's numbers. Writes JSON + markdown under --out (each result is written as soon as it exists).

    python scripts/bench_e2e.py --out docs/benchmarks [--layers 4] [--kernels pallas|reference]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import ds4jax
from ds4jax.model import params as P
from ds4jax.runtime import steps
from ds4jax.model.handle import Model
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.pools import PoolBook, zeros
from ds4jax.runtime.roles import Role

# HF transformers 5.17, same GPU, same config (hf_gpu_baseline.md): seconds per prefill, ms per decode step
HF = {"prefill_b1_s2048": 0.089, "prefill_b1_s8192": 0.590, "prefill_b8_s2048": 0.527,
      "decode_b1_ctx2048": 32.5, "decode_b8_ctx2048": 24.1}


def copy_bandwidth() -> float:
    x = jnp.ones((1 << 30,), jnp.float32)  # 4 GiB
    f = jax.jit(lambda a: a * 1.0000001)
    f(x).block_until_ready()
    times = []
    for _ in range(5):
        t = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t)
    return 2 * x.nbytes / min(times)


def decode_bytes(cfg, params, batch: int, ctx: int) -> float:
    """Bytes one decode step must read: every non-routed weight, the routed experts the batch can touch, the
    embedding rows, and each layer's KV (ring + compressed entries + indexer keys) of every request."""
    total = 0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path)
        if "mtp" in name or "embed" in name:
            continue
        if "experts" in name:
            per_expert = leaf.nbytes / leaf.shape[0]
            total += per_expert * min(leaf.shape[0], batch * cfg.num_experts_per_tok)
        else:
            total += leaf.nbytes
    total += batch * cfg.hidden_size * 2
    d, di = cfg.head_dim, cfg.index_head_dim
    for kind in cfg.attention_types:
        kv = cfg.sliding_window
        if kind is ds4jax.AttentionType.CSA:
            kv += min(cfg.index_topk, ctx // cfg.csa_ratio)
            total += batch * (ctx // cfg.csa_ratio) * di * 2
        elif kind is ds4jax.AttentionType.HCA:
            kv += ctx // cfg.hca_ratio
        total += batch * kv * d * 2
    return float(total)


def timed(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        jax.block_until_ready(fn())
        out.append(time.perf_counter() - t)
    return out


class Bench:
    def __init__(self, model: Model, kernels: str, max_context: int, max_slots: int):
        self.model = model
        self.kernels = kernels
        self.spec = PoolSpec.for_role(model.config, role=Role.TARGET, max_slots=max_slots, max_context=max_context,
                                      dtype="bfloat16")

    def fresh(self, rows: int, lengths: list[int]):
        book = PoolBook(self.spec, self.model.config.vocab_size)
        for r in range(rows):
            book.admit(r)
            book.reserve(r, lengths[r])
        return book, book.sync(zeros(self.spec))

    def prefill(self, rows: int, seq: int, chunk: int):
        cfg = self.model.config
        ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (rows, seq)).astype(np.int32)

        def run():
            book, pool = self.fresh(rows, [seq + 64] * rows)
            out = None
            for s in range(0, seq, chunk):
                tok = ids[:, s : s + chunk]
                n = [tok.shape[1]] * rows
                batch = steps.StepBatch(jnp.arange(rows, dtype=jnp.int32), jnp.asarray(tok), jnp.asarray(n, jnp.int32))
                out, pool = steps.prefill(self.model.params, pool, batch, cfg=cfg, spec=self.spec,
                                          need_logits=s + chunk >= seq, kernels=self.kernels)
                book.commit(range(rows), n)
            return out.logits, pool, book

        return run

    def decode(self, rows: int, ctx: int, new: int):
        cfg = self.model.config
        logits, pool, book = self.prefill(rows, ctx, min(ctx, 2048))()
        jax.block_until_ready(pool)
        state = {"pool": pool, "logits": logits}

        def run():
            pool, logits = state["pool"], state["logits"]
            slots = jnp.arange(rows, dtype=jnp.int32)
            ones = jnp.ones((rows,), jnp.int32)
            for _ in range(new):
                tok = jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None]
                out, pool = steps.decode(self.model.params, pool, steps.StepBatch(slots, tok, ones), cfg=cfg,
                                         spec=self.spec, kernels=self.kernels)
                logits = out.logits
            # roll lengths back so every repeat decodes at the same context
            pool = pool.replace(lengths=pool.lengths - new)
            state["pool"], state["logits"] = pool, logits
            return logits

        return run


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kernels", default="pallas", choices=["pallas", "reference"])
    ap.add_argument("--skip", default="", help="comma-separated case names to skip")
    ap.add_argument("--smoke", action="store_true", help="tiny config and sizes (CPU check of the script)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, f"e2e_{args.kernels}.json")
    cfg = ds4jax.tiny() if args.smoke else ds4jax.flash_slice(args.layers)
    t = time.perf_counter()
    params = jax.jit(lambda k: P.init(cfg, k, jnp.bfloat16))(jax.random.key(0))
    jax.block_until_ready(params)
    model = Model(cfg, params)
    results = {"device": str(jax.devices()[0]), "jax": jax.__version__, "layers": args.layers,
               "kernels": args.kernels, "params_b": P.count(params) / 1e9, "init_s": time.perf_counter() - t,
               "copy_bandwidth_tb_s": (1e-3 if args.smoke else copy_bandwidth() / 1e12), "cases": {}}
    print(json.dumps({k: v for k, v in results.items() if k != "cases"}), flush=True)
    bw = results["copy_bandwidth_tb_s"] * 1e12
    scale = 32 if args.smoke else 1  # smoke: 64-token prompts
    bench = Bench(model, args.kernels, max_context=8192 // scale + 256, max_slots=8)
    skip = set(filter(None, args.skip.split(",")))
    cases = [("prefill_b1_s2048", "prefill", 1, 2048, 2048), ("prefill_b8_s2048", "prefill", 8, 2048, 2048),
             ("prefill_b1_s8192", "prefill", 1, 8192, 2048),
             ("decode_b1_ctx2048", "decode", 1, 2048, 32), ("decode_b8_ctx2048", "decode", 8, 2048, 32)]
    for name, kind, rows, size, extra in cases:
        if name in skip:
            continue
        size, extra = max(size // scale, 8), (max(extra // scale, 4) if kind == "prefill" else extra)
        try:
            t = time.perf_counter()
            if kind == "prefill":
                fn = bench.prefill(rows, size, extra)
                fn()  # compile
                compile_s = time.perf_counter() - t
                secs = statistics.median(timed(fn, 3))
                res = {"seconds": secs, "tokens_per_s": rows * size / secs, "compile_s": compile_s,
                       "hf_seconds": HF.get(name), "speedup_vs_hf": HF[name] / secs if name in HF else None}
            else:
                fn = bench.decode(rows, size, extra)
                fn()
                compile_s = time.perf_counter() - t
                secs = statistics.median(timed(fn, 3)) / extra
                need = decode_bytes(cfg, params, rows, size)
                roof = need / bw
                res = {"ms_per_step": secs * 1e3, "tokens_per_s": rows / secs, "compile_s": compile_s,
                       "bytes_per_step": need, "roofline_ms": roof * 1e3, "fraction_of_roofline": roof / secs,
                       "hf_ms_per_step": HF.get(name), "speedup_vs_hf": HF[name] / (secs * 1e3) if name in HF else None}
        except Exception as e:  # a failed case is recorded, the others still run
            res = {"error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()[-3000:]}
        results["cases"][name] = res
        print(name, json.dumps(res)[:600], flush=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        write_markdown(results, path[: -len(".json")] + ".md")
    return 0


def write_markdown(results: dict, path: str) -> None:
    lines = [f"# End-to-end steps: flash_slice({results['layers']}), kernels={results['kernels']}", "",
             f"{results['device']}, jax {results['jax']}, {results['params_b']:.2f} B params (bf16, random), "
             f"measured copy bandwidth {results['copy_bandwidth_tb_s']:.2f} TB/s", "",
             "| case | time | tokens/s | HF transformers | speedup vs HF | roofline | fraction of roofline |",
             "|---|---|---|---|---|---|---|"]
    for name, r in results["cases"].items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:120]} | | | | | |")
        elif "ms_per_step" in r:
            lines.append(f"| {name} | {r['ms_per_step']:.2f} ms/step | {r['tokens_per_s']:.0f} | "
                         f"{r['hf_ms_per_step']} ms/step | {r['speedup_vs_hf']:.1f}x | {r['roofline_ms']:.3f} ms | "
                         f"{100 * r['fraction_of_roofline']:.1f} % |")
        else:
            lines.append(f"| {name} | {r['seconds'] * 1e3:.1f} ms | {r['tokens_per_s']:.0f} | "
                         f"{r['hf_seconds'] * 1e3:.0f} ms | {r['speedup_vs_hf']:.1f}x | | |")
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
