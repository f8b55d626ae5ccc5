"""``ds4jax --version`` and ``--help`` answer without importing JAX or NumPy (they are instant); ``import ds4jax``
is lazy, yet every public name and subpackage is there on first use."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs `python -m ds4jax ARGS` in this interpreter, then reports which heavy modules it imported.
PROBE = """
import runpy, sys
sys.argv = ["ds4jax", *sys.argv[1:]]
try:
    runpy.run_module("ds4jax", run_name="__main__", alter_sys=True)
except SystemExit as e:
    code = e.code
print("EXIT", code, "HEAVY", sorted(m for m in ("jax", "jaxlib", "numpy", "flax", "orbax") if m in sys.modules))
"""


def run_probe(*args: str) -> str:
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.mark.parametrize("args", [("--version",), ("--help",), ("generate", "--help")])
def test_version_and_help_do_not_import_jax(args):
    out = run_probe(*args)
    assert "EXIT 0 HEAVY []" in out, out
    if args == ("--version",):
        assert out.startswith("ds4jax ")


def test_lazy_package_still_exposes_everything():
    import ds4jax

    for name in ds4jax.__all__:
        assert getattr(ds4jax, name) is not None, name
    assert ds4jax.model.config.Config is ds4jax.Config  # subpackages are bound, as after an eager import
    assert ds4jax.errors.InputError is ds4jax.InputError
    with pytest.raises(AttributeError):
        ds4jax.no_such_name
