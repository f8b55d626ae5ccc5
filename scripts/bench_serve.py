"""Serving benchmark: throughput, time to first token and inter-token gaps of `ds4jax serve` at 1, 8, 32 and 64
concurrent streaming clients, with the Engine's own numbers on the same workload beside them (so the HTTP
overhead is visible: the goal is < 5 % of tokens/s at 32 clients), and every response checked.

The server runs in this process (uvicorn on a free 127.0.0.1 port, the engine warmed up first) with the engine
`ds4jax serve` builds by default (`--steps-per-call 4`, `--max-logprobs 20`); with `--engine-process` the engine
runs in a process of its own as `ds4jax serve --engine-process` runs it (its passes alone and its counters are
then taken there, through the server's `RemoteDriver.call`). The clients run in `--client-procs`
separate processes (each one asyncio event loop with one keep-alive httpx client, its connections open before
the timed runs, handling its share of the streams), so parsing the streams does not compete with the server for
its GIL; on a machine with few cores they still compete for the CPU. Each client sends one greedy streaming
completion of `--new` tokens after a `--prompt-tokens` prompt (distinct windows of the default model's held-out
corpus, else repeated text). Per level: a reference pass of the engine (untimed, with each token's top-2
log-probabilities), then `--repeats` timed runs of the Engine alone (`engine.generate` of the same requests, in
this process: tokens/s; TTFT = queue + prefill; inter-token = decode time / tokens) and of the server (output
tokens/s from the first request sent to the last stream's end, TTFT from send to first text, gaps between SSE
events of one stream, p50 / p99, and tokens per SSE event: the server sends a choice's tokens that are ready
together as one chunk).

Every level runs as one wave (each client sends one request: the burst) and, with `--requests-per-client N`
(default 4), sustained: each client sends N requests back to back (the next as its stream ends), against the
engine alone running the same closed loop (N x clients requests, one joining as one finishes); both are
reported. The server stamps each request on its way to the first token (`ServerConfig.trace`,
`driver.TRACE_MARKS`); with the clients' send and first-arrival times (one CLOCK_MONOTONIC on Linux) the report
gives each step's p50 / p99, the engine feeds that admitted the requests and how long receiving them took.

Checks (any failure: exit status 1, the JSON lists them): every engine and server result has the reference's
greedy tokens; every stream's text is exactly the decoded text of its tokens, its usage counts them, it ends
with a finish reason and [DONE], one result per request; no compile after the warm-up. fp32 matmuls run at
"highest" precision (`--precision`) so greedy tokens do not depend on the batch; a path that still parts from the
reference at a near-tie (its token within `TIE_NATS` of the reference's, by the reference's log-probabilities)
is counted as a tie, not a failure.

    python scripts/bench_serve.py --out "$OUT/serve"                # H200: default model, 1/8/32/64 clients
    python scripts/bench_serve.py --tiny --out /tmp/serve          # CPU smoke: random tiny model, 1/2/4 clients
    python scripts/bench_serve.py --engine-process --name serve_engine_process --out "$OUT/serve"
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import functools
import itertools
import json
import logging
import multiprocessing
import os
import sys
import threading
import time

import numpy as np

TIE_NATS = 1e-3


def pct(xs, q):
    return round(float(np.percentile(np.asarray(xs, np.float64), q)), 6) if len(xs) else None


def prompts_for(tokenizer, n: int, length: int, path: str) -> list[list[int]]:
    """n distinct prompts: held-out windows (16 of 515 tokens of `path`) at several offsets (the non-overlapping
    ones first, then the same shifted by a half, a quarter and three quarters of a prompt), else numbered text."""
    if os.path.exists(path) and tokenizer.__class__.__name__ != "ByteTokenizer":
        windows = np.load(path)
        span, places = windows.shape[1] - 1, []
        for phase in dict.fromkeys((0, length // 2, length // 4, 3 * length // 4)):
            per = max(span // length, 1) if phase == 0 else max((span - phase) // length, 0)
            places += [(w, phase + j * length) for j in range(per) for w in range(len(windows))]
        assert n <= len(places), f"only {len(places)} distinct prompts of {length} tokens"
        prompts = [[int(t) for t in windows[w][at:at + length]] for w, at in places[:n]]
    else:
        text = "import os\nimport sys\n\ndef main(argv):\n    return 0\n" * (length // 8 + 1)
        prompts = [tokenizer.encode(f"# {i}\n{text}", add_bos=True)[:length] for i in range(n)]  # distinct for any n
    assert len({tuple(p) for p in prompts}) == n, "prompts repeat: results are matched to requests by prompt"
    return prompts


def parted(got: list[int], ref_tokens: list[int], ref_logprobs) -> str | None:
    """None when equal; "tie" when `got` leaves the reference at a near-tie; else what differs."""
    if got == ref_tokens:
        return None
    i = next((j for j, (a, b) in enumerate(zip(got, ref_tokens)) if a != b), min(len(got), len(ref_tokens)))
    if i < min(len(got), len(ref_tokens)):
        top = dict(ref_logprobs[i].top)
        if got[i] in top and top[ref_tokens[i]] - top[got[i]] <= TIE_NATS:
            return "tie"
    return f"token {i}: {got[i:i + 4]} (got, {len(got)} tokens) vs {ref_tokens[i:i + 4]} (reference, {len(ref_tokens)})"


class Checks:
    def __init__(self):
        self.failures: list[str] = []
        self.ties = 0
        self.checked = 0

    def tokens(self, where: str, got, ref) -> None:
        self.checked += 1
        why = parted(list(got), ref.tokens, ref.logprobs)
        if why == "tie":
            self.ties += 1
        elif why is not None:
            self.failures.append(f"{where}: {why}")

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)


def requests_for(prompts, new: int, stop_ids, logprobs=None):
    from ds4jax import Request

    return [Request(prompt=p, max_new_tokens=new, stop_ids=stop_ids, logprobs=logprobs) for p in prompts]


def thread_cpu(ident: int) -> float:
    """CPU seconds thread `ident` of this process has used (Linux / POSIX thread CPU clocks)."""
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def us_per_token(seconds: float, tokens: int) -> float | None:
    return round(1e6 * seconds / tokens, 1) if tokens else None


def stats_delta(now: dict, before: dict) -> dict:
    """The engine's counters (calls, steps, prefill chunks) since `before`: the work each side made the engine do,
    so a gap in tokens/s can be traced to more calls or steps rather than to the HTTP layer."""
    keys = ("prefill_steps", "decode_calls", "decode_steps", "spec_calls", "spec_rounds", "tokens")
    return {k: now[k] - before[k] for k in keys}


# ---- what runs where the engine is (this process, or the engine process through `EngineSide.run`) ------------------
def bench_engine(args):
    """The benchmark's engine, warmed up (`warmup_s` set on it); with --engine-process the engine process runs this."""
    import jax

    jax.config.update("jax_default_matmul_precision", args.precision)
    from ds4jax import Engine
    from ds4jax.io import default_model as dm

    model, tok = (dm.random_model(), dm.random_tokenizer()) if args.tiny else (dm.default_model(),
                                                                                dm.default_tokenizer())
    levels = sorted({int(c) for c in args.clients.split(",")})
    # one program per measured concurrency (not every power of two): a shorter warm-up
    engine = Engine(model, max_slots=max(levels), max_context=args.prompt_tokens + args.new + 8,
                    prefill_chunk=args.prompt_tokens, steps_per_call=args.steps_per_call, tokenizer=tok,
                    snapshot_bytes=0, row_buckets=tuple(levels), prefill_row_buckets=tuple(levels),
                    logprobs=args.max_logprobs)
    t = time.perf_counter()
    engine.warmup()
    engine.warmup_s = round(time.perf_counter() - t, 2)
    return engine


