"""What both sides of `bench_e2e.py` share: the cases, the prompts, the timing loop and the roofline arithmetic."""

from __future__ import annotations

import dataclasses
import json
import os
import time

import numpy as np

SEED = 0  # params: P.init(cfg, jax.random.key(SEED), bf16) on both sides
CHECK_CASE = "prefill_b1_s2048"  # its last-token logits are compared between the sides
CHECK_DECODE = "decode_b1_ctx2048"  # and the first greedy decode step of this case


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kind: str  # prefill | decode
    rows: int
    size: int  # prompt tokens (prefill) or context (decode)
    chunk: int = 2048  # prefill chunk
    new: int = 32  # decode steps per timed run
    hf: bool = True  # HF transformers measured too
    hf_only: bool = False
    note: str = ""


def cases(args) -> list[Case]:
    s = 32 if args.smoke else 1
    out = [Case("prefill_b1_s2048", "prefill", 1, 2048 // s, 2048 // s),
           Case("prefill_b8_s2048", "prefill", 8, 2048 // s, 2048 // s),
           Case("prefill_b1_s8192", "prefill", 1, 8192 // s, 2048 // s),
           Case("decode_b1_ctx2048", "decode", 1, 2048 // s, new=32 // (s // 8 or 1)),
           Case("decode_b8_ctx2048", "decode", 8, 2048 // s, new=32 // (s // 8 or 1))]
    if not args.smoke:
        no_hf = "HF not run: its eager attention needs [heads, ctx, ctx] scores for the 32k prompt (out of memory)"
        out += [Case("decode_b1_ctx32768", "decode", 1, 32768, hf=False, note=no_hf),
                Case("decode_b8_ctx32768", "decode", 8, 32768, hf=False, note=no_hf)]
    return out


def max_context(args) -> int:
    return max(c.size for c in cases(args)) + 64


def prompt_ids(rows: int, seq: int, vocab: int) -> np.ndarray:
    return np.random.default_rng(SEED).integers(0, vocab, (rows, seq)).astype(np.int32)


def cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def compare(got, ref) -> dict:
    """Two outputs of one computation (logits, or a layer's update): finite, cosine (NaN when either is all zero),
    max |got - ref|, that over max |ref|, and whether the argmax over the last axis agrees."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    finite = bool(np.isfinite(got).all() and np.isfinite(ref).all())
    return {"finite": finite, "cosine": cosine(got, ref) if finite else float("nan"),
            "max_abs_err": float(np.abs(got - ref).max()) if finite else float("nan"),
            "rel_err": float(np.abs(got - ref).max() / np.abs(ref).max()) if finite else float("nan"),
            "argmax_equal": bool((got.argmax(-1) == ref.argmax(-1)).all())}


def timed(fn, repeats: int) -> list[float]:
    """Wall seconds of `repeats` calls of fn (whose result is blocked on: jax arrays, or torch after a sync)."""
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        r = fn()
        _block(r)
        out.append(time.perf_counter() - t)
    return out


def _block(r) -> None:
    try:
        import jax

        jax.block_until_ready(r)
    except Exception:
        pass
    if "torch" in __import__("sys").modules:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()


def write_json(path: str, obj) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)  # a crash never leaves a half-written file


# ---- roofline ------------------------------------------------------------------------------------------------------

def param_bytes(cfg, params) -> dict:
    """Bytes of the weights a step may read: routed experts per expert, the rest (no MTP, no embedding table)."""
    import jax

    experts = other = head = 0
    n_exp = cfg.num_routed_experts
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path)
        if "mtp" in name or "embed" in name:
            continue
        if "experts" in name and "shared" not in name:
            experts += leaf.nbytes / n_exp
        elif name == "['head']":
            head += leaf.nbytes
        else:
            other += leaf.nbytes
    return {"per_expert": experts, "moe_layers": sum(1 for _ in cfg.mlp_types), "other": other, "head": head}


def decode_bytes(cfg, pb: dict, batch: int, ctx: int, kv_itemsize: int = 2, kv_row_bytes: int = 0) -> float:
    """Bytes one decode step must read: every non-routed weight, the distinct routed experts the batch can touch
    (at most batch * k per layer), the embedding rows, and each layer's KV (SWA window + CSA top-k entries and all
    indexer keys, or all HCA entries) of every request: `kv_itemsize` bytes per cached value (bf16: 2; the FP8 KV
    cache: 1) plus `kv_row_bytes` per cached row (the FP8 cache's float32 scale: 4)."""
    total = pb["other"] + pb["head"] + pb["per_expert"] * min(cfg.num_routed_experts, batch * cfg.num_experts_per_tok)
    total += batch * cfg.hidden_size * 2
    d, di = cfg.head_dim, cfg.index_head_dim
    from ds4jax.model.config import AttentionType

    for kind in cfg.attention_types:
        kv = cfg.sliding_window
        if kind is AttentionType.CSA:
            kv += min(cfg.index_topk, ctx // cfg.csa_ratio)
            total += batch * (ctx // cfg.csa_ratio) * (di * kv_itemsize + kv_row_bytes)
        elif kind is AttentionType.HCA:
            kv += ctx // cfg.hca_ratio
        total += batch * kv * (d * kv_itemsize + kv_row_bytes)
    return float(total)


def prefill_cost(cfg, pb: dict, params_count_active: float, rows: int, seq: int) -> tuple[float, float]:
    """(bytes, flops) of a prefill with last-token logits: every weight read once (all experts are touched at
    these sizes), 2 flops per active weight per token, and attention / indexer scores over the visible keys."""
    from ds4jax.model.config import AttentionType

    weights = pb["other"] + pb["head"] + pb["per_expert"] * cfg.num_routed_experts
    tokens = rows * seq
    flops = 2 * params_count_active * tokens + 2 * rows * cfg.hidden_size * cfg.vocab_size
    mean_pos = seq / 2
    for kind in cfg.attention_types:
        keys = min(cfg.sliding_window, mean_pos)
        if kind is AttentionType.CSA:
            keys += min(cfg.index_topk, mean_pos / cfg.csa_ratio)
            flops += 2 * tokens * cfg.index_num_heads * cfg.index_head_dim * mean_pos / cfg.csa_ratio
        elif kind is AttentionType.HCA:
            keys += mean_pos / cfg.hca_ratio
        flops += 4 * tokens * cfg.num_heads * cfg.head_dim * keys
    return float(weights), float(flops)


def active_params(cfg, params) -> float:
    """Weights one token multiplies by (no embedding, head or MTP): all but the unselected routed experts."""
    import jax

    total = 0.0
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        name = jax.tree_util.keystr(path)
        if "mtp" in name or "embed" in name or name == "['head']":
            continue
        size = leaf.size
        if "experts" in name and "shared" not in name:
            size = size / cfg.num_routed_experts * cfg.num_experts_per_tok
        total += size
    return total


def bandwidth_note(s: dict) -> str:
    """The roofline's denominator and which timing it is: device-timed when the profiler trace gave it, else
    host-timed with the reason (never a host figure labelled device-timed); results written before both were
    recorded show the one figure they have."""
    device, host = s.get("copy_bandwidth_device_timed_tb_s"), s.get("copy_bandwidth_host_timed_tb_s")
    if device:
        return f"{device:.2f} TB/s (device-timed: the roofline's denominator; host-timed {host or 0:.2f} TB/s)"
    if host is None:
        return f"{s.get('copy_bandwidth_tb_s') or 0:.2f} TB/s (timing not recorded)"
    why = s.get("copy_bandwidth_device_timed_error") or "not measured"
    return f"{host:.2f} TB/s (host-timed, the roofline's denominator: the device-timed measurement failed: {why})"
