"""Host (Python) CPU of the `Engine` per generated token and per decode call, outside the compiled programs.

Default model, Engine(max_slots, max_context=512, steps_per_call=4, logprobs=20 or 0), 32 requests of a 64-token
prompt x 128 new tokens, greedy; warmed up (`engine.warmup()`) and one untimed pass before the timed ones.

The engine's program calls (`_prefill_call`, `_decode_call`, `_spec_call`, `_restore_call`) are wrapped and timed
to `block_until_ready`, and so is every `ds4jax.runtime.distributed.fetch` the generation modules call (device ->
host copies). Host time = the run's time minus the time in those wrappers: the engine's own Python (row planning,
delivery, logprobs, books). Both the wall clock and the calling thread's CPU time (`time.thread_time`) are
reported; on a shared machine the thread CPU is the steadier number. `call_cpu_ms_per_call` is the thread's CPU
inside the wrappers (dispatch and fetch; on CPU the device work runs on XLA's own threads). Cases:

* ``lp20_none``: an engine with logprobs=20 whose requests ask for none (what `ds4jax serve` builds, and most of
  its requests), through `stream` with an `on_token` callback (the server's driver shape);
* ``lp0``: an engine without logprobs, through `generate`;
* ``lp20_asked``: logprobs=20 and every request asks for 5 alternatives (`stream` + `on_token`);
* ``*_host_only``: `Engine._decode_once` alone, its program and fetch replaced by canned numpy outputs
  (`host_only`): the engine's own Python per decode call, the steadiest number on a shared machine.

    PYTHONPATH=. JAX_PLATFORMS=cpu python scripts/profile_engine_host.py --out docs/benchmarks/engine_host_cpu.json \
        --label after [--profile 25]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time
import types

import jax
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ds4jax  # noqa: E402
from ds4jax import Engine, Request  # noqa: E402
from ds4jax.runtime import distributed  # noqa: E402

CALLS = ("_prefill_call", "_decode_call", "_spec_call", "_restore_call")


class Clock:
    """Seconds (wall and this thread's CPU) spent inside the wrapped program calls and fetches."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            w, c = time.perf_counter(), time.thread_time()
            out = jax.block_until_ready(fn(*args, **kwargs))
            self.wall += time.perf_counter() - w
            self.cpu += time.thread_time() - c
            return out

        return timed


def instrument(engine: Engine, clock: Clock) -> None:
    for name in CALLS:
        setattr(engine, name, clock.wrap(getattr(engine, name)))
    real = distributed.fetch
    for mod in list(sys.modules.values()):  # every generation module that imported `fetch` under any name
        if getattr(mod, "__name__", "").startswith("ds4jax.generation"):
            for attr, val in list(vars(mod).items()):
                if val is real:
                    setattr(mod, attr, clock.wrap(real))


def requests(tokenizer, n: int, prompt_len: int, new: int, logprobs, on_token) -> list[Request]:
    rng = np.random.default_rng(0)
    vocab = 256  # byte-level ids are valid in any vocabulary of the default model
    return [Request(prompt=[int(t) for t in rng.integers(3, vocab, prompt_len)], max_new_tokens=new,
                    logprobs=logprobs, on_token=on_token) for _ in range(n)]


def run_once(engine: Engine, reqs, streaming: bool, clock: Clock, prof=None) -> dict:
    calls0 = engine.stats.decode_calls + engine.stats.spec_calls
    clock.wall = clock.cpu = 0.0
    w, c = time.perf_counter(), time.thread_time()
    if prof is not None:
        prof.enable()
    if streaming:
        results = []
        for _ in engine.stream(reqs):
            pass
        results = engine.last_results
    else:
        results = engine.generate(reqs)
    if prof is not None:
        prof.disable()
    wall, cpu = time.perf_counter() - w, time.thread_time() - c
    tokens = sum(len(r.tokens) for r in results)
    assert all(r.ok for r in results), [r.message for r in results if not r.ok]
    calls = engine.stats.decode_calls + engine.stats.spec_calls - calls0
    host_wall, host_cpu = wall - clock.wall, cpu - clock.cpu
    return dict(tokens=tokens, decode_calls=calls, wall_s=wall, program_wall_s=clock.wall,
                host_wall_us_per_token=1e6 * host_wall / tokens, host_cpu_us_per_token=1e6 * host_cpu / tokens,
                host_wall_ms_per_call=1e3 * host_wall / calls, host_cpu_ms_per_call=1e3 * host_cpu / calls,
                # this thread's CPU inside the wrapped calls: dispatch (argument flattening, the executable cache's
                # lookup, transfers) and fetches; the device's own work runs on other threads
                call_cpu_ms_per_call=1e3 * clock.cpu / calls,
                tokens_digest=hash(tuple(tuple(r.tokens) for r in results)) & 0xFFFFFFFF)


def host_only(model, tokenizer, lp: int, on_token, streaming: bool, slots: int, new: int, repeats: int) -> dict:
    """`Engine._decode_once` alone with the decode program and the fetch replaced by canned numpy outputs (every
    row emits M tokens per call): the engine's own Python per call, free of XLA's threads sharing the cores."""
    from ds4jax.generation import decode_calls as calls_mod  # where `_decode_once` reads its fetch
    from ds4jax.generation.delivery import Live
    from ds4jax.generation.request_checks import check_for_engine

    eng = Engine(model, max_slots=slots, max_context=512, steps_per_call=4, logprobs=lp, tokenizer=tokenizer)
    m = eng.steps_per_call
    out = types.SimpleNamespace(tokens=(np.arange(slots * m, dtype=np.int32).reshape(slots, m) % 200 + 3),
                                steps=np.int32(m), bad=np.full(slots, -1, np.int32), logprobs=None)
    real_fetch = calls_mod.fetch
    calls_mod.fetch, eng._decode_call = (lambda tree: tree), (lambda rows: out)
    eng.programs = types.SimpleNamespace(lengths=lambda pool: np.zeros(slots, np.int32))
    best = None
    try:
        for _ in range(repeats):
            eng._slots.clear()
            part = []
            for i in range(slots):
                req = Request(prompt=[5] * 64, max_new_tokens=new + 1, on_token=on_token)
                lv = Live.start(i, req, check_for_engine(req, eng.limits, tokenizer=None), 0.0)
                lv.slot, lv.pos, lv.cur, lv.result.tokens = i, 64, 7, [7]  # prefilled, first token out
                eng._slots[i] = lv
                if hasattr(eng, "_table"):  # (trees before the SlotTable write it at admission)
                    eng._table.admit(lv)
                part.append(lv)
            calls, c = 0, time.thread_time()
            while not all(lv.done for lv in part):
                eng._decode_once([lv for lv in part if not lv.done], 0, [] if streaming else None, False)
                calls += 1
            cpu = time.thread_time() - c
            tokens = sum(len(lv.result.tokens) - 1 for lv in part)
            got = dict(tokens=tokens, decode_calls=calls, host_cpu_us_per_token=1e6 * cpu / tokens,
                       host_cpu_ms_per_call=1e3 * cpu / calls)
            best = got if best is None or got["host_cpu_us_per_token"] < best["host_cpu_us_per_token"] else best
    finally:
        calls_mod.fetch = real_fetch
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True, help="JSON file; the run is stored under --label (others kept)")
    ap.add_argument("--label", default="after")
    ap.add_argument("--max-slots", type=int, default=32)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="timed passes per case; the best (least host CPU)")
    ap.add_argument("--cases", default="lp20_none,lp0,lp20_asked")
    ap.add_argument("--profile", type=int, default=0, help="print cProfile's top N (tottime) of each case")
    a = ap.parse_args()

    model, tokenizer = ds4jax.default_model(), ds4jax.io.default_model.default_tokenizer()
    engines: dict[int, Engine] = {}
    report = {}
    sink = []

    def on_token(ev):
        sink.append(ev)  # the server's driver buffers each event

    for case in a.cases.split(","):
        lp, asked, streaming = {"lp20_none": (20, None, True), "lp0": (0, None, False),
                                "lp20_asked": (20, 5, True)}[case]
        if lp not in engines:
            eng = Engine(model, max_slots=a.max_slots, max_context=512, steps_per_call=4, logprobs=lp,
                         tokenizer=tokenizer)
            t = time.perf_counter()
            eng.warmup()
            print(f"engine logprobs={lp}: warm-up {time.perf_counter() - t:.1f} s", flush=True)
            clock = Clock()
            instrument(eng, clock)
            eng._clock = clock
            engines[lp] = eng
        eng = engines[lp]
        reqs = requests(tokenizer, a.requests, a.prompt_len, a.new, asked, on_token if streaming else None)
        run_once(eng, reqs, streaming, eng._clock)  # untimed
        runs = [run_once(eng, reqs, streaming, eng._clock) for _ in range(a.repeats)]
        best = min(runs, key=lambda r: r["host_cpu_us_per_token"])
        best["compiles_after_warmup"] = eng.stats.compiles_after_warmup
        report[case] = best
        print(case, json.dumps(best), flush=True)
        if a.profile:
            prof = cProfile.Profile()
            run_once(eng, reqs, streaming, eng._clock, prof)
            s = io.StringIO()
            pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(a.profile)
            print(s.getvalue())
        sink.clear()

    for case in a.cases.split(","):  # the same cases with the programs replaced by canned outputs
        lp, streaming = {"lp20_none": (20, True), "lp0": (0, False), "lp20_asked": (20, True)}[case]
        if case == "lp20_asked":
            continue  # canned outputs carry no logprobs
        got = host_only(model, tokenizer, lp, on_token if streaming else None, streaming, a.max_slots, a.new,
                        a.repeats * 3)
        report[f"{case}_host_only"] = got
        print(f"{case}_host_only", json.dumps(got), flush=True)

    data = json.load(open(a.out)) if os.path.exists(a.out) else {}
    data[a.label] = dict(config=dict(max_slots=a.max_slots, max_context=512, steps_per_call=4,
                                     requests=a.requests, prompt_len=a.prompt_len, new_tokens=a.new,
                                     repeats=a.repeats, backend=jax.default_backend()), cases=report)
    with open(a.out, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
