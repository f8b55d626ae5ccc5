"""XLA flags ds4jax sets before JAX starts a GPU backend: one switch for GPU command buffers (graphs).

XLA:GPU records runs of kernels into command buffers (CUDA graphs / HIP graphs). On ROCm, graph replay of while-loop
bodies has crashed (SIGSEGV in the HSA runtime on MI355 / gfx950 with ROCm 7.1, openxla/xla#46952), and AMD's notes
give `--xla_gpu_enable_command_buffer=` (empty: no command buffers) as the workaround. ds4jax's speculative loop is a
while loop, so on ROCm command buffers are off unless asked for:

    DS4JAX_COMMAND_BUFFERS=auto   (default) off on ROCm, XLA's default elsewhere
    DS4JAX_COMMAND_BUFFERS=on     XLA's default everywhere
    DS4JAX_COMMAND_BUFFERS=off    off everywhere

An explicit `--xla_gpu_enable_command_buffer` in XLA_FLAGS always wins. XLA reads XLA_FLAGS when the first backend
starts, so `apply()` runs when `ds4jax` is imported; a backend started earlier keeps its flags (a warning says so).
"""

from __future__ import annotations

import importlib.util
import os
import warnings

ENV = "DS4JAX_COMMAND_BUFFERS"
FLAG = "--xla_gpu_enable_command_buffer"
ROCM_PLUGINS = ("jax_rocm7_plugin", "jax_rocm60_plugin", "jax_plugins.xla_rocm7", "jax_plugins.xla_rocm60")


def _rocm_installed() -> bool:
    for name in ROCM_PLUGINS:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:  # parent package (jax_plugins) absent
            continue
    return False


def rocm_expected(environ=os.environ) -> bool:
    """Will JAX pick a ROCm device? A ROCm plugin is installed and JAX_PLATFORMS (if set) allows it."""
    platforms = [p.strip() for p in environ.get("JAX_PLATFORMS", "").lower().split(",") if p.strip()]
    if platforms and not {"rocm", "gpu"} & set(platforms):
        return False
    return _rocm_installed()


def command_buffers_off(environ=os.environ, rocm: bool | None = None) -> bool:
    mode = environ.get(ENV, "auto").lower()
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"{ENV}={mode!r}: expected auto, on or off")
    if mode == "auto":
        return rocm_expected(environ) if rocm is None else rocm
    return mode == "off"


def flags_with_switch(xla_flags: str, off: bool) -> str:
    """XLA_FLAGS with command buffers disabled when `off` (an explicit setting of the flag is left alone)."""
    if not off or FLAG in xla_flags:
        return xla_flags
    return f"{xla_flags} {FLAG}=".strip()


def apply(environ=os.environ) -> None:
    new = flags_with_switch(environ.get("XLA_FLAGS", ""), command_buffers_off(environ))
    if new == environ.get("XLA_FLAGS", ""):
        return
    from jax._src import xla_bridge  # private: the only way to know whether backends already read XLA_FLAGS

    if xla_bridge.backends_are_initialized():
        warnings.warn(f"ds4jax: a JAX backend started before ds4jax was imported; {FLAG}= is not applied "
                      f"(set XLA_FLAGS yourself or import ds4jax first)", stacklevel=2)
        return
    environ["XLA_FLAGS"] = new
