"""One process of the 2-process job that tests/test_multiprocess.py starts with ``ds4jax launch --processes 2
--devices-per-process 4`` (8 devices, 4 per process). Usage: multiprocess_worker.py DIR [LAYOUT...]; each process writes
DIR/p{index}.json, process 0 also DIR/ckpt (the model, which both processes load) and, through the batch command,
DIR/out.jsonl (from DIR/in.jsonl: the test writes both before the job starts).

Process 0 computes the one-device reference on its own first device (jit on one local device runs there alone):
the logits of `forward_logits` and greedy decoding with it, whose tokens are also the greedy tokens an `Engine`
must give (the prompts are whole, so both decode the same thing). It hands the reference to process 1 through
the coordinator's key-value store, so nothing is computed twice. Then, on every layout of `LAYOUTS`, both
processes (SPMD): `forward_logits`, each process comparing the logits blocks it holds with the reference's, and
greedy decoding with it (`forward_greedy`); an `Engine` runs on the layouts of `ENGINES`: on EP 4 x TP 2 it
speculates (k = 2) and restores a prefix snapshot, on DP 2 x EP 4 its rows are split over the two processes (the
engine's host loop does not run on a split across processes yet). `agree` is checked to name a disagreeing
process, and ``ds4jax batch`` runs on the speculating engine's mesh and flags (`batch_command`). Last, on the DP 2 x EP 4 engine (its programs already compiled), process 1 kills itself (SIGKILL) in
the middle of a generation: process 0 must not succeed and must be ended by JAX's heartbeat
(``DS4JAX_HEARTBEAT_TIMEOUT``), which the test reads from its output.
"""

import json
import os
import signal
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's ds4jax
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # tests/: spec_helpers

from cheap_compile import relax_gc  # noqa: E402

relax_gc()
import numpy as np  # noqa: E402

import ds4jax  # noqa: E402
from ds4jax.runtime import distributed  # noqa: E402
from ds4jax.runtime.mesh import make_mesh, place_model  # noqa: E402

LAYOUTS = {"ep8": dict(expert=8), "ep4_tp2": dict(expert=4, tensor=2), "dp2_ep4": dict(data=2, expert=4),
           "split2_ep4": dict(layer_split=2, expert=4)}  # split2: one stage per process
SPECULATIVE, DATA = "ep4_tp2", "dp2_ep4"
ENGINES = (SPECULATIVE, DATA)  # the layouts an Engine runs on (every layout runs forward_logits)
# the speculating engine, and the batch command run on the saved checkpoint (the same flags, so the same programs,
# compiled once); one slot, so one program of each kind
SIZES = dict(max_slots=1, max_context=48, prefill_chunk=8, prefill_tokens=16, steps_per_call=4)
DATA_SLOTS = 2  # the data-parallel engine: one row per data shard
PROMPTS = ([5, 17, 99, 3, 250, 41, 7, 300, 12, 8, 64], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11])
NEW = 6
WIDTH = len(PROMPTS[0]) + NEW  # forward_greedy's buffer: a whole prompt and every new token
BATCH = [dict(id="a", prompt=PROMPTS[0], max_new_tokens=NEW), dict(id=7, prompt=PROMPTS[1], max_new_tokens=NEW),
         dict(id="c", prompt=PROMPTS[0], max_new_tokens=NEW)]  # the test writes "a" as done: 7 and c run


def config():
    """tiny with 2 layers (CSA + HCA, hash + top-k MoE) so that a 2-stage split has one layer per stage; a vocabulary
    of 320 so the byte tokenizer of the batch command fits, and splits over 8."""
    A, M = ds4jax.AttentionType, ds4jax.MlpType
    return ds4jax.tiny(num_layers=2, vocab_size=320, attention_types=(A.CSA, A.HCA), mlp_types=(M.HASH, M.TOPK))


