"""The HTTP front end's own CPU: the server (`ds4jax.serving`) over the test suite's fake engine (no JAX work: one
token per 2 ms iteration), uvicorn's event loop on this process's main thread, streaming clients in a subprocess.
Prints the event loop thread's CPU per request and per token (the fake engine delivers one token per call: an SSE
event per token, sometimes one more for the finish); with --profile also the functions that took it (cProfile,
which slows everything about 1.5x). Every stream must end with [DONE] (exit 1 otherwise).

    python scripts/profile_serve_front_end.py --clients 64 --new 1 --rounds 20     # per-request cost
    python scripts/profile_serve_front_end.py --clients 32 --new 128 --rounds 3    # per-event cost
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

CLIENT = """
import asyncio, json, sys, time
import httpx
base, clients, new, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
body = {"model": "ds4jax-default", "prompt": "hello world", "max_tokens": new, "temperature": 0, "stream": True}
async def one(c):
    last = None
    async with c.stream("POST", base + "/v1/completions", json=body) as r:
        assert r.status_code == 200, r.status_code
        async for line in r.aiter_lines():
            last = line if line.startswith("data: ") else last
    return last == "data: [DONE]"
async def main():
    async with httpx.AsyncClient(limits=httpx.Limits(max_connections=clients), timeout=120) as c:
        while True:
            try:
                if (await c.get(base + "/health")).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.1)
        await asyncio.gather(*[one(c) for _ in range(clients)])  # connections open, untimed
        t = time.perf_counter()
        for _ in range(rounds):
            got = await asyncio.gather(*[one(c) for _ in range(clients)])
            assert all(done for done in got), got  # every stream ended with [DONE]
        print(json.dumps({"client_wall_s": time.perf_counter() - t}))
asyncio.run(main())
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--new", type=int, default=1, help="tokens per request")
    ap.add_argument("--rounds", type=int, default=20, help="timed waves of --clients requests (after one untimed)")
    ap.add_argument("--profile", action="store_true", help="print the top functions of the event loop thread")
    ap.add_argument("--out", help="append the result as one JSON line to this file")
    ap.add_argument("--label", default="", help="a name for the result (its JSON's label)")
    args = ap.parse_args()

    from fake_engine import FakeEngine

    from ds4jax.io.tokenizer import ByteTokenizer
    from ds4jax.serving.app import Server
    from ds4jax.serving.config import ServerConfig
    from ds4jax.serving.server import free_port, uvicorn_server

    engine = FakeEngine(max_slots=args.clients, delay_s=0.002)
    engine.tspec.max_context = 4096
    server = Server(engine, ByteTokenizer(), ServerConfig(max_tokens_cap=4096, max_queue=4096, ping_s=0))
    port = free_port()
    uv = uvicorn_server(server, "127.0.0.1", port, log_level="warning")
    client = subprocess.Popen([sys.executable, "-c", CLIENT, f"http://127.0.0.1:{port}", str(args.clients),
                               str(args.new), str(args.rounds)], stdout=subprocess.PIPE, text=True)

    def stop_when_done():
        client.wait()
        uv.should_exit = True

    threading.Thread(target=stop_when_done, daemon=True).start()
    prof = cProfile.Profile() if args.profile else None
    cpu = time.thread_time()
    if prof:
        prof.enable()
    uv.run()
    if prof:
        prof.disable()
    cpu = time.thread_time() - cpu
    out = client.stdout.read()
    if client.returncode != 0:
        print(f"the clients failed (exit {client.returncode})", file=sys.stderr)
        return 1
    requests = (args.rounds + 1) * args.clients
    line = json.dumps({"label": args.label, "clients": args.clients, "new": args.new, "requests": requests,
                       **json.loads(out), "loop_cpu_s": round(cpu, 3),
                       "loop_cpu_us_per_request": round(1e6 * cpu / requests, 1),
                       "loop_cpu_us_per_token": round(1e6 * cpu / (requests * args.new), 1), "profiled": bool(prof)})
    print(line)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")
    if prof:
        pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
    return 0


if __name__ == "__main__":
    sys.exit(main())
