"""Where compiled programs persist between processes: one policy for every entry point.

The CLI, the batch command, `ds4jax.load` / `default_model`, `forward_logits`, `generate` and the `Engine` call
`ensure_compilation_cache()` before they compile, so a notebook or a script reuses what an earlier process
compiled, as the CLI does. It is not an import side effect: ``import ds4jax`` changes no JAX setting, and a
program that never calls an entry point is left alone.

Policy, decided at the first call:

* ``DS4JAX_COMPILATION_CACHE=off`` disables it (checked at every call, so it can be turned off before any use);
  ``DS4JAX_COMPILATION_CACHE=<dir>`` names the directory; otherwise ``$XDG_CACHE_HOME/ds4jax/jax`` (default
  ``~/.cache/ds4jax/jax``).
* A cache the user configured (``jax_compilation_cache_dir`` / ``JAX_COMPILATION_CACHE_DIR``, or
  ``jax_enable_compilation_cache=False``) wins: nothing of theirs is changed, thresholds included.
* Every program is written, however small or fast to compile (minimum compile time 0, no minimum size): a
  ds4jax start-up is dozens of small programs (weight casts, random init, sampling) that add up to seconds.

``DS4JAX_EXECUTABLE_CACHE=on`` adds, for every entry point, the executable cache the CLI uses by default
(`ds4jax.runtime.executable_cache`, under ``<dir>/executables``): it also skips tracing and lowering, which is most of
a warm-up from the cache (the default model's Engine on the 2-core CPU: 8.4 s with JAX's cache, 4.5 s with both).
Its key cannot see code monkeypatched at run time, so a library process opts in; ``off`` keeps the CLI on JAX's
cache alone too. A multi-process job never uses it (its executables span processes).

The entries are JAX's own: keyed by the lowered program (so the model config, shapes, dtypes and shardings),
the compile options, the XLA flags, the jaxlib version, the backend's platform and version and the devices'
topology (`tests/test_compilation_cache_keys.py` checks each). An entry is native code run as is, so the
directory is created private to this user (mode 0700). Nothing is ever evicted; delete the directory to
reclaim the space.
"""

from __future__ import annotations

import os
import threading
import warnings

ENV = "DS4JAX_COMPILATION_CACHE"
_lock = threading.Lock()
_ours: str | None = None  # the directory this process configured, once it did


def default_directory() -> str:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ds4jax", "jax")


def ensure_compilation_cache() -> str | None:
    """Turn JAX's persistent compilation cache on for this process (once) per the policy above.

    Returns the directory ds4jax configured, or None when the cache is off or the user configured their own."""
    global _ours
    with _lock:
        if _ours is not None:
            return _ours
        where = os.environ.get(ENV)
        if where == "off":
            return None
        import jax

        if os.environ.get("JAX_COMPILATION_CACHE_DIR") or jax.config.jax_compilation_cache_dir:
            return None  # theirs
        if not jax.config.jax_enable_compilation_cache:
            return None  # they turned JAX's cache off
        where = os.path.abspath(os.path.expanduser(where or default_directory()))
        try:
            os.makedirs(where, mode=0o700, exist_ok=True)
        except OSError as e:  # a read-only home must not break generation: run uncached
            warnings.warn(f"ds4jax: compilation cache disabled, cannot create {where}: {e}", stacklevel=2)
            return None
        # JAX reads the directory at the first compile that finds it set, so turning it on after earlier
        # (uncached) compiles of this process still caches every later one.
        jax.config.update("jax_compilation_cache_dir", where)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # -1: no minimum, and no override
        _ours = where
        if os.environ.get(EXECUTABLES_ENV) == "on":
            enable_executable_cache(where)
        return where


EXECUTABLES_ENV = "DS4JAX_EXECUTABLE_CACHE"


def enable_executable_cache(where: str) -> bool:
    """Our executable cache under `where` (JAX's cache directory), unless ``DS4JAX_EXECUTABLE_CACHE=off`` or this
    process is one of a multi-process job. Returns whether it is on."""
    from ds4jax.runtime import executable_cache
    from ds4jax.runtime.distributed import launched

    if os.environ.get(EXECUTABLES_ENV) == "off" or launched():
        return False
    if not executable_cache.enabled():
        executable_cache.enable(os.path.join(where, "executables"))
    return True
