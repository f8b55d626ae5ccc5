"""Run by tests/test_mesh.py in a subprocess with 8 forced host devices (XLA_FLAGS must be set before jax starts,
and the rest of the suite runs with 4): every layout against the single-device run, results as JSON on stdout.

Per layout: prefill (all logits of a ragged 2-row batch in chunks of 8), 3 greedy decode steps (logits and
tokens; each a one-token row of the same step program, so a layout compiles one program), and every pool array
at the positions each request has committed (rings, states, paged entries read through each run's own page
table). Per engine case: `ds4jax.Engine` on the mesh (its fused prefill, decode and speculative programs), one
plain and one speculative greedy request, whose tokens must be the single-device run's. Per layer-split engine
case: `Engine` stage by stage on a ragged batch joining mid-flight (tokens, pools, last logits, park / unpark,
compiles after warmup) and `ds4jax.generate` with top-k sampling, against the single-device engine.
Usage: python tests/mesh_worker.py NAME... (default: every case, one group after the other).
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's ds4jax
os.environ["JAX_PLATFORMS"] = "cpu"
from cheap_compile import relax_gc, xla_flags  # noqa: E402  (tests/, this script's folder)

os.environ["XLA_FLAGS"] = xla_flags(devices=8)
relax_gc()

import json  # noqa: E402
import math  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import compile_log  # noqa: E402  (tests/: the opt-in per-program compile log)
import ds4jax  # noqa: E402
from spec_helpers import agreeable_model  # noqa: E402  (tests/, this script's folder)
from ds4jax.model.handle import Model  # noqa: E402
from ds4jax.runtime import steps  # noqa: E402
from ds4jax.runtime.mesh import make_mesh, place_model  # noqa: E402
from ds4jax.runtime.mesh_steps import POOL_AXES, gather_pools  # noqa: E402
from ds4jax.runtime.pool_spec import PoolSpec  # noqa: E402
from ds4jax.runtime.pools import PoolBook, zeros  # noqa: E402
from ds4jax.runtime.roles import Role  # noqa: E402

LAYOUTS = {
    "ep8": dict(expert=8),
    "tp2_ep4": dict(tensor=2, expert=4),
    "dp2_ep4": dict(data=2, expert=4),
    "tp8": dict(tensor=8),
    "split2_ep4": dict(layer_split=2, expert=4),
    "split3_tp2": dict(layer_split=3, tensor=2),  # a stage per layer, on 6 of the 8 devices
    # DP attention whose ranks also split the experts (tokens all-gathered over data inside the step's shard_map),
    # with the Pallas kernels (interpreted) in shard_map per head
    "dp2_tp2_ep2_pallas": dict(data=2, tensor=2, expert=2, rules="experts_over_data", kernels="pallas_interpret"),
}
# ds4jax.Engine on a mesh: one plain and one speculative greedy request (one engine, k = 2) against the
# single-device engine; a second identical call must compile nothing (shardings stay put from call to call)
ENGINES = {"engine_dp2_tp2_ep2": dict(data=2, tensor=2, expert=2)}  # every mesh axis in one engine
# ds4jax.Engine on a layer split (stage by stage): a ragged batch of 4 requests on 2 slots (two join mid-flight),
# chunked prefill, greedy, seeded top-k and top-k 1 sampling, against the single-device engine; then
# ds4jax.generate on the same split (its one-shot engine has the same sizes, so it shares every program)
SPLIT_ENGINES = {"engine_split2_dp2_ep2": dict(layer_split=2, data=2, expert=2),
                 "engine_split3_tp2": dict(layer_split=3, tensor=2)}
# prefix snapshots on a layer split: exact and suffix restores against the no-snapshot one-device engine
SPLIT_SNAPSHOTS = {"snapshots_split2_dp2_ep2": dict(layer_split=2, data=2, expert=2)}
# speculative decoding (k = 2) on a layer split: the split engine's ragged batch, an exact snapshot hit and a
# park / unpark of the draft, against the same on one device (and plain greedy tokens)
SPLIT_SPEC = {"spec_split2_dp2_ep2": dict(layer_split=2, data=2, expert=2)}
SPLIT_NEW = (4, 3, 4, 4)  # max_new_tokens per request (one bucket: 4 = the engine's steps_per_call)
# The cases in two groups, run as two processes side by side (tests/test_mesh.py); they are started together, so
# neither finds the other's programs in the run's compilation cache: a program both groups need is compiled twice.
# The layouts and the mesh engine (whose reference is `run`'s one-device tokens) in one; the layer splits, their
# snapshots and speculation (one set of engine SIZES: the one-device plain engine is compiled once and serves the
# split references and the speculative case's plain tokens) in the other. About the same CPU seconds each.
# Each group builds the references it needs.
GROUPS = (list(LAYOUTS) + list(ENGINES), list(SPLIT_ENGINES) + list(SPLIT_SNAPSHOTS) + list(SPLIT_SPEC))
assert sorted(sum(GROUPS, [])) == sorted([*LAYOUTS, *ENGINES, *SPLIT_ENGINES, *SPLIT_SNAPSHOTS, *SPLIT_SPEC])
FORWARD = ("ep8", "split3_tp2")  # also compare the cache-free forward_logits
CHUNK, DECODE = 8, 3
# The engine sizes of the split, snapshot and speculative cases: one set, so that their one-device references and
# the split engines on the same layout share compiled programs (a program is keyed by the pool spec, and the pool
# spec by these sizes). 32 tokens: ds4jax.generate's one-shot engine for the split requests (19-token prompt, 4 new)
# has this max_context, so it shares them too; the longest request (19 + 6 new + k = 2 drafts) fits.
# The engines of the split, snapshot and speculative cases share these sizes, and they are the sizes
# `ds4jax.generate` picks for PROMPTS with max_new_tokens 4 (`buckets.one_shot`), so the engine's compiled
# programs also serve generate (`generate_compiles == 0`); `_check_sizes` fails loudly if bucketing changes.
SIZES = dict(max_slots=2, max_context=64, prefill_chunk=CHUNK, prefill_tokens=2 * CHUNK, row_buckets=(2,),
             steps_per_call=16)


def _check_sizes(cfg, data: int) -> None:
    from ds4jax.generation import buckets

    want = buckets.one_shot(PROMPTS, 4, speculative=0, data=data, max_position_embeddings=cfg.max_position_embeddings,
                            prefill_chunk=CHUNK)
    want.pop("speculative")
    want.pop("draft_lengths")  # None without speculation
    assert want == SIZES, f"ds4jax.generate now sizes its engine {want}; update SIZES to match"
PROMPTS = (19, 11)


def config():
    # tiny (one layer of each kind: sliding, CSA, HCA; hash and top-k MoE) with 8 heads / 8 output groups so TP 8
    # splits real heads and 8 experts so EP 8 holds one each; layer_split=3 has a stage per layer and
    # layer_split=2 a stage of two layers of different kinds. Compile time dominates this worker, and every
    # program holds one body per layer: no layer is here that adds no case.
    return ds4jax.tiny(num_heads=8, o_groups=8)


def experts_over_data():
    from ds4jax.model.sharding import default_rules

    return tuple((k, ("data", "expert")) if k == "experts" else (k, v) for k, v in default_rules())


def layout_of(name) -> dict:
    return LAYOUTS.get(name) or ENGINES.get(name) or SPLIT_ENGINES.get(name) or SPLIT_SNAPSHOTS.get(name) \
        or SPLIT_SPEC[name]


def devices_of(name) -> int:
    """How many of the 8 devices case `name`'s layout spans (stages x data x expert x tensor)."""
    kw = layout_of(name)
    return math.prod(kw.get(axis, 1) for axis in ("layer_split", "data", "expert", "tensor"))


