"""The ``ds4jax`` command as a command-line tool: exit statuses, one-line errors, --debug, --quiet, prompt input,
streaming output, help text. Generation itself is faked here (it is tested in test_cli.py)."""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys

import pytest

from bad_inputs import numpy_params, small_config, write_checkpoint
from ds4jax import cli
from ds4jax.errors import NonFiniteError
from ds4jax.io.tokenizer import ByteTokenizer

OFF = ByteTokenizer.OFFSET


@pytest.fixture(autouse=True)
def no_persistent_cache(monkeypatch):
    monkeypatch.setenv("DS4JAX_COMPILATION_CACHE", "off")


@pytest.fixture(autouse=True)
def random_default(monkeypatch):
    """The byte-level tokenizer of the random tiny model makes the expected output obvious."""
    from ds4jax.io import default_model as module

    monkeypatch.setattr(module, "default_tokenizer", module.random_tokenizer)
    monkeypatch.setattr(module, "default_config", module.random_config)


@pytest.fixture
def fake_generate(monkeypatch):
    """Replace generation: streams 'ok' then EOS through on_token; records what it was given."""
    import ds4jax.generation.generate as gen

    seen = {}

    def fake(model, ids, sampling, *, prefill_chunk=None, check_finite=False, on_token=None, **_):
        seen.update(ids=ids, check_finite=check_finite, sampling=sampling)
        tokens = [OFF + ord("o"), OFF + ord("k"), ByteTokenizer.EOS]
        for i, t in enumerate(tokens):
            if on_token:
                on_token(0, t)
            if i == 0:
                seen["printed_after_first"] = sys.stdout.getvalue() if isinstance(sys.stdout, io.StringIO) else None
        return [tokens]

    monkeypatch.setattr(gen, "generate", fake)
    monkeypatch.setattr("ds4jax.io.default_model.default_model", lambda dtype=None: object())
    return seen


def run(capsys, *argv):
    code = cli.main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_version(capsys):
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith("ds4jax ")


def test_python_dash_m():
    out = subprocess.run([sys.executable, "-m", "ds4jax", "--version"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("ds4jax "), out.stderr


def test_every_option_has_help():
    parser = cli.build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, sub in subparsers.choices.items():
        for action in sub._actions:
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"


def test_prompt_sources(fake_generate, capsys, tmp_path, monkeypatch):
    (tmp_path / "p.txt").write_text("hé", encoding="utf-8")
    code, out, err = run(capsys, "generate", "--prompt-file", str(tmp_path / "p.txt"))
    assert (code, out) == (0, "ok\n") and fake_generate["ids"] == [0] + [b + OFF for b in "hé".encode()]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"from stdin")))
    code, out, _ = run(capsys, "generate", "--prompt-file", "-")
    assert code == 0 and fake_generate["ids"][1:] == [b + OFF for b in b"from stdin"]
    code, _, err = run(capsys, "generate", "--prompt", "a", "--prompt-file", "-")
    assert code == 2 and "not allowed with" in err


@pytest.mark.parametrize("how", ["file", "stdin", "argv"])
def test_invalid_utf8_prompt_exits_2(fake_generate, capsys, tmp_path, monkeypatch, how):
    (tmp_path / "bad.txt").write_bytes(b"ab\xffc")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"ab\xffc")))
    argv = {"file": ["--prompt-file", str(tmp_path / "bad.txt")], "stdin": ["--prompt-file", "-"],
            "argv": ["--prompt", os.fsdecode(b"ab\xffc")]}[how]
    code, _, err = run(capsys, "generate", *argv)
    assert code == 2 and "not valid UTF-8" in err and "Traceback" not in err and err.count("\n") == 1


