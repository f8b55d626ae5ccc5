"""Device busy time and kernel counts of a piece of JAX work, from a profiler trace (one definition for the
benchmarks).

`profile(run, steps)` traces `run()` (which must do `steps` steps and block), and returns per step: the device
busy time (union of kernel intervals on the device's stream lines), the number of kernels, the kernels per model
layer (attributed by the `layer<i>_` name scope XLA records with each op, when the trace carries it) and the
heaviest kernels.
"""

from __future__ import annotations

import collections
import glob
import pathlib
import re
import tempfile

import jax

_LAYER = re.compile(r"layer(\d+)_")


def gpu_events(log_dir) -> list[tuple[str, int, int, str]]:
    """[(kernel name, start_ns, end_ns, op scope)] on the device stream lines of the trace under log_dir."""
    paths = glob.glob(str(pathlib.Path(log_dir) / "**" / "*.xplane.pb"), recursive=True)
    if not paths:
        raise RuntimeError("no xplane.pb written")
    data = jax.profiler.ProfileData.from_file(paths[0])
    events = []
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        lines = list(plane.lines)
        streams = [ln for ln in lines if ln.name.lower().startswith("stream")]
        for line in streams or [ln for ln in lines if "xla" not in ln.name.lower()]:
            for ev in line.events:
                scope = ""
                try:
                    for key, value in ev.stats:
                        if key in ("tf_op", "name_scope", "long_name", "hlo_op") and isinstance(value, str):
                            scope += " " + value
                except Exception:  # stats are best effort; timing does not depend on them
                    pass
                events.append((ev.name, ev.start_ns, ev.end_ns, scope))
    if not events:
        raise RuntimeError("no device events in the trace: " + str([p.name for p in data.planes])[:400])
    return events


_PALLAS_NAME = re.compile(r'\\?"name\\?":\\?"([\w.\-]+)')


def hlo_scopes(dump_dir, module: str) -> dict[str, str]:
    """{kernel name -> op_name} from the optimized HLO that ``--xla_dump_to=dump_dir --xla_dump_hlo_as_text`` wrote
    for the modules whose name contains `module` (e.g. ``speculative_loop``): a trace names an XLA kernel after
    its instruction with dots as underscores (``loop_fusion.3`` -> ``loop_fusion_3``), and a Pallas kernel by the
    name its call gave (``grouped_matmul``; a second one of that name ``grouped_matmul__1``, mapped here by its base
    name to the first). Where the trace's own events carry no scope (seen on an H100 with jax 0.11.2), this gives
    each kernel the scope its op recorded."""
    import step_kernels

    out: dict[str, str] = {}
    for path in sorted(glob.glob(str(pathlib.Path(dump_dir) / "*after_optimizations.txt"))):
        if module not in pathlib.Path(path).name:
            continue
        for comp in step_kernels.parse(pathlib.Path(path).read_text()).values():
            for name, opcode, line in comp["instrs"]:
                m = step_kernels._OP_NAME.search(line)
                if m is None:
                    continue
                out.setdefault(name.replace(".", "_"), m.group(1))
                if opcode == "custom-call":
                    kernel = _PALLAS_NAME.search(line)
                    if kernel:
                        out.setdefault(kernel.group(1), m.group(1))
    return out


def scope_of(name: str, scope: str, scopes: dict[str, str]) -> str:
    """An event's scope: its own, then the HLO's (`hlo_scopes`) for its kernel name (a Pallas kernel's ``__<n>``
    suffix dropped) and for any instruction its stats name (``hlo_op``: ``loop_fusion.3``). The own scope comes
    first, so a caller's leftmost match prefers it: where a trace's events name no layer (an H100, jax 0.11.2),
    the HLO's op_name says which layer ran the kernel."""
    if not scopes:
        return scope
    keys = [name, re.sub(r"__\d+$", "", name)] + [w.replace(".", "_") for w in scope.split()]
    found = [scopes[k] for k in dict.fromkeys(keys) if k in scopes]
    return " ".join([scope] + found)


def busy_ns(intervals) -> int:
    """Length of the union of [start, end) intervals."""
    total, end = 0, None
    for a, b in sorted(intervals):
        if end is None or a >= end:
            total, end = total + b - a, b
        elif b > end:
            total, end = total + b - end, b
    return total


def summarize(events, steps: int, layers: int) -> dict:
    per_kernel = collections.Counter()
    per_layer = collections.Counter()
    for name, a, b, scope in events:
        per_kernel[name] += b - a
        m = _LAYER.search(scope)
        per_layer[int(m.group(1)) if m else -1] += 1
    attributed = sum(v for k, v in per_layer.items() if k >= 0)
    return {
        "device_busy_ms_per_step": busy_ns((a, b) for _, a, b, _ in events) / steps / 1e6,
        "kernels_per_step": len(events) / steps,
        "kernels_per_layer_per_step": ({str(k): v / steps for k, v in sorted(per_layer.items()) if k >= 0}
                                       if attributed else None),
        "kernels_outside_layers_per_step": per_layer[-1] / steps if attributed else None,
        "top_kernels_us_per_step": {k[:80]: round(v / steps / 1e3, 1) for k, v in per_kernel.most_common(12)},
    }


def profile(run, steps: int, layers: int) -> dict:
    with tempfile.TemporaryDirectory() as log_dir:
        jax.profiler.start_trace(log_dir)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        return summarize(gpu_events(log_dir), steps, layers)


_SKIP_OPS = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all", "partition-id"}
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?\S+\s*=\s*\S+\s+([a-z][a-z0-9\-]*)\(")


def launches_per_layer(hlo_text: str) -> dict:
    """Static count of the ops of a compiled program's entry computation that launch device work (fusions,
    custom calls, copies, ...), attributed to model layers by the `layer<i>_` name scope in their metadata."""
    counts = collections.Counter()
    entry = hlo_text[hlo_text.find("\nENTRY"):]
    for line in entry.splitlines()[1:]:
        if line.startswith("}"):
            break
        m = _INSTR.match(line)
        if not m or m.group(1) in _SKIP_OPS:
            continue
        layer = _LAYER.search(line.split("metadata=", 1)[-1]) if "metadata=" in line else None
        counts[int(layer.group(1)) if layer else -1] += 1
    return {"per_layer": {str(k): v for k, v in sorted(counts.items()) if k >= 0}, "outside_layers": counts[-1],
            "total": sum(counts.values())}