def engine_facts(engine, driver) -> dict:
    import jax

    from ds4jax.io.default_model import default_checkpoint

    return {"device": str(jax.devices()[0].device_kind), "warmup_s": engine.warmup_s,
            "heldout": os.path.join(default_checkpoint(), "heldout_eval.npy")}


def engine_pass(engine, driver, prompts, new: int, stop_ids, logprobs=None, concurrency=None):
    """The requests through the engine alone: (results, wall s, CPU s of this thread, engine counters' delta).
    concurrency=c (fewer than the requests): a closed loop of c clients, as the server's sustained mode runs
    them: the first c requests at once, then one more as each finishes (`Engine.iterations` with a feed, so a
    decode call ends at a finished row while requests are left)."""
    reqs = requests_for(prompts, new, stop_ids, logprobs=logprobs)
    stats = dataclasses.asdict(engine.stats)
    start, cpu = time.perf_counter(), time.thread_time()
    if concurrency is None or concurrency >= len(reqs):
        results = engine.generate(reqs)
    else:
        left, freed = collections.deque(reqs[concurrency:]), [0]

        def finished(i, result):
            freed[0] += 1

        def feed():
            out = []
            while freed[0] and left:
                out.append(left.popleft())
                freed[0] -= 1
            return out

        for _ in engine.iterations(reqs[:concurrency], on_result=finished, feed=feed, waiting=lambda: bool(left)):
            pass
        results = engine.last_results
    wall, cpu = time.perf_counter() - start, time.thread_time() - cpu
    return results, wall, cpu, stats_delta(dataclasses.asdict(engine.stats), stats)


