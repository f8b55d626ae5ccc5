"""Every bad input gets a clear error (issue 15): one test per reported example, and the surfaces around them.

Validation runs before anything is traced, so most of these use a `Model` whose params are empty: a test that
reached the device would fail on them."""

from __future__ import annotations

import math
import os

import jax.numpy as jnp
import numpy as np
import pytest

import ds4jax
from bad_inputs import numpy_params, small_config, write_checkpoint, write_json
from ds4jax.errors import ArgumentError, CheckpointError, ConfigError, TokenizerError
from ds4jax.generation.generate import SamplingParams, generate
from ds4jax.io import checkpoint
from ds4jax.io.tokenizer import load_tokenizer
from ds4jax.model.config import load_config
from ds4jax.model.handle import Model

CFG = small_config()
HOLLOW = Model(config=CFG, params={})  # validation must fail before the params are touched


# ---- SamplingParams ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("field, value, says", [
    ("temperature", -1.0, "must be >= 0"),  # ran greedy before
    ("temperature", math.nan, "finite"),
    ("temperature", math.inf, "finite"),
    ("top_p", 0.0, "(0, 1]"),  # returned BOS over and over before
    ("top_p", 1.5, "(0, 1]"),  # ran before
    ("top_p", -0.1, "(0, 1]"),
    ("max_new_tokens", 0, "[1, inf]"),
    ("max_new_tokens", True, "integer"),
    ("max_new_tokens", 2.0, "integer"),
    ("seed", 2**64, "[-9223372036854775808"),
    ("seed", "1", "integer"),
    ("stop_ids", (-1,), "stop_ids[0]"),
    ("stop_ids", 5, "tuple"),
])
def test_sampling_params_reject(field, value, says):
    with pytest.raises(ArgumentError) as e:
        SamplingParams(**{field: value})
    assert f"SamplingParams.{field}" in str(e.value) and says in str(e.value)


def test_sampling_params_accept_edges():
    SamplingParams(temperature=0, top_p=1, max_new_tokens=1, seed=-(2**63), stop_ids=(0, np.int64(3)))
    SamplingParams(top_p=1e-9, temperature=1e-9)


def test_sampling_params_hold_python_numbers():
    """numpy fields become Python numbers: numpy's fixed-width arithmetic wrapped np.uint64(2**64 - 1) new tokens
    around to a small count where the prompt's room was checked."""
    p = SamplingParams(max_new_tokens=np.uint64(2**64 - 1), seed=np.int64(3), top_k=np.int32(2),
                       temperature=np.float32(0.5), top_p=np.float64(0.9), stop_ids=[np.int32(4)])
    assert [type(v) for v in (p.max_new_tokens, p.seed, p.top_k, p.temperature, p.top_p)] == [int] * 3 + [float] * 2
    assert p.stop_ids == (4,) and type(p.stop_ids[0]) is int
    with pytest.raises(ArgumentError, match="exceed max_position_embeddings"):
        generate(HOLLOW, [1, 2], p)


# ---- generate / forward_logits -------------------------------------------------------------------------------------

@pytest.mark.parametrize("prompts, kwargs, says", [
    ([1, 2, 3], dict(prefill_chunk=0), "prefill_chunk=0"),  # ran as one chunk before
    ([1, 2, 3], dict(prefill_chunk=-2), "prefill_chunk=-2"),
    ([1, CFG.vocab_size], {}, f"token id {CFG.vocab_size} at position [1]"),
    ([[1, 2], [3, -1]], {}, "prompt_ids[1]"),
    ([], {}, "empty"),
    ([[1], []], {}, "empty"),
    ([1.0, 2.0], {}, "integer token ids"),
    ("hello", {}, "must be a list of token ids"),
    ({"a": 1}, {}, "must be a list of token ids"),
    ([1, 2], dict(speculative=-1), "speculative=-1"),
    ([1] * (CFG.max_position_embeddings - 3), {}, "max_position_embeddings"),
])
def test_generate_rejects_before_running(prompts, kwargs, says):
    with pytest.raises(ArgumentError) as e:
        generate(HOLLOW, prompts, SamplingParams(max_new_tokens=4), **kwargs)
    assert says in str(e.value)


def test_generate_rejects_stop_ids_outside_the_vocabulary():
    with pytest.raises(ArgumentError, match=r"stop_ids\[1\]"):
        generate(HOLLOW, [1, 2], SamplingParams(stop_ids=(1, CFG.vocab_size)))


@pytest.mark.parametrize("ids, says", [
    ([[1, CFG.vocab_size + 5]], f"token id {CFG.vocab_size + 5} at position [0, 1]"),  # finite logits before
    ([-1, 2], "token id -1 at position [0]"),
    (np.array([1.0, 2.0]), "cast to int32"),
    (np.zeros((0,), np.int32), "empty"),
    (np.zeros((1, 2, 3), np.int32), "[tokens] or [batch, tokens]"),
    ([[1, 2], [3]], "array of token ids"),
])
def test_forward_logits_rejects_bad_ids(ids, says):
    with pytest.raises(ArgumentError) as e:
        ds4jax.forward_logits(HOLLOW, ids)
    assert "token_ids" in str(e.value) and says in str(e.value)


