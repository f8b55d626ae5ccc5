"""The safetensors side of a checkpoint: which upstream tensors make each params leaf, and where they are.

Shared by the single-device loader (`ds4jax.io.checkpoint`), the sharded loader (`ds4jax.io.sharded_load`) and
the Orbax format (config reading), so none of them imports another:

* the parameter plan (`plan`): every params leaf (`ds4jax.model.params` layout) with its upstream source names
  and how they map onto it (`SAME`, `T` transposed, `WO_A` regrouped, `EXPERTS` one tensor per expert);
* aliases (`aliases`): the other names a source may carry (``model.`` prefix, transformers in-memory and saved);
* shards (`Shard`, `open_shards`): safetensors files and the optional index, F8 tensors read as raw bytes;
* name resolution (`resolve`: every source to a `Loc`, scales paired, HF fused experts split) and header
  validation (`validate`: dtype and shape of each raw tensor and its scale), both before any data is read;
* `read_config`: ``config.json`` and the FP8 block size of ``quantization_config``.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os
import struct
from contextlib import ExitStack
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from safetensors import safe_open

from ds4jax.bounded_read import regular_file
from ds4jax.errors import CheckpointError
from ds4jax.io.quant_formats import FP4_BLOCK, FP4_MAX, FP8_MAX, e8m0_to_float
from ds4jax.model.config import Config, ConfigError, load_config, read_json
from ds4jax.model.params import abstract

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
INT_DTYPES = {"I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8"}
FP8_WEIGHT = "F8_E4M3"
FP4_WEIGHT = {"I8", "U8"}
SCALE_DTYPES = {"F8_E8M0", "U8"} | FLOAT_DTYPES  # E8M0 bytes, or plain float scales (V3 style)


# ---- the parameter plan: our leaves <-> upstream tensor names ------------------------------------------------------

SAME, T, WO_A, EXPERTS = "same", "transpose", "wo_a", "experts"


@dataclasses.dataclass(frozen=True)
class Leaf:
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
        names[(hc, "fn")] = (f"{hc}_fn", SAME)  # [(2+m)*m, m*e] in the checkpoint and in ds4jax
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
_HC_HEAD = {("hc_head", k): (f"hc_head_{k}", SAME) for k in ("fn", "base", "scale")}
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


def path_of(key_path) -> tuple[str | int, ...]:
    return tuple(k.key if hasattr(k, "key") else k.idx for k in key_path)


def plan(cfg: Config, dtype: Any) -> list[Leaf]:
    leaves = []
    for key_path, target in jax.tree_util.tree_flatten_with_path(abstract(cfg, dtype))[0]:
        path = path_of(key_path)
        name, layout = _upstream(path)
        sources = tuple(name.format(x=x) for x in range(target.shape[0])) if layout == EXPERTS else (name,)
        leaves.append(Leaf(path, sources, layout, target))
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


def aliases(name: str) -> set[str]:
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

class Shard:
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

    def read(self, key: str, index: Any = ()) -> np.ndarray:
        """The tensor, or its block `index` (an int or a tuple of ints / slices); F8 tensors come back as raw
        uint8 bytes (numpy has no float8: safetensors' numpy loader cannot build them)."""
        dtype, shape = self.info(key)
        if dtype.startswith("F8"):
            begin, _ = self._data_offsets()[key]
            return np.array(np.memmap(self.path, dtype=np.uint8, mode="r", offset=begin, shape=shape)[index])
        if index == ():
            return self._file.get_tensor(key)
        return self._file.get_slice(key)[index]

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


def open_shards(ckpt_dir: str, stack: ExitStack) -> dict[str, Shard]:
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
    where: dict[str, Shard] = {}
    for fname in files:
        shard = Shard(os.path.join(ckpt_dir, fname), stack)
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
class Loc:
    """Where a source lives: a raw tensor (or expert `expert`, rows `rows` of a fused HF tensor) and its scale."""

    shard: Shard
    key: str
    scale: tuple[Shard, str] | None = None
    expert: int | None = None
    rows: slice | None = None


@dataclasses.dataclass(frozen=True)
class Raw:
    """A raw weight tensor to validate: its expected dequantized shape in checkpoint orientation."""

    shard: Shard
    key: str
    shape: tuple[int, ...]
    integer: bool
    scale: tuple[Shard, str] | None


_FUSED = {"w1": "gate_up_proj", "w3": "gate_up_proj", "w2": "down_proj"}


def _fused_experts(cfg: Config) -> dict[str, tuple[int, str]]:
    names = {}
    for i in range(cfg.num_layers):
        names[f"model.layers.{i}.mlp.experts.gate_up_proj"] = (i, "gate_up")
        names[f"model.layers.{i}.mlp.experts.down_proj"] = (i, "down")
    return names


def resolve(cfg: Config, leaves: list[Leaf], where: dict[str, Shard], ckpt_dir: str):
    """Map every source name to a `Loc` and collect the raw tensors to validate; drops MTP leaves if MTP is absent."""
    source_leaf = {name: leaf for leaf in leaves for name in leaf.sources}
    alias: dict[str, str] = {}
    for name in source_leaf:
        for a in aliases(name):
            assert alias.setdefault(a, name) == name, f"alias {a} is ambiguous"
    fused = _fused_experts(cfg)
    scales = _pair_scales(cfg, where, set(alias) | set(fused))
    locs: dict[str, Loc] = {}
    raws: list[Raw] = []
    for key, shard in where.items():
        scale = scales.get(key)
        if key in alias:
            leaf = source_leaf[alias[key]]
            _claim(locs, alias[key], Loc(shard, key, scale))
            raws.append(Raw(shard, key, leaf.source_shape, leaf.integer, scale))
        elif key in fused:
            raws.append(_locate_fused(cfg, locs, shard, key, scale, *fused[key]))
    return _complete(leaves, locs, ckpt_dir), locs, raws


def _pair_scales(cfg: Config, where: dict[str, Shard], known: set[str]) -> dict[str, tuple[Shard, str]]:
    """Weight key -> its scale companion. Any tensor that is neither known nor a scale of one is unexpected."""
    scales: dict[str, tuple[Shard, str]] = {}
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


def _claim(locs: dict[str, Loc], name: str, loc: Loc) -> None:
    if name in locs:
        raise CheckpointError(f"tensor {name} is given twice: as {locs[name].key} in {locs[name].shard.name} "
                              f"and as {loc.key} in {loc.shard.name}")
    locs[name] = loc


def _locate_fused(cfg: Config, locs: dict[str, Loc], shard: Shard, key: str, scale, layer: int, kind: str) -> Raw:
    """HF fused experts: gate_up_proj [x, 2f, e] rows = concat(w1, w3); down_proj [x, e, f] = w2 per expert."""
    x, f, e = cfg.num_routed_experts, cfg.moe_intermediate_size, cfg.hidden_size
    if kind == "gate_up":
        parts, shape = [("w1", slice(0, f)), ("w3", slice(f, 2 * f))], (x, 2 * f, e)
    else:
        parts, shape = [("w2", None)], (x, e, f)
    for w, rows in parts:
        for j in range(x):
            _claim(locs, f"layers.{layer}.ffn.experts.{j}.{w}.weight", Loc(shard, key, scale, j, rows))
    return Raw(shard, key, shape, False, scale)


def _complete(leaves: list[Leaf], locs: dict[str, Loc], ckpt_dir: str) -> list[Leaf]:
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
                others = sorted(aliases(name) - {name})
                if leaf.layout == EXPERTS and leaf.path[0] == "layers":
                    others.append(f"fused model.layers.{leaf.path[1]}.mlp.experts.{_FUSED[leaf.path[-1]]}")
                raise CheckpointError(f"missing tensor {name} (or {', '.join(others)}) in checkpoint {ckpt_dir}")
    return leaves


def _describe(cfg: Config) -> str:
    return f"a {cfg.num_layers}-layer DeepSeek-V4 with {cfg.num_routed_experts} experts"


def validate(raw: Raw, block: tuple[int, int]) -> None:
    """Check dtype and shape of a raw tensor (and its scale) against the expected checkpoint-orientation shape."""
    dtype, shape = raw.shard.info(raw.key)
    where = f"tensor {raw.key} in {raw.shard.name}"
    expected = raw.shape
    if raw.integer:
        if dtype not in INT_DTYPES or raw.scale is not None:
            raise CheckpointError(f"{where}: wrong dtype {dtype}, an integer table is needed")
    elif dtype in FLOAT_DTYPES:
        if raw.scale is not None:
            raise CheckpointError(f"unexpected tensor {raw.scale[1]} in {raw.scale[0].name}: "
                                  f"scale for {raw.key}, which is stored unquantized ({dtype})")
    elif len(expected) >= 2 and (dtype == FP8_WEIGHT or dtype in FP4_WEIGHT):
        if raw.scale is None:
            raise CheckpointError(f"{where}: quantized ({dtype}) weight without its scale tensor")
        *lead, r, c = expected
        if dtype == FP8_WEIGHT:
            scale_shape = (*lead, math.ceil(r / block[0]), math.ceil(c / block[1]))
        else:
            if c % FP4_BLOCK:
                raise CheckpointError(f"{where}: FP4 needs an input dim divisible by {FP4_BLOCK}, got {c}")
            scale_shape = (*lead, r, c // FP4_BLOCK)
            expected = (*lead, r, c // 2)
        scale_shard, scale_key = raw.scale
        s_dtype, s_shape = scale_shard.info(scale_key)
        if s_dtype not in SCALE_DTYPES:
            raise CheckpointError(f"tensor {scale_key} in {scale_shard.name}: wrong dtype {s_dtype} for a scale")
        if s_shape != scale_shape:
            raise CheckpointError(f"tensor {scale_key} in {scale_shard.name}: wrong shape, expected "
                                  f"{list(scale_shape)} got {list(s_shape)} (scales of {dtype} weight {raw.key})")
    else:
        raise CheckpointError(f"{where}: wrong dtype {dtype}, a floating-point weight is needed")
    if shape != expected:
        raise CheckpointError(f"{where}: wrong shape, expected {list(expected)} got {list(shape)} "
                              f"(checkpoint orientation, dtype {dtype})")



def check_tid2eid(a: np.ndarray, loc: Loc, cfg: Config) -> None:
    bad = (a < 0) | (a >= cfg.num_routed_experts)
    if bad.any():
        raise CheckpointError(f"tensor {loc.key} in {loc.shard.name}: expert ids must be in "
                              f"[0, {cfg.num_routed_experts}), found {int(a[bad].flat[0])}")



def read_config(ckpt_dir: str) -> tuple[Config, tuple[int, int]]:
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


# ---- reading ------------------------------------------------------------------------------------------------------

def read_tensor(shard: Shard, key: str, expert: int | None) -> np.ndarray:
    try:
        return shard.read(key, () if expert is None else expert)
    except Exception as e:  # truncated data, I/O errors: safetensors raises its own types
        raise CheckpointError(f"cannot read the tensor data ({type(e).__name__}: {e})", source=shard.path,
                              name=key) from None


def as_loaded(w: np.ndarray, target: Any, shard: Shard, key: str, check_finite: bool) -> np.ndarray:
    """Source values (tensor `key`, whole or a block) as the dtype they load into, and with `check_finite`
    checked there: a finite bfloat16 of 1e38 is an Inf in float16. Integer sources (tid2eid) stay as read, for
    their own range check."""
    if np.issubdtype(w.dtype, np.integer):
        return w
    if jnp.issubdtype(target, jnp.floating):
        with np.errstate(over="ignore"):  # an overflow is reported below, with check_finite
            w = w.astype(target, copy=False)
    if check_finite:
        check_finite_values(w, shard, key, note=f" (as {np.dtype(w.dtype).name})")
    return w


def check_finite_values(a: np.ndarray, shard: Shard, key: str, what: str = "value", note: str = "") -> None:
    finite = np.isfinite(a)
    if not finite.all():
        index = tuple(int(i) for i in np.argwhere(~finite)[0])
        raise CheckpointError(f"non-finite {what} {a[index]} at index {list(index)}{note}", source=shard.path,
                              name=key)


# the largest magnitude of a stored code before its scale: E4M3 448, E2M1 6
LARGEST_CODE = {FP8_WEIGHT: FP8_MAX, **{d: FP4_MAX for d in FP4_WEIGHT}}


def checked_scales(raw: np.ndarray, shard: Shard, key: str, weight_dtype: str, dtype: Any) -> np.ndarray:
    """Scale tensor `key` (its stored values `raw`, whole or a block of them) in float32, checked on every load
    path: finite (E8M0 byte 255 is NaN: it would poison its whole block) and small enough that the block's values
    fit `dtype`, the dtype they are dequantized into or computed in: a value reaches the format's largest code
    (448 for E4M3, 6 for E2M1) times its scale, so a finite scale of 2^127 loaded a block of infinities."""
    scale_dtype, _ = shard.info(key)
    s = e8m0_to_float(raw) if scale_dtype in ("F8_E8M0", "U8") else np.asarray(raw).astype(np.float32)
    check_finite_values(s, shard, key, "scale")
    largest = LARGEST_CODE[weight_dtype]
    top = min(float(np.finfo(np.float32).max), float(jnp.finfo(dtype).max))  # dequantized in float32 first
    over = np.abs(s) > top / largest
    if over.any():
        index = tuple(int(i) for i in np.argwhere(over)[0])
        raise CheckpointError(f"scale {s[index]:.4g} at index {list(index)} overflows {jnp.dtype(dtype).name}: its "
                              f"block's {weight_dtype} values reach {largest:g} x the scale, over {top:.4g}",
                              source=shard.path, name=key)
    return s


def read_scale(shard: Shard, key: str, expert: int | None, weight_dtype: str, dtype: Any) -> np.ndarray:
    """The scales of a weight stored as `weight_dtype`, for values in `dtype`: float32, checked (`checked_scales`)."""
    return checked_scales(read_tensor(shard, key, expert), shard, key, weight_dtype, dtype)
