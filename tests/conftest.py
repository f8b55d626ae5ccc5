"""Test-wide setup: CPU by default, several virtual devices (so sharding code runs), deterministic seeds.

Where a GPU and a JAX GPU plugin are present, JAX also initialises that GPU (CPU stays the default backend), and
tests marked `device` run on it inside `jax.default_device(gpu)`; elsewhere they are skipped. No environment
variable is needed either way (an explicit JAX_PLATFORMS is respected).
"""

import glob
import importlib.metadata
import os
import sys

# Byte code: the suite starts ~40 Python processes (pytest workers, notebook kernels, mesh / multi-process / CLI
# subprocesses), and each imports jax, and many torch and transformers. With PYTHONDONTWRITEBYTECODE set (the CI
# image sets it) no .pyc is ever written, so every one of them compiled those packages' sources again: collecting
# the suite took 15.2 s per worker instead of 7.0, `import jax` 2.45 s instead of 1.10 (2-core CI machine). This
# process and every process it starts write and reuse .pyc files as Python does by default.
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None) is not None:
    sys.dont_write_bytecode = False

import pytest  # noqa: E402

import cheap_compile
import run_cache


def _gpu_platform() -> str | None:
    """'cuda' / 'rocm' when this host has such a GPU and a JAX plugin for it (checked without starting JAX)."""
    plugins = {d.metadata["Name"].lower().replace("_", "-") for d in importlib.metadata.distributions()}
    has = lambda prefix: any(p.startswith(prefix) for p in plugins)
    if glob.glob("/dev/nvidia[0-9]*") and (has("jax-cuda") or has("jaxlib-cuda")):
        return "cuda"
    if os.path.exists("/dev/kfd") and has("jax-rocm"):
        return "rocm"
    return None


_GPU = _gpu_platform() if "JAX_PLATFORMS" not in os.environ else None
os.environ.setdefault("JAX_PLATFORMS", f"cpu,{_GPU}" if _GPU else "cpu")
# Tiny test models run in microseconds; XLA's optimisations only cost compile time here (cheap_compile.py).
os.environ.setdefault("XLA_FLAGS", cheap_compile.xla_flags(devices=4))
cheap_compile.relax_gc()  # tracing allocates fast: the collector's default pace cost ~8 % of a test process's CPU
# `ds4jax generate` / `compare` / `batch` turn on JAX's on-disk compilation cache for the rest of their process;
# a test calling them in process would leave it on for every later test of its worker (writing into ~/.cache).
# Tests of the cache name their own directory.
os.environ["DS4JAX_COMPILATION_CACHE"] = "off"
# Instead, one JAX compilation cache for the whole run (run_cache.py): a program compiled by one pytest worker, or
# by a subprocess a test starts, is loaded by every other process that needs it.
run_cache.configure()

# Through the environment, not jax.config, so that every process the suite starts (notebook kernels, CLI and
# worker subprocesses) inherits it: the precision is part of each program (so of its key in the run's cache), and
# a kernel without it compiled its own copy of every program the suite had compiled already.
os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# Layers under lax.scan from two repetitions of a unit, not ds4jax's default three (ds4jax/model/layer_stack.py):
# the default model's [(HCA, top-k), (CSA, top-k)] x 2 then runs as one scanned body instead of four unrolled
# layers. At the tests' XLA level 0 that compiles its engine programs in ~20 % less CPU time (warm-up with k = 3:
# 18.0 / 21.2 -> 15.1 / 16.6 CPU s; tests/test_default_model.py 75 -> 64 CPU s); at XLA's default level on CPU the
# two are even (36-41 CPU s either way), and GPU decode speed at 2 is not measured yet, so the library keeps 3.
# The unrolled layout stays tested: tiny configs have no repeated unit, tests/test_layer_stack.py and
# test_stage_scan.py compare the two layouts, and test_default_model.py the shipped model's.
os.environ.setdefault("DS4JAX_SCAN_MIN_REPEATS", "2")

import jax  # noqa: E402


def gpu_device():
    """The first GPU JAX can see (default backend or not), else None."""
    for platform in ("cuda", "rocm", "gpu"):
        try:
            return jax.devices(platform)[0]
        except RuntimeError:
            continue
    return None


