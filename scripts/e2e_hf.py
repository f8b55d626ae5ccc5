"""The HF transformers side of `bench_e2e.py` (its own process, after the ds4jax side): `DeepseekV4ForCausalLM`
(eager attention, bf16) holding exactly ds4jax's random weights, timed on the same cases.

The weights: ds4jax's params are initialised with the same seed on the device (JAX, no preallocation), each
tensor is handed to torch through DLPack, laid out under its HF name (transposed linears, fused experts) and
copied into the HF model, and the JAX buffer is freed. Prefill = `model(ids, past_key_values=DynamicCache,
logits_to_keep=1)`; decode = greedy steps over that cache; a torch profiler trace of decode steps gives HF's device
busy time and kernel count per step.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import traceback

import numpy as np

import e2e_common as common


def hf_tensors(cfg, params):
    """Yield (HF names, producer of a torch tensor in HF layout, jax leaves to free) for every ds4jax leaf."""
    import jax
    import torch

    from ds4jax.io import safetensors_layout as sl

    leaves = {leaf.path: leaf for leaf in sl.plan(cfg, params["embed"].dtype)}
    experts = {}
    for key_path, array in jax.tree_util.tree_flatten_with_path(params)[0]:
        path = sl.path_of(key_path)
        if path[0] == "mtp":  # HF has no MTP block
            array.delete()
            continue
        leaf = leaves[path]
        if leaf.layout == sl.EXPERTS:  # HF fuses them: gate_up_proj [x, 2f, e] = (w1 | w3)^T, down_proj = w2^T
            experts.setdefault(path[1], {})[path[-1]] = array
            continue
        t = torch.from_dlpack(array)
        if leaf.layout == sl.T:
            t = t.T
        elif leaf.layout == sl.WO_A:
            g, hd, o = t.shape
            t = t.permute(0, 2, 1).reshape(g * o, hd)
        yield sl.aliases(leaf.sources[0]), t, [array]
    for layer, w in experts.items():
        up = torch.cat([torch.from_dlpack(w["w1"]).transpose(1, 2), torch.from_dlpack(w["w3"]).transpose(1, 2)], 1)
        yield {f"model.layers.{layer}.mlp.experts.gate_up_proj"}, up, [w["w1"], w["w3"]]
        yield {f"model.layers.{layer}.mlp.experts.down_proj"}, torch.from_dlpack(w["w2"]).transpose(1, 2), [w["w2"]]


def build_hf(cfg, params, device: str):
    """DeepseekV4ForCausalLM (bf16, eager) with ds4jax's weights; raises naming any unmatched tensor."""
    import torch
    import transformers

    hf_cfg = transformers.DeepseekV4Config(**cfg.to_hf_dict())
    with torch.device(device):
        model = transformers.DeepseekV4ForCausalLM._from_config(hf_cfg, dtype=torch.bfloat16,
                                                                attn_implementation="eager")
    state = dict(model.named_parameters())
    state.update(dict(model.named_buffers()))
    done = set()
    with torch.no_grad():
        for names, tensor, arrays in hf_tensors(cfg, params):
            hit = [n for n in names if n in state]
            if len(hit) != 1:
                raise KeyError(f"no single HF tensor for {sorted(names)} (found {hit})")
            dst = state[hit[0]]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(f"{hit[0]}: HF shape {tuple(dst.shape)}, ours {tuple(tensor.shape)}")
            dst.copy_(tensor.to(device=dst.device, dtype=dst.dtype))
            done.add(hit[0])
            del tensor
            for a in arrays:
                a.delete()
    missing = sorted(n for n, _ in model.named_parameters() if n not in done)
    if missing:
        raise KeyError(f"HF parameters without a ds4jax tensor: {missing[:8]} ({len(missing)})")
    return model.eval()


