"""HF transformers reference for tests: random fp32 `DeepseekV4ForCausalLM` models built from a ds4jax `Config`.

A helper module (not collected by pytest). Everything here is written from the spec (§5.1, §5.3, §6.3) and the HF
module tree, independently of `ds4jax.checkpoint`, so tests can check the loader against it.

HF's `_init_weights` makes sinks, position biases, mHC bases, router biases and tid2eid trivial (zeros) and uses
std 0.02 for linears, which makes a tiny model almost linear. `randomize_` replaces every tensor with values that keep
each code path live: variance-preserving linears (std fan_in**-0.5), unit-scale embeddings, norm weights 1+N(0,0.1),
sinks N(0,1), position biases N(0,0.5), mHC bases N(0,0.1), mHC scales 1+N(0,0.1), router biases N(0,0.1) and
distinct random experts per token in tid2eid.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
import torch

from ds4jax.model.config import Config


def hf_config_kwargs(cfg: Config) -> dict[str, Any]:
    """`DeepseekV4Config` kwargs for `cfg`; layer schedules and rope scaling passed explicitly (spec §1.3)."""
    d = cfg.to_hf_dict()
    d["layer_types"] = [t.value for t in cfg.attention_types]
    d["mlp_layer_types"] = [t.value for t in cfg.mlp_types]
    d["compress_rates"] = {"compressed_sparse_attention": cfg.csa_ratio, "heavily_compressed_attention": cfg.hca_ratio}
    if cfg.yarn is not None:
        d["rope_scaling"] = {
            "type": "yarn", "factor": cfg.yarn.factor,
            "original_max_position_embeddings": cfg.yarn.original_max_position_embeddings,
            "beta_fast": cfg.yarn.beta_fast, "beta_slow": cfg.yarn.beta_slow,
        }
    d["attn_implementation"] = "eager"
    return d


def _normal(shape, std: float, gen: torch.Generator, mean: float = 0.0) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float32) * std + mean


def _random_value(name: str, shape: torch.Size, gen: torch.Generator) -> torch.Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("embed_tokens.weight"):
        return _normal(shape, 1.0, gen)
    if "norm" in name:  # every RMSNorm weight (input/post layernorms, q_a_norm, kv_norm, final norm)
        return _normal(shape, 0.1, gen, mean=1.0)
    if leaf == "sinks":
        return _normal(shape, 1.0, gen)
    if leaf == "position_bias":
        return _normal(shape, 0.5, gen)
    if leaf in ("base", "hc_base"):
        return _normal(shape, 0.1, gen)
    if leaf in ("scale", "hc_scale"):
        return _normal(shape, 0.1, gen, mean=1.0)
    # linears, routers, experts, mHC fn: variance preserving over the input (last) dim
    return _normal(shape, shape[-1] ** -0.5, gen)


@torch.no_grad()
def randomize_(model: torch.nn.Module, cfg: Config, seed: int = 0) -> None:
    """Overwrite every parameter and persistent buffer of an HF DeepSeek-V4 model with non-trivial random values."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        p.copy_(_random_value(name, p.shape, gen))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(_normal(b.shape, 0.1, gen))
        elif name.endswith("tid2eid"):  # k distinct experts per token
            noise = torch.rand((cfg.vocab_size, cfg.num_routed_experts), generator=gen)
            b.copy_(torch.argsort(noise, dim=-1)[:, : cfg.num_experts_per_tok])


def build_hf_model(cfg: Config, seed: int = 0):
    """A random fp32 `DeepseekV4ForCausalLM` (eval mode) with the architecture of `cfg`."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**hf_config_kwargs(cfg))).float().eval()
    randomize_(model, cfg, seed)
    return model


def save_hf_checkpoint(cfg: Config, directory: str | os.PathLike, seed: int = 0):
    """Build a random model and `save_pretrained` it (safetensors) into `directory`; returns the model."""
    model = build_hf_model(cfg, seed)
    model.save_pretrained(os.fspath(directory), safe_serialization=True)
    return model


@torch.no_grad()
def run_hf(model, token_ids: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """fp32 full forward, no cache: token_ids [B, S] -> (logits [B, S, V], per-layer output streams [B, S, hc, D]).

    Streams come from forward hooks on each decoder layer: HF's `output_hidden_states` records layer *inputs* plus
    the final normed state, so it lacks the last layer's streams.
    """
    streams: list[torch.Tensor] = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: streams.append(out[0] if isinstance(out, tuple) else out))
             for layer in model.model.layers]
    try:
        out = model(input_ids=torch.as_tensor(np.asarray(token_ids), dtype=torch.long), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return out.logits.float().numpy(), [s.float().numpy() for s in streams]


def upstream_state_dict(model, cfg: Config) -> dict[str, torch.Tensor]:
    """The model's tensors under upstream DeepSeek names (spec §5.1), in checkpoint orientation ([out, in])."""
    mm = model.model
    sd = {
        "embed.weight": mm.embed_tokens.weight, "head.weight": model.lm_head.weight, "norm.weight": mm.norm.weight,
        "hc_head_fn": mm.hc_head.hc_fn, "hc_head_base": mm.hc_head.hc_base, "hc_head_scale": mm.hc_head.hc_scale,
    }
    f = cfg.moe_intermediate_size
    for i, layer in enumerate(mm.layers):
        p = f"layers.{i}."
        a, mlp = layer.self_attn, layer.mlp
        sd[p + "attn_norm.weight"] = layer.input_layernorm.weight
        sd[p + "ffn_norm.weight"] = layer.post_attention_layernorm.weight
        for hc, mod in (("hc_attn", layer.attn_hc), ("hc_ffn", layer.ffn_hc)):
            sd[p + f"{hc}_fn"], sd[p + f"{hc}_base"], sd[p + f"{hc}_scale"] = mod.fn, mod.base, mod.scale
        sd[p + "attn.attn_sink"] = a.sinks
        for ours, theirs in (("wq_a", a.q_a_proj), ("q_norm", a.q_a_norm), ("wq_b", a.q_b_proj), ("wkv", a.kv_proj),
                             ("kv_norm", a.kv_norm), ("wo_a", a.o_a_proj), ("wo_b", a.o_b_proj)):
            sd[p + f"attn.{ours}.weight"] = theirs.weight
        if a.compressor is not None:
            _compressor(sd, p + "attn.compressor.", a.compressor)
            if hasattr(a.compressor, "indexer"):
                idx = a.compressor.indexer
                _compressor(sd, p + "attn.indexer.compressor.", idx)
                sd[p + "attn.indexer.wq_b.weight"] = idx.q_b_proj.weight
                sd[p + "attn.indexer.weights_proj.weight"] = idx.scorer.weights_proj.weight
        sd[p + "ffn.gate.weight"] = mlp.gate.weight
        if hasattr(mlp.gate, "tid2eid"):
            sd[p + "ffn.gate.tid2eid"] = mlp.gate.tid2eid
        else:
            sd[p + "ffn.gate.bias"] = mlp.gate.e_score_correction_bias
        for w, lin in (("w1", mlp.shared_experts.gate_proj), ("w3", mlp.shared_experts.up_proj),
                       ("w2", mlp.shared_experts.down_proj)):
            sd[p + f"ffn.shared_experts.{w}.weight"] = lin.weight
        for x in range(cfg.num_routed_experts):
            sd[p + f"ffn.experts.{x}.w1.weight"] = mlp.experts.gate_up_proj[x, :f]
            sd[p + f"ffn.experts.{x}.w3.weight"] = mlp.experts.gate_up_proj[x, f:]
            sd[p + f"ffn.experts.{x}.w2.weight"] = mlp.experts.down_proj[x]
    return {k: v.detach().contiguous().clone() for k, v in sd.items()}