@pytest.fixture(autouse=True)
def _device_tests_on_the_gpu(request):
    if request.node.get_closest_marker("device") is None:
        yield
        return
    gpu = gpu_device()
    if gpu is None:
        pytest.skip("needs a GPU (none found, or no JAX GPU plugin installed)")
    with jax.default_device(gpu):
        yield


def _mappings() -> tuple[int, int] | None:
    """(memory mappings of this process, the kernel's limit), where Linux tells."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read())
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f), limit
    except OSError:
        return None


@pytest.fixture(autouse=True)
def _release_executables():
    """Drop compiled executables before the process runs out of memory mappings.

    XLA's CPU backend maps its JIT code per kernel: a tiny-model test compiles thousands of kernels (2-6 k
    mappings per test here), and a worker that runs half the suite passes Linux's default `vm.max_map_count`
    (65,530), after which the next compile segfaults or aborts inside XLA. Clearing JAX's caches unmaps them
    (measured: 13 k -> 1.1 k); it only costs recompiles, so it happens when a worker is past 40 % of the limit.
    """
    yield
    seen = _mappings()
    if seen is not None and seen[0] > 0.4 * seen[1]:
        import gc

        from ds4jax.runtime import executable_cache

        executable_cache.clear_memory()
        jax.clear_caches()
        gc.collect()


# The suite's long items, with their CPU seconds on the 2-core CI machine (measured with the run's shared cache). A
# key is a node id prefix (a file, or a file::test) or "fixture:NAME" (every test using that fixture). Items under
# one key share a module fixture (a subprocess, a compiled program set), so they stay together on one worker.
_LONG = {
    "fixture:mesh_cases": 150,  # tests/test_mesh.py's two worker processes (every layout and engine case)
    "tests/rocm/test_kernel_compile.py::test_every_kernel": 45,  # lowers every step for 3 GPU targets
    "tests/test_multiprocess.py": 120,  # a 2-process job (mp_job) and launches
    "tests/test_notebooks.py::test_notebook_runs": 80,  # five notebooks, a kernel process each
    "tests/test_compilation_cache.py": 40,  # six fresh processes
    "tests/rocm/test_kernel_compile.py::test_fp8_kv": 35,
    "tests/test_bench_mesh.py": 35,
}


def _long_key(item) -> str | None:
    fixtures = set(getattr(item, "fixturenames", ()))
    for key in _LONG:
        if key.startswith("fixture:") and key[len("fixture:"):] in fixtures or item.nodeid.startswith(key):
            return key
    return None


def pytest_collection_modifyitems(items):
    """Put the long items first in both halves of the collection, split between the halves by their cost.

    `.ci/run` uses `-n 2 --dist worksteal`: xdist hands each worker one contiguous half of the collection, and a
    worker that runs out steals the END of the other's queue. So a long item at the start of a half runs first on
    its worker, none is left to start last while the other worker idles, and the short items fill in around them.
    (Without xdist the order changes nothing.)"""
    groups: dict[str, list] = {}
    short = []
    for item in items:
        key = _long_key(item)
        (groups.setdefault(key, []) if key else short).append(item)
    halves, load = ([], []), [0, 0]
    for key in sorted(groups, key=lambda k: -_LONG[k]):  # greedy: the next longest to the lighter half
        h = load.index(min(load))
        halves[h].extend(groups[key])
        load[h] += _LONG[key]
    fill = max(0, len(items) // 2 - len(halves[0]))
    items[:] = halves[0] + short[:fill] + halves[1] + short[fill:]


_CPU_REPORT = os.environ.get("DS4JAX_TEST_CPU_REPORT")  # a path: each test's CPU seconds, one JSON line per test


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With DS4JAX_TEST_CPU_REPORT set, append {test, cpu_s} per test: this process's CPU (every thread) plus the
    subprocesses it waited for (notebook kernels, CLI and worker processes), setup and teardown included. Wall
    times under xdist mix in the other worker's load; CPU seconds say what a test costs the machine."""
    if not _CPU_REPORT:
        yield
        return
    import json
    import resource

    def used():
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    start = used()
    yield
    with open(_CPU_REPORT, "a") as f:
        f.write(json.dumps({"test": item.nodeid, "cpu_s": round(used() - start, 2)}) + "\n")
