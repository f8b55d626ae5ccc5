"""The checkpoint modules form no import circle: the shared pieces live in `safetensors_layout` / `quant_formats`."""

import subprocess
import sys

import pytest

# module -> the loader modules it must not import (directly or through another)
INDEPENDENT = {
    "ds4jax.io.safetensors_layout": ("ds4jax.io.checkpoint", "ds4jax.io.orbax_checkpoint", "ds4jax.io.sharded_load"),
    "ds4jax.io.orbax_checkpoint": ("ds4jax.io.checkpoint", "ds4jax.io.sharded_load"),
    "ds4jax.io.sharded_load": ("ds4jax.io.checkpoint", "ds4jax.io.orbax_checkpoint"),
}


@pytest.mark.parametrize("module", sorted(INDEPENDENT))
def test_loader_modules_import_alone(module):
    code = (f"import sys, {module}; print(sorted(m for m in {INDEPENDENT[module]!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", f"{module} imports {out.strip()}"
