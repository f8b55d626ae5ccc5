"""The ``ds4jax`` command line (`ds4jax.cli.main`) and the tokenizers behind ``generate``.

Every ``generate`` here uses a 6-token prompt and float32 weights of the default architecture, so all of them
share one compiled prefill and one compiled decode step.
"""

from __future__ import annotations

import importlib
import json
import re
import shutil

import jax.numpy as jnp
import pytest

import ds4jax
from ds4jax.io import checkpoint
from ds4jax.cli import main, printable
from ds4jax.commands.generate import STREAM_STEPS
from ds4jax.io import default_model as default_module
from ds4jax.io.default_model import random_config as default_config
from ds4jax.io.default_model import random_model as default_model
from ds4jax.io.default_model import random_tokenizer as default_tokenizer
from ds4jax.io.tokenizer import ByteTokenizer, HFTokenizer, TokenizerError, load_tokenizer

PROMPT = "Hello"  # BOS + 5 bytes


@pytest.fixture(autouse=True)
def no_persistent_cache(monkeypatch):
    """`main` would otherwise turn on JAX's on-disk compilation cache for the rest of the test process."""
    monkeypatch.setenv("DS4JAX_COMPILATION_CACHE", "off")


@pytest.fixture(autouse=True)
def random_default(monkeypatch):
    """These tests check the command's plumbing on the seeded random tiny model (fast to compile); the trained
    default model is tested through the command in test_default_model.py."""
    monkeypatch.setattr(default_module, "default_model", default_model)
    monkeypatch.setattr(default_module, "default_tokenizer", default_tokenizer)
    monkeypatch.setattr(default_module, "default_config", default_config)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


# ---- generate ------------------------------------------------------------------------------------------------

def test_generate_default_is_greedy_generate(capsys):
    code, out, err = run(capsys, "generate", "--prompt", PROMPT, "--max-new-tokens", "12")
    assert code == 0, err
    assert "random weights" in err
    tok = default_tokenizer()
    # the reference with the command's engine settings (one step per call, logits checked): it runs the programs
    # the command compiled (greedy tokens do not depend on them) instead of compiling a second decode program
    ids = ds4jax.generate(default_model(jnp.float32), tok.encode(PROMPT, add_bos=True),
                          ds4jax.SamplingParams(max_new_tokens=12, stop_ids=(tok.eos_id,)),
                          steps_per_call=STREAM_STEPS, check_finite=True)[0]
    assert ids and ids[-1] != tok.eos_id  # the default model does not stop at once (else this test shows little)
    assert out == printable(tok.decode(ids)) + "\n"
    assert out.strip()
    assert run(capsys, "generate", "--prompt", PROMPT, "--max-new-tokens", "12")[1] == out  # deterministic


def test_generate_sampling_depends_on_seed_only(capsys):
    argv = ("generate", "--prompt", PROMPT, "--max-new-tokens", "12", "--temperature", "1.0", "--top-p", "0.95")
    first = run(capsys, *argv, "--seed", "1")
    assert first[0] == 0 and first[:2] == run(capsys, *argv, "--seed", "1")[:2]  # stderr has timings
    assert run(capsys, *argv, "--seed", "2")[1] != first[1]


def test_generate_passes_every_option(capsys, monkeypatch):
    seen = {}

    def fake_generate(model, ids, sampling, *, prefill_chunk=None, **_):
        seen.update(model=model, ids=ids, sampling=sampling, prefill_chunk=prefill_chunk)
        return [[ByteTokenizer.OFFSET + ord("o"), ByteTokenizer.OFFSET + ord("k"), ByteTokenizer.EOS]]

    # the package attribute `ds4jax.generate` is the function; patch the module the CLI imports from
    monkeypatch.setattr(importlib.import_module("ds4jax.generation.generate"), "generate", fake_generate)
    code, out, _ = run(capsys, "generate", "--prompt", "hi", "--max-new-tokens", "7", "--temperature", "0.5",
                       "--top-p", "0.8", "--seed", "3", "--prefill-chunk", "2", "--dtype", "bfloat16")
    assert (code, out) == (0, "ok\n")  # EOS ends the text and is not printed
    s = seen["sampling"]
    assert (s.max_new_tokens, s.temperature, s.top_p, s.seed, s.stop_ids) == (7, 0.5, 0.8, 3, (ByteTokenizer.EOS,))
    assert seen["prefill_chunk"] == 2 and seen["ids"] == [ByteTokenizer.BOS, 107, 108]
    assert seen["model"].params["embed"].dtype == jnp.bfloat16