def requests(speculative):
    from ds4jax.generation.requests import Request

    return [Request(prompt=list(p), max_new_tokens=NEW, speculative=speculative) for p in PROMPTS]


def engine_tokens(engine, snapshots: bool) -> dict:
    """Greedy tokens of `PROMPTS` through `engine`; with `snapshots`, prompt 0 again from a prefix snapshot made
    on its first run (an exact hit: no prefill)."""
    from ds4jax.generation.requests import Request

    results = engine.generate(requests(None))
    out = dict(tokens=[r.tokens for r in results], errors=[r.message for r in results if r.error is not None])
    if snapshots:
        made = engine.generate([Request(prompt=list(PROMPTS[0]), max_new_tokens=NEW, snapshot=True)])[0]
        hit = engine.generate([Request(prompt=list(PROMPTS[0]), max_new_tokens=NEW)])[0]
        out.update(made=made.tokens, hit=hit.tokens, hit_prefill=hit.prefill_tokens,
                   hits=engine.stats.snapshot_hits, accepted=sum(sum(r.accepted_per_round or ()) for r in (made, hit)))
    return out


def forward_greedy(model):
    """Greedy decoding with `forward_logits` alone (no pools): `NEW` tokens after each (whole) prompt, every step on
    the same [2, WIDTH] buffer (causal: the padding after a row's end changes nothing before it), so one program
    serves every step. Returns (the first step's logits array, the tokens per row)."""
    from ds4jax.runtime.distributed import fetch

    start = len(PROMPTS[0])
    assert all(len(p) == start for p in PROMPTS)
    buf = np.zeros((len(PROMPTS), WIDTH), np.int32)
    buf[:, :start] = PROMPTS
    first, tokens = None, [[] for _ in PROMPTS]
    for i in range(NEW):
        out = ds4jax.forward_logits(model, buf)
        first = out if first is None else first
        nxt = np.argmax(fetch(out)[:, start - 1 + i], axis=-1)  # every process reads the logits, wherever they are
        for r, t in enumerate(nxt.tolist()):
            tokens[r].append(t)
            buf[r, start + i] = t
    return first, tokens


def references(model) -> dict:
    import jax

    with jax.default_device(jax.local_devices()[0]):
        first, tokens = forward_greedy(model)
        return dict(logits=np.asarray(first).tolist(), greedy=tokens)


def compare_logits(out, ref: np.ndarray) -> tuple[float, int]:
    """(largest relative error over the blocks of `out` this process holds, how many blocks it holds)."""
    worst, n = 0.0, 0
    scale = float(np.max(np.abs(ref)))
    for shard in out.addressable_shards:
        worst = max(worst, float(np.max(np.abs(np.asarray(shard.data) - ref[shard.index]))) / scale)
        n += 1
    return worst, n