def make(name):
    kw = dict(layout_of(name))
    kernels = kw.pop("kernels", None)
    if kw.pop("rules", None) == "experts_over_data":
        kw["rules"] = experts_over_data()
    return make_mesh(**kw), kernels


def run(model, mesh_steps=None, kernels=None):
    from ds4jax.generation.compiles import program_compiles

    cfg = model.config
    before = program_compiles()
    spec = PoolSpec.for_role(cfg, role=Role.TARGET, max_slots=len(PROMPTS), max_context=max(PROMPTS) + DECODE,
                             page_size=8, dtype="float32")
    run = steps if mesh_steps is None else mesh_steps
    book = PoolBook(spec, cfg.vocab_size) if mesh_steps is None else run.book(spec, cfg.vocab_size)
    slots = [book.admit() for _ in PROMPTS]
    for s, n in zip(slots, PROMPTS):
        book.reserve(s, n + DECODE)
    pool = book.sync(zeros(spec)) if mesh_steps is None else run.sync(book, run.zeros(spec), spec)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n) for n in PROMPTS]
    prefill_logits, last = [], None
    for c in range(0, max(PROMPTS), CHUNK):
        n = [max(0, min(CHUNK, len(p) - c)) for p in prompts]
        tok = np.zeros((len(prompts), CHUNK), np.int32)
        for r, p in enumerate(prompts):
            tok[r, : n[r]] = p[c : c + n[r]]
        book.check_extend(slots, tok, n)
        batch = steps.StepBatch(jnp.asarray(slots, jnp.int32), jnp.asarray(tok), jnp.asarray(n, jnp.int32))
        out, pool = run.prefill(model.params, pool, batch, cfg=cfg, spec=spec, all_logits=True, kernels=kernels)
        book.commit(slots, n)
        logits = np.asarray(out.logits)
        prefill_logits.append(logits)
        for r in range(len(prompts)):
            if n[r] and c + n[r] == len(prompts[r]):
                last = logits[r, n[r] - 1] if last is None else np.where(np.arange(len(prompts))[:, None] == r,
                                                                         logits[:, n[r] - 1], last)
    tokens, decode_logits = [], []
    token = np.argmax(last, axis=-1)
    for _ in range(DECODE):
        tokens.append(token.tolist())
        n = [1] * len(prompts)
        tok = np.zeros((len(prompts), CHUNK), np.int32)  # a decode step as one-token rows: the prefill program
        tok[:, 0] = token
        book.check_extend(slots, tok, n)
        batch = steps.StepBatch(jnp.asarray(slots, jnp.int32), jnp.asarray(tok), jnp.asarray(n, jnp.int32))
        out, pool = run.prefill(model.params, pool, batch, cfg=cfg, spec=spec, all_logits=True, kernels=kernels)
        book.commit(slots, n)
        logits = np.asarray(out.logits)[:, 0]
        decode_logits.append(logits)
        token = np.argmax(logits, axis=-1)
    tokens.append(token.tolist())
    if mesh_steps:
        arrays = gather_pools(pool, mesh_steps, spec)
    else:
        arrays = {k: np.asarray(getattr(pool, k)) for k in POOL_AXES}
    # every chunk and decode step is one program per stage, compiled once: a step's pools come back placed as
    # they went in (else the second call compiles it again, as empty pool arrays on a data mesh once did)
    steps_compiled = (program_compiles() - before)["jit(stage_step)"]
    return dict(prefill=np.stack(prefill_logits), decode=np.stack(decode_logits), tokens=tokens,
                pools=committed(arrays, spec, cfg), steps_compiled=steps_compiled)


