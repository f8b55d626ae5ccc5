"""What ``ds4jax generate`` imports before its first token (issue 22: start fast). A cached run traces nothing (its
programs come from the executable cache), so the modules that only tracing, other formats or other commands need
must stay out of its path: flax (mesh rules, FrozenDict views), orbax / tensorstore (the default model is packed:
`ds4jax.io.packed_params`), pallas_kernels (the kernels, imported when a program is traced), tqdm (sharded
loading), the serving and plotting stacks. And ``import ds4jax`` (notebooks) imports no JAX at all, not even when
a single-file module such as ``ds4jax.compilation_cache`` is reached through the package."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("flax", "orbax", "tensorstore", "pallas_kernels", "tqdm", "transformers", "torch", "matplotlib", "fastapi",
         "uvicorn", "starlette", "optax")


def loaded(code: str) -> str:
    """Run `code` in a fresh interpreter; it prints what it found."""
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "DS4JAX_COMPILATION_CACHE": "off", "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_import_ds4jax_and_its_single_file_modules_import_no_jax():
    code = ("import sys, ds4jax\n"
            "from ds4jax import compilation_cache, errors\n"  # the import system probes the package's __getattr__
            "ds4jax.xla_flags\n"
            "print(sorted(m for m in ('jax', 'numpy', *%r) if m in sys.modules))" % (HEAVY,))
    assert loaded(code) == "[]"


def test_generate_path_and_default_model_load_import_nothing_heavy():
    # the modules `ds4jax generate` imports up to its first call, and the default model's load (packed, no compile)
    code = ("import sys\n"
            "from ds4jax.cli import build_parser, enable_compilation_cache\n"
            "build_parser(); enable_compilation_cache()\n"
            "from ds4jax.commands import generate\n"
            "from ds4jax.io.default_model import default_model, default_tokenizer\n"
            "default_tokenizer().encode('def f():', add_bos=True)\n"
            "model = default_model()\n"
            "import ds4jax.generation.generate, ds4jax.generation.engine, ds4jax.runtime.executable_cache\n"
            "assert 'jax' in sys.modules and model.params\n"
            "print(sorted(m for m in %r if m in sys.modules))" % (HEAVY,))
    assert loaded(code) == "[]"
