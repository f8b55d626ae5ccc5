"""Which source ops become kernels in a compiled step: the optimized HLO of one target step of `flash_slice(n)` (or
the tiny config), compiled ahead of time from abstract parameters (no weights allocated, so any card can compile
the 68 GB model), its kernel-launching instructions listed with the scope of the JAX op each came from.

Issue 27 asks for <= 150 kernels per decode step at batch 1; a profile names kernels `gemm_fusion_dot_70` and
`input_reduce_fusion_53`, which says nothing about the model. Here each launching instruction (a fusion, a custom
call such as a Pallas kernel, an unfused copy / sort / scatter) is counted under its `op_name` metadata, cut to the
layer scope and the module path below it, per computation (the entry, and the bodies of loops: a scanned layer kind
runs its body once per layer of the kind; `trip` gives the count where XLA knows it; a loop's condition counts
too).

    PYTHONPATH=. python scripts/step_kernels.py --out /tmp/kernels --program decode --rows 1
    PYTHONPATH=. python scripts/step_kernels.py --hlo /tmp/kernels/decode_r1.hlo.txt   # re-read a saved module

Writes <program>_r<rows>.{hlo.txt,json,md}. Counting rules: see `launches`; the figure is static (a conditional's
branches are all listed; command buffers, if XLA forms them, replay these same kernels).

Without a GPU: `--deviceless sm90` compiles for an H100 on a CPU host through the CUDA plugin's compile-only
topology (a CPU host with jax >= 0.11 and `jax-cuda13-plugin` / `jax-cuda13-pjrt` of the same version installed;
no driver, no device, no CUDA toolkit). The same tree's decode step at 1 and 8 rows and its verify step gave the
same counts as on an H100 (195 / 216 / 221 at `853ac23`, `docs/benchmarks/step_kernels_h100_853ac23/`), in ~15 s a
program on the 2-core CPU machine: a kernel-count change can be checked here, its speed only on the device.

    python3.12 -m venv /tmp/cv && /tmp/cv/bin/pip install "jax==0.11.2" "jax-cuda13-plugin==0.11.2" \
        "jax-cuda13-pjrt==0.11.2" flax orbax-checkpoint chex safetensors tokenizers tqdm
    JAX_PLATFORMS=cpu PYTHONPATH=. /tmp/cv/bin/python scripts/step_kernels.py --deviceless sm90 --rows 1
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# opcodes that launch nothing at run time (views, tuples, control flow whose bodies are counted themselves; the
# `-done` half of an async pair waits for what its `-start` launched: an async dynamic-slice fusion in a scanned
# body is one kernel, which the counts before session 29 listed twice)
FREE_OPCODES = {"parameter", "get-tuple-element", "tuple", "bitcast", "constant", "while", "conditional", "call",
         "after-all", "add-dependency", "partition-id", "replica-id", "opt-barrier", "copy-done", "async-done",
         "fusion-done", "get-dimension-size"}
_COMP = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s([\w\-]+)\((.*)$")
_OP_NAME = re.compile(r'op_name="([^"]*)"')
# a list continues only with %-named computations: `condition=%c, body=%b` is two attributes, not the list "c, body"
# (which dropped every while loop's body from the count when its condition came first, as XLA prints it)
_CALLS = re.compile(r"(?:body|condition|calls|to_apply|branch_computations|true_computation|false_computation)=\{?"
                    r"%?([\w.\-]+(?:,\s*%[\w.\-]+)*)\}?")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_ARRAY = re.compile(r"\b(pred|[subf]\d+|bf16|f8e\w+)\[([\d,]*)\]")
_DYNAMIC_SLICE = re.compile(r"calls=%?[\w.\-]*dynamic[_\-]slice")


def _bytes(dtype: str, dims: str) -> int:
    width = 1 if dtype == "pred" or dtype.startswith("f8") else int(re.sub(r"\D", "", dtype) or 8) // 8
    count = 1
    for d in filter(None, dims.split(",")):
        count *= int(d)
    return count * width


def sliced_bytes(opcode: str, type_text: str, line: str) -> int:
    """Bytes a dynamic-slice fusion writes (its result: a slice copied into a buffer of its own, e.g. a scanned
    layer's weight cut out of its stack), else 0. An async `fusion-start`'s type is ((operands), result, context)."""
    if opcode not in ("fusion", "fusion-start") or not _DYNAMIC_SLICE.search(line):
        return 0
    arrays = _ARRAY.findall(type_text)
    if opcode == "fusion-start":
        arrays = arrays[-2:-1]
    return sum(_bytes(*a) for a in arrays)


def parse(text: str) -> dict:
    """{computation: {"entry": bool, "instrs": [(name, opcode, line)]}} of an HLO module's text."""
    comps, cur = {}, None
    for line in text.splitlines():
        m = _COMP.match(line) if not line[:1].isspace() else None  # headers start a line, instructions indent
        if m:
            cur = m.group(2)
            comps[cur] = {"entry": bool(m.group(1)), "instrs": []}
            continue
        if cur is None:
            continue
        if line.strip() == "}":
            cur = None
            continue
        m = _INSTR.match(line)
        if m:
            comps[cur]["instrs"].append((m.group(2), m.group(4), line))
    return comps


def frames(text: str):
    """stack_frame_id -> [(file, function, line)], innermost first, from the module's FileNames / FunctionNames /
    FileLocations / StackFrames tables (XLA prints them before the computations)."""
    tables, cur = collections.defaultdict(dict), None
    for line in text.splitlines():
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            cur = line
            continue
        if cur is None or not line or not line[0].isdigit():
            if line.startswith(("%", "ENTRY", "HloModule")):
                cur = None
            continue
        idx, rest = line.split(" ", 1)
        tables[cur][int(idx)] = rest.strip().strip('"')
    field = lambda text, key: int(re.search(key + r"=(\d+)", text).group(1))

    def chain(fid: int) -> list:
        out, seen = [], set()
        while fid and fid not in seen and fid in tables["StackFrames"]:
            seen.add(fid)
            frame = tables["StackFrames"][fid]
            loc = tables["FileLocations"].get(field(frame, "file_location_id"), "")
            if loc:
                out.append((tables["FileNames"].get(field(loc, "file_name_id"), "?"),
                            tables["FunctionNames"].get(field(loc, "function_name_id"), "?"), field(loc, " line")))
            fid = field(frame, "parent_frame_id")
        return out

    return chain


def source(chain: list) -> str:
    """The innermost frame in ds4jax or pallas_kernels as `path/file.py:function:line` (relative to the package)."""
    for file, func, line in chain:
        m = re.search(r"((?:ds4jax|pallas_kernels)/.*)$", file)
        if m:
            return f"{m.group(1)}:{func}:{line}"
    return "(outside ds4jax)"


def scheduled(comps: dict) -> dict:
    """The computations whose instructions run as launches (the entry, and what its loops / conditionals call,
    transitively), each with the trip count of the loop that runs it (1 outside loops; None where unknown)."""
    entry = next(name for name, c in comps.items() if c["entry"])
    out, todo = {entry: 1}, [entry]
    while todo:
        name = todo.pop()
        for _, opcode, line in comps[name]["instrs"]:
            if opcode not in ("while", "conditional", "call"):
                continue
            trip = _TRIP.search(line)
            for group in _CALLS.findall(line):
                for callee in re.split(r",\s*%?", group):
                    if callee in comps and callee not in out:
                        mult = out[name]
                        if opcode == "while":
                            mult = None if mult is None or not trip else mult * int(trip.group(1))
                        out[callee] = mult
                        todo.append(callee)
    return out


def scope(op_name: str, depth: int) -> str:
    """`jit(step)/while/body/target/layer1+2j_csa/attention/...` -> `layer1+2j_csa/attention` (depth parts from the
    layer scope on; outside the layers, the first parts after the jit and control-flow prefixes)."""
    parts = [p for p in op_name.split("/") if p and not p.startswith(("jit(", "pjit(")) and p not in
             ("while", "body", "cond", "checkpoint", "remat", "closed_call", "target", "target_step",
              "draft_step")]
    for i, p in enumerate(parts):
        if p.startswith("layer"):
            return "/".join(parts[i:i + depth])
    return "/".join(["(outside layers)"] + parts[: depth - 1])


# a copy of an array with a zero dimension (`f32[0,1024]`): XLA:GPU runs a `copy` instruction as a device-to-device
# memcpy thunk, not a kernel, and this one moves no bytes (zero-size pool arrays, e.g. the row scales of an FP8 KV
# cache the pool does not have, come back from a step as constants copied into their donated buffers)
_ZERO_ELEMENTS = re.compile(r"^\w+\[(?:[\d,]*,)?0(?:,[\d,]*)?\]")


def launches(text: str, depth: int = 2) -> dict:
    """Launching instructions per scheduled computation, grouped by scope; and totals per step (a loop body's count
    times its trip count where known)."""
    comps = parse(text)
    runs = scheduled(comps)
    chain = frames(text)
    per_comp, by_scope, by_kind, by_source = {}, collections.Counter(), collections.Counter(), collections.Counter()
    by_layer = collections.Counter()
    total = unknown = sliced = empty = 0
    for name, mult in runs.items():
        items = []
        for iname, opcode, line in comps[name]["instrs"]:
            if opcode in FREE_OPCODES:
                continue
            typed = _INSTR.match(line)
            sliced += sliced_bytes(opcode, typed.group(3) if typed else "", line) * (mult or 1)
            m = _OP_NAME.search(line)
            where = scope(m.group(1), depth) if m else "(no metadata)"
            kind = opcode if opcode != "fusion" else "fusion:" + (re.search(r"kind=(\w+)", line) or ["", "?"])[1]
            if opcode == "custom-call":
                target = re.search(r'custom_call_target="([^"]+)"', line)
                kind = "custom-call:" + (target.group(1) if target else "?")
            frame = re.search(r"stack_frame_id=(\d+)", line)
            src = source(chain(int(frame.group(1)))) if frame else "(no stack frame)"
            items.append({"name": iname, "kind": kind, "scope": where, "source": src})
            weight = mult or 1
            if opcode == "copy" and _ZERO_ELEMENTS.search(typed.group(3) if typed else ""):
                empty += weight
            by_scope[where] += weight
            by_kind[kind] += weight
            by_source[src] += weight
            by_layer[where.split("/")[0] if where.startswith("layer") else "(outside layers)"] += weight
        if items:
            per_comp[name] = {"trip": mult, "launches": len(items), "items": items}
        if mult is None:
            unknown += len(items)
        else:
            total += len(items) * mult
    return {"per_step": total, "in_loops_of_unknown_trip": unknown, "dynamic_slice_bytes_per_step": sliced,
            "zero_element_copies_per_step": empty,
            "by_scope": dict(by_scope.most_common()),
            "by_kind": dict(by_kind.most_common()), "by_source": dict(by_source.most_common()),
            "by_layer": dict(sorted(by_layer.items())), "computations": per_comp}


# XLA's description of an H100 SXM (xla/tools/hlo_opt/gpu_specs), the target of a deviceless compile: the fusion
# and GEMM decisions read the compute capability, SM count and shared memory (an H200 is the same sm90 chip)
H100_TARGET_CONFIG = """gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: 132 fpus_per_core: 128
  block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: 3352320000000 l2_cache_size: 52428800 clock_rate_ghz: 1.98
  device_memory_size: 84929347584 shared_memory_per_block_optin: 232448
  cuda_compute_capability { major: 9 } registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA" dnn_version_info { major: 9 minor: 8 } runtime_version { major: 13 minor: 0 }
device_description_str: "NVIDIA H100 80GB HBM3"
"""


@contextlib.contextmanager
def deviceless(target: str):
    """(the sharding every input takes) for a compile on an sm90 target without its device: the CUDA plugin's
    compile-only topology, ds4jax's dispatcher answering as on the target (`rocm_check.lowering.as_if_on`), and
    Pallas' Triton lowering told the GPU it would ask the (absent) device about."""
    from unittest import mock

    import jax
    from jax._src.pallas.triton import gpu_info
    from jax.experimental import topologies

    from ds4jax.rocm_check.lowering import as_if_on
    from ds4jax.rocm_check.targets import TARGETS

    if target != "sm90":
        raise SystemExit(f"--deviceless {target}: only sm90 (an H100 / H200) is described here")
    topology = topologies.get_topology_desc(platform="cuda", target_config=H100_TARGET_CONFIG, topology="1x1x1")
    mesh = topologies.make_mesh(topology, (1,), ("x",))
    h100 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
    with as_if_on(TARGETS[target].target), mock.patch.object(gpu_info, "get_gpu_info", lambda: h100):
        yield jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())