def engine_run(model, layout) -> dict:
    """The prompts of `run` through `ds4jax.Engine` on `layout` (k = 2): row 0 plain, row 1 speculative."""
    from ds4jax.generation.compiles import program_compiles
    from ds4jax.generation.engine import Engine
    from ds4jax.generation.requests import Request

    engine = Engine(place_model(model, layout), max_slots=2, max_context=32, speculative=2, prefill_chunk=32,
                    row_buckets=(2,), steps_per_call=4)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, model.config.vocab_size, n).tolist() for n in PROMPTS]
    requests = [Request(prompt=p, max_new_tokens=DECODE + 1, speculative=k) for p, k in zip(prompts, (0, None))]
    before = program_compiles()
    first = engine.generate(requests)
    fused = ("jit(prefill_call)", "jit(decode_loop)", "jit(speculative_loop)")
    first_compiles = {k: v for k, v in (program_compiles() - before).items() if k in fused}
    compiled = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, _, **kw: compiled.append(kw.get("fun_name")) if event.endswith("backend_compile_duration")
        else None)
    again = engine.generate(requests)  # the same programs on the same placements: none compiles again
    return dict(tokens=[r.tokens for r in first], again=[r.tokens for r in again],
                errors=[r.message for r in first + again if r.error is not None],
                accepted=[r.accepted_per_round for r in first], recompiled=sorted(set(compiled)),
                first_compiles=first_compiles,
                pool_spec=str(engine.tpool.swa_kv.sharding.spec),
                devices=len({d for leaf in jax.tree.leaves(engine.model.params) for d in leaf.devices()}))


