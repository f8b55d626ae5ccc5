"""``ds4jax serve``'s flags: they build the engine `ds4jax batch` / `warmup` would and the server's limits; the API
key may come from the environment; ``serve --help`` needs no JAX."""

from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("flag, value, says", [
    ("--port", "99999", "must be a TCP port (0 to 65535)"), ("--port", "-1", "must be >= 0"),
    ("--port", "http", "must be an integer"), ("--host", "", "must be a host name or address"),
    ("--host", "local host", "must be a host name or address"), ("--shutdown-grace", "nan", "must be finite"),
    ("--shutdown-grace", "-5", "must be >= 0"),
])
def test_bad_server_flags_exit_2_before_anything_loads(capsys, monkeypatch, flag, value, says):
    """These passed the parser and met their end only at bind time (a port outside 0-65535, an empty host) or at
    SIGTERM (a NaN grace period), after the model's load and warm-up."""
    monkeypatch.setattr(serve, "build", lambda *a, **k: pytest.fail("the server was built"))
    assert cli.main(["serve", flag, value]) == 2
    assert f"argument {flag}: {says}" in capsys.readouterr().err