def main(root: str, names) -> None:
    import compile_log  # tests/: the opt-in per-program compile log

    compile_log.install("multiprocess_worker")
    layouts = {name: make_mesh(**LAYOUTS[name]) for name in names}  # joins the job (make_mesh first)
    import jax

    me = jax.process_index()
    result = dict(process=me, processes=jax.process_count(), devices=jax.device_count(),
                  local=jax.local_device_count())
    compile_log.phase("model")
    model = shared_model(os.path.join(root, "ckpt"), me)
    params = jax.tree.map(np.asarray, model.params)
    host = lambda: ds4jax.Model(model.config, params)
    compile_log.phase("references")
    ref = distributed.broadcast("references", references(host()) if me == 0 else None)
    logits = np.asarray(ref["logits"], np.float32)
    result["reference"] = ref["greedy"]
    if "split2_ep4" in layouts:
        stages = layouts["split2_ep4"].stages
        result["stage_processes"] = [sorted({d.process_index for d in s.devices.flat}) for s in stages]
    from ds4jax.generation.engine import Engine

    engines = {}
    for name, layout in layouts.items():
        compile_log.phase(name)
        placed = place_model(host(), layout)
        first, greedy = forward_greedy(placed)
        err, blocks = compare_logits(first, logits)
        result[name] = dict(logits=err, blocks=blocks, greedy=greedy == ref["greedy"], got_greedy=greedy)
        if name in ENGINES:
            spec = name == SPECULATIVE
            sizes = SIZES if spec else dict(SIZES, max_slots=DATA_SLOTS)
            engines[name] = Engine(placed, speculative=2 if spec else 0, **sizes)
            got = engine_tokens(engines[name], spec)
            result[name].update(tokens=got["tokens"] == ref["greedy"], got=got["tokens"], errors=got["errors"])
            if spec:
                result[name].update(spec=got)
        print(name, json.dumps(result[name]), file=sys.stderr, flush=True)
    try:
        distributed.agree("the test value", me)
    except distributed.DistributedError as e:
        result["disagree"] = str(e)
    compile_log.phase("batch")
    result["batch"] = batch_command(root)
    with open(os.path.join(root, f"p{me}.json"), "w") as f:
        json.dump(result, f)
    compile_log.write()  # the kill below ends both processes before their exit handlers
    kill_mid_generation(engines[DATA], me)


def shared_model(ckpt: str, me: int):
    """The test's model in both processes: process 0 builds it and saves it to `ckpt` (the checkpoint the batch
    command reads), then both load it from there (process 1 builds nothing: a build compiles ~40 programs)."""
    import jax

    with jax.default_device(jax.local_devices()[0]):
        if me == 0:
            from spec_helpers import agreeable_model

            built = agreeable_model(config())
            ds4jax.save(ds4jax.Model(built.config, jax.tree.map(np.asarray, built.params)), ckpt)
        distributed.broadcast("the checkpoint is saved", True)  # process 1 waits for it
        return ds4jax.load(ckpt, dtype=np.float32)


def batch_command(root: str) -> int:
    """``ds4jax batch ROOT/in.jsonl ROOT/out.jsonl --checkpoint ROOT/ckpt --mesh expert=4,tensor=2`` with the
    speculating engine's flags, run in every process of this job by `cli.main` (what the ``ds4jax`` command runs):
    the speculating engine's mesh and flags, so the same programs, found compiled in this job. The test wrote the input and a resumed output
    before the job started; returns the command's exit status."""
    from ds4jax import cli

    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SIZES.items()]
    return cli.main(["batch", os.path.join(root, "in.jsonl"), os.path.join(root, "out.jsonl"), "--checkpoint",
                     os.path.join(root, "ckpt"), "--mesh", "expert=4,tensor=2", "--dtype", "float32",
                     "--speculative", "2", f"--max-new-tokens={NEW}", "--no-progress", *flags])


def kill_mid_generation(engine, me: int) -> None:
    """Process 1 dies (SIGKILL) as its second decode call starts; process 0 goes into that call, whose collectives
    need process 1: the step fails there (an error result), and the heartbeat timeout ends the process at its
    shutdown barrier, or in the step if it blocks. `engine` has run already: nothing compiles."""
    from ds4jax.generation.requests import Request

    decode, calls = engine._decode_call, []

    def dying(rows):
        calls.append(1)
        if me == 1 and len(calls) == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return decode(rows)

    engine._decode_call = dying
    print("generating; process 1 is about to be killed", file=sys.stderr, flush=True)
    result = engine.generate([Request(prompt=list(PROMPTS[0]), max_new_tokens=30)])[0]  # 8 decode calls of 4 steps
    # the step fails in process 0 (the CPU collectives see the peer gone) or blocks until the heartbeat ends it
    if result.error is None:
        print("UNEXPECTED: the generation succeeded without process 1", file=sys.stderr, flush=True)
    else:
        print(f"generation failed: {result.error.value}: {(result.message or '')[:300]}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:] or list(LAYOUTS))  # layout names: a subset with DATA, to debug one
