"""A disk cache of compiled executables that skips tracing and lowering, for short command-line runs.

JAX's persistent compilation cache saves the XLA compile, but its key is the lowered program, so every process
still traces and lowers each step before it can look the entry up: on the tiny default model that is most of
a cached ``ds4jax generate`` (seconds of Python per step function). `cached_jit` keys a serialized executable by
what determines the program instead: the function, its static arguments, the shapes / dtypes / shardings of the
dynamic ones, and a fingerprint of everything else that can change the trace (ds4jax's and pallas_kernels'
source, the jax / jaxlib versions, the devices, ``DS4JAX_*`` / ``JAX_*`` / ``XLA_FLAGS`` variables, x64).

Off unless `enable(directory)` was called. The CLI does (under JAX's cache directory, see
`ds4jax.cli.enable_compilation_cache`); the Python API, the Engine and notebooks do with
``DS4JAX_EXECUTABLE_CACHE=on`` (`ds4jax.compilation_cache`), and otherwise use JAX's own persistent cache alone,
whose key is the lowered program itself and so cannot be fooled by anything that changes a trace. The contexts a
library caller may trace under (a default device, a mesh, a matmul precision or x64 set in a ``with`` block) are
part of every key here: JAX's trace context (`jax._src.config.trace_context`, what its own in-memory jit cache
keys on), rendered stably, and a call whose context has no stable rendering runs uncached. Code monkeypatched at
run time is the one thing no key sees (the source files are fingerprinted, not the objects): hence opt-in. Kept there because it saves what JAX's cache cannot, tracing and lowering: a cached ``ds4jax generate
--max-new-tokens 32`` on the default model took 3.50 s of CPU to its first token with it and 5.06 s with JAX's
cache alone (4.86 vs 8.23 s for the whole run; docs/benchmarks/cli_startup.md, "The executable cache, kept for
the CLI").

Entries are pickles written by this process' user into its own cache directory: the same trust as JAX's cache,
whose entries are native code run as is. A corrupt or incompatible entry is a miss.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import contextlib
import functools
import hashlib
import importlib.util
import os
import pickle
import re
import tempfile
import threading
from typing import Any, Callable

import jax
import numpy as np

_directory: str | None = None
_FRESH = {"xla_embed_ir_in_executable": False}  # see _fresh_compile
_memory: dict[str, Any] = {}
_by_signature: dict[tuple, Any] = {}  # a call's hashable signature -> its executable (skips the sha256 key)
# prefetch: entries being loaded on threads, and the first keys this run asked for after announcing itself
MAX_HINTED = 4  # a run's start-up programs (the CLI's first token needs one, its second one more)
PARALLEL_CPUS = 4  # with fewer cores, only the first hinted program is prefetched
_pending: dict[str, concurrent.futures.Future] = {}
_writer: concurrent.futures.ThreadPoolExecutor | None = None  # `_store`'s background writes
_writer_lock = threading.Lock()
_writes: list[concurrent.futures.Future] = []
_hint: dict[str, Any] = {"path": None, "read": [], "seen": []}


def enable(directory: str | None) -> None:
    """Cache executables under `directory` (None disables)."""
    global _directory
    flush()
    _directory = directory
    clear_memory()


def clear_memory() -> None:
    """Forget the executables loaded in this process (the disk entries stay, every pending write finished)."""
    flush()
    _memory.clear()
    _by_signature.clear()
    _pending.clear()  # a thread still loading one finishes into a future nobody reads
    _hint.update(path=None, read=[], seen=[])


def prefetch(tag: str) -> int:
    """Start loading, each on a thread of its own, the executables that the last run announcing `tag` asked for first
    (up to `MAX_HINTED`; only the first one on a machine of fewer than `PARALLEL_CPUS` cores), and record this run's
    first ones for the next. Returns how many loads started.

    For a short run whose programs come from this cache, deserializing them is a large part of its start-up (the
    default model's prefill and decode programs: ~0.6 s each on a 2-core CPU, ~0.9 s each on an H200 host), and
    the first call cannot name its program before its arguments exist (the weights loaded, the pools allocated).
    XLA deserializes without the GIL, so the loads overlap that work and each other
    (docs/benchmarks/cli_startup.md). `tag` must name everything the run's programs depend on beyond the code
    (the CLI: its arguments and the prompt's length); a stale hint costs a load nobody uses, never a wrong
    program: a call still looks its own key up, and only takes a prefetched executable stored under that key."""
    if _directory is None:
        return 0
    path = os.path.join(_directory, "hints", hashlib.sha256(tag.encode()).hexdigest())
    try:
        with open(path) as f:
            read = [k for k in f.read().split()[:MAX_HINTED] if re.fullmatch(r"[0-9a-f]{64}", k)]
    except OSError:
        read = []
    _hint.update(path=path, read=read, seen=[])
    keys = [k for k in read if k not in _memory and k not in _pending and os.path.exists(_path(k))]
    if _cpus() < PARALLEL_CPUS:
        # few cores: the first program only. Loading the next ones early competes with the first call's own work
        # for the same cores, and delays the first token (measured on 2 cores: docs/benchmarks/cli_startup.md)
        keys = keys[:1]
    for key in keys:
        future = _pending[key] = concurrent.futures.Future()
        threading.Thread(target=_load_into, args=(key, future), name=f"ds4jax-prefetch-{key[:8]}",
                         daemon=True).start()
    return len(keys)


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def _load_into(key: str, future: concurrent.futures.Future) -> None:
    result = None  # the future itself, not _pending's entry: a caller may have taken that already
    try:
        result = _load(key)
    finally:
        future.set_result(result)


def _note(key: str) -> None:
    """Record `key` among the first programs of the run `prefetch` announced (the hint file changes only when
    this run's first keys differ from the ones it read)."""
    seen, path = _hint["seen"], _hint["path"]
    if path is None or len(seen) >= MAX_HINTED or key in seen:
        return
    seen.append(key)
    if seen == _hint["read"][:len(seen)]:
        return
    try:  # best effort, like the entries: write then rename
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(seen) + "\n")
        os.replace(tmp, path)
        _hint["read"] = list(seen)
    except OSError:
        pass


def _take(key: str):
    """The executable stored under `key`: a prefetch's (waiting for its thread), else loaded now; None: a miss."""
    future = _pending.pop(key, None)
    return future.result() if future is not None else _load(key)


def enabled() -> bool:
    return _directory is not None


@functools.lru_cache(maxsize=1)
def _fingerprint() -> str:
    """Everything outside the call that can change a trace."""
    import jaxlib

    h = hashlib.sha256()
    roots = [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]  # the ds4jax package
    # where pallas_kernels lives, without running its __init__ (importing the package costs ~60 ms of start-up)
    spec = importlib.util.find_spec("pallas_kernels")
    if spec is not None and spec.submodule_search_locations:
        roots.append(os.path.abspath(next(iter(spec.submodule_search_locations))))
    for root in roots:
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                h.update(os.path.relpath(path, root).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    devices = jax.devices()
    # XLA_PYTHON_CLIENT_* (preallocation, memory fraction, allocator) size the allocator, not a program: the CLI
    # sets one of them itself (cli.NO_PREALLOCATION), and a run without it must find the same entries
    env = sorted((k, v) for k, v in os.environ.items()
                 if k.startswith(("DS4JAX_", "JAX_", "XLA_")) and not k.startswith("XLA_PYTHON_CLIENT_"))
    h.update(repr((jax.__version__, jaxlib.__version__, jax.default_backend(), len(devices),
                   devices[0].device_kind, env, jax.config.jax_enable_x64,
                   jax.config.jax_default_matmul_precision)).encode())
    return h.hexdigest()


def _signature(args: tuple, static: dict) -> str:
    leaves, treedef = jax.tree.flatten(args)
    avals = [(str(jax.typeof(x)), repr(getattr(x, "sharding", None))) for x in leaves]
    return repr((treedef, avals, sorted(static.items(), key=lambda kv: kv[0])))


def _fast_signature(args: tuple, static: dict) -> tuple:
    """What `_signature` renders, as a hashable tuple: building it costs a tree flatten, where the rendered key
    (reprs of every leaf's type and sharding, then sha256) costs milliseconds per call on a model's params. With
    the trace context (a tuple of interned values: hashing it is cheap)."""
    leaves, treedef = jax.tree.flatten(args)
    return (treedef, tuple((getattr(x, "shape", None), getattr(x, "dtype", None), getattr(x, "sharding", None),
                            getattr(x, "weak_type", False)) for x in leaves), tuple(sorted(static.items())),
            _trace_context())


def _trace_context() -> tuple:
    from jax._src import config

    return config.trace_context()


def _stable(value) -> str | None:
    """A rendering of one trace-context value that is the same in every process, or None (then nothing is cached):
    plain values as themselves, JAX's axis environment by its names and sizes, anything whose repr names a memory
    address refused."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    if isinstance(value, (tuple, list, frozenset)):
        parts = [_stable(v) for v in (sorted(value, key=repr) if isinstance(value, frozenset) else value)]
        return None if None in parts else f"{type(value).__name__}({', '.join(parts)})"
    if type(value).__name__ == "AxisEnv":  # outside shard_map / pmap: empty
        return repr(("AxisEnv", sorted(map(repr, value.axis_sizes.items())), sorted(map(repr, value.spmd_axis_names)),
                     sorted(map(repr, value.explicit_mesh_axis_names))))
    text = repr(value)
    if " at 0x" in text:
        return None
    try:  # a concrete mesh: its repr names its shape, not which devices (an abstract one has none)
        ids = getattr(value, "device_ids", None)
    except ValueError:
        ids = None
    return f"{type(value).__name__}:{text}" + ("" if ids is None else f":{np.asarray(ids).tolist()}")


def _context_key() -> str | None:
    """The trace context rendered for a disk key, or None when a value of it has no stable rendering."""
    parts = [_stable(v) for v in _trace_context()]
    return None if None in parts else "|".join(parts)


def cached_jit(jitted: Callable) -> "CachedJit":
    """Wrap a ``jax.jit`` function whose keyword arguments are all static (and positional ones dynamic)."""
    return CachedJit(jitted)


class CachedJit:
    """Calls `uncached` (the jitted function) when the cache is off; other attributes are the jitted function's."""

    def __init__(self, jitted: Callable):
        self.uncached = jitted
        self._name = f"{jitted.__module__}.{getattr(jitted, '__qualname__', getattr(jitted, '__name__', 'fn'))}"
        functools.update_wrapper(self, jitted)

    def __call__(self, *args, **static):
        from ds4jax.runtime import precompile

        if precompile.active():  # warm-up's capture pass: lower here, compile later on a thread pool
            precompile.capture(self._job(args, static))
        if _directory is None:
            return self.uncached(*args, **static)
        fast = (self._name, _fast_signature(args, static))
        compiled = _by_signature.get(fast)
        if compiled is None:
            key = self._key(args, static)
            if key is None:  # a context no key can name: JAX's own caches only
                return self.uncached(*args, **static)
            compiled = _memory.get(key)
            if compiled is None:
                compiled = _memory[key] = _take(key) or _compile_and_store(self.uncached, key, args, static)
                _note(key)
            _by_signature[fast] = compiled
        return compiled(*args)

    def _key(self, args: tuple, static: dict) -> str | None:
        context = _context_key()
        if context is None:
            return None
        return hashlib.sha256(f"{self._name}|{_fingerprint()}|{context}|{_signature(args, static)}".encode()).hexdigest()

    def _job(self, args: tuple, static: dict):
        """The compile this call needs, with tracing and lowering done now (on the caller's thread)."""
        from ds4jax.runtime.precompile import Job

        if _directory is None:  # an AOT compile fills the jitted function's own cache, which the call then hits
            lowered = self.uncached.trace(*args, **static).lower()
            return Job(self._name, lowered.compile)
        key = self._key(args, static)
        if key is None:  # a context no key can name: compiled by JAX, as the call will be
            return Job(self._name, self.uncached.trace(*args, **static).lower().compile)
        if key in _memory:
            return Job(self._name, None)
        if key in _pending or os.path.exists(_path(key)):  # deserialized on the pool, beside the other programs
            return Job(self._name, functools.partial(_load_to_memory, key))
        lowered = self.uncached.trace(*args, **static).lower()

        def compile_and_store():
            _memory[key] = _store(key, lowered.compile(_FRESH))  # inside precompile's fresh_compiles() scope

        return Job(self._name, compile_and_store)

    def __getattr__(self, name: str):  # _cache_size, lower, trace, ... of the jitted function
        return getattr(self.uncached, name)


def _load_to_memory(key: str) -> None:
    """A warm-up job (`CachedJit._job`) for a stored program: XLA deserializes without the GIL, so the engine's
    programs load side by side (on an H200 host ~0.9 s each one after another; docs/benchmarks/cli_startup.md). An
    entry that fails to load stays out of memory: the program's own call then compiles it, on its caller's thread
    and in its contexts, as for any miss."""
    loaded = _take(key)
    if loaded is not None:
        _memory[key] = loaded


def _path(key: str) -> str:
    return os.path.join(_directory, key[:2], key + ".exe")


def _load(key: str):
    from jax.experimental.serialize_executable import deserialize_and_load

    try:
        with open(_path(key), "rb") as f:
            payload, in_tree, out_tree, device_ids = pickle.load(f)
        by_id = {d.id: d for d in jax.devices()}
        return deserialize_and_load(payload, in_tree, out_tree, execution_devices=[by_id[i] for i in device_ids])
    except Exception:  # absent, truncated, or written by an incompatible build: recompile
        return None


@contextlib.contextmanager
def fresh_compiles():
    """Within, on this thread: compiles are never written to JAX's persistent cache (see `_fresh_compile`). JAX's
    setting taken as a context is thread-local, so only the compiles that need it skip the cache: a warm-up's small
    programs, compiled on the calling thread while the pool's jobs hold this, are written as usual (with the
    setting changed process-wide they were not, and a cached warm-up compiled them again)."""
    from jax._src import config

    with config.persistent_cache_min_compile_time_secs(float("inf")):
        yield


def _fresh_compile(lowered):
    """Compile `lowered` with XLA, never taking it from JAX's persistent cache: an executable *loaded* from that
    cache serializes without its kernels (XLA:CPU; the copy we would store fails with "NOT_FOUND: Function
    wrapped_slice not found" when it runs). `_FRESH` (an option set to its default value) gives the program a key
    of its own in JAX's cache, and nothing is written under that key, so the lookup always misses."""
    with fresh_compiles():
        return lowered.compile(_FRESH)


def _compile_and_store(jitted: Callable, key: str, args: tuple, static: dict):
    return _store(key, _fresh_compile(jitted.trace(*args, **static).lower()))


def _store(key: str, compiled):
    """Write `compiled` under `key` on a background thread (best effort) and return it at once: serializing and
    writing an executable (0.2 s for the default model's prefill on an H100 host, 0.3 s on the 2-core CPU;
    docs/benchmarks/startup_timeline_h100/) no longer stands between a cold run's compile and its first call.
    `flush()` waits for the writes; so do `enable`, `clear_memory` and the interpreter's exit."""
    global _writer
    with _writer_lock:
        if _writer is None:  # one thread: writes are few, and a second would only contend for the cores
            _writer = concurrent.futures.ThreadPoolExecutor(1, "ds4jax-store")
            atexit.register(flush)
        _writes.append(_writer.submit(_write, _path(key), compiled))
    return compiled


def flush() -> None:
    """Wait for the executables `_store` is still writing."""
    with _writer_lock:
        pending = list(_writes)
        _writes.clear()
    concurrent.futures.wait(pending)


def _write(path: str, compiled) -> None:
    from jax.experimental.serialize_executable import serialize

    try:
        device_ids = [d.id for d in compiled._executable.xla_executable.local_devices()]
        blob = pickle.dumps((*serialize(compiled), device_ids))
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path))  # write then rename: readers never see half a file
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
        os.replace(tmp, path)
    except Exception:  # unserializable (closed-over constants; sort comparators at
        pass  # XLA:CPU optimization level 0) or a read-only cache: runs, uncached
