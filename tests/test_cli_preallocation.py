"""The CLI's short-lived commands grow GPU memory on demand instead of preallocating 75 % of the card (a cost every
new process paid before its first transfer completed); the server keeps JAX's default; a value the user set wins."""

import os

import pytest

from ds4jax import cli

VAR = "XLA_PYTHON_CLIENT_PREALLOCATE"


@pytest.fixture
def unset(monkeypatch):
    monkeypatch.setenv(VAR, "sentinel")  # registers the variable's state to restore after the test
    monkeypatch.delenv(VAR)


@pytest.mark.parametrize("command", cli.NO_PREALLOCATION)
def test_short_commands_skip_preallocation(unset, command):
    cli.skip_preallocation(command)
    assert os.environ[VAR] == "false"


def test_server_keeps_preallocation(unset):
    cli.skip_preallocation("serve")
    assert VAR not in os.environ


def test_user_value_wins(monkeypatch):
    monkeypatch.setenv(VAR, "true")
    cli.skip_preallocation("generate")
    assert os.environ[VAR] == "true"


def test_main_applies_it_before_the_command_runs(unset, tmp_path):
    # a checkpoint that does not exist: the command fails at once, after main() chose the allocation
    assert cli.main(["generate", "--prompt", "x", "--checkpoint", str(tmp_path / "missing"), "-q"]) == cli.BAD_INPUT
    assert os.environ[VAR] == "false"