def test_tokens_stream_and_progress(fake_generate, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert cli.main(["generate", "--prompt", "x"]) == 0
    assert fake_generate["printed_after_first"] == "o"  # printed before generation returned
    assert sys.stdout.getvalue() == "ok\n" and fake_generate["check_finite"] is True
    err = capsys.readouterr().err
    assert "loading" in err and "generating" in err and "tokens/s" in err


def test_quiet(fake_generate, capsys):
    code, out, err = run(capsys, "generate", "--prompt", "x", "--quiet")
    assert (code, out, err) == (0, "ok\n", "")
    assert run(capsys, "--quiet", "generate", "--prompt", "x")[2] == ""
    assert run(capsys, "generate", "--prompt", "x", "--no-check-finite", "-q")[0] == 0
    assert fake_generate["check_finite"] is False


@pytest.mark.parametrize("exc, status, says", [
    (RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123456789 bytes."), 3,
     "out of memory: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 123456789 bytes. (context 34 tokens)"),
    (MemoryError(), 3, "out of memory"),
    (ZeroDivisionError("boom"), 3, "internal error (ZeroDivisionError: boom); rerun with --debug"),
    (NonFiniteError("NaN/Inf values first appear here", name="layer 1"), 3, "layer 1: NaN/Inf"),
    (KeyboardInterrupt(), 130, "interrupted"),
])
def test_failures_are_one_line_with_a_status(monkeypatch, capsys, exc, status, says):
    import ds4jax.generation.generate as gen

    def boom(*a, **k):
        raise exc

    monkeypatch.setattr(gen, "generate", boom)
    monkeypatch.setattr("ds4jax.io.default_model.default_model", lambda dtype=None: object())
    code, _, err = run(capsys, "generate", "--prompt", "x", "-q")
    assert code == status and says in err and err.count("\n") == 1 and "Traceback" not in err
    if not isinstance(exc, KeyboardInterrupt):
        with pytest.raises(type(exc)):
            cli.main(["generate", "--prompt", "x", "-q", "--debug"])


def test_speculative_too_large_fails_before_loading(monkeypatch, capsys):
    def no_load(args):
        raise AssertionError("the weights must not be loaded for an impossible --speculative")

    monkeypatch.setattr("ds4jax.commands.generate.load_model", no_load)
    code, _, err = run(capsys, "generate", "--prompt", "x", "--speculative", "100")
    assert code == 2 and "--speculative=100: too many drafts" in err and "PoolSpec" in err
    assert err.count("\n") == 2  # the tokenizer note, then the error


# ---- bad files through the command ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("cli_ckpt"))


def _bad_config(tmp_path, text):
    (tmp_path / "config.json").write_text(text)
    return str(tmp_path)


@pytest.mark.parametrize("command", ["info", "generate", "compare"])
@pytest.mark.parametrize("text, says", [("{oops", "is not valid JSON: "),
                                        ('{"model_type": "deepseek_v4"}', "required field is missing")])
def test_bad_config_json_exits_2(tmp_path, capsys, command, text, says):
    if command == "compare":
        pytest.importorskip("transformers")
    argv = [command, "--checkpoint", _bad_config(tmp_path, text)] + (["--prompt", "x"] if command == "generate" else [])
    code, _, err = run(capsys, *argv)
    assert code == 2 and says in err and "config.json" in err and "Traceback" not in err


def test_nan_weights_exit_2_naming_the_tensor(tmp_path, capsys):
    params = numpy_params(small_config())
    params["layers"][0]["ffn"]["shared"]["w2"][0, 0] = float("inf")
    d = write_checkpoint(tmp_path, small_config(), params)
    code, out, err = run(capsys, "generate", "--prompt", "x", "--checkpoint", d, "--dtype", "float32")
    assert code == 2 and "layers.0.ffn.shared_experts.w2.weight" in err and "non-finite" in err and out == ""


def test_compare_unreadable_checkpoint_is_2_not_1(ckpt, tmp_path, capsys):
    pytest.importorskip("transformers")
    from safetensors.numpy import load_file, save_file
    import shutil

    shutil.copytree(ckpt, tmp_path, dirs_exist_ok=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["layers.1.attn.wkv.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    code, _, err = run(capsys, "compare", "--checkpoint", str(tmp_path))
    assert code == 2 and "missing tensor layers.1.attn.wkv.weight" in err
    tensors["layers.1.attn.wkv.weight"] = load_file(os.path.join(ckpt, "model.safetensors"))[
        "layers.1.attn.wkv.weight"][:, :-1]
    save_file(tensors, tmp_path / "model.safetensors")
    code, _, err = run(capsys, "compare", "--checkpoint", str(tmp_path))
    assert code == 2 and "layers.1.attn.wkv.weight" in err and "wrong shape" in err


# ---- bounded inputs: configs, metadata files, memory (issue 24) ----------------------------------------------------

def _config_with(tmp_path, **changes) -> str:
    d = small_config().to_hf_dict()
    d.update(changes)
    (tmp_path / "config.json").write_text(json.dumps(d))
    return str(tmp_path)


@pytest.mark.parametrize("key, field", [("n_routed_experts", "num_routed_experts"),
                                        ("sliding_window", "sliding_window"), ("vocab_size", "vocab_size"),
                                        ("hidden_size", "hidden_size"), ("num_attention_heads", "num_heads")])
def test_info_refuses_a_huge_config_naming_the_field(tmp_path, capsys, key, field):
    code, out, err = run(capsys, "info", "--checkpoint", _config_with(tmp_path, **{key: 2**31}))
    assert code == 2 and f"Config.{field}: must be <= " in err and "2,147,483,648" in err and out == "", err


def test_info_refuses_a_config_whose_fields_multiply_past_the_parameter_cap(tmp_path, capsys):
    layers = 1000
    d = dict(num_hidden_layers=layers, layer_types=["sliding_attention"] * layers, mlp_layer_types=["moe"] * layers,
             n_routed_experts=8000, moe_intermediate_size=100_000, hidden_size=4096)
    code, _, err = run(capsys, "info", "--checkpoint", _config_with(tmp_path, **d))
    assert code == 2 and "parameters, more than the" in err and "routed experts" in err, err


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "tokenizer_config.json"])
def test_metadata_linked_to_dev_zero_is_refused(ckpt, tmp_path, capsys, name):
    import shutil

    shutil.copytree(ckpt, tmp_path, dirs_exist_ok=True)
    if name != "config.json":  # a real tokenizer.json, so that tokenizer_config.json is read too
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        shutil.copy(os.path.join(root, "checkpoints", "default", "tokenizer.json"), tmp_path / "tokenizer.json")
    if (tmp_path / name).exists():
        os.remove(tmp_path / name)
    os.symlink("/dev/zero", tmp_path / name)
    code, _, err = run(capsys, "generate", "--prompt", "x", "--checkpoint", str(tmp_path), "-q")
    assert code == 2 and "is a link to /dev/zero, a character device, not a regular file" in err, err


def test_shards_may_link_outside_the_checkpoint_but_must_be_regular_files(ckpt, tmp_path):
    from ds4jax.errors import CheckpointError
    from ds4jax.io import checkpoint

    for f in os.listdir(ckpt):  # a Hugging Face cache layout: every file a link into a blob store elsewhere
        os.symlink(os.path.join(ckpt, f), tmp_path / f)
    assert checkpoint.load(str(tmp_path)).config == small_config()
    os.remove(tmp_path / "model.safetensors")
    os.symlink("/dev/zero", tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="model.safetensors: is a link to /dev/zero"):
        checkpoint.load(str(tmp_path))


def test_orbax_metadata_linked_to_dev_zero_is_refused(tmp_path):
    from ds4jax.errors import CheckpointError
    from ds4jax.io import orbax_checkpoint

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    os.makedirs(tmp_path / "params")
    os.symlink(os.path.join(root, "checkpoints", "default", "config.json"), tmp_path / "config.json")
    os.symlink("/dev/zero", tmp_path / "params" / "_METADATA")
    with pytest.raises(CheckpointError, match="_METADATA: is a link to /dev/zero"):
        orbax_checkpoint.stored_metadata(str(tmp_path))


def test_a_file_over_its_cap_is_refused_unread(tmp_path):
    from ds4jax.bounded_read import read_bytes
    from ds4jax.errors import ConfigError

    (tmp_path / "config.json").write_text(json.dumps(small_config().to_hf_dict()))
    with pytest.raises(ConfigError, match="bytes, more than the 100 this file may have"):
        read_bytes(str(tmp_path / "config.json"), ConfigError, cap=100)


@pytest.mark.parametrize("free, says", [
    ([1000], "out of memory before allocating the weights ("),
    ([1 << 40, 1000], "out of memory before allocating the KV pools (1 slots x max_context"),  # the weights fit
])
def test_out_of_memory_names_what_was_being_allocated(ckpt, capsys, monkeypatch, free, says):
    from ds4jax.runtime import memory

    answers = iter(free)
    monkeypatch.setattr(memory, "free_bytes", lambda device: next(answers, free[-1]))
    code, _, err = run(capsys, "generate", "--prompt", "x", "--checkpoint", ckpt, "--dtype", "float32", "-q")
    assert code == 3 and says in err and "--max-new-tokens" not in err, err
