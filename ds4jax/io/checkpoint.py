"""Load and save DeepSeek-V4 safetensors checkpoints in the `ds4jax.params` layout.

Naming schemes accepted by `load` (spec §5.1, §5.3), mixed freely as long as no tensor appears twice:

* upstream DeepSeek names: ``embed.weight``, ``layers.{i}.attn.wq_a.weight``, ``layers.{i}.ffn.experts.{x}.w1.weight``,
  ``mtp.0.*`` (also accepted under a ``model.`` prefix);
* transformers' in-memory names: ``model.embed_tokens.weight``, ``model.layers.{i}.self_attn.q_a_proj.weight``,
  fused ``model.layers.{i}.mlp.experts.gate_up_proj`` [x, 2f, e] (rows = concat(w1, w3)) and ``down_proj`` [x, e, f],
  ``lm_head.weight``;
* what ``DeepseekV4ForCausalLM.save_pretrained`` writes in transformers 5.24: its reverse rename map is applied but the
  ``^``-anchored rules miss under the ``model.`` prefix, so it writes ``model.`` + upstream name, except
  ``head.weight`` (no prefix), ``model.embed_tokens.weight``, ``model.hc_head.hc_{fn,base,scale}``, and the attention
  kv-norm as ``model.layers.{i}.attn.norm.weight`` (the reverse of HF's ``.norm.`` -> ``.kv_norm.`` rule is lossy).

Quantized linears are dequantized at load (spec §5.2): FP8 = ``X.weight`` F8_E4M3 + block scales (``X.scale`` or HF's
``X.weight_scale_inv``; E8M0 bytes or float) over 128x128 blocks (``quantization_config.weight_block_size``);
FP4 = ``X.weight`` I8 [out, in/2] (low nibble = even element) + ``X.scale`` E8M0 [out, in/32].

Everything is validated against the headers before any tensor data is read; tensors are then read, dequantized and
converted one parameter leaf at a time, so at most one leaf's raw data is on the host at once.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import struct
from contextlib import ExitStack
from typing import Any, Iterator

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

from ds4jax.bounded_read import regular_file
from ds4jax.compilation_cache import ensure_compilation_cache
from ds4jax.io import orbax_checkpoint
from ds4jax.model.config import Config, ConfigError, load_config, read_json
from ds4jax.model import footprint, layer_stack
from ds4jax.model.handle import Model
from ds4jax.model.params import abstract
from ds4jax.runtime import memory
from ds4jax.errors import ArgumentError, CheckpointError  # CheckpointError: importable from here too

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"


# ---- dequantization (spec §5.2) ----------------------------------------------------------------------------------

FP4_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
FP4_BLOCK = 32  # MXFP4: one E8M0 scale per 32 consecutive input elements of a row


def e8m0_to_float(raw: np.ndarray) -> np.ndarray:
    """E8M0 scale bytes b -> 2**(b - 127) in float32 (b = 255 is NaN)."""
    b = np.asarray(raw).view(np.uint8).astype(np.int32)
    out = np.ldexp(np.float32(1), np.minimum(b, 254) - 127).astype(np.float32)
    out[b == 255] = np.nan
    return out


def dequant_fp8(raw: np.ndarray, scale: np.ndarray, block: tuple[int, int] = (128, 128)) -> np.ndarray:
    """FP8 block dequant: E4M3 bytes [..., r, c], float scale [..., ceil(r/br), ceil(c/bc)] -> float32 [..., r, c]."""
    r, c = raw.shape[-2:]
    w = np.asarray(raw).view(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    s = np.repeat(np.repeat(scale.astype(np.float32), block[0], axis=-2), block[1], axis=-1)[..., :r, :c]
    return w * s


def dequant_fp4(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """FP4 (e2m1) dequant: bytes [..., r, c/2] (low nibble first), scale [..., r, c/32] -> float32 [..., r, c]."""
    u = np.asarray(packed).view(np.uint8)
    values = np.stack([FP4_VALUES[u & 0xF], FP4_VALUES[u >> 4]], axis=-1).reshape(*u.shape[:-1], 2 * u.shape[-1])
    return values * np.repeat(scale.astype(np.float32), FP4_BLOCK, axis=-1)


_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_INT_DTYPES = {"I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8"}
_FP8_WEIGHT = "F8_E4M3"
_FP4_WEIGHT = {"I8", "U8"}
_SCALE_DTYPES = {"F8_E8M0", "U8"} | _FLOAT_DTYPES  # E8M0 bytes, or plain float scales (V3 style)


# ---- the parameter plan: our leaves <-> upstream tensor names ------------------------------------------------------

SAME, T, WO_A, EXPERTS = "same", "transpose", "wo_a", "experts"


@dataclasses.dataclass(frozen=True)
class _Leaf:
    """One params leaf, made from `sources` (upstream names; one per expert for EXPERTS) via `layout`."""

    path: tuple[str | int, ...]
    sources: tuple[str, ...]
    layout: str
    target: jax.ShapeDtypeStruct

    @property
    def integer(self) -> bool:
        return jnp.issubdtype(self.target.dtype, jnp.integer)

    @property
    def source_shape(self) -> tuple[int, ...]:
        """Shape of each source in checkpoint orientation ([out, in] for linears)."""
        s = self.target.shape
        if self.layout == T:
            return s[::-1]
        if self.layout == WO_A:  # ours [g, h*d/g, o] <- checkpoint [g*o, h*d/g]
            return (s[0] * s[2], s[1])
        if self.layout == EXPERTS:  # ours [x, in, out] <- per expert [out, in]
            return (s[2], s[1])
        return s


def _compressor_names(prefix: str) -> dict[tuple[str, ...], tuple[str, str]]:
    return {
        ("wkv",): (f"{prefix}.wkv.weight", T),
        ("wgate",): (f"{prefix}.wgate.weight", T),
        ("ape",): (f"{prefix}.ape", SAME),
        ("norm",): (f"{prefix}.norm.weight", SAME),
    }


def _block_names() -> dict[tuple[str, ...], tuple[str, str]]:
    """Path inside one block -> (upstream suffix, layout). Expert suffixes carry an ``{x}`` placeholder."""
    names: dict[tuple[str, ...], tuple[str, str]] = {
        ("attn_norm",): ("attn_norm.weight", SAME),
        ("ffn_norm",): ("ffn_norm.weight", SAME),
        ("attn", "wq_a"): ("attn.wq_a.weight", T),
        ("attn", "q_norm"): ("attn.q_norm.weight", SAME),
        ("attn", "wq_b"): ("attn.wq_b.weight", T),
        ("attn", "wkv"): ("attn.wkv.weight", T),
        ("attn", "kv_norm"): ("attn.kv_norm.weight", SAME),
        ("attn", "wo_a"): ("attn.wo_a.weight", WO_A),
        ("attn", "wo_b"): ("attn.wo_b.weight", T),
        ("attn", "sink"): ("attn.attn_sink", SAME),
        ("attn", "indexer", "wq_b"): ("attn.indexer.wq_b.weight", T),
        ("attn", "indexer", "weights_proj"): ("attn.indexer.weights_proj.weight", T),
        ("ffn", "gate"): ("ffn.gate.weight", T),
        ("ffn", "bias"): ("ffn.gate.bias", SAME),
        ("ffn", "tid2eid"): ("ffn.gate.tid2eid", SAME),
    }
    for hc in ("hc_attn", "hc_ffn"):
        names[(hc, "fn")] = (f"{hc}_fn", T)  # checkpoint [(2+m)*m, m*e]
        names[(hc, "base")] = (f"{hc}_base", SAME)
        names[(hc, "scale")] = (f"{hc}_scale", SAME)
    for w in ("w1", "w2", "w3"):
        names[("ffn", "shared", w)] = (f"ffn.shared_experts.{w}.weight", T)
        names[("ffn", "experts", w)] = (f"ffn.experts.{{x}}.{w}.weight", EXPERTS)
    for sub, prefix in ((("attn", "compressor"), "attn.compressor"),
                        (("attn", "indexer", "compressor"), "attn.indexer.compressor")):
        names.update({sub + k: v for k, v in _compressor_names(prefix).items()})
    return names


_BLOCK = _block_names()
_HC_HEAD = {("hc_head", k): (f"hc_head_{k}", T if k == "fn" else SAME) for k in ("fn", "base", "scale")}
_TOP = {("embed",): ("embed.weight", SAME), ("head",): ("head.weight", T), ("norm",): ("norm.weight", SAME), **_HC_HEAD}
_MTP = {
    ("enorm",): ("enorm.weight", SAME), ("hnorm",): ("hnorm.weight", SAME), ("norm",): ("norm.weight", SAME),
    ("e_proj",): ("e_proj.weight", T), ("h_proj",): ("h_proj.weight", T), **_HC_HEAD,
}


def _upstream(path: tuple[str | int, ...]) -> tuple[str, str]:
    """Params path -> (upstream name, layout)."""
    if path[0] == "layers":
        suffix, layout = _BLOCK[path[2:]]
        return f"layers.{path[1]}.{suffix}", layout
    if path[0] == "mtp":
        suffix, layout = _BLOCK[path[2:]] if path[1] == "block" else _MTP[path[1:]]
        return f"mtp.0.{suffix}", layout
    return _TOP[path]


def _path_of(key_path) -> tuple[str | int, ...]:
    return tuple(k.key if hasattr(k, "key") else k.idx for k in key_path)


def _plan(cfg: Config, dtype: Any) -> list[_Leaf]:
    leaves = []
    for key_path, target in jax.tree_util.tree_flatten_with_path(abstract(cfg, dtype))[0]:
        path = _path_of(key_path)
        name, layout = _upstream(path)
        sources = tuple(name.format(x=x) for x in range(target.shape[0])) if layout == EXPERTS else (name,)
        leaves.append(_Leaf(path, sources, layout, target))
    return leaves


# ---- aliases: the other names a source may carry ------------------------------------------------------------------

_HF_RENAMES = (  # upstream -> transformers in-memory, applied in order (transformers conversion_mapping "deepseek_v4")
    (".attn.", ".self_attn."), (".ffn.", ".mlp."), (".indexer.compressor.", ".compressor.indexer."),
    (".attn_norm.", ".input_layernorm."), (".ffn_norm.", ".post_attention_layernorm."),
    (".hc_attn_fn", ".attn_hc.fn"), (".hc_attn_base", ".attn_hc.base"), (".hc_attn_scale", ".attn_hc.scale"),
    (".hc_ffn_fn", ".ffn_hc.fn"), (".hc_ffn_base", ".ffn_hc.base"), (".hc_ffn_scale", ".ffn_hc.scale"),
    (".attn_sink", ".sinks"), (".indexer.weights_proj.", ".compressor.indexer.scorer.weights_proj."),
    (".indexer.wq_b.", ".compressor.indexer.q_b_proj."), (".norm.", ".kv_norm."), (".ape", ".position_bias"),
    (".wq_a.", ".q_a_proj."), (".self_attn.wq_b.", ".self_attn.q_b_proj."), (".wkv.", ".kv_proj."),
    (".wgate.", ".gate_proj."), (".wo_a.", ".o_a_proj."), (".wo_b.", ".o_b_proj."), (".q_norm.", ".q_a_norm."),
    (".gate.bias", ".gate.e_score_correction_bias"), (".shared_experts.w1.", ".shared_experts.gate_proj."),
    (".shared_experts.w2.", ".shared_experts.down_proj."), (".shared_experts.w3.", ".shared_experts.up_proj."),
)
_HF_TOP = {  # top-level names: in-memory == saved, except head
    "embed.weight": "model.embed_tokens.weight",
    "hc_head_fn": "model.hc_head.hc_fn", "hc_head_base": "model.hc_head.hc_base",
    "hc_head_scale": "model.hc_head.hc_scale",
}


def _hf_memory_name(name: str) -> str:
    if name == "head.weight":
        return "lm_head.weight"
    if name in _HF_TOP:
        return _HF_TOP[name]
    for old, new in _HF_RENAMES:
        name = name.replace(old, new)
    return "model." + name


def _hf_saved_name(name: str) -> str:
    if name == "head.weight":
        return name
    if name in _HF_TOP:
        return _HF_TOP[name]
    return "model." + name.replace(".attn.kv_norm.", ".attn.norm.")


def _aliases(name: str) -> set[str]:
    names = {name, "model." + name, _hf_saved_name(name)}
    if not name.startswith("mtp.") and ".ffn.experts." not in name:  # HF has no MTP; its experts are fused
        names.add(_hf_memory_name(name))
    return names


def _scale_base(key: str) -> str | None:
    """The weight key a scale companion belongs to, or None if `key` is not a scale name."""
    for suffix, weight_suffix in ((".weight_scale_inv", ".weight"), (".scale", ".weight"), ("_scale_inv", "")):
        if key.endswith(suffix):
            return key[: -len(suffix)] + weight_suffix
    return None


# ---- shards -------------------------------------------------------------------------------------------------------

class _Shard:
    """One safetensors file: header info for validation, and tensor reads (F8 dtypes via the raw bytes)."""

    def __init__(self, path: str, stack: ExitStack):
        self.path = path
        self.name = os.path.basename(path)
        regular_file(path, CheckpointError)  # a link may leave the directory (HF caches); reads stay within the header
        try:
            self._file = stack.enter_context(safe_open(path, framework="np"))
        except Exception as e:  # corrupt header, not a safetensors file, ...
            raise CheckpointError(f"cannot read safetensors file {path}: {e}") from None
        self.keys = list(self._file.keys())
        self._offsets: dict[str, tuple[int, int]] | None = None

    def info(self, key: str) -> tuple[str, tuple[int, ...]]:
        s = self._file.get_slice(key)
        return s.get_dtype(), tuple(s.get_shape())

    def read(self, key: str, expert: int | None = None) -> np.ndarray:
        """The tensor (or its `expert`-th slice); F8 tensors come back as raw uint8 bytes."""
        dtype, shape = self.info(key)
        if dtype.startswith("F8"):  # numpy has no float8: safetensors' numpy loader cannot build these
            begin, _ = self._data_offsets()[key]
            raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=begin, shape=shape)
            return np.array(raw if expert is None else raw[expert])
        if expert is None:
            return self._file.get_tensor(key)
        return self._file.get_slice(key)[expert]

    def _data_offsets(self) -> dict[str, tuple[int, int]]:
        if self._offsets is None:
            with open(self.path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            self._offsets = {
                k: (8 + n + v["data_offsets"][0], 8 + n + v["data_offsets"][1])
                for k, v in header.items() if k != "__metadata__"
            }
        return self._offsets


def _read_index(index_path: str) -> dict[str, str]:
    """``weight_map`` of an index file: tensor name -> a shard file name in the same directory."""
    index = read_json(index_path, CheckpointError)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointError('must be a JSON object with a "weight_map" object', source=index_path,
                              name="weight_map", value=weight_map)
    for key, fname in weight_map.items():
        if not isinstance(fname, str) or os.path.basename(fname) != fname or not fname.endswith(".safetensors"):
            raise CheckpointError("must name a .safetensors file in the checkpoint directory", source=index_path,
                                  name=f"weight_map[{key!r}]", value=fname)
    return weight_map


def _open_shards(ckpt_dir: str, stack: ExitStack) -> dict[str, _Shard]:
    """Raw tensor name -> shard. With an index, only its shards are used and every listed shard must exist."""
    index_path = os.path.join(ckpt_dir, INDEX_FILE)
    if os.path.exists(index_path):
        weight_map = _read_index(index_path)
        files = sorted(set(weight_map.values()))
        for fname in files:
            if not os.path.exists(os.path.join(ckpt_dir, fname)):
                example = next(k for k, v in weight_map.items() if v == fname)
                raise CheckpointError(f"missing shard {fname} (listed in {index_path}, holds e.g. {example})")
    else:
        files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ckpt_dir, "*.safetensors")))
        weight_map = None
        if not files:
            raise CheckpointError(f"no *.safetensors files in {ckpt_dir}")
    where: dict[str, _Shard] = {}
    for fname in files:
        shard = _Shard(os.path.join(ckpt_dir, fname), stack)
        for key in shard.keys:
            if key in where:
                raise CheckpointError(f"tensor {key} appears in both {where[key].name} and {shard.name}")
            where[key] = shard
    for key, fname in (weight_map or {}).items():
        if key not in where or where[key].name != fname:
            raise CheckpointError(f"index {INDEX_FILE} lists tensor {key} in {fname}, but that file lacks it")
    return where


# ---- resolving names, validation ---------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Loc:
    """Where a source lives: a raw tensor (or expert `expert`, rows `rows` of a fused HF tensor) and its scale."""

    shard: _Shard
    key: str
    scale: tuple[_Shard, str] | None = None
    expert: int | None = None
    rows: slice | None = None


@dataclasses.dataclass(frozen=True)
class _Raw:
    """A raw weight tensor to validate: its expected dequantized shape in checkpoint orientation."""

    shard: _Shard
    key: str
    shape: tuple[int, ...]
    integer: bool
    scale: tuple[_Shard, str] | None


_FUSED = {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}


def _fused_experts(cfg: Config) -> dict[str, tuple[int, str]]:
    names = {}
    for i in range(cfg.num_layers):
        names[f"model.layers.{i}.mlp.experts.gate_up_proj"] = (i, "gate_up")
        names[f"model.layers.{i}.mlp.experts.down_proj"] = (i, "down")
    return names


def _resolve(cfg: Config, leaves: list[_Leaf], where: dict[str, _Shard], ckpt_dir: str):
    """Map every source name to a `_Loc` and collect the raw tensors to validate; drops MTP leaves if MTP is absent."""
    source_leaf = {name: leaf for leaf in leaves for name in leaf.sources}
    alias: dict[str, str] = {}
    for name in source_leaf:
        for a in _aliases(name):
            assert alias.setdefault(a, name) == name, f"alias {a} is ambiguous"
    fused = _fused_experts(cfg)
    scales = _pair_scales(cfg, where, set(alias) | set(fused))
    locs: dict[str, _Loc] = {}
    raws: list[_Raw] = []
    for key, shard in where.items():
        scale = scales.get(key)
        if key in alias:
            leaf = source_leaf[alias[key]]
            _claim(locs, alias[key], _Loc(shard, key, scale))
            raws.append(_Raw(shard, key, leaf.source_shape, leaf.integer, scale))
        elif key in fused:
            raws.append(_locate_fused(cfg, locs, shard, key, scale, *fused[key]))
    return _complete(leaves, locs, ckpt_dir), locs, raws


def _pair_scales(cfg: Config, where: dict[str, _Shard], known: set[str]) -> dict[str, tuple[_Shard, str]]:
    """Weight key -> its scale companion. Any tensor that is neither known nor a scale of one is unexpected."""
    scales: dict[str, tuple[_Shard, str]] = {}
    for key, shard in where.items():
        if key in known:
            continue
        base = _scale_base(key)
        if base is None or base not in where or base not in known:
            raise CheckpointError(f"unexpected tensor {key} in {shard.name} (not part of {_describe(cfg)})")
        if base in scales:
            raise CheckpointError(f"tensor {base} has two scales: {scales[base][1]} and {key} ({shard.name})")
        scales[base] = (shard, key)
    return scales


def _claim(locs: dict[str, _Loc], name: str, loc: _Loc) -> None:
    if name in locs:
        raise CheckpointError(f"tensor {name} is given twice: as {locs[name].key} in {locs[name].shard.name} "
                              f"and as {loc.key} in {loc.shard.name}")
    locs[name] = loc


def _locate_fused(cfg: Config, locs: dict[str, _Loc], shard: _Shard, key: str, scale, layer: int, kind: str) -> _Raw:
    """HF fused experts: gate_up_proj [x, 2f, e] rows = concat(w1, w3); down_proj [x, e, f] = w2 per expert."""
    x, f, e = cfg.num_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    if kind == "gate_up":
        parts, shape = [("w1", slice(0, f)), ("w3", slice(f, 2 * f))], (x, 2 * f, e)
    else:
        parts, shape = [("w2", None)], (x, e, f)
    for w, rows in parts:
        for j in range(x):
            _claim(locs, f"layers.{layer}.ffn.experts.{j}.{w}.weight", _Loc(shard, key, scale, j, rows))
    return _Raw(shard, key, shape, False, scale)


def _complete(leaves: list[_Leaf], locs: dict[str, _Loc], ckpt_dir: str) -> list[_Leaf]:
    """The leaves to load: all of them, less the MTP block when the checkpoint has none of it (HF checkpoints)."""
    mtp = [name for leaf in leaves if leaf.path[0] == "mtp" for name in leaf.sources]
    present = [name for name in mtp if name in locs]
    if mtp and not present:
        leaves = [leaf for leaf in leaves if leaf.path[0] != "mtp"]
    elif len(present) < len(mtp):
        missing = sorted(set(mtp) - set(locs))
        raise CheckpointError(f"partial MTP block in {ckpt_dir}: {len(missing)} of {len(mtp)} mtp.* tensors "
                              f"missing, e.g. {missing[0]}")
    for leaf in leaves:
        for name in leaf.sources:
            if name not in locs:
                others = sorted(_aliases(name) - {name})
                if leaf.layout == EXPERTS and leaf.path[0] == "layers":
                    others.append(f"fused model.layers.{leaf.path[1]}.mlp.experts.{_FUSED[leaf.path[-1]]}")
                raise CheckpointError(f"missing tensor {name} (or {', '.join(others)}) in checkpoint {ckpt_dir}")
    return leaves


def _describe(cfg: Config) -> str:
    return f"a {cfg.num_layers}-layer DeepSeek-V4 with {cfg.num_routed_experts} experts"


def _validate(raw: _Raw, block: tuple[int, int]) -> None:
    """Check dtype and shape of a raw tensor (and its scale) against the expected checkpoint-orientation shape."""
    dtype, shape = raw.shard.info(raw.key)
    where = f"tensor {raw.key} in {raw.shard.name}"
    expected = raw.shape
    if raw.integer:
        if dtype not in _INT_DTYPES or raw.scale is not None:
            raise CheckpointError(f"{where}: wrong dtype {dtype}, an integer table is needed")
    elif dtype in _FLOAT_DTYPES:
        if raw.scale is not None:
            raise CheckpointError(f"unexpected tensor {raw.scale[1]} in {raw.scale[0].name}: "
                                  f"scale for {raw.key}, which is stored unquantized ({dtype})")
    elif len(expected) >= 2 and (dtype == _FP8_WEIGHT or dtype in _FP4_WEIGHT):
        if raw.scale is None:
            raise CheckpointError(f"{where}: quantized ({dtype}) weight without its scale tensor")
        *lead, r, c = expected
        if dtype == _FP8_WEIGHT:
            scale_shape = (*lead, math.ceil(r / block[0]), math.ceil(c / block[1]))
        else:
            if c % FP4_BLOCK:
                raise CheckpointError(f"{where}: FP4 needs an input dim divisible by {FP4_BLOCK}, got {c}")
            scale_shape = (*lead, r, c // FP4_BLOCK)
            expected = (*lead, r, c // 2)
        scale_shard, scale_key = raw.scale
        s_dtype, s_shape = scale_shard.info(scale_key)
        if s_dtype not in _SCALE_DTYPES:
            raise CheckpointError(f"tensor {scale_key} in {scale_shard.name}: wrong dtype {s_dtype} for a scale")
        if s_shape != scale_shape:
            raise CheckpointError(f"tensor {scale_key} in {scale_shard.name}: wrong shape, expected "
                                  f"{list(scale_shape)} got {list(s_shape)} (scales of {dtype} weight {raw.key})")
    else:
        raise CheckpointError(f"{where}: wrong dtype {dtype}, a floating-point weight is needed")
    if shape != expected:
        raise CheckpointError(f"{where}: wrong shape, expected {list(expected)} got {list(shape)} "
                              f"(checkpoint orientation, dtype {dtype})")


# ---- reading ------------------------------------------------------------------------------------------------------

def _read(shard: _Shard, key: str, expert: int | None) -> np.ndarray:
    try:
        return shard.read(key, expert)
    except Exception as e:  # truncated data, I/O errors: safetensors raises its own types
        raise CheckpointError(f"cannot read the tensor data ({type(e).__name__}: {e})", source=shard.path,
                              name=key) from None


def _check_finite(a: np.ndarray, shard: _Shard, key: str, what: str = "value") -> None:
    finite = np.isfinite(a)
    if not finite.all():
        index = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise CheckpointError(f"non-finite {what} {a[index]} at index {list(index)}", source=shard.path, name=key)


def _read_scale(shard: _Shard, key: str, expert: int | None) -> np.ndarray:
    dtype, _ = shard.info(key)
    s = _read(shard, key, expert)
    s = e8m0_to_float(s) if dtype in ("F8_E8M0", "U8") else s.astype(np.float32)
    _check_finite(s, shard, key, "scale")  # E8M0 255 is NaN: it would poison the whole block
    return s


def _read_source(loc: _Loc, block: tuple[int, int], check_finite: bool = False) -> np.ndarray:
    """A source in checkpoint orientation: native dtype if unquantized, float32 if dequantized."""
    dtype, _ = loc.shard.info(loc.key)
    w = _read(loc.shard, loc.key, loc.expert)
    if loc.scale is not None:
        s = _read_scale(*loc.scale, loc.expert)
        w = dequant_fp8(w, s, block) if dtype == _FP8_WEIGHT else dequant_fp4(w, s)
    w = w if loc.rows is None else w[loc.rows]
    if check_finite and not np.issubdtype(w.dtype, np.integer):
        _check_finite(w, loc.shard, loc.key)
    return w


def _to_layout(a: np.ndarray, layout: str, target: jax.ShapeDtypeStruct) -> np.ndarray:
    if layout == T:
        return a.T
    if layout == WO_A:
        g, hd, o = target.shape
        return a.reshape(g, o, hd).transpose(0, 2, 1)
    return a


def _check_tid2eid(a: np.ndarray, loc: _Loc, cfg: Config) -> None:
    bad = (a < 0) | (a >= cfg.num_routed_experts)
    if bad.any():
        raise CheckpointError(f"tensor {loc.key} in {loc.shard.name}: expert ids must be in "
                              f"[0, {cfg.num_routed_experts}), found {int(a[bad].flat[0])}")


def _load_leaf(leaf: _Leaf, locs: dict[str, _Loc], cfg: Config, block: tuple[int, int],
               check_finite: bool = False) -> jax.Array:
    np_dtype = np.dtype(leaf.target.dtype)
    if leaf.layout == EXPERTS:
        out = np.empty(leaf.target.shape, np_dtype)  # filled expert by expert: one expert's raw data at a time
        for x, name in enumerate(leaf.sources):
            out[x] = _read_source(locs[name], block, check_finite).T.astype(np_dtype)
    else:
        loc = locs[leaf.sources[0]]
        a = _read_source(loc, block, check_finite)
        if leaf.integer:
            _check_tid2eid(a, loc, cfg)
        out = np.ascontiguousarray(_to_layout(a, leaf.layout, leaf.target).astype(np_dtype))
    return jnp.asarray(out)


def _read_config(ckpt_dir: str) -> tuple[Config, tuple[int, int]]:
    path = os.path.join(ckpt_dir, CONFIG_FILE)
    if not os.path.exists(path):
        raise CheckpointError(f"bad config: {path} does not exist")
    try:
        cfg = load_config(path)
    except ConfigError as e:
        raise CheckpointError(f"bad config: {e}") from None
    quant = read_json(path, CheckpointError).get("quantization_config") or {}
    block = quant.get("weight_block_size") if isinstance(quant, dict) else None
    block = (128, 128) if block is None and isinstance(quant, dict) else block
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= 1 << 20 for b in block)):
        raise CheckpointError("must be 2 positive ints", source=path, name="quantization_config.weight_block_size",
                              value=block)
    return cfg, (block[0], block[1])


def check_dtype(dtype: Any) -> Any:
    """The compute dtype, validated: a floating-point dtype (float32, bfloat16, float16, ...)."""
    try:
        dt = jnp.dtype(dtype)
    except TypeError:
        raise ArgumentError("not a dtype", name="dtype", value=dtype) from None
    if not jnp.issubdtype(dt, jnp.floating):
        raise ArgumentError("the compute dtype must be floating point (float32, bfloat16, float16); the "
                            "checkpoint's own dtypes are converted to it", name="dtype", value=dt.name)
    return dt


def load(path: str | os.PathLike, dtype: Any = jnp.bfloat16, *, check_finite: bool = False, mesh=None,
         rules=None) -> Model:
    """Load a checkpoint directory (``config.json`` + ``*.safetensors``, optionally with an index, or our Orbax
    format: ``config.json`` + ``params/``, see `ds4jax.io.orbax_checkpoint`) into a `Model`.

    Compute-dtype leaves come back in `dtype`; norms, mHC, sinks, ape and router bias in float32; tid2eid int32.
    Raises `CheckpointError` on any missing / unexpected / mis-shaped / mis-typed tensor, missing shard, bad config,
    non-finite scale, and (with `check_finite`, one pass over the host data) any NaN / Inf weight, naming the
    tensor and its file; `ArgumentError` for a `dtype` that is not floating point.
    With ``mesh=ds4jax.make_mesh(...)`` (and optionally Flax logical-axis ``rules``), each device's block is read
    straight from the files into its shard (`ds4jax.io.sharded_load`) and the model runs on that mesh.
    """
    ensure_compilation_cache()  # casting and placing the weights compiles too (ds4jax.compilation_cache)
    dtype = check_dtype(dtype)
    ckpt_dir = os.fspath(path)
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError("is not a directory" if os.path.exists(ckpt_dir) else "does not exist",
                              source=ckpt_dir)
    if mesh is not None and rules is not None:
        mesh = dataclasses.replace(mesh, rules=tuple(rules))
    if orbax_checkpoint.is_orbax(ckpt_dir):
        model = orbax_checkpoint.load(ckpt_dir, dtype, layout=mesh)
        if check_finite:
            for key_path, leaf in jax.tree_util.tree_flatten_with_path(model.params)[0]:
                a = np.asarray(leaf)
                if not np.issubdtype(a.dtype, np.integer) and not np.isfinite(a).all():
                    raise CheckpointError("non-finite value in the Orbax params", source=ckpt_dir,
                                          name=jax.tree_util.keystr(key_path))
        return model
    if mesh is not None:
        from ds4jax.io.sharded_load import load_sharded

        return load_sharded(ckpt_dir, dtype, mesh)
    cfg, block = _read_config(ckpt_dir)
    memory.check_fits(*footprint.weights(cfg, dtype))  # before any tensor is read
    with ExitStack() as stack:
        where = _open_shards(ckpt_dir, stack)
        leaves, locs, raws = _resolve(cfg, _plan(cfg, dtype), where, ckpt_dir)
        for raw in raws:
            _validate(raw, block)
        arrays = {leaf.path: _load_leaf(leaf, locs, cfg, block, check_finite) for leaf in leaves}
    tree = abstract(cfg, dtype)
    if not any(p[0] == "mtp" for p in arrays):
        tree.pop("mtp", None)
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    params = jax.tree_util.tree_unflatten(treedef, [arrays[_path_of(kp)] for kp, _ in flat])
    return Model(config=cfg, params=layer_stack.for_loader(cfg, params))


# ---- saving -------------------------------------------------------------------------------------------------------

def _export(cfg: Config, params: dict) -> Iterator[tuple[str, Any, str, int | None]]:
    """(upstream name, leaf array, layout, expert index) for every tensor to write."""
    leaves = {leaf.path: leaf for leaf in _plan(cfg, jnp.float32)}
    for key_path, array in jax.tree_util.tree_flatten_with_path(params)[0]:
        leaf = leaves[_path_of(key_path)]
        if leaf.layout == EXPERTS:
            for x, name in enumerate(leaf.sources):
                yield name, array, leaf.layout, x
        else:
            yield leaf.sources[0], array, leaf.layout, None


def _checkpoint_array(array: Any, layout: str, expert: int | None) -> np.ndarray:
    a = np.asarray(array)
    if expert is not None:
        a = a[expert].T
    elif layout == T:
        a = a.T
    elif layout == WO_A:  # ours [g, h*d/g, o] -> [g*o, h*d/g]
        g, hd, o = a.shape
        a = a.transpose(0, 2, 1).reshape(g * o, hd)
    if np.issubdtype(a.dtype, np.integer):
        a = a.astype(np.int64)  # upstream stores tid2eid as I64
    return np.ascontiguousarray(a)


def _nbytes(array: Any, expert: int | None) -> int:
    dtype = np.dtype(array.dtype)
    itemsize = 8 if np.issubdtype(dtype, np.integer) else dtype.itemsize  # integers are written as I64
    n = int(np.prod(array.shape)) * itemsize
    return n // array.shape[0] if expert is not None else n


def _check_savable(model: Model) -> None:
    """Every leaf the config declares is present with its shape (an MTP block may be absent), and nothing else."""
    if not isinstance(model, Model) or not isinstance(model.params, dict):
        raise ArgumentError("must be a ds4jax Model (config + params dict)", name="model", value=type(model).__name__)
    expected = {leaf.path: leaf.target.shape for leaf in _plan(model.config, jnp.float32)}
    per_layer = jax.eval_shape(layer_stack.unstacked_params, model.params) if layer_stack.is_stacked(model.params) \
        else model.params
    got = {_path_of(kp): getattr(a, "shape", None) for kp, a in jax.tree_util.tree_flatten_with_path(per_layer)[0]}
    if not any(p[0] == "mtp" for p in got):
        expected = {p: v for p, v in expected.items() if p[0] != "mtp"}
    for path in sorted(set(expected) | set(got), key=str):
        name = "params" + "".join(f"[{k!r}]" for k in path)
        if path not in got:
            raise ArgumentError("is missing", name=name)
        if path not in expected:
            raise ArgumentError("is not a parameter of this config", name=name)
        if tuple(got[path] or ()) != tuple(expected[path]):
            raise ArgumentError(f"has shape {got[path]}, the config needs {tuple(expected[path])}", name=name)


def save(model: Model, path: str | os.PathLike, max_shard_bytes: int = 5 * 1024**3, overwrite: bool = False) -> None:
    """Write `model` as an upstream-named checkpoint: ``config.json`` + safetensors in the params' dtypes.

    Linears are written ``[out, in]`` (bf16 or fp32, unquantized), experts one tensor per expert, tid2eid as I64.
    Shards are cut before exceeding `max_shard_bytes` (a tensor larger than the limit gets a shard of its own);
    more than one shard also writes ``model.safetensors.index.json``. Refuses a directory that already holds
    safetensors files unless `overwrite` (which deletes them first).
    """
    out_dir = os.fspath(path)
    _check_savable(model)  # before anything is created or deleted
    os.makedirs(out_dir, exist_ok=True)
    stale = glob.glob(os.path.join(out_dir, "*.safetensors")) + glob.glob(os.path.join(out_dir, INDEX_FILE))
    if stale and not overwrite:
        raise CheckpointError(f"{out_dir} already holds a checkpoint ({os.path.basename(stale[0])}); pass overwrite")
    for f in stale:
        os.remove(f)
    shards: list[list[tuple[str, Any, str, int | None]]] = [[]]
    size = 0
    for entry in _export(model.config, layer_stack.unstacked_host(model.params)):
        n = _nbytes(entry[1], entry[3])
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += n
    names = ["model.safetensors"] if len(shards) == 1 else [
        f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    weight_map, total = {}, 0
    for fname, entries in zip(names, shards):
        tensors = {name: _checkpoint_array(a, layout, x) for name, a, layout, x in entries}
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        total += sum(t.nbytes for t in tensors.values())
        weight_map.update({name: fname for name in tensors})
        del tensors
    if len(shards) > 1:
        with open(os.path.join(out_dir, INDEX_FILE), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
        json.dump(model.config.to_hf_dict(), f, indent=2)
