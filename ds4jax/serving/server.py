"""Run a `Server` under uvicorn. SIGTERM / SIGINT: /health turns 503 and new requests get 503 at once, in-flight
ones get `shutdown_grace_s` to finish (uvicorn waits for their connections that long), then the rest are
cancelled; the log says which finished and which were cancelled."""

from __future__ import annotations

import logging
import socket

import uvicorn

from ds4jax.serving.app import Server

log = logging.getLogger("ds4jax.serve")


class _Uvicorn(uvicorn.Server):
    def __init__(self, config, server: Server):
        super().__init__(config)
        self.ds4jax = server

    def handle_exit(self, sig, frame):  # noqa: D401 - uvicorn's signal hook
        if not self.should_exit:
            waiting, running = self.ds4jax.driver.depth()
            log.warning("signal %s: draining (%d running, %d waiting; grace %.0f s)", sig, running, waiting,
                        self.ds4jax.config.shutdown_grace_s)
            self.ds4jax.driver.stop_accepting()
        super().handle_exit(sig, frame)


def uvicorn_server(server: Server, host: str, port: int, *, log_level: str = "info") -> _Uvicorn:
    config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level, access_log=False,
                            timeout_graceful_shutdown=server.config.shutdown_grace_s, lifespan="on")
    return _Uvicorn(config, server)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run(server: Server, host: str, port: int, *, log_level: str = "info") -> None:
    uvicorn_server(server, host, port, log_level=log_level).run()
