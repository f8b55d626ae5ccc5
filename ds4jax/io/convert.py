"""``ds4jax convert SRC DST``: any loadable checkpoint (safetensors in any accepted naming/quantization, or ours
in Orbax or packed) to our Orbax format, our packed one (`ds4jax.io.packed_params`: one file, the fastest to load)
or upstream-named safetensors.

The destination is assembled in a hidden directory beside DST and renamed into place only when complete
(`orbax_checkpoint.atomic_directory`), so an interrupted conversion leaves nothing at DST and nothing that loads.
Files other than weights and config (tokenizer, reports, plots) are copied along.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
from typing import Any

FORMATS = ("orbax", "packed", "safetensors")
# Imported lazily below, so that building the command-line parser does not import JAX.
CONFIG_FILE, INDEX_FILE = "config.json", "model.safetensors.index.json"


def source_format(path: str) -> str:
    from ds4jax.io import orbax_checkpoint, packed_params

    if packed_params.is_packed(path):
        return "packed"
    return "orbax" if orbax_checkpoint.is_orbax(path) else "safetensors"


def source_dtype(path: str) -> Any:
    """float32 when the source stores its embedding in float32, else bfloat16 (FP8/FP4 dequantize to bf16)."""
    import jax.numpy as jnp
    import numpy as np

    from ds4jax.io import orbax_checkpoint, packed_params

    fmt = source_format(path)
    if fmt in ("orbax", "packed"):
        meta = (orbax_checkpoint.stored_metadata(path) if fmt == "orbax" else packed_params.stored_metadata(path))
        embed = meta.get("embed")
        dtype = None if embed is None else (embed.dtype if fmt == "orbax" else embed[1])
        return jnp.float32 if dtype is not None and np.dtype(dtype) == np.float32 else jnp.bfloat16
    from safetensors import safe_open

    for shard in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(shard, "np") as f:
            for key in f.keys():
                if key.endswith(("embed.weight", "embed_tokens.weight")):
                    return jnp.float32 if f.get_slice(key).get_dtype() == "F32" else jnp.bfloat16
    return jnp.bfloat16


def _extras(src: str) -> list[str]:
    """Top-level files to carry over: everything but weights, the index and config.json (rewritten)."""
    return sorted(f for f in os.listdir(src) if os.path.isfile(os.path.join(src, f))
                  and f not in (CONFIG_FILE, INDEX_FILE) and not f.endswith(".safetensors"))


def convert(src: str | os.PathLike, dst: str | os.PathLike, to: str | None = None, dtype: Any = None,
            overwrite: bool = False, quantize: str | None = None) -> str:
    """Convert `src` to format `to` (default: safetensors from ours, Orbax from safetensors) at `dst`; returns the
    format written.

    ``quantize="fp4"`` / ``"fp8"`` writes the published quantized safetensors layout (`ds4jax.save`'s `quantize`),
    quantized from the source's values read in float32 (unless `dtype` says otherwise)."""
    import numpy as np

    from ds4jax.errors import ArgumentError
    from ds4jax.io import checkpoint, official_format, orbax_checkpoint, packed_params

    official_format.check_quantize(quantize)
    if quantize is not None:
        if to in ("orbax", "packed"):
            raise ArgumentError(f"the {to} format stores the params as they are: quantize writes safetensors",
                                name="quantize", value=quantize)
        to, dtype = "safetensors", dtype or np.float32

    src, dst = os.fspath(src), os.fspath(dst)
    if not os.path.isdir(src):
        raise checkpoint.CheckpointError(f"checkpoint directory {src!r} does not exist")
    if os.path.abspath(src) == os.path.abspath(dst):
        raise checkpoint.CheckpointError("source and destination are the same directory")
    to = to or ("orbax" if source_format(src) == "safetensors" else "safetensors")
    if to not in FORMATS:
        raise checkpoint.CheckpointError(f"unknown format {to!r}; expected one of {FORMATS}")
    model = checkpoint.load(src, dtype=dtype if dtype is not None else source_dtype(src), weights="bf16")
    with orbax_checkpoint.atomic_directory(dst, overwrite=overwrite) as tmp:
        for name in _extras(src):
            shutil.copy2(os.path.join(src, name), os.path.join(tmp, name))
        if to == "orbax":
            orbax_checkpoint.write_params(model.params, tmp)
        elif to == "packed":
            packed_params.write_params(model.params, tmp)
        else:
            checkpoint.save(model, tmp, overwrite=True, quantize=quantize)
            os.remove(os.path.join(tmp, CONFIG_FILE))  # written again below, last
        write_config(model, tmp, quantize)
    return to


def write_config(model, directory: str, quantize: str | None = None) -> None:
    """config.json is written last: a directory without it is not a checkpoint."""
    from ds4jax.io import official_format

    with open(os.path.join(directory, CONFIG_FILE), "w") as f:
        json.dump(official_format.official_config(model.config, quantize, (128, 128)), f, indent=2)


def add_parser(sub) -> None:
    p = sub.add_parser("convert", help="convert a checkpoint between safetensors and our Orbax / packed formats",
                       description="Convert SRC (safetensors in any accepted naming, Orbax or packed) to DST. The "
                                   "default target format is Orbax from safetensors, safetensors from ours. DST "
                                   "appears only once complete.")
    p.add_argument("src", metavar="SRC", help="checkpoint directory to read (safetensors, Orbax or packed)")
    p.add_argument("dst", metavar="DST", help="directory to write (appears only once complete)")
    p.add_argument("--to", choices=FORMATS, default=None, help="target format (default: Orbax from safetensors, safetensors from Orbax or packed; packed: "
                        "one file, the fastest to load)")
    p.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="weight dtype (auto: float32 if the source embedding is float32, else bfloat16)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing DST")
    p.add_argument("--quantize", choices=("fp8", "fp4"), default=None,
                   help="write the published quantized safetensors layout: FP8 dense linears with 128x128 E8M0 "
                        "block scales, routed experts FP4 (fp4, instruct) or FP8 (fp8, base)")


def run(args) -> int:
    import jax.numpy as jnp

    dtype = None if args.dtype == "auto" else jnp.dtype(args.dtype)
    written = convert(args.src, args.dst, to=args.to, dtype=dtype, overwrite=args.overwrite, quantize=args.quantize)
    print(f"wrote {written} checkpoint {args.dst}")
    return 0