def engine_counters(engine, driver, link: bool) -> dict:
    """The engine's counters and the CPU seconds of its serving threads: the driver's (the one that calls the
    engine) and, in an engine process, the main thread's (it reads the front end's messages); the process's."""
    cpu = {"engine_thread": thread_cpu(driver.thread_ident), "engine_process": time.process_time()}
    if link:
        cpu["engine_link"] = thread_cpu(threading.main_thread().ident)
    return {"stats": dataclasses.asdict(engine.stats), "cpu": cpu}


def engine_idle(engine, driver, timeout: float) -> bool:
    return driver.wait_idle(timeout)


def _on_host(host, fn, *args):
    return fn(host.engine, host.driver, *args)


class EngineSide:
    """Runs fn(engine, driver, *args) where the engine is: here (the server's `Driver`), or in the engine process
    (its `EngineHost`'s, through `RemoteDriver.call`)."""

    def __init__(self, server, remote: bool):
        self.server, self.remote = server, remote

    def run(self, fn, *args):
        if self.remote:
            return self.server.driver.call(_on_host, fn, *args, timeout=3600)
        return fn(self.server.engine, self.server.driver, *args)

    def counters(self) -> dict:
        return self.run(engine_counters, self.remote)


def engine_level(side: EngineSide, prompts, new: int, stop_ids, refs, checks: Checks, label: str,
                 concurrency: int) -> dict:
    results, wall, cpu, stats = side.run(engine_pass, prompts, new, stop_ids, None, concurrency)
    for i, (r, ref) in enumerate(zip(results, refs)):
        checks.expect(r.ok, f"{label} engine request {i}: {r.error} {r.message}")
        checks.tokens(f"{label} engine request {i}", r.tokens, ref)
    tokens = sum(len(r.tokens) for r in results)
    ttft = [r.timings.queue_s + r.timings.prefill_s for r in results]
    itl = [r.timings.decode_s / max(len(r.tokens) - 1, 1) for r in results]
    return {"tokens_per_s": round(tokens / wall, 2), "tokens": tokens, "wall_s": round(wall, 4),
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "inter_token_mean_p50_s": pct(itl, 50),
            "engine_thread_cpu_us_per_token": us_per_token(cpu, tokens), "engine_stats": stats}


async def one_stream(http, prompt, new: int) -> dict:
    """One streamed completion. Times are `time.monotonic()` (CLOCK_MONOTONIC on Linux: one clock for every
    process, so the parent can span the streams of all client processes)."""
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.monotonic()
    arrivals, text, tokens, reasons, done, error = [], "", None, [], False, None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}", "sent": sent,
                    "end": time.monotonic()}
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                    break
                if event["choices"]:
                    choice = event["choices"][0]
                    if choice["text"]:
                        arrivals.append(time.monotonic())
                        text += choice["text"]
                    if choice["finish_reason"]:
                        reasons.append(choice["finish_reason"])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
            elif line.startswith("data: [DONE]"):
                done = True
                break
    return {"ttft": arrivals[0] - sent if arrivals else None, "first_at": arrivals[0] if arrivals else None,
            "gaps": np.diff(arrivals).tolist(),
            "events": len(arrivals), "tokens": tokens, "text": text, "reasons": reasons, "done": done,
            "error": error, "sent": sent, "end": time.monotonic()}


async def open_connections(http, n: int) -> None:
    """n keep-alive connections, opened by n concurrent streamed two-token requests (so the server's streaming
    path has run, its lazy imports done, before the timed runs)."""
    async def one():
        body = {"prompt": [1, 2], "max_tokens": 2, "stream": True}
        async with http.stream("POST", "/v1/completions", json=body) as r:
            r.raise_for_status()
            await r.aread()

    await asyncio.gather(*(one() for _ in range(n)))


