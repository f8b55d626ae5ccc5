"""Our executable cache next to JAX's persistent cache: an entry we store must run in a later process even when
JAX's cache already held the program (the CLI enables both; ds4jax upgrades change our keys, not JAX's)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PROGRAM = """
import sys
import jax, jax.numpy as jnp
jax.config.update("jax_compilation_cache_dir", sys.argv[1] + "/jax")
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
from ds4jax.runtime import executable_cache
if sys.argv[2] == "ours":
    executable_cache.enable(sys.argv[1] + "/ours")

@executable_cache.cached_jit
@jax.jit
def f(x):
    return jax.lax.fori_loop(0, 3, lambda i, c: jnp.sort(c[::-1] * 2 + c[1:2]), x).sum()

print("RESULT", float(f(jnp.arange(8.0))))
"""


def run(cache, mode):
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", PROGRAM, cache, mode], capture_output=True, text=True, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.split("RESULT")[1].strip()


def test_entries_stored_after_a_jax_cache_hit_run(tmp_path):
    cache = str(tmp_path)
    expected = run(cache, "jax")  # JAX's cache only: it now holds the program
    assert run(cache, "ours") == expected  # our miss: compiled and stored (not JAX's copy, which loses kernels)
    assert os.listdir(os.path.join(cache, "ours"))
    assert run(cache, "ours") == expected  # our hit: the stored executable runs
