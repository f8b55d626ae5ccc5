"""``ds4jax serve``: the OpenAI-compatible HTTP server (docs/serving.md) on one `Engine` built from the engine flags
that ``ds4jax batch`` and ``ds4jax warmup`` take (so ``ds4jax warmup`` with the same flags fills the compilation
cache the server's warm-up reads)."""

from __future__ import annotations

import argparse
import os

from ds4jax.commands.engine_options import add_engine_options, add_logprobs_option
from ds4jax.commands.options import HelpFormatter, host_name, non_negative_float, port_number, positive_int

NAME = "serve"


def add_parser(sub) -> argparse.ArgumentParser:
    from ds4jax.serving.config import API_KEY_ENV, DEFAULT_HOST, ServerConfig

    d = ServerConfig()
    p = sub.add_parser(NAME, help="serve the OpenAI HTTP API (completions, chat) on one engine",
                       description="An OpenAI-compatible server: POST /v1/completions, /v1/chat/completions "
                                   "(stream or not), GET /v1/models, /health, /metrics. docs/serving.md.",
                       formatter_class=HelpFormatter)
    add_engine_options(p)
    add_logprobs_option(p, 20)
    p.add_argument("--host", type=host_name, default=DEFAULT_HOST,
                   help="address to bind (0.0.0.0 exposes it to the network)")
    p.add_argument("--port", type=port_number, default=8000, help="port to bind (0: any free port)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' (default: ${API_KEY_ENV} if set, else no auth)")
    p.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model id clients send and /v1/models lists (default: the checkpoint's directory name)")
    p.add_argument("--max-tokens-cap", type=positive_int, default=d.max_tokens_cap, metavar="N",
                   help="largest max_tokens a request may ask for")
    p.add_argument("--default-max-tokens", type=positive_int, default=d.default_max_tokens, metavar="N",
                   help="max_tokens of a request that does not say")
    p.add_argument("--max-n", type=positive_int, default=d.max_n, metavar="N", help="most choices per request")
    p.add_argument("--max-queue", type=positive_int, default=d.max_queue, metavar="N",
                   help="generations waiting for a slot before new requests get 429")
    p.add_argument("--max-body-bytes", type=positive_int, default=d.max_body_bytes, metavar="B",
                   help="largest request body")
    p.add_argument("--shutdown-grace", type=non_negative_float, default=d.shutdown_grace_s, metavar="S",
                   help="seconds in-flight requests get to finish after SIGTERM before they are cancelled")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="take requests at once (the first ones compile)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--engine-process", dest="engine_process", action="store_true", default=d.engine_process,
                       help="run the engine in a process of its own and HTTP in this one, so that the two do not "
                            "share one interpreter lock (less HTTP overhead with many streams)" +
                            (" (the default)" if d.engine_process else ""))
    where.add_argument("--in-process", dest="engine_process", action="store_false",
                       help="run the engine on a thread of the HTTP server's process" +
                            ("" if d.engine_process else " (the default)"))
    p.set_defaults(steps_per_call=4)  # tokens reach clients every 4 steps (engine default 8): smoother streams
    return p


def build(args, model=None, tokenizer=None):
    """(Server, host, port) that `args` describe; `model` / `tokenizer` override the checkpoint (tests)."""
    from ds4jax.commands.engine_options import build_engine
    from ds4jax.serving.app import Server
    from ds4jax.serving.config import API_KEY_ENV, ServerConfig

    name = args.model_name or (os.path.basename(os.path.normpath(args.checkpoint)) if args.checkpoint
                               else "ds4jax-default")
    config = ServerConfig(model_name=name, api_key=args.api_key or os.environ.get(API_KEY_ENV) or None,
                          max_body_bytes=args.max_body_bytes, max_tokens_cap=args.max_tokens_cap,
                          default_max_tokens=args.default_max_tokens, max_n=args.max_n, max_queue=args.max_queue,
                          warmup=args.warmup, shutdown_grace_s=args.shutdown_grace,
                          engine_process=args.engine_process)
    if config.engine_process and model is None:  # (a model given here is the tests': it stays in this process)
        import functools
        import logging

        from ds4jax.serving.engine_process import build_server

        level = logging.WARNING if getattr(args, "quiet", False) else logging.INFO
        return build_server(functools.partial(engine_from_args, args), config, log_level=level), args.host, args.port
    if model is None:
        from ds4jax.cli import _load

        model, tokenizer = _load(args)
    return Server(build_engine(model, args, tokenizer), tokenizer, config), args.host, args.port


def engine_from_args(args):
    """The engine process's engine (--engine-process): the model and engine that `args` describe, with the
    compilation cache on as in one process."""
    from ds4jax.cli import _load, enable_compilation_cache
    from ds4jax.commands.engine_options import build_engine

    enable_compilation_cache()
    model, tokenizer = _load(args)
    return build_engine(model, args, tokenizer)


def run(args) -> int:
    import logging

    from ds4jax.cli import enable_compilation_cache
    from ds4jax.errors import UsageError

    try:
        from ds4jax.serving.server import run as run_server
    except ImportError as e:
        raise UsageError(f"needs the serve extra: pip install 'ds4jax[serve]' ({e})") from None

    # our own lines at INFO; other libraries (orbax's loader is chatty) only at WARNING
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger("ds4jax").setLevel(logging.WARNING if args.quiet else logging.INFO)
    from ds4jax.runtime.distributed import launched

    if launched():  # each process would run its own server; requests are not shared between processes
        raise UsageError("runs in one process (its HTTP requests are not shared with other processes): serve a mesh "
                         "of this process's devices with --mesh, without ds4jax launch / a multi-process job",
                         name="serve")
    if not args.engine_process:  # else the engine process does (the front end loads no JAX)
        enable_compilation_cache()  # the warm-up loads what an earlier run (or `ds4jax warmup`) compiled
    server, host, port = build(args)
    if host not in ("127.0.0.1", "localhost", "::1") and server.config.api_key is None:
        logging.getLogger("ds4jax.serve").warning("binding %s without --api-key: anyone who can reach it can use it",
                                                  host)
    run_server(server, host, port, log_level="warning" if args.quiet else "info")
    return 0