async def streams(http, sequences, new: int) -> list[list[dict]]:
    """Concurrent clients, each sending its sequence of prompts one after another (the next as soon as the last
    stream ended)."""
    async def client(prompts):
        return [await one_stream(http, p, new) for p in prompts]

    return await asyncio.gather(*(client(seq) for seq in sequences))


COMMANDS = {"open": open_connections, "run": streams}


async def _client(base: str, most: int):
    import httpx

    limits = httpx.Limits(max_connections=most + 4, max_keepalive_connections=most + 4)
    return httpx.AsyncClient(base_url=base, timeout=600, limits=limits)


def client_process(base: str, most: int, conn) -> None:
    """A client process: one keep-alive httpx client on one event loop for the whole benchmark, as a long-lived
    client would be; it runs the parent's commands ((name, *args) of `COMMANDS`) until None, answering
    ("ok", value) or ("error", what)."""
    with asyncio.Runner() as runner:
        http = runner.run(_client(base, most))
        try:
            while (msg := conn.recv()) is not None:
                name, *args = msg
                try:
                    conn.send(("ok", runner.run(COMMANDS[name](http, *args))))
                except Exception as exc:  # noqa: BLE001 - the parent reports it and fails the benchmark
                    conn.send(("error", f"{name}: {exc!r}"))
        finally:
            runner.run(http.aclose())


