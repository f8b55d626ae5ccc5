"""XLA flags ds4jax sets before JAX starts a GPU backend: GPU command buffers (graphs).

XLA:GPU records runs of kernels into command buffers (CUDA graphs / HIP graphs). Its default set leaves out `while`
and `conditional`, so each iteration of a while loop -- ds4jax's decode and speculative calls are while loops of up
to M steps / rounds -- costs a host round trip for its condition and a launch of the body's graph. With WHILE and
CONDITIONAL added, a whole call replays as one graph: on an H100 the default model decoded 904 -> 1,159 tokens/s at
batch 1 and 6,815 -> 9,199 at batch 8 (speculative k=3: 1,715 -> 2,001 and 10,070 -> 12,700; one run each,
`scripts/gpu_command_buffers.sh`, docs/benchmarks/command_buffers_h100.md). Without command buffers at all the same
decode ran at 332 tokens/s.

On ROCm, graph replay of while-loop bodies has crashed (SIGSEGV in the HSA runtime on MI355 / gfx950 with ROCm 7.1,
openxla/xla#46952), and AMD's notes give `--xla_gpu_enable_command_buffer=` (empty: no command buffers) as the
workaround. So:

    DS4JAX_COMMAND_BUFFERS=auto   (default) `loops` on CUDA, `off` on ROCm, nothing set otherwise (CPU)
    DS4JAX_COMMAND_BUFFERS=loops  XLA's default set plus WHILE and CONDITIONAL
    DS4JAX_COMMAND_BUFFERS=on     XLA's default set
    DS4JAX_COMMAND_BUFFERS=off    no command buffers

There is no switch for XLA:GPU's parallel LLVM compilation: `--xla_gpu_enable_llvm_module_compilation_parallelism`
is not a flag of the XLA in jax 0.11.2 (a process given it aborts at backend start: "Unknown flag in XLA_FLAGS",
seen on the H200, docs/benchmarks/startup_timeline_h200/), so the opt-in that set it is gone.

An explicit flag in XLA_FLAGS always wins. XLA reads XLA_FLAGS when the first backend starts, so
`apply()` runs when `ds4jax` is imported; a backend started earlier keeps its flags (a warning says so).
"""

from __future__ import annotations

import importlib.util
import os
import warnings

ENV = "DS4JAX_COMMAND_BUFFERS"
FLAG = "--xla_gpu_enable_command_buffer"
MODES = ("auto", "loops", "on", "off")
VALUES = {"loops": "+WHILE,+CONDITIONAL", "on": None, "off": ""}  # the flag's value per mode (None: not set)
ROCM_PLUGINS = ("jax_rocm7_plugin", "jax_rocm60_plugin", "jax_plugins.xla_rocm7", "jax_plugins.xla_rocm60")
CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_cuda12_plugin", "jax_plugins.xla_cuda13", "jax_plugins.xla_cuda12")


def _installed(names) -> bool:
    for name in names:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except ModuleNotFoundError:  # parent package (jax_plugins) absent
            continue
    return False


def _rocm_installed() -> bool:
    return _installed(ROCM_PLUGINS)


def _cuda_installed() -> bool:
    return _installed(CUDA_PLUGINS)


def _allowed(environ, names: set[str]) -> bool:
    """JAX_PLATFORMS (if set) lets JAX pick one of `names`."""
    platforms = {p.strip() for p in environ.get("JAX_PLATFORMS", "").lower().split(",") if p.strip()}
    return not platforms or bool(names & platforms)


def rocm_expected(environ=os.environ) -> bool:
    """Will JAX pick a ROCm device? A ROCm plugin is installed and JAX_PLATFORMS (if set) allows it."""
    return _allowed(environ, {"rocm", "gpu"}) and _rocm_installed()


def cuda_expected(environ=os.environ) -> bool:
    """Will JAX pick a CUDA device? A CUDA plugin is installed and JAX_PLATFORMS (if set) allows it."""
    return _allowed(environ, {"cuda", "gpu"}) and _cuda_installed()


def mode(environ=os.environ, rocm: bool | None = None, cuda: bool | None = None) -> str:
    """The command-buffer mode in effect: `auto` resolved by the GPU JAX will start (ROCm first: it is the one that
    crashes) to off / loops, or `on` (XLA's default: nothing to set) where neither is expected."""
    chosen = environ.get(ENV, "auto").lower()
    if chosen not in MODES:
        raise ValueError(f"{ENV}={chosen!r}: expected one of {', '.join(MODES)}")
    if chosen != "auto":
        return chosen
    if rocm_expected(environ) if rocm is None else rocm:
        return "off"
    return "loops" if (cuda_expected(environ) if cuda is None else cuda) else "on"


def records_conditionals(xla_flags: str) -> bool:
    """Whether XLA_FLAGS' command-buffer setting (the last one given; absent: XLA's default set, which leaves
    CONDITIONAL out) records conditionals, so a `lax.cond` in a loop runs on the device without a host round trip."""
    given = [f.split("=", 1)[1] for f in xla_flags.split() if f.startswith(FLAG + "=")]
    value = given[-1] if given else ""
    return "CONDITIONAL" in value and "-CONDITIONAL" not in value


def flags_with_mode(xla_flags: str, chosen: str) -> str:
    """XLA_FLAGS with the command-buffer flag for mode `chosen` appended (an explicit setting is left alone)."""
    value = VALUES[chosen]
    if value is None or FLAG in xla_flags:
        return xla_flags
    return f"{xla_flags} {FLAG}={value}".strip()


def apply(environ=os.environ) -> None:
    old = environ.get("XLA_FLAGS", "")
    new = flags_with_mode(old, mode(environ))
    if new == old:
        return
    from jax._src import xla_bridge  # private: the only way to know whether backends already read XLA_FLAGS

    if xla_bridge.backends_are_initialized():
        added = " ".join(new.split()[len(old.split()):])
        warnings.warn(f"ds4jax: a JAX backend started before ds4jax was imported; {added} is not "
                      f"applied (set XLA_FLAGS yourself or import ds4jax first)", stacklevel=2)
        return
    environ["XLA_FLAGS"] = new