def compile_step(args) -> str:
    import jax

    import bench_compile
    from ds4jax.runtime import steps
    from ds4jax.runtime.kernels import resolve

    with deviceless(args.deviceless) if args.deviceless else contextlib.nullcontext() as placed:
        impl = resolve(args.kernels)  # deviceless: the target's default (as_if_on answers "gpu"), as on the card
        cfg = bench_compile.make_config(args.config, args.layers)
        args.chunk, args.stages, args.stage = args.tokens, 1, -1
        inputs, static = bench_compile.abstract_inputs(cfg, "scanned", args.program, args)
        if placed is not None:
            inputs = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=placed), inputs)
        fn = jax.jit(lambda params, pool, batch, x: steps.step(params, pool, batch, x, kernels=impl, **static),
                     donate_argnums=1)
        return fn.trace(*inputs).lower().compile().as_text()


def render(res: dict, title: str) -> str:
    unknown, empty = res["in_loops_of_unknown_trip"], res.get("zero_element_copies_per_step", 0)
    lines = [f"# Kernel launches per step: {title}", "",
             f"**{res['per_step']}** launches per step (static count from the optimized HLO: loop bodies times their "
             f"trip count{f'; {unknown} in loops of unknown trip count' if unknown else ''}"
             f"{f'; {empty} of them copies of zero-element arrays: memcpys of no bytes, not kernels' if empty else ''}"
             ").",
             "", f"Dynamic-slice fusions write {res.get('dynamic_slice_bytes_per_step', 0) / 1e6:,.1f} MB a step "
             f"(slices copied into buffers of their own, e.g. a scanned layer's weights cut out of their stacks).",
             "", "| layer (scope; a scanned body counts once per layer it runs) | launches per step |", "|---|---|"]
    lines += [f"| `{k}` | {v} |" for k, v in res["by_layer"].items()]
    lines += ["", "| scope | launches per step |", "|---|---|"]
    lines += [f"| `{k}` | {v} |" for k, v in res["by_scope"].items()]
    lines += ["", "| source (innermost ds4jax frame) | launches per step |", "|---|---|"]
    lines += [f"| `{k}` | {v} |" for k, v in res["by_source"].items()]
    lines += ["", "| kind | launches per step |", "|---|---|"]
    lines += [f"| `{k}` | {v} |" for k, v in res["by_kind"].items()]
    for name, c in res["computations"].items():
        lines += ["", f"## `{name}` (trip {c['trip']}, {c['launches']} launches)", ""]
        lines += [f"- `{i['name']}` {i['kind']} — `{i['scope']}` — `{i['source']}`" for i in c["items"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="/tmp/step_kernels")
    ap.add_argument("--program", default="decode", choices=("decode", "prefill", "verify"))
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=256, help="prefill tokens (one row)")
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4, help="flash_slice(n)")
    ap.add_argument("--config", default="flash_slice", choices=("flash_slice", "tiny"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--weights", default="bf16", choices=("bf16", "published"),
                    help="published: FP8 dense + FP4 experts as the checkpoint stores them (abstract, stacked)")
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--kernels", default=None, help="reference | pallas (default: the backend's)")
    ap.add_argument("--depth", type=int, default=2, help="scope parts kept from the layer scope on")
    ap.add_argument("--hlo", default=None, help="read this optimized HLO text instead of compiling")
    ap.add_argument("--title", default=None, help="with --hlo: the title to write (default: the file's name)")
    ap.add_argument("--deviceless", default=None, choices=("sm90",),
                    help="compile for this GPU on a host without one (the CUDA plugin's compile-only topology)")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, f"{args.program}_r{args.rows}")
    if args.hlo:
        text = open(args.hlo).read()
        title = args.title or os.path.basename(args.hlo)
    else:
        import jax

        text = compile_step(args)
        with open(stem + ".hlo.txt", "w") as f:
            f.write(text)
        device = f"deviceless {args.deviceless}" if args.deviceless else jax.devices()[0].device_kind
        weights = ", FP8 + FP4 weights" if args.weights == "published" else ""
        title = (f"{args.config}({args.layers}){weights} {args.program}, {args.rows} row(s), {device}, "
                 f"jax {jax.__version__}")
    res = launches(text, args.depth)
    res["title"] = title
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(render(res, title))
    print(f"{title}: {res['per_step']} launches per step, {res['dynamic_slice_bytes_per_step'] / 1e6:,.1f} MB "
          f"written by dynamic-slice fusions -> {stem}.md")
    for k, v in list(res["by_source"].items())[:40]:
        print(f"  {v:5d}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
