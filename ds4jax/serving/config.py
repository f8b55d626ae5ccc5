"""`ServerConfig`: what ``ds4jax serve`` flags set beside the engine's own."""

from __future__ import annotations

import dataclasses

DEFAULT_HOST = "127.0.0.1"  # local only unless asked: the server has no TLS and, without --api-key, no auth
API_KEY_ENV = "DS4JAX_API_KEY"


@dataclasses.dataclass(frozen=True)
class ServerConfig:
    model_name: str = "ds4jax-default"
    api_key: str | None = None  # requests must send "Authorization: Bearer <api_key>" (all routes but /health)
    max_body_bytes: int = 1 << 20  # a larger request body is refused (413) before it is read
    max_tokens_cap: int = 4096  # the largest max_tokens a request may ask for
    default_max_tokens: int = 256  # when a request does not say (clipped to the context left)
    max_n: int = 8  # choices per request (n x prompts)
    max_queue: int = 256  # generations waiting for a slot; more -> 429 with Retry-After
    retry_after_s: int = 1
    warmup: bool = True  # compile every engine program before /health says ready
    shutdown_grace_s: float = 30.0  # SIGTERM: in-flight requests get this long to finish, then are cancelled
    ping_s: float = 15.0  # open streams get a ": ping" comment this often (proxies drop idle connections); 0: never
    # how `ds4jax serve` runs the engine (commands/serve.build reads it; a `Server` built directly runs the driver
    # it is given): True (--engine-process, the default) in a process of its own, the HTTP front end in this one
    # (serving/engine_process.py), so the engine's interpreter does not share its GIL with the event loop; False
    # (--in-process) on a thread of this one. On both GPUs measured the server gave more tokens/s with the engine
    # process at every concurrency above 1 (H100: 27.8k vs 17.1k tok/s at 32 clients, 35.5k vs 23.9k at 64,
    # docs/benchmarks/serve_h100_*.md; H200: 16.4k vs 15.1k at 32); the 2-core CPU could not tell them apart
    engine_process: bool = True
    # stamp each request's way to its first token (`driver.TRACE_MARKS`: a few dict writes per request, none per
    # token): scripts/bench_serve.py reads the stamps to show where time to first token goes
    trace: bool = False
    # an idle engine starts once no request arrived for this long, so a burst's requests share their first
    # prefill (serving/driver.py); 0: it starts at the first request
    admit_quiet_ms: float = 1.0