def write_word_tokenizer(directory, config_style: str) -> dict[str, int]:
    """A word-level tokenizer.json; BOS/EOS declared in tokenizer_config.json (string or dict form)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<s>": 5, "</s>": 6, "<unk>": 7, **{w: 10 + i for i, w in enumerate("one two three four five".split())}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(directory / "tokenizer.json"))
    special = {"dict": {"bos_token": {"content": "<s>"}, "eos_token": {"content": "</s>"}},
               "string": {"bos_token": "<s>", "eos_token": "</s>"}, "none": {}}[config_style]
    (directory / "tokenizer_config.json").write_text(json.dumps(special))
    return vocab


def test_generate_uses_the_checkpoint_tokenizer(tmp_path, capsys):
    """A checkpoint of the default architecture (saved by ds4jax) shipping a tokenizer.json."""
    model = default_model(jnp.float32)
    checkpoint.save(model, tmp_path)
    vocab = write_word_tokenizer(tmp_path, "dict")
    prompt = "one two three four five"  # BOS + 5 words: the same compiled steps as the default model
    code, out, err = run(capsys, "generate", "--checkpoint", str(tmp_path), "--prompt", prompt, "--dtype",
                         "float32", "--max-new-tokens", "12")
    assert code == 0, err
    assert "tokenizer.json" in err
    ids = [vocab["<s>"]] + [vocab[w] for w in prompt.split()]
    new = ds4jax.generate(model, ids, ds4jax.SamplingParams(max_new_tokens=12, stop_ids=(vocab["</s>"],)),
                          steps_per_call=STREAM_STEPS, check_finite=True)[0]  # the command's programs, as above
    tok = load_tokenizer(tmp_path)
    assert out == printable(tok.decode([i for i in new if i != vocab["</s>"]])) + "\n"


# ---- compare and info ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import hf_reference as hr
    from ds4jax.model.config import tiny

    directory = tmp_path_factory.mktemp("cli_hf")
    hr.save_hf_checkpoint(tiny(), directory, seed=4)
    return directory


def test_compare_passes_and_fails_by_tolerance(hf_checkpoint, capsys):
    code, out, _ = run(capsys, "compare", "--checkpoint", str(hf_checkpoint), "--seq-len", "24", "--batch", "1")
    assert code == 0 and "PASS" in out and "layer 2" in out
    code, out, _ = run(capsys, "compare", "--checkpoint", str(hf_checkpoint), "--seq-len", "24", "--batch", "1",
                       "--tol", "1e-12")  # fp32 rounding alone exceeds this
    assert code == 1 and "FAIL" in out


def test_info_of_a_checkpoint(hf_checkpoint, capsys):
    code, out, _ = run(capsys, "info", "--checkpoint", str(hf_checkpoint))
    assert code == 0
    assert "3 layers, hidden 64, vocab 256" in out and "SCH" in out and "HHT" in out


def _count(out: str, label: str) -> int:
    return int(re.search(rf"([\d,]+) {label}", out).group(1).replace(",", ""))


def test_info_flash_matches_published_sizes(capsys):
    """DeepSeek-V4-Flash: 284B total, 13B activated (ours counts embedding and head as active: +1.06B)."""
    code, out, _ = run(capsys, "info", "--preset", "flash")
    assert code == 0
    total = int(re.search(r"parameters\s+([\d,]+)", out).group(1).replace(",", ""))
    assert 284e9 <= total < 285e9
    assert 13e9 <= _count(out, "active per token") < 14e9


def test_info_default_preset(capsys):
    code, out, _ = run(capsys, "info", "--preset", "default")
    assert code == 0 and f"vocab {default_config().vocab_size}" in out


# ---- user errors ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, message", [
    (["generate", "--prompt", "x", "--checkpoint", "/no/such/dir"], "does not exist"),
    (["compare", "--checkpoint", "/no/such/dir"], "does not exist"),
    (["info", "--checkpoint", "/no/such/dir"], "does not exist"),
    (["generate", "--prompt", "x", "--max-new-tokens", "0"], "must be >= 1"),
    (["generate", "--prompt", "x", "--top-p", "0"], "must be in (0, 1]"),
    (["generate", "--prompt", "x", "--temperature", "-1"], "must be >= 0"),
    (["generate", "--prompt", "x", "--dtype", "float16"], "invalid choice"),
    (["compare", "--checkpoint", "x", "--tol", "0"], "must be > 0"),
    (["info"], "one of the arguments"),
    # 1e308 GiB overflowed its conversion to bytes: an internal error (exit 3)
    (["info", "--preset", "flash", "--mesh", "expert=8", "--devices", "8", "--device-memory", "1e308"],
     "must be at most 1048576 GiB"),
    (["generate"], "--prompt"),
    ([], "COMMAND"),
])
def test_user_errors_exit_2_with_a_message(argv, message, capsys):
    code, out, err = run(capsys, *argv)
    assert code == 2 and message in err and "Traceback" not in err


def test_bad_checkpoints_exit_2(tmp_path, capsys):
    code, _, err = run(capsys, "generate", "--prompt", "x", "--checkpoint", str(tmp_path))
    assert code == 2 and "no config.json" in err
    (tmp_path / "config.json").write_text(json.dumps(default_config().to_hf_dict()))
    code, _, err = run(capsys, "generate", "--prompt", "x", "--checkpoint", str(tmp_path))
    assert code == 2 and "safetensors" in err  # the loader names what is missing


def test_checkpoint_without_tokenizer_needs_a_byte_vocabulary(hf_checkpoint, capsys):
    code, _, err = run(capsys, "generate", "--prompt", "x", "--checkpoint", str(hf_checkpoint))
    assert code == 2 and "too small for the byte-level fallback" in err


def test_prompt_outside_the_vocabulary_exits_2(hf_checkpoint, tmp_path, capsys):
    shutil.copytree(hf_checkpoint, tmp_path, dirs_exist_ok=True)
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0, "big": 999}, unk_token="<unk>")).save(str(tmp_path / "tokenizer.json"))
    code, _, err = run(capsys, "generate", "--prompt", "big", "--checkpoint", str(tmp_path), "--dtype", "float32")
    assert code == 2 and "id 999, outside the model's vocabulary (256)" in err


# ---- tokenizers ----------------------------------------------------------------------------------------------

def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "héllo, 世界 \n"
    ids = tok.encode(text, add_bos=True)
    assert ids[0] == tok.bos_id and all(ByteTokenizer.OFFSET <= i < ByteTokenizer.VOCAB_SIZE for i in ids[1:])
    assert tok.decode(ids + [tok.eos_id, tok.pad_id]) == text
    assert tok.decode([ByteTokenizer.OFFSET + 0xFF]) == "\ufffd"  # invalid UTF-8 is replaced, not raised
    assert ByteTokenizer.VOCAB_SIZE <= default_config().vocab_size
    assert (default_config().bos_token_id, default_config().eos_token_id) == (tok.bos_id, tok.eos_id)


@pytest.mark.parametrize("style", ["dict", "string"])
def test_load_tokenizer_reads_specials_from_tokenizer_config(tmp_path, style):
    vocab = write_word_tokenizer(tmp_path, style)
    tok = load_tokenizer(tmp_path)
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_id, tok.eos_id) == (vocab["<s>"], vocab["</s>"])
    assert tok.encode("two five", add_bos=True) == [vocab["<s>"], vocab["two"], vocab["five"]]
    assert tok.decode([vocab["<s>"], vocab["one"], vocab["</s>"]]) == "one"


def test_load_tokenizer_falls_back_to_config_ids(tmp_path):
    write_word_tokenizer(tmp_path, "none")
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 11, "eos_token_id": [12, 13]}))
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id) == (11, 12)


def test_load_tokenizer_without_tokenizer_json(tmp_path):
    tok = load_tokenizer(tmp_path, vocab_size=300)
    assert isinstance(tok, ByteTokenizer) and "no tokenizer.json" in tok.note
    with pytest.raises(TokenizerError, match="too small"):
        load_tokenizer(tmp_path, vocab_size=256)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot read"):
        load_tokenizer(tmp_path)


def test_printable_escapes_control_characters():
    assert printable("a\x1b[31mb\tc\nd\x00") == "a\\x1b[31mb\tc\nd\\x00"