def split_requests(cfg):
    from ds4jax.generation.requests import Request

    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in PROMPTS]
    sampled = (dict(), dict(), dict(temperature=0.9, top_k=5, seed=3), dict(temperature=0.7, top_k=1, seed=4))
    return [Request(prompt=prompts[r % 2], max_new_tokens=m, **kw) for r, (m, kw) in enumerate(zip(SPLIT_NEW, sampled))]


def split_engine_run(model) -> dict:
    """`SPLIT_ENGINES`' run of `model` (placed on its mesh, or on one device): tokens, pools at the committed
    positions and the slots' last prefill logits after the run, compiles after warmup, and `ds4jax.generate`."""
    from ds4jax.generation.engine import Engine, compile_count

    cfg = model.config
    _check_sizes(model.config, 1 if model.layout is None else model.layout.axis_sizes["data"])
    engine = Engine(model, **SIZES)
    engine.warmup()
    requests = split_requests(cfg)
    results = engine.generate(requests)
    if engine.stages is not None:
        arrays = gather_pools(engine.tpool, engine.stages.mesh_steps, engine.tspec)
    else:
        arrays = {k: np.asarray(getattr(engine.tpool, k)) for k in POOL_AXES}
    pools = committed(arrays, engine.tspec, cfg)
    logits = np.asarray(engine.slot_state.last_logits)
    prompts = [r.prompt for r in requests[:2]]
    before = compile_count()
    greedy = ds4jax.generate(model, prompts, ds4jax.SamplingParams(max_new_tokens=4), prefill_chunk=CHUNK)
    gen_compiles = compile_count() - before
    top1 = ds4jax.generate(model, prompts, ds4jax.SamplingParams(max_new_tokens=4, temperature=0.8, top_k=1, seed=5),
                           prefill_chunk=CHUNK)
    topk = ds4jax.generate(model, prompts, ds4jax.SamplingParams(max_new_tokens=4, temperature=0.9, top_k=3, seed=7),
                           prefill_chunk=CHUNK)
    again = results
    if engine.stages is not None:  # park deletes the buffers of the model the engine was built with: last
        engine.park()
        engine.unpark()
        again = engine.generate(requests)  # after park / unpark: same tokens, no compile
    return dict(tokens=[r.tokens for r in results], again=[r.tokens for r in again],
                errors=[r.message for r in results + again if r.error is not None],
                compiles_after_warmup=engine.stats.compiles_after_warmup, pools=pools, logits=logits,
                generate=dict(greedy=greedy, top1=top1, topk=topk), generate_compiles=gen_compiles,
                devices=len({d for leaf in jax.tree.leaves(engine.model.params) for d in leaf.devices()}))


def split_snapshot_run(model, placed) -> dict:
    """A 20-token prompt snapshotted at 12 and 20 on the split, then the same prompt (exact hit: no prefill step)
    and one sharing its first 12 tokens (suffix restore), against one device without snapshots; the split's
    snapshots restored on one device; a snapshot from another pool spec is refused."""
    from ds4jax.generation.engine import Engine
    from ds4jax.generation.requests import Request

    rng = np.random.default_rng(2)
    base = rng.integers(0, model.config.vocab_size, 20).tolist()
    other = base[:12] + rng.integers(0, model.config.vocab_size, 6).tolist()
    sizes = SIZES
    ask = lambda p, **kw: Request(prompt=p, max_new_tokens=4, **kw)
    ref = [r.tokens for r in Engine(model, snapshot_bytes=0, **sizes).generate([ask(base), ask(other)])]
    engine = Engine(placed, **sizes)
    engine.warmup()
    made = engine.generate([ask(base, snapshot=True, snapshot_at=(12,))])[0].tokens
    steps0 = engine.stats.prefill_steps
    exact = engine.generate([ask(base)])[0]
    exact_steps = engine.stats.prefill_steps - steps0
    suffix = engine.generate([ask(other)])[0]
    one = Engine(model, **sizes)  # the split's snapshots are the one-device layout
    for snap in engine.snapshots:
        one.snapshots.put(snap)
    on_one = [r.tokens for r in one.generate([ask(base), ask(other)])]
    wider = Engine(placed, **dict(sizes, max_context=2 * sizes["max_context"]))  # another pool spec
    for snap in engine.snapshots:
        wider.snapshots.put(snap)
    refused = wider.generate([ask(base)])[0]
    return dict(ref=ref, made=made, exact=exact.tokens, exact_prefill=exact.prefill_tokens, exact_steps=exact_steps,
                suffix=suffix.tokens, suffix_prefill=suffix.prefill_tokens, on_one=on_one,
                hits=engine.stats.snapshot_hits, one_hits=one.stats.snapshot_hits,
                refused=str(refused.error), compiles_after_warmup=engine.stats.compiles_after_warmup,
                errors=[r.message for r in (exact, suffix) if r.error is not None])