class ClientPool:
    """`procs` client processes (spawned: the parent holds JAX's threads, which a fork would not carry). A level
    of n streams gives process i the streams i, i + k, ... of its k = min(procs, n) processes."""

    def __init__(self, base: str, procs: int, most: int):
        ctx = multiprocessing.get_context("spawn")
        self.conns, self.procs = [], []
        for _ in range(procs):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=client_process, args=(base, -(-most // procs), theirs), daemon=True)
            proc.start()
            theirs.close()
            self.conns.append(mine)
            self.procs.append(proc)

    def _each(self, shares: list) -> list:
        """Send command shares[i] to process i (all first, then wait for all); their answers in order."""
        for conn, share in zip(self.conns, shares):
            conn.send(share)
        out = []
        for conn, _ in zip(self.conns, shares):
            status, value = conn.recv()
            if status != "ok":
                raise RuntimeError(f"a client process failed: {value}")
            out.append(value)
        return out

    def open(self, n: int) -> None:
        k = min(len(self.conns), n)
        self._each([("open", len(range(i, n, k))) for i in range(k)])

    def run(self, prompts, new: int, clients: int) -> tuple[list[dict], float]:
        """`clients` concurrent clients, client j sending prompts j, j + clients, ... one after another (one wave
        when there are as many prompts as clients). -> (one result per prompt, in order; seconds from the first
        request sent to the last stream's end)."""
        sequences = [prompts[j::clients] for j in range(clients)]
        k = min(len(self.conns), clients)
        parts = self._each([("run", sequences[i::k], new) for i in range(k)])
        per_client: list = [None] * clients
        for i, part in enumerate(parts):
            per_client[i::k] = part
        runs: list = [None] * len(prompts)
        for j, done in enumerate(per_client):
            runs[j::clients] = done
        return runs, max(r["end"] for r in runs) - min(r["sent"] for r in runs)

    def close(self) -> None:
        for conn in self.conns:
            conn.send(None)
        for proc in self.procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()


def trace_phases(jobs, prompts, runs) -> dict:
    """Where the time to first token went: the requests' stamps (`driver.TRACE_MARKS`, the server's, with the
    client's send and first arrival) as the gaps between consecutive stamps, p50 / p99 in ms over the requests;
    "admission_feeds": in how many engine-thread feeds the requests reached the engine (one for a wave that the
    engine admits at once), "received_spread_ms": from the first request sent to the last one's handler start."""
    from ds4jax.serving.driver import TRACE_MARKS

    client = {tuple(p): r for p, r in zip(prompts, runs)}
    gaps: dict[str, list[float]] = {}
    handed, received, sent = set(), [], []
    for job in jobs:
        if job.trace is None:
            continue
        stamps = dict(job.trace)
        run = client.get(tuple(job.request.prompt), {})
        stamps.update({k: v for k, v in (("sent", run.get("sent")), ("first_arrival", run.get("first_at")))
                       if v is not None})
        present = [m for m in TRACE_MARKS if m in stamps]
        for a, b in itertools.pairwise(present):
            gaps.setdefault(f"{a}->{b}", []).append(stamps[b] - stamps[a])
        if "handed" in stamps:
            handed.add(stamps["handed"])
        if "received" in stamps and "sent" in stamps:
            received.append(stamps["received"])
            sent.append(stamps["sent"])
    order = {f"{a}->{b}": (TRACE_MARKS.index(a), TRACE_MARKS.index(b)) for a in TRACE_MARKS for b in TRACE_MARKS}
    return {"phases_ms": {k: {"p50": round(1e3 * pct(v, 50), 3), "p99": round(1e3 * pct(v, 99), 3), "n": len(v)}
                          for k, v in sorted(gaps.items(), key=lambda kv: order[kv[0]])},
            "admission_feeds": len(handed),
            "received_spread_ms": round(1e3 * (max(received) - min(sent)), 3) if received else None}


def server_level(server, side: EngineSide, loop_thread: int, clients: ClientPool, tok, prompts, new: int, refs,
                 checks: Checks, label: str, concurrency: int) -> dict:
    captured = collections.defaultdict(list)  # prompt -> the engine results the server got for it
    finished = server.metrics.finished
    jobs = []

    def record(job, result):
        captured[tuple(job.request.prompt)].append(result)
        jobs.append(job)
        finished(job, result)

    server.metrics.finished = record
    # this process's serving threads: the event loop, and with an engine process the thread that reads its messages
    threads = {"event_loop": loop_thread, **({"frontend_link": server.driver.thread_ident} if side.remote else {})}
    cpu = {name: thread_cpu(ident) for name, ident in threads.items()}
    before, front = side.counters(), time.process_time()
    try:
        runs, wall = clients.run(prompts, new, concurrency)
    finally:
        server.metrics.finished = finished
    cpu = {name: thread_cpu(ident) - cpu[name] for name, ident in threads.items()}
    after = side.counters()
    cpu.update({name: after["cpu"][name] - before["cpu"][name] for name in after["cpu"]})
    if side.remote:
        cpu["frontend_process"] = time.process_time() - front
    stats = stats_delta(after["stats"], before["stats"])
    by_prompt = {tuple(p): ref for p, ref in zip(prompts, refs)}
    checks.expect(sorted(map(len, captured.values())) == [1] * len(prompts) and set(captured) == set(by_prompt),
                  f"{label} server: {sum(map(len, captured.values()))} results for {len(prompts)} requests")
    for i, (p, run) in enumerate(zip(prompts, runs)):
        where = f"{label} server stream {i}"
        got = captured.get(tuple(p), [None])[0]
        if run.get("error") or got is None:
            checks.expect(False, f"{where}: {run.get('error') or 'no engine result'}")
            continue
        checks.tokens(where, got.tokens, by_prompt[tuple(p)])
        checks.expect(run["text"] == tok.decode(got.tokens), f"{where}: streamed text differs from its tokens' text")
        checks.expect(run["tokens"] == len(got.tokens), f"{where}: usage {run['tokens']} != {len(got.tokens)} tokens")
        checks.expect(run["done"] and run["reasons"] in (["length"], ["stop"]),
                      f"{where}: finish {run['reasons']}, [DONE] {run['done']}")
    tokens = sum(r.get("tokens") or 0 for r in runs)
    ttft = [r["ttft"] for r in runs if r.get("ttft") is not None]
    gaps = [g for r in runs for g in r.get("gaps", ())]
    events = sum(r.get("events", 0) for r in runs)
    return {"tokens_per_s": round(tokens / wall, 2), "tokens": tokens, "wall_s": round(wall, 4),
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "inter_token_p50_s": pct(gaps, 50),
            "inter_token_p99_s": pct(gaps, 99), "sse_events": events,
            "tokens_per_event": round(tokens / events, 2) if events else None,
            **{f"{name}_cpu_us_per_token": us_per_token(seconds, tokens) for name, seconds in cpu.items()},
            "engine_stats": stats, **trace_phases(jobs, prompts, runs)}


def start_server(args):
    """The server (its engine built and warmed up: in this process, or in an engine process), serving."""
    from ds4jax.serving.app import Server
    from ds4jax.serving.config import ServerConfig
    from ds4jax.serving.server import free_port, uvicorn_server
    import httpx

    config = ServerConfig(model_name="bench", max_queue=4096, max_n=1, max_tokens_cap=1 << 16, warmup=False,
                          engine_process=args.engine_process, trace=True,
                          **({} if args.admit_quiet_ms is None else {"admit_quiet_ms": args.admit_quiet_ms}))
    if args.engine_process:
        from ds4jax.serving.engine_process import build_server

        server = build_server(functools.partial(bench_engine, args), config, log_level=logging.WARNING)
    else:
        engine = bench_engine(args)
        server = Server(engine, engine.tokenizer, config)
    port = free_port()
    uv = uvicorn_server(server, "127.0.0.1", port, log_level="warning")
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(base + "/health", timeout=5).status_code == 200:
                return server, uv, thread, base
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the server did not become ready")


def render_md(doc: dict) -> str:
    ms = lambda x: "n/a" if x is None else f"{1e3 * x:.1f} ms"  # noqa: E731
    c = doc["checks"]
    remote = doc.get("engine") == "its own process"
    lines = [f"# Serving benchmark ({doc['device']}{', engine process' if remote else ''})", "",
             f"`{doc['command']}`", "",
             f"The engine runs in {doc.get('engine', 'a thread of the server process')}.", "",
             f"Model: {doc['model']}; prompt {doc['prompt_tokens']} tokens, up to {doc['new_tokens']} new tokens per "
             f"request, greedy; engine max_slots {doc['max_slots']}, steps_per_call {doc['steps_per_call']}, "
             f"logprobs {doc['max_logprobs']} (what `ds4jax serve` builds); matmul precision {doc['precision']}; "
             f"warm-up {doc['warmup_s']} s, compiles after warm-up {doc['compiles_after_warmup']}; best of "
             f"{doc['repeats']} runs per level and side; uvicorn's HTTP protocol {doc.get('http', '?')}; "
             f"server admit_quiet_ms {doc.get('admit_quiet_ms', 'n/a')}, GIL switch interval while serving "
             f"{doc.get('gil_switch_interval_ms', 'n/a')} ms; "
             f"{doc['cpus']} CPUs, clients in {doc['client_procs']} "
             "processes.", "",
             "| clients | requests / client | engine tok/s | server tok/s | HTTP overhead | engine TTFT p50 | server TTFT p50 / p99 | "
             "server inter-event p50 / p99 | tokens / SSE event | engine decode s/token | engine thread CPU / token "
             "(alone / serving) | event loop CPU / token | decode calls / steps, prefill chunks (alone / serving) |" +
             (" engine process's pipe thread / front end's link thread CPU / token |" if remote else ""),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|" + ("---|" if remote else "")]
    work = lambda st: "n/a" if not st else (f"{st['decode_calls'] + st['spec_calls']} / "  # noqa: E731
                                            f"{st['decode_steps'] + st['spec_rounds']}, {st['prefill_steps']}")
    for r in doc["levels"]:
        e, s = r["engine"], r["server"]
        lines.append(f"| {r['clients']} | {r.get('requests_per_client', 1)} | {e['tokens_per_s']:.1f} | {s['tokens_per_s']:.1f} | "
                     f"{r['overhead_pct']:+.1f} % | {ms(e['ttft_p50_s'])} | {ms(s['ttft_p50_s'])} / "
                     f"{ms(s['ttft_p99_s'])} | {ms(s['inter_token_p50_s'])} / {ms(s['inter_token_p99_s'])} | "
                     f"{s['tokens_per_event']} | {ms(e['inter_token_mean_p50_s'])} | "
                     f"{e['engine_thread_cpu_us_per_token']} / {s['engine_thread_cpu_us_per_token']} us | "
                     f"{s['event_loop_cpu_us_per_token']} us | {work(e.get('engine_stats'))} / "
                     f"{work(s.get('engine_stats'))} |" +
                     (f" {s.get('engine_link_cpu_us_per_token')} / {s.get('frontend_link_cpu_us_per_token')} us |"
                      if remote else ""))
    names = list(dict.fromkeys(k for r in doc["levels"] for k in r["server"].get("phases_ms", {})))
    if names:
        lines += ["", "Where the server's time to first token goes (p50 ms of each step, over the requests of the "
                  "reported run; `driver.TRACE_MARKS`):", "",
                  "| clients | requests / client | " + " | ".join(names) + " | client TTFT p50 | feeds that "
                  "admitted them | first sent -> last received |", "|---|---|" + "---|" * (len(names) + 3)]
        for r in doc["levels"]:
            s, ph = r["server"], r["server"].get("phases_ms", {})
            lines.append(f"| {r['clients']} | {r.get('requests_per_client', 1)} | " +
                         " | ".join(f"{ph[k]['p50']:.2f}" if k in ph else "" for k in names) +
                         f" | {ms(s['ttft_p50_s'])} | {s.get('admission_feeds')} | {s.get('received_spread_ms')} ms |")
    verdict = "PASS" if not c["failures"] else f"FAIL ({len(c['failures'])}: {c['failures'][:3]})"
    lines += ["", f"Checks: {c['checked']} results compared with the engine's reference greedy tokens "
              f"({c['ties']} parted at a near-tie), streamed text = its tokens' text, usage, finish, one result "
              f"per request, no compile after warm-up: **{verdict}**.", "",
              "HTTP overhead = 1 - server tok/s / engine tok/s. The clients run in separate processes "
              "(each asyncio + one keep-alive httpx client whose connections are open before the timed runs), "
              "so they do not take the server's GIL (they do share its CPU cores). The server sends the tokens "
              "of a choice that are ready together (a decode call of M steps delivers M) as one SSE event, so "
              "inter-event gaps are about one engine call and an event carries up to M tokens. CPU / token: "
              "CPU time of the thread that drives the engine (the caller of `engine.generate` alone; the "
              "server's engine thread when serving) and of the server's event loop (HTTP, SSE, detokenization), "
              "per generated token, in the reported (best) run: a measure of the server's own work that a busy "
              "machine distorts less than tokens/s. Decode calls / steps and prefill chunks: the engine's own counters "
              "over the reported run of each side (the work the same requests cost it alone and behind the server). "
              "Requests / client 1 is one wave (every client sends one request at once: the burst); more is the "
              "sustained mode, each client sending its next request as soon as its last stream ended (the engine "
              "alone runs the same closed loop: a request joins as one finishes), steady-state throughput."]
    if remote:
        lines += ["", "Engine process: the engine thread is the engine process's driver thread (it also sends the "
                  "one message per engine iteration); its pipe thread reads the front end's messages; the front "
                  "end's link thread receives the engine's messages and hands them to the event loop. The JSON "
                  "also has each process's whole CPU per token (on a CPU backend the engine process's includes "
                  "the model's compute)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for serve.json / serve.md")
    ap.add_argument("--clients", help="concurrency levels (default 1,8,32,64; --tiny: 1,2,4)")
    ap.add_argument("--new", type=int, help="new tokens per request (default 128; --tiny: 8)")
    ap.add_argument("--prompt-tokens", type=int, help="default 64; --tiny: 16")
    ap.add_argument("--client-procs", type=int, default=max(1, min(4, (os.cpu_count() or 1) // 4)),
                    help="client processes (default a quarter of the CPUs, 1 to 4)")
    ap.add_argument("--steps-per-call", type=int, default=4, help="as `ds4jax serve`")
    ap.add_argument("--max-logprobs", type=int, default=20, help="as `ds4jax serve`")
    ap.add_argument("--requests-per-client", type=int, default=4,
                    help="the sustained mode: each client sends this many requests back to back (reported beside "
                         "the one-wave burst, which always runs; 1: the burst only)")
    ap.add_argument("--admit-quiet-ms", type=float,
                    help="the server's ServerConfig.admit_quiet_ms (default: its default; 0: an idle engine starts "
                         "at the first request)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per level and side; the best is reported")
    ap.add_argument("--precision", default="highest", help="jax_default_matmul_precision (batch-invariant greedy)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke: the random tiny model, smaller defaults")
    ap.add_argument("--name", default="serve", help="output file stem")
    where = ap.add_mutually_exclusive_group()
    where.add_argument("--engine-process", dest="engine_process", action="store_true", default=None,
                       help="the engine in a process of its own, as `ds4jax serve` runs it by default")
    where.add_argument("--in-process", dest="engine_process", action="store_false",
                       help="the engine on a thread of the server's process (`ds4jax serve --in-process`)")
    args = ap.parse_args(argv)
    if args.engine_process is None:  # as `ds4jax serve` does
        from ds4jax.serving.config import ServerConfig

        args.engine_process = ServerConfig().engine_process
    defaults = ("1,2,4", 8, 16) if args.tiny else ("1,8,32,64", 128, 64)
    for name, value in zip(("clients", "new", "prompt_tokens"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.client_procs < 1:
        ap.error(f"--client-procs must be >= 1, got {args.client_procs}")
    levels = [int(c) for c in args.clients.split(",")]
    if args.requests_per_client < 1:
        ap.error(f"--requests-per-client must be >= 1, got {args.requests_per_client}")
    modes = sorted({1, args.requests_per_client})  # the one-wave burst always, the sustained mode beside it
    slots = max(levels)
    # with --engine-process this process is the front end: it imports no JAX (the engine process does it all)
    server, uv, thread, base = start_server(args)
    side = EngineSide(server, remote=args.engine_process)
    facts, tok = side.run(engine_facts), server.tokenizer
    stop_ids = () if tok.eos_id is None else (tok.eos_id,)
    clients = ClientPool(base, min(args.client_procs, max(levels)), max(levels))
    checks = Checks()
    doc = {"device": facts["device"], "command": " ".join(["python", *sys.argv]),
           "engine": "its own process" if args.engine_process else "a thread of the server's process",
           "model": "random tiny" if args.tiny else "default", "prompt_tokens": args.prompt_tokens,
           "new_tokens": args.new, "max_slots": slots, "steps_per_call": args.steps_per_call,
           "max_logprobs": args.max_logprobs, "precision": args.precision, "warmup_s": facts["warmup_s"],
           "repeats": args.repeats, "cpus": os.cpu_count(), "client_procs": len(clients.procs),
           "http": uv.config.http_protocol_class.__name__, "admit_quiet_ms": server.config.admit_quiet_ms,
           "gil_switch_interval_ms": round(sys.getswitchinterval() * 1e3, 3),  # the server's lifespan sets it
           "loop": uv.config.loop, "levels": []}
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    try:
        for c in levels:
            prompts = prompts_for(tok, c * modes[-1], args.prompt_tokens, facts["heldout"])
            # the engine alone, between server levels, once the driver thread is idle (it owns the engine while it
            # streams, and still resets slots after the last result went out). The reference pass also settles it.
            if not side.run(engine_idle, 60):
                raise RuntimeError("the server's engine thread did not go idle within 60 s")
            refs = side.run(engine_pass, prompts, args.new, stop_ids, 2)[0]
            for i, r in enumerate(refs):
                checks.expect(r.ok, f"{c} clients reference {i}: {r.error} {r.message}")
            clients.open(c)
            for n in modes:
                these, label = prompts[:c * n], f"{c} clients x {n} requests"
                if not side.run(engine_idle, 60):
                    raise RuntimeError("the server's engine thread did not go idle within 60 s")
                e = max((engine_level(side, these, args.new, stop_ids, refs, checks, f"{label} run {k}", c)
                         for k in range(args.repeats)), key=lambda r: r["tokens_per_s"])
                s = max((server_level(server, side, thread.ident, clients, tok, these, args.new, refs, checks,
                                      f"{label} run {k}", c)
                         for k in range(args.repeats)), key=lambda r: r["tokens_per_s"])
                doc["levels"].append({"clients": c, "requests_per_client": n, "engine": e, "server": s,
                                      "overhead_pct": round(100 * (1 - s["tokens_per_s"] / e["tokens_per_s"]), 2)})
                compiles = side.counters()["stats"]["compiles_after_warmup"]
                doc["compiles_after_warmup"] = compiles
                checks.expect(compiles == 0, f"{compiles} compiles after warm-up")
                doc["checks"] = {"checked": checks.checked, "ties": checks.ties,
                                 "failures": sorted(set(checks.failures))}
                doc["measure_s"] = round(time.perf_counter() - start, 2)
                with open(os.path.join(args.out, f"{args.name}.json"), "w") as f:
                    json.dump(doc, f, indent=1)
                with open(os.path.join(args.out, f"{args.name}.md"), "w") as f:
                    f.write(render_md(doc))
                print(json.dumps(doc["levels"][-1]), flush=True)
    finally:  # a clean stop before the interpreter exits (the lifespan's drain needs a live executor)
        clients.close()
        uv.should_exit = True
        thread.join(timeout=60)
    for failure in doc["checks"]["failures"]:
        print("FAILED CHECK:", failure, file=sys.stderr)
    return 1 if doc["checks"]["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
