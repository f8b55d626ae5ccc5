"""Serving benchmark: throughput, time to first token and inter-token gaps of `ds4jax serve` at 1, 8, 32 and 64
concurrent streaming clients, with the Engine's own numbers on the same workload beside them (so the HTTP
overhead is visible: the goal is < 5 % of tokens/s at 32 clients), and every response checked.

The server runs in this process (uvicorn on a free 127.0.0.1 port, the engine warmed up first) with the engine
`ds4jax serve` builds by default (`--steps-per-call 4`, `--max-logprobs 20`); the clients are asyncio + httpx
streams in the same process, so their own work counts against the server (a conservative measure). Each client
sends one greedy streaming completion of `--new` tokens after a `--prompt-tokens` prompt (distinct windows of the
default model's held-out corpus, else repeated text). Per level: a reference pass of the engine (untimed, with
each token's top-2 log-probabilities), then `--repeats` timed runs of the Engine alone (`engine.generate` of the
same requests: tokens/s; TTFT = queue + prefill; inter-token = decode time / tokens) and of the server (output
tokens/s over the wall clock, TTFT from send to first text, gaps between SSE events of one stream, p50 / p99).

Checks (any failure: exit status 1, the JSON lists them): every engine and server result has the reference's
greedy tokens; every stream's text is exactly the decoded text of its tokens, its usage counts them, it ends
with a finish reason and [DONE], one result per request; no compile after the warm-up. fp32 matmuls run at
"highest" precision (`--precision`) so greedy tokens do not depend on the batch; a path that still parts from the
reference at a near-tie (its token within `TIE_NATS` of the reference's, by the reference's log-probabilities)
is counted as a tie, not a failure.

    python scripts/bench_serve.py --out "$OUT/serve"                # H200: default model, 1/8/32/64 clients
    python scripts/bench_serve.py --tiny --out /tmp/serve          # CPU smoke: random tiny model, 1/2/4 clients
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import sys
import threading
import time

import numpy as np

TIE_NATS = 1e-3


def pct(xs, q):
    return round(float(np.percentile(np.asarray(xs, np.float64), q)), 6) if len(xs) else None


def prompts_for(tokenizer, n: int, length: int) -> list[list[int]]:
    """n distinct prompts: held-out windows (16 of 515 tokens) at several offsets, else shifted text."""
    from ds4jax.io.default_model import default_checkpoint

    path = os.path.join(default_checkpoint(), "heldout_eval.npy")
    if os.path.exists(path) and tokenizer.__class__.__name__ != "ByteTokenizer":
        windows = np.load(path)
        per = max((windows.shape[1] - 1) // length, 1)
        assert n <= len(windows) * per, f"only {len(windows) * per} distinct prompts of {length} tokens"
        return [[int(t) for t in windows[i % len(windows)][(i // len(windows)) * length:][:length]]
                for i in range(n)]
    text = "import os\nimport sys\n\ndef main(argv):\n    return 0\n" * (length // 8 + 1)
    return [tokenizer.encode(text[i:], add_bos=True)[:length] for i in range(n)]


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


def engine_level(engine, prompts, new: int, stop_ids, refs, checks: Checks, label: str) -> dict:
    start = time.perf_counter()
    results = engine.generate(requests_for(prompts, new, stop_ids))
    wall = time.perf_counter() - start
    for i, (r, ref) in enumerate(zip(results, refs)):
        checks.expect(r.ok, f"{label} engine request {i}: {r.error} {r.message}")
        checks.tokens(f"{label} engine request {i}", r.tokens, ref)
    tokens = sum(len(r.tokens) for r in results)
    ttft = [r.timings.queue_s + r.timings.prefill_s for r in results]
    itl = [r.timings.decode_s / max(len(r.tokens) - 1, 1) for r in results]
    return {"tokens_per_s": round(tokens / wall, 2), "tokens": tokens, "wall_s": round(wall, 4),
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "inter_token_mean_p50_s": pct(itl, 50)}


async def one_stream(http, prompt, new: int) -> dict:
    body = {"prompt": prompt, "max_tokens": new, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    arrivals, text, tokens, reasons, done, error = [], "", None, [], False, None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                if "error" in event:
                    error = event["error"]
                    break
                if event["choices"]:
                    choice = event["choices"][0]
                    if choice["text"]:
                        arrivals.append(time.perf_counter())
                        text += choice["text"]
                    if choice["finish_reason"]:
                        reasons.append(choice["finish_reason"])
                if event.get("usage"):
                    tokens = event["usage"]["completion_tokens"]
            elif line.startswith("data: [DONE]"):
                done = True
                break
    return {"ttft": arrivals[0] - sent if arrivals else None, "gaps": list(np.diff(arrivals)), "events": len(arrivals),
            "tokens": tokens, "text": text, "reasons": reasons, "done": done, "error": error}


async def server_runs(http, prompts, new: int) -> tuple[list[dict], float]:
    start = time.perf_counter()
    runs = await asyncio.gather(*(one_stream(http, p, new) for p in prompts))
    return runs, time.perf_counter() - start


class Clients:
    """One keep-alive httpx client on one event loop for the whole benchmark, as a long-lived client would be:
    the timed runs do not pay for TCP connects (`open` makes a level's connections first)."""

    def __init__(self, base: str, most: int):
        import httpx

        self.runner = asyncio.Runner()
        limits = httpx.Limits(max_connections=most + 4, max_keepalive_connections=most + 4)
        self.http = self.runner.run(self._client(httpx, base, limits))

    @staticmethod
    async def _client(httpx, base, limits):
        return httpx.AsyncClient(base_url=base, timeout=600, limits=limits)

    def open(self, n: int) -> None:
        async def one():
            r = await self.http.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
            r.raise_for_status()

        async def all_():
            await asyncio.gather(*(one() for _ in range(n)))

        self.runner.run(all_())

    def run(self, prompts, new: int):
        return self.runner.run(server_runs(self.http, prompts, new))

    def close(self) -> None:
        self.runner.run(self.http.aclose())
        self.runner.close()


def server_level(server, clients: Clients, tok, prompts, new: int, refs, checks: Checks, label: str) -> dict:
    captured = collections.defaultdict(list)  # prompt -> the engine results the server got for it
    finished = server.metrics.finished

    def record(job, result):
        captured[tuple(job.request.prompt)].append(result)
        finished(job, result)

    server.metrics.finished = record
    try:
        runs, wall = clients.run(prompts, new)
    finally:
        server.metrics.finished = finished
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
    return {"tokens_per_s": round(tokens / wall, 2), "tokens": tokens, "wall_s": round(wall, 4),
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "inter_token_p50_s": pct(gaps, 50),
            "inter_token_p99_s": pct(gaps, 99), "sse_events": sum(r.get("events", 0) for r in runs)}


def start_server(engine, tokenizer):
    from ds4jax.serving.app import Server
    from ds4jax.serving.config import ServerConfig
    from ds4jax.serving.server import free_port, uvicorn_server
    import httpx

    server = Server(engine, tokenizer, ServerConfig(model_name="bench", max_queue=4096, max_n=1,
                                                    max_tokens_cap=1 << 16, warmup=False))
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
    lines = [f"# Serving benchmark ({doc['device']})", "", f"`{doc['command']}`", "",
             f"Model: {doc['model']}; prompt {doc['prompt_tokens']} tokens, up to {doc['new_tokens']} new tokens per "
             f"request, greedy; engine max_slots {doc['max_slots']}, steps_per_call {doc['steps_per_call']}, "
             f"logprobs {doc['max_logprobs']} (what `ds4jax serve` builds); matmul precision {doc['precision']}; "
             f"warm-up {doc['warmup_s']} s, compiles after warm-up {doc['compiles_after_warmup']}; best of "
             f"{doc['repeats']} runs per level and side; {doc['cpus']} CPUs.", "",
             "| clients | engine tok/s | server tok/s | HTTP overhead | engine TTFT p50 | server TTFT p50 / p99 | "
             "server inter-token p50 / p99 | engine decode s/token |", "|---|---|---|---|---|---|---|---|"]
    for r in doc["levels"]:
        e, s = r["engine"], r["server"]
        lines.append(f"| {r['clients']} | {e['tokens_per_s']:.1f} | {s['tokens_per_s']:.1f} | "
                     f"{r['overhead_pct']:+.1f} % | {ms(e['ttft_p50_s'])} | {ms(s['ttft_p50_s'])} / "
                     f"{ms(s['ttft_p99_s'])} | {ms(s['inter_token_p50_s'])} / {ms(s['inter_token_p99_s'])} | "
                     f"{ms(e['inter_token_mean_p50_s'])} |")
    verdict = "PASS" if not c["failures"] else f"FAIL ({len(c['failures'])}: {c['failures'][:3]})"
    lines += ["", f"Checks: {c['checked']} results compared with the engine's reference greedy tokens "
              f"({c['ties']} parted at a near-tie), streamed text = its tokens' text, usage, finish, one result "
              f"per request, no compile after warm-up: **{verdict}**.", "",
              "HTTP overhead = 1 - server tok/s / engine tok/s. The clients run in the server's process "
              "(asyncio + httpx, one keep-alive client whose connections are open before the timed runs), so "
              "they count against it. Inter-token gaps are between SSE events of one "
              "stream: a decode call of M steps delivers M tokens together, so p50 is near 0 and p99 near "
              "the call's time."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for serve.json / serve.md")
    ap.add_argument("--clients", default="1,8,32,64")
    ap.add_argument("--new", type=int, default=128, help="new tokens per request")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--steps-per-call", type=int, default=4, help="as `ds4jax serve`")
    ap.add_argument("--max-logprobs", type=int, default=20, help="as `ds4jax serve`")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per level and side; the best is reported")
    ap.add_argument("--precision", default="highest", help="jax_default_matmul_precision (batch-invariant greedy)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke: the random tiny model, clients 1,2,4, 8 tokens")
    ap.add_argument("--name", default="serve", help="output file stem")
    args = ap.parse_args(argv)
    import jax

    jax.config.update("jax_default_matmul_precision", args.precision)
    from ds4jax import Engine
    from ds4jax.io import default_model as dm

    if args.tiny:
        model, tok = dm.random_model(), dm.random_tokenizer()
        args.clients, args.new, args.prompt_tokens = "1,2,4", 8, 16
    else:
        model, tok = dm.default_model(), dm.default_tokenizer()
    levels = [int(c) for c in args.clients.split(",")]
    slots = max(levels)
    stop_ids = () if tok.eos_id is None else (tok.eos_id,)
    # one program per measured concurrency (not every power of two): a shorter warm-up
    engine = Engine(model, max_slots=slots, max_context=args.prompt_tokens + args.new + 8,
                    prefill_chunk=args.prompt_tokens, steps_per_call=args.steps_per_call, tokenizer=tok,
                    snapshot_bytes=0, row_buckets=tuple(sorted(set(levels))),
                    prefill_row_buckets=tuple(sorted(set(levels))), logprobs=args.max_logprobs)
    t = time.perf_counter()
    engine.warmup()
    warm = round(time.perf_counter() - t, 2)
    server, uv, thread, base = start_server(engine, tok)
    clients = Clients(base, max(levels))
    checks = Checks()
    doc = {"device": str(jax.devices()[0].device_kind), "command": " ".join(["python", *sys.argv]),
           "model": "random tiny" if args.tiny else "default", "prompt_tokens": args.prompt_tokens,
           "new_tokens": args.new, "max_slots": slots, "steps_per_call": args.steps_per_call,
           "max_logprobs": args.max_logprobs, "precision": args.precision, "warmup_s": warm,
           "repeats": args.repeats, "cpus": os.cpu_count(), "levels": []}
    os.makedirs(args.out, exist_ok=True)
    start = time.perf_counter()
    try:
        for c in levels:
            prompts = prompts_for(tok, c, args.prompt_tokens)
            # the engine alone, between server levels: the driver thread is idle then (it owns the engine while
            # requests run; nothing is in flight here). The reference pass also settles the engine.
            refs = engine.generate(requests_for(prompts, args.new, stop_ids, logprobs=2))
            for i, r in enumerate(refs):
                checks.expect(r.ok, f"{c} clients reference {i}: {r.error} {r.message}")
            e = max((engine_level(engine, prompts, args.new, stop_ids, refs, checks, f"{c} clients run {k}")
                     for k in range(args.repeats)), key=lambda r: r["tokens_per_s"])
            clients.open(c)
            s = max((server_level(server, clients, tok, prompts, args.new, refs, checks, f"{c} clients run {k}")
                     for k in range(args.repeats)), key=lambda r: r["tokens_per_s"])
            doc["levels"].append({"clients": c, "engine": e, "server": s,
                                  "overhead_pct": round(100 * (1 - s["tokens_per_s"] / e["tokens_per_s"]), 2)})
            doc["compiles_after_warmup"] = engine.stats.compiles_after_warmup
            checks.expect(engine.stats.compiles_after_warmup == 0,
                          f"{engine.stats.compiles_after_warmup} compiles after warm-up")
            doc["checks"] = {"checked": checks.checked, "ties": checks.ties, "failures": sorted(set(checks.failures))}
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