def split_spec_run(model, plain=None) -> dict:
    """`SPLIT_SPEC`'s run of `model` (placed, or on one device): the split requests speculating with k = 2 after
    warmup (tokens, drafts accepted per round, the draft's ring), the first prompt snapshotted and hit exactly
    (the draft's pending row from the restore path), then the requests again after park / unpark of the draft.
    On one device also the plain engine's tokens of the same requests: `plain` when the caller has them (the
    one-device split engine's, `split_engine_run`: the same requests, sizes and model), else run here."""
    from ds4jax.generation.engine import Engine
    from ds4jax.generation.requests import Request

    sizes = SIZES
    engine = Engine(model, speculative=2, **sizes)
    engine.warmup()
    requests = split_requests(model.config)
    results = engine.generate(requests)
    draft_ring = np.asarray(engine.dpool.swa_kv)
    ask = lambda **kw: Request(prompt=requests[0].prompt, max_new_tokens=6, **kw)
    made = engine.generate([ask(snapshot=True)])[0]
    hit = engine.generate([ask()])[0]
    engine.park("draft")
    engine.unpark("draft")
    again = engine.generate(requests)
    out = dict(tokens=[r.tokens for r in results], accepted=[r.accepted_per_round for r in results],
               draft_ring=draft_ring, made=made.tokens, hit=hit.tokens, hit_prefill=hit.prefill_tokens,
               hits=engine.stats.snapshot_hits, again=[r.tokens for r in again],
               compiles_after_warmup=engine.stats.compiles_after_warmup,
               errors=[r.message for r in results + again + [made, hit] if r.error is not None],
               stages=0 if engine.stages is None else len(engine.stages.ranges))
    if engine.stages is None:  # one device: plain tokens too (speculation must not change the greedy ones)
        out["plain"] = plain or [r.tokens for r in Engine(engine.model, **sizes).generate(requests)]
    return out