@pytest.mark.parametrize("dtype", [jnp.int32, "int8", np.bool_, "not-a-dtype"])
def test_load_rejects_a_non_float_dtype_before_reading(dtype, tmp_path):
    with pytest.raises(ArgumentError, match="dtype=") as e:  # blamed the checkpoint's dtype before
        checkpoint.load(tmp_path / "nothing-here", dtype=dtype)
    assert "checkpoint" not in str(e.value).split(":")[0]


# ---- config.json ---------------------------------------------------------------------------------------------------

def test_config_not_json_names_the_file_and_line(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 259,\n  "hidden_size": }')
    with pytest.raises(ConfigError) as e:
        load_config(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value) and "line 2" in str(e.value)


def test_config_missing_or_mistyped_field_is_named(tmp_path):
    d = CFG.to_hf_dict()
    del d["q_lora_rank"]
    write_json(tmp_path / "config.json", d)
    with pytest.raises(ConfigError, match="q_lora_rank: required field is missing"):
        load_config(tmp_path)
    write_json(tmp_path / "config.json", {**CFG.to_hf_dict(), "hidden_size": "64"})
    with pytest.raises(ConfigError, match="hidden_size='64': must be an integer"):
        load_config(tmp_path)
    write_json(tmp_path / "config.json", [1, 2])
    with pytest.raises(ConfigError, match="must be a JSON object"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_bytes(b'{"a": "\xff"}')
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(tmp_path)


@pytest.mark.parametrize("field, value", [("rope_theta", math.inf), ("hc_eps", math.nan),
                                          ("num_hidden_layers", 10**9), ("eos_token_id", 10**6),
                                          ("rope_scaling", [1, 2]), ("compress_rates", "x")])
def test_from_hf_config_rejects(field, value):
    with pytest.raises(ConfigError):
        ds4jax.from_hf_config({**CFG.to_hf_dict(), field: value})


# ---- checkpoints ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def good_ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("good"))


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst, dirs_exist_ok=True)
    return str(dst)


@pytest.mark.parametrize("content, says", [
    ("{not json", "is not valid JSON"),
    ('{"weight_map": [1]}', 'weight_map'),
    ('{"weight_map": {"embed.weight": "../../etc/passwd"}}', "must name a .safetensors file"),
    ('{"weight_map": {"embed.weight": 3}}', "must name a .safetensors file"),
])
def test_broken_index_is_a_checkpoint_error(good_ckpt, tmp_path, content, says):
    d = _copy(good_ckpt, tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(content)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(d, jnp.float32)
    assert "model.safetensors.index.json" in str(e.value) and says in str(e.value)


def test_nan_weight_is_named_with_check_finite(tmp_path):
    params = numpy_params(CFG)
    params["layers"][1]["attn"]["wq_a"][3, 5] = np.nan
    d = write_checkpoint(tmp_path, CFG, params)
    with pytest.raises(CheckpointError) as e:
        checkpoint.load(d, jnp.float32, check_finite=True)
    assert "layers.1.attn.wq_a.weight" in str(e.value) and "non-finite value nan" in str(e.value)
    checkpoint.load(d, jnp.float32)  # off by default: the Python API does not pay for the pass


def test_wrong_dtype_and_shape_are_named(good_ckpt, tmp_path):
    from safetensors.numpy import load_file, save_file

    d = _copy(good_ckpt, tmp_path)
    tensors = load_file(os.path.join(d, "model.safetensors"))
    tensors["norm.weight"] = tensors["norm.weight"][:-1]
    save_file(tensors, os.path.join(d, "model.safetensors"))
    with pytest.raises(CheckpointError, match="tensor norm.weight in model.safetensors: wrong shape"):
        checkpoint.load(d, jnp.float32)


# ---- tokenizers ----------------------------------------------------------------------------------------------------

def _word_tokenizer(directory):
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3}, unk_token="<unk>")).save(
        str(directory / "tokenizer.json"))


@pytest.mark.parametrize("name, content, says", [
    ("tokenizer_config.json", "{broken", "is not valid JSON"),  # a traceback before
    ("tokenizer_config.json", "[1]", "must be a JSON object"),
    ("tokenizer.json", "{}", "cannot read"),
    ("config.json", '{"eos_token_id": "x"}', "eos_token_id='x'"),
])
def test_broken_tokenizer_files(tmp_path, name, content, says):
    _word_tokenizer(tmp_path)
    (tmp_path / name).write_text(content)
    with pytest.raises(TokenizerError) as e:
        load_tokenizer(tmp_path, 16)
    assert name in str(e.value) and says in str(e.value)


def test_save_validates_before_writing(tmp_path):
    params = numpy_params(CFG)
    params["layers"][0]["attn"]["wq_a"] = params["layers"][0]["attn"]["wq_a"][:, :-1]
    with pytest.raises(ArgumentError, match=r"params\['layers'\]\[0\]\['attn'\]\['wq_a'\]: has shape"):
        ds4jax.save(Model(config=CFG, params=params), tmp_path / "out")
    assert not (tmp_path / "out").exists()  # nothing written
    del params["layers"][0]["attn"]["wq_a"]
    with pytest.raises(ArgumentError, match="is missing"):
        ds4jax.save(Model(config=CFG, params=params), tmp_path / "out")