def _compressor(sd: dict, prefix: str, mod) -> None:
    sd[prefix + "wkv.weight"] = mod.kv_proj.weight
    sd[prefix + "wgate.weight"] = mod.gate_proj.weight
    sd[prefix + "ape"] = mod.position_bias
    sd[prefix + "norm.weight"] = mod.kv_norm.weight


def mtp_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    """Upstream `mtp.0.*` tensor names and checkpoint-orientation shapes (spec §5.1: SWA block, top-k MoE)."""
    e, m, l, h, d = cfg.hidden_size, cfg.hc_mult, cfg.q_lora_rank, cfg.num_heads, cfg.head_dim
    g, o, x, f = cfg.o_groups, cfg.o_lora_rank, cfg.num_routed_experts, cfg.moe_intermediate_size
    mix = (2 + m) * m
    shapes = {
        "enorm.weight": (e,), "hnorm.weight": (e,), "norm.weight": (e,),
        "e_proj.weight": (e, e), "h_proj.weight": (e, e),
        "hc_head_fn": (m, m * e), "hc_head_base": (m,), "hc_head_scale": (1,),
        "attn_norm.weight": (e,), "ffn_norm.weight": (e,),
        "hc_attn_fn": (mix, m * e), "hc_attn_base": (mix,), "hc_attn_scale": (3,),
        "hc_ffn_fn": (mix, m * e), "hc_ffn_base": (mix,), "hc_ffn_scale": (3,),
        "attn.wq_a.weight": (l, e), "attn.q_norm.weight": (l,), "attn.wq_b.weight": (h * d, l),
        "attn.wkv.weight": (d, e), "attn.kv_norm.weight": (d,), "attn.wo_a.weight": (g * o, h * d // g),
        "attn.wo_b.weight": (e, g * o), "attn.attn_sink": (h,),
        "ffn.gate.weight": (x, e), "ffn.gate.bias": (x,),
        "ffn.shared_experts.w1.weight": (f, e), "ffn.shared_experts.w3.weight": (f, e),
        "ffn.shared_experts.w2.weight": (e, f),
    }
    for j in range(x):
        shapes.update({f"ffn.experts.{j}.w1.weight": (f, e), f"ffn.experts.{j}.w3.weight": (f, e),
                       f"ffn.experts.{j}.w2.weight": (e, f)})
    return {"mtp.0." + k: v for k, v in shapes.items()}


def add_random_mtp(directory: str | os.PathLike, cfg: Config, seed: int = 0,
                   filename: str = "mtp.safetensors") -> dict[str, np.ndarray]:
    """Write random fp32 `mtp.0.*` tensors (upstream names) into a checkpoint dir; updates the index if present."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in mtp_shapes(cfg).items():
        if name.endswith(("norm.weight", "_scale")):
            value = 1.0 + 0.1 * rng.standard_normal(shape)
        elif name.endswith(("_base", ".bias", "attn_sink")):
            value = 0.1 * rng.standard_normal(shape)
        else:
            value = rng.standard_normal(shape) / math.sqrt(shape[-1])
        tensors[name] = value.astype(np.float32)
    directory = os.fspath(directory)
    save_file(tensors, os.path.join(directory, filename), metadata={"format": "pt"})
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as fh:
            data = json.load(fh)
        data["weight_map"].update({k: filename for k in tensors})
        with open(index, "w") as fh:
            json.dump(data, fh, indent=2)
    return tensors