def cuda_profile(fn, steps: int) -> dict:
    """Device busy time and kernel count per step of `fn` (which runs `steps` steps), from torch.profiler."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    spans = [(e.time_range.start, e.time_range.end) for e in kernels]
    per = {}
    for e in kernels:
        per[e.name] = per.get(e.name, 0) + e.time_range.end - e.time_range.start
    import device_trace

    top = sorted(per.items(), key=lambda kv: -kv[1])[:12]
    return {"device_busy_ms_per_step": device_trace.busy_ns(spans) / steps / 1e3,
            "kernels_per_step": len(kernels) / steps,
            "top_kernels_us_per_step": {k[:80]: round(v / steps, 1) for k, v in top}}


def main(args) -> int:
    import jax
    import jax.numpy as jnp
    import torch
    import transformers
    from transformers import DynamicCache

    import ds4jax
    from ds4jax.model import params as P

    cfg = ds4jax.tiny() if args.smoke else ds4jax.flash_slice(args.layers)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    res = {"side": "hf", "transformers": transformers.__version__, "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if device == "cuda" else "cpu", "cases": {}}
    t = time.perf_counter()
    try:
        params = jax.jit(lambda k: P.init(cfg, k, jnp.bfloat16))(jax.random.key(common.SEED))
        jax.block_until_ready(params)
        model = build_hf(cfg, params, device)
        del params
    except Exception as e:
        res["error"] = f"{type(e).__name__}: {e}"[:2000]
        res["trace"] = traceback.format_exc()[-3000:]
        common.write_json(args.part, res)
        return 1
    res["load_s"] = time.perf_counter() - t
    res["params_b"] = sum(p.numel() for p in model.parameters()) / 1e9
    print(json.dumps({k: v for k, v in res.items() if k != "cases"}), flush=True)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)

    @torch.no_grad()
    def prefill(ids):
        cache = DynamicCache(config=model.config)
        out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1].float(), cache

    for case in common.cases(args):
        if case.name in args.skip or not case.hf:
            continue
        try:
            ids = torch.as_tensor(common.prompt_ids(case.rows, case.size, cfg.vocab_size), dtype=torch.long,
                                  device=device)
            torch.cuda.reset_peak_memory_stats() if device == "cuda" else None
            if case.kind == "prefill":
                logits, _ = prefill(ids)
                if case.name == common.CHECK_CASE:
                    np.save(os.path.join(args.part_dir, "check_prefill_hf.npy"), logits[0].cpu().numpy())
                secs = statistics.median(common.timed(lambda: prefill(ids), 3 if case.size <= 2048 else 2))
                r = {"seconds": secs, "tokens_per_s": case.rows * case.size / secs}
            else:
                logits, cache = prefill(ids)
                sync()

                @torch.no_grad()
                def steps(n, logits=logits, cache=cache):
                    for _ in range(n):
                        tok = logits.argmax(-1, keepdim=True)
                        logits = model(input_ids=tok, past_key_values=cache, use_cache=True).logits[:, -1].float()
                    return logits

                first = steps(1)
                if case.name == common.CHECK_DECODE:
                    np.save(os.path.join(args.part_dir, "check_decode_hf.npy"), first[0].cpu().numpy())
                    r0 = {"check_token": int(logits[0].argmax())}
                else:
                    r0 = {}
                steps(4)  # warm-up (the cache grows: later runs decode at ctx + a few tokens, as HF generate does)
                secs = statistics.median(common.timed(lambda: steps(case.new), 3)) / case.new
                r = {"ms_per_step": secs * 1e3, "tokens_per_s": case.rows / secs, **r0}
                if device == "cuda":
                    r["profile"] = cuda_profile(lambda: steps(8), 8)
            if device == "cuda":
                r["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        except Exception as e:
            r = {"error": f"{type(e).__name__}: {e}"[:1500], "trace": traceback.format_exc()[-2500:]}
            if device == "cuda":
                torch.cuda.empty_cache()
        res["cases"][case.name] = r
        print("hf", case.name, json.dumps(r)[:400], flush=True)
        common.write_json(args.part, res)
    return 0
