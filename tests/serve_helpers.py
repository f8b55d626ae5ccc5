"""A live `ds4jax serve` in this process for the server tests: the one-layer engine of `small_engine` with up to
`LOGPROBS` logprobs (its programs compiled once per process, for every server of the tests) behind uvicorn on a
free 127.0.0.1 port."""

from __future__ import annotations

import contextlib
import functools
import threading
import time

import httpx
import pytest

# The server needs the `serve` extra (the test extra installs it; a GPU image may lack it): without it the server
# tests are skipped, visibly, rather than failing the whole collection.
for _name in ("starlette", "uvicorn"):
    pytest.importorskip(_name, reason="the serve extra is not installed (pip install 'ds4jax[serve]')")

from ds4jax.io.tokenizer import ByteTokenizer
from ds4jax.serving.app import Server
from ds4jax.serving.config import ServerConfig
from ds4jax.serving.server import free_port, uvicorn_server
from small_engine import build_small_engine, one_layer_model, small_engine

LOGPROBS = 5
READY_TIMEOUT_S = 600  # warm-up compiles the engine's programs (seconds on an idle CPU; minutes on a busy one)
GUARD_S = 300  # deadlock guards, not timing thresholds: a loaded CI machine may take minutes where an idle one takes ms


def holding_first_token(deliver, job, held: threading.Event):
    """An `on_tokens` callback around `deliver` that, at the job's first token, sets `held` and holds the engine
    thread until the job is cancelled (or GUARD_S pass): a client can leave mid-stream at a known point."""

    def slow(events):
        if events[0].index == 0:
            held.set()
            deadline = time.monotonic() + GUARD_S
            while not job.cancelled and time.monotonic() < deadline:
                time.sleep(0.01)
        return deliver(events)

    return slow


@contextlib.contextmanager
def live_server(config: ServerConfig = ServerConfig(), engine=None, engine_process: bool = False, build=None):
    """Yields (Server, base URL) once /health is 200; stops it (and checks it stopped) afterwards. engine_process:
    the same engine, built in an engine process of its own (`ds4jax serve --engine-process`); build: what that
    process builds instead (picklable)."""
    if engine_process or build is not None:
        from ds4jax.serving.engine_process import build_server

        server = build_server(build or functools.partial(build_small_engine, logprobs=LOGPROBS), config)
    else:
        server = Server(engine or small_engine(one_layer_model(), logprobs=LOGPROBS), ByteTokenizer(), config)
    port = free_port()
    uv = uvicorn_server(server, "127.0.0.1", port, log_level="warning")
    thread = threading.Thread(target=uv.run, name="uvicorn", daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while True:
            assert thread.is_alive(), "the server thread died"
            try:
                if httpx.get(base + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, f"not ready after {READY_TIMEOUT_S} s: {server.driver.state}"
            time.sleep(0.1)
        yield server, base
    finally:
        uv.should_exit = True
        thread.join(timeout=60)
        assert not thread.is_alive(), "the server did not stop"


def metric(text: str, name: str, **labels) -> float:
    """The value of one sample in Prometheus text (0 when absent)."""
    want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
    for line in text.splitlines():
        if line.startswith(want + " "):
            return float(line.split()[-1])
    return 0.0