def committed(a: dict, spec: PoolSpec, cfg) -> dict:
    """Each slot's committed rows of every pool array, in logical order (independent of page placement)."""
    out = {}
    for slot, length in enumerate(a["lengths"]):
        length = int(length)
        ring = lambda arr, rows: arr[:, slot, [p % rows for p in range(max(0, length - rows), length)]]
        out[f"{slot}/lengths"] = np.array([length])
        out[f"{slot}/swa_kv"] = ring(a["swa_kv"], spec.swa_rows)
        for name, rows in (("c4_state_kv", spec.c4_state_rows), ("c4_state_gate", spec.c4_state_rows),
                           ("indexer_state_kv", spec.indexer_state_rows),
                           ("indexer_state_gate", spec.indexer_state_rows),
                           ("c128_state_kv", spec.c128_state_rows), ("c128_state_gate", spec.c128_state_rows)):
            out[f"{slot}/{name}"] = ring(a[name], rows)
        for name, ratio in (("c4_kv", cfg.csa_ratio), ("indexer_kv", cfg.csa_ratio), ("c128_kv", cfg.hca_ratio)):
            per_page = spec.page_size // ratio
            rows = [a["page_table"][slot, j // per_page] * per_page + j % per_page for j in range(length // ratio)]
            out[f"{slot}/{name}"] = a[name][:, rows]
    return out


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    if a.shape != b.shape:
        return float("inf")
    if a.size == 0:
        return 0.0
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


def main(names):
    compile_log.install("mesh_worker")
    cfg = config()
    model = agreeable_model(cfg)  # random weights whose MTP draft the target often accepts (speculative cases)
    # every placed model from its own host copy: placing device arrays on a mesh compiles a slicing program per
    # param shape (~80 programs, ~1.5 s), and park() deletes the buffers of the model an engine was built with
    host = lambda: Model(model.config, jax.tree.map(np.asarray, model.params))
    compile_log.phase("ref:run")
    ref = run(model) if set(names) & (set(LAYOUTS) | set(ENGINES)) else None
    results = {}
    for name in [n for n in names if n in ENGINES]:
        compile_log.phase(name)
        got = engine_run(host(), make(name)[0])
        results[name] = dict(got, ref=[list(r) for r in zip(*ref["tokens"])])
        print(name, json.dumps(results[name]), file=sys.stderr, flush=True)
    split = [n for n in names if n in SPLIT_ENGINES]
    spec = [n for n in names if n in SPLIT_SPEC]
    compile_log.phase("ref:split_engine")
    # the speculative case's plain tokens are these (a one-device plain engine of these sizes compiles ~9 s)
    ref_split = split_engine_run(model) if split or spec else None
    for name in split:
        compile_log.phase(name)
        got = split_engine_run(place_model(host(), make(name)[0]))
        res = dict(tokens=got["tokens"], ref=ref_split["tokens"], again=got["again"], errors=got["errors"],
                   compiles_after_warmup=got["compiles_after_warmup"], devices=got["devices"],
                   pools={k: rel(v, ref_split["pools"][k]) for k, v in got["pools"].items()},
                   logits=rel(got["logits"], ref_split["logits"]), generate=got["generate"],
                   ref_generate=ref_split["generate"], generate_compiles=got["generate_compiles"])
        results[name] = res
        print(name, json.dumps(res), file=sys.stderr, flush=True)
    for name in [n for n in names if n in SPLIT_SNAPSHOTS]:
        compile_log.phase(name)
        results[name] = split_snapshot_run(model, place_model(host(), make(name)[0]))
        print(name, json.dumps(results[name]), file=sys.stderr, flush=True)
    compile_log.phase("ref:split_spec")
    ref_spec = split_spec_run(host(), plain=ref_split["tokens"]) if spec else None
    for name in spec:
        compile_log.phase(name)
        copy = host()
        got = split_spec_run(place_model(copy, make(name)[0]))
        res = {k: v for k, v in got.items() if k != "draft_ring"}
        res.update(ref={k: v for k, v in ref_spec.items() if k != "draft_ring"},
                   draft_ring=rel(got["draft_ring"], ref_spec["draft_ring"]))
        results[name] = res
        print(name, json.dumps(res), file=sys.stderr, flush=True)
    names = [n for n in names if n not in ENGINES and n not in SPLIT_ENGINES and n not in SPLIT_SNAPSHOTS
             and n not in SPLIT_SPEC]
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 16))
    compile_log.phase("ref:forward")
    ref_fwd = np.asarray(ds4jax.forward_logits(model, ids)) if set(names) & set(FORWARD) else None
    for name in names:
        compile_log.phase(name)
        layout, kernels = make(name)
        placed = place_model(host(), layout)
        got = run(placed, layout.steps(cfg), kernels)
        res = dict(prefill=rel(got["prefill"], ref["prefill"]), decode=rel(got["decode"], ref["decode"]),
                   tokens_equal=got["tokens"] == ref["tokens"], tokens=got["tokens"],
                   pools={k: rel(v, ref["pools"][k]) for k, v in got["pools"].items()},
                   devices=len({d for leaf in jax.tree.leaves(placed.params) for d in leaf.devices()}),
                   steps_compiled=got["steps_compiled"], stages=layout.num_stages)
        if name in FORWARD:
            res["forward"] = rel(ds4jax.forward_logits(placed, ids), ref_fwd)
        results[name] = res
        print(name, json.dumps(res), file=sys.stderr, flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1:] or [name for group in GROUPS for name in group])
