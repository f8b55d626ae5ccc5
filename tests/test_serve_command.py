"""``ds4jax serve``'s flags: they build the engine `ds4jax batch` / `warmup` would and the server's limits; the API
key may come from the environment; ``serve --help`` needs no JAX."""

from __future__ import annotations

from ds4jax import cli
from ds4jax.commands import serve
from ds4jax.io.tokenizer import ByteTokenizer
from small_engine import one_layer_model


def test_flags_build_the_server(monkeypatch):
    monkeypatch.setenv("DS4JAX_API_KEY", "from-env")
    args = cli.build_parser().parse_args(["serve", "--max-slots", "2", "--max-context", "64", "--prefill-chunk", "8",
                                          "--max-queue", "5", "--max-tokens-cap", "9", "--port", "0"])
    assert args.host == "127.0.0.1" and args.steps_per_call == 4
    # the engine in a process of its own unless --in-process (a model given to build stays in this one)
    assert args.engine_process is True
    assert cli.build_parser().parse_args(["serve", "--in-process"]).engine_process is False
    assert cli.build_parser().parse_args(["serve", "--engine-process"]).engine_process is True
    server, host, port = serve.build(args, one_layer_model(), ByteTokenizer())
    assert server.config.api_key == "from-env" and server.config.max_queue == 5
    assert server.limits.max_tokens_cap == 9 and server.engine.tspec.max_slots == 2
    assert server.engine.steps_per_call == 4
    assert server.engine.logprobs == server.limits.max_logprobs == 20  # OpenAI's cap, by default
    assert server.driver.state == "starting"  # nothing runs until the app starts
    off = serve.build(cli.build_parser().parse_args(["serve", "--max-logprobs", "0", "--max-context", "64"]),
                      one_layer_model(), ByteTokenizer())[0]
    assert off.engine.logprobs == off.limits.max_logprobs == 0
    assert cli.build_parser().parse_args(["warmup", "--max-logprobs", "20"]).max_logprobs == 20


def test_help_does_not_import_jax():
    from test_cli_imports import run_probe

    assert "EXIT 0 HEAVY []" in run_probe("serve", "--help")
