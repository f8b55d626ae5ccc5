"""Property-based fuzzing of every input surface (hypothesis, CI-sized and deterministic).

Property: each input either works or raises one of our errors (`Ds4jaxError`) — never another exception, a hang
or a crash — and what loads is finite (no silent NaN). Inputs are random mutations of valid ones, so most of
them get past the first checks. ``derandomize=True`` with no example database: the same examples every run.
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import struct
import sys

import hypothesis.strategies as st
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import ds4jax
from bad_inputs import small_config, write_checkpoint
from ds4jax.errors import Ds4jaxError
from ds4jax.io import checkpoint, safetensors_layout

CI = settings(derandomize=True, database=None, deadline=None, print_blob=False, max_examples=50,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                     HealthCheck.data_too_large])

json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.sampled_from([0, 1, -1, 2**31, 2**63]),
                      st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8))
json_value = st.recursive(json_leaf, lambda c: st.one_of(st.lists(c, max_size=4),
                                                         st.dictionaries(st.text(max_size=6), c, max_size=4)),
                          max_leaves=8)


def works_or_ours(fn, *args, **kwargs):
    """fn's result, or None when it raised a `Ds4jaxError`; anything else propagates and fails the test."""
    try:
        return fn(*args, **kwargs)
    except Ds4jaxError as e:
        assert str(e), "an error must say something"
        return None


# ---- config.json ---------------------------------------------------------------------------------------------------

BASE_CONFIG = small_config().to_hf_dict()


@st.composite
def mutated_config(draw):
    d = json.loads(json.dumps(BASE_CONFIG))
    for _ in range(draw(st.integers(1, 3))):
        key = draw(st.sampled_from(sorted(d) + ["compress_ratios", "rope_parameters", "n_layers", "dim"]))
        if draw(st.booleans()) and key in d:
            del d[key]
        else:
            d[key] = draw(json_value)
    return d


@CI
@given(mutated_config())
def test_fuzz_config_dict(d):
    from ds4jax.model.config import from_hf_config

    cfg = works_or_ours(from_hf_config, d)
    if cfg is not None:
        floats = [cfg.rope_theta, cfg.compress_rope_theta, cfg.hc_eps, cfg.rms_norm_eps, cfg.swiglu_limit,
                  cfg.routed_scaling_factor]
        assert all(math.isfinite(x) and x > 0 for x in floats)
        assert 0 <= cfg.eos_token_id < cfg.vocab_size


@CI
@given(st.one_of(st.binary(max_size=64), mutated_config().map(lambda d: json.dumps(d).encode())))
def test_fuzz_config_file(tmp_path_factory, data):
    from ds4jax.model.config import load_config

    d = tmp_path_factory.mktemp("cfg")
    (d / "config.json").write_bytes(data)
    works_or_ours(load_config, d)


# ---- safetensors files, index files --------------------------------------------------------------------------------

# an HF config.json key for each capped field (issue 24: n_routed_experts 2**31 made `info` report 636 trillion
# parameters and `load` build a name plan per expert)
CAPPED_KEYS = {"vocab_size": "vocab_size", "hidden_size": "hidden_size", "num_heads": "num_attention_heads",
               "head_dim": "head_dim", "q_lora_rank": "q_lora_rank", "o_lora_rank": "o_lora_rank",
               "index_num_heads": "index_n_heads", "index_head_dim": "index_head_dim", "index_topk": "index_topk",
               "sliding_window": "sliding_window", "num_routed_experts": "n_routed_experts",
               "num_experts_per_tok": "num_experts_per_tok", "moe_intermediate_size": "moe_intermediate_size",
               "hc_mult": "hc_mult", "hc_sinkhorn_iters": "hc_sinkhorn_iters",
               "max_position_embeddings": "max_position_embeddings", "num_layers": "num_hidden_layers"}


def test_every_capped_field_has_a_config_key():
    from ds4jax.model.config import FIELD_CAPS

    assert set(FIELD_CAPS) - {"csa_ratio", "hca_ratio"} == set(CAPPED_KEYS)  # ratios: compress_rates below


@CI
@given(field=st.sampled_from(sorted(CAPPED_KEYS) + ["csa_ratio", "hca_ratio"]), excess=st.integers(1, 2**64))
def test_fuzz_config_field_above_its_cap(field, excess):
    from ds4jax.errors import ConfigError
    from ds4jax.model.config import FIELD_CAPS, from_hf_config

    d = json.loads(json.dumps(BASE_CONFIG))
    value = FIELD_CAPS[field] + excess
    if field in CAPPED_KEYS:
        d[CAPPED_KEYS[field]] = value
    else:
        d["compress_rates"]["compressed_sparse_attention" if field == "csa_ratio" else
                            "heavily_compressed_attention"] = value
    with pytest.raises(ConfigError, match=rf"Config\.{field}: must be (<= |in \[1, )"):
        from_hf_config(d)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("fuzz_good"))


def _header(path):
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    return raw, n, json.loads(raw[8 : 8 + n])


@st.composite
def safetensors_mutation(draw, names):
    kind = draw(st.sampled_from(["truncate", "length", "dtype", "shape", "offsets", "overlap", "json", "body",
                                 "extra"]))
    name = draw(st.sampled_from(names))
    return kind, name, draw(st.integers(0, 2**64 - 1)), draw(json_value), draw(st.sampled_from(
        ["F32", "BF16", "F16", "I64", "I8", "U8", "F8_E4M3", "F8_E8M0", "BOOL", "F64", "Q4", ""]))


def _mutate(raw: bytes, n: int, header: dict, mutation) -> bytes:
    kind, name, number, value, dtype = mutation
    body = raw[8 + n :]
    entry = header[name]
    if kind == "truncate":
        return raw[: number % len(raw)]
    if kind == "length":
        return struct.pack("<Q", number % (2 * len(raw)) if number % 3 else number) + raw[8:]
    if kind == "dtype":
        entry["dtype"] = dtype
    elif kind == "shape":
        entry["shape"] = value if number % 2 else [int(number % 7)] * (1 + number % 3)
    elif kind == "offsets":
        entry["data_offsets"] = value if number % 2 else [int(number % len(body)), int(number % len(body)) + 4]
    elif kind == "overlap":  # point this tensor at another one's bytes (same size)
        other = next(v for k, v in header.items() if k not in (name, "__metadata__"))
        entry["data_offsets"] = other["data_offsets"]
    elif kind == "json":
        header[name] = value
    elif kind == "body":
        b = bytearray(body)
        b[number % len(b)] = 0xFF  # with a neighbour: a NaN or Inf float
        b[(number + 1) % len(b)] = 0x7F
        body = bytes(b)
    elif kind == "extra":
        header[f"extra.{number % 100}"] = {"dtype": dtype, "shape": [2], "data_offsets": [0, 8]}
    text = json.dumps(header).encode()
    return struct.pack("<Q", len(text)) + text + body


def _names(directory):
    return sorted(k for k in _header(os.path.join(directory, "model.safetensors"))[2] if k != "__metadata__")


def _check_loaded(model):
    if model is not None:
        for leaf in jax.tree.leaves(model.params):
            assert np.isfinite(np.asarray(leaf, np.float32)).all(), "a checkpoint loaded with a silent NaN"


NAMES = sorted(  # the tensor names of the fixture checkpoint (independent of the fixture, for the strategy)
    leaf_name for leaf in safetensors_layout.plan(small_config(), np.float32) for leaf_name in leaf.sources)


@settings(CI, max_examples=60)
@given(safetensors_mutation(NAMES), st.booleans())
def test_fuzz_safetensors(good, tmp_path_factory, mutation, sharded):
    """Through the single-device loader and the sharded one (`mesh=`: each device's block read on its own)."""
    d = tmp_path_factory.mktemp("st")
    shutil.copytree(good, d, dirs_exist_ok=True)
    path = os.path.join(d, "model.safetensors")
    raw, n, header = _header(path)
    if mutation[1] not in header:
        return
    with open(path, "wb") as f:
        f.write(_mutate(raw, n, header, mutation))
    mesh = ds4jax.make_mesh(expert=2, tensor=2) if sharded else None
    _check_loaded(works_or_ours(checkpoint.load, d, np.float32, check_finite=True, mesh=mesh))


@settings(CI, max_examples=30)
@given(st.one_of(json_value, st.fixed_dictionaries({"weight_map": st.dictionaries(
    st.sampled_from(NAMES + ["nope"]), st.sampled_from(["model.safetensors", "other.safetensors", "../x",
                                                         "model.safetensors.index.json", 3]), max_size=4)})))
def test_fuzz_index(good, tmp_path_factory, index):
    d = tmp_path_factory.mktemp("idx")
    shutil.copytree(good, d, dirs_exist_ok=True)
    with open(os.path.join(d, checkpoint.INDEX_FILE), "w") as f:
        json.dump(index, f)
    _check_loaded(works_or_ours(checkpoint.load, d, np.float32))


# ---- tokenizer files -----------------------------------------------------------------------------------------------

def _word_tokenizer_json() -> str:
    from tokenizers import Tokenizer, models

    return Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3}, unk_token="<unk>")).to_str()


TOKENIZER_JSON = _word_tokenizer_json()


@settings(CI, max_examples=40)
@given(which=st.sampled_from(["tokenizer.json", "tokenizer_config.json", "config.json"]),
       content=st.one_of(st.binary(max_size=40), json_value.map(lambda v: json.dumps(v).encode()),
                         st.just(TOKENIZER_JSON[: len(TOKENIZER_JSON) // 2].encode())),
       text=st.text(max_size=12), ids=st.lists(st.integers(0, 15), max_size=6))
def test_fuzz_tokenizer_files(tmp_path_factory, which, content, text, ids):
    from ds4jax.io.tokenizer import load_tokenizer

    d = tmp_path_factory.mktemp("tok")
    (d / "tokenizer.json").write_text(TOKENIZER_JSON)
    (d / which).write_bytes(content)
    tok = works_or_ours(load_tokenizer, d, 16)
    if tok is not None:
        assert all(0 <= i < 16 for i in tok.encode(text, add_bos=True))
        assert isinstance(tok.decode(ids), str)
        assert tok.eos_id is None or 0 <= tok.eos_id < 16


# ---- SamplingParams, generate arguments ----------------------------------------------------------------------------

any_value = st.one_of(json_leaf, st.just(np.int64(3)), st.just(np.float32(0.5)), st.tuples(st.integers(-3, 300)))


@settings(CI, max_examples=150)
@given(st.dictionaries(st.sampled_from(["max_new_tokens", "temperature", "top_p", "seed", "stop_ids"]), any_value))
def test_fuzz_sampling_params(fields):
    from ds4jax.generation.generate import SamplingParams

    p = works_or_ours(SamplingParams, **fields)
    if p is not None:
        assert p.max_new_tokens >= 1 and 0 <= p.temperature < math.inf and 0 < p.top_p <= 1


@settings(CI, max_examples=80)
@given(prompts=st.one_of(st.lists(st.integers(-5, 300), max_size=4), st.lists(st.lists(st.integers(-2, 300),
                         max_size=3), max_size=3), json_value), chunk=st.one_of(st.none(), st.integers(-2, 3), json_leaf),
       speculative=st.one_of(st.integers(-2, 0), json_leaf))
def test_fuzz_generate_arguments(prompts, chunk, speculative):
    """Invalid arguments never reach the device: validation fails first (the model's params are empty)."""
    from ds4jax.generation.generate import SamplingParams, generate
    from ds4jax.model.handle import Model

    hollow = Model(config=small_config(), params={})
    try:
        generate(hollow, prompts, SamplingParams(max_new_tokens=2), prefill_chunk=chunk, speculative=speculative)
    except Ds4jaxError:
        return
    except (KeyError, TypeError, AttributeError):  # got past validation to the (empty) params: must be valid input
        valid_chunk = chunk is None or (isinstance(chunk, int) and chunk >= 1)  # json_leaf's ints reach 2^70
        assert isinstance(prompts, list) and prompts and valid_chunk and speculative in (0, False)


@settings(CI, max_examples=80)
@given(st.one_of(st.lists(st.integers(-(2**40), 2**40), max_size=5), st.lists(st.lists(st.integers(-3, 300),
       min_size=2, max_size=2), max_size=3), json_value, st.lists(st.floats(), max_size=3)))
def test_fuzz_forward_logits_ids(ids):
    import ds4jax
    from ds4jax.model.handle import Model

    hollow = Model(config=small_config(), params={})
    try:
        ds4jax.forward_logits(hollow, ids)
    except Ds4jaxError:
        return
    except (KeyError, TypeError):  # reached the empty params: the ids were valid
        arr = np.asarray(ids)
        assert arr.size and np.issubdtype(arr.dtype, np.integer) and arr.min() >= 0 and arr.max() < 259


# ---- command lines -------------------------------------------------------------------------------------------------

WORDS = ["generate", "compare", "info", "convert", "--prompt", "--prompt-file", "-", "--checkpoint", "--preset",
         "tiny", "flash", "--max-new-tokens", "--temperature", "--top-p", "--seed", "--prefill-chunk", "--dtype",
         "float32", "bfloat16", "--speculative", "--tol", "--seq-len", "--batch", "--quiet", "--no-check-finite",
         "0", "1", "-1", "2.5", "nan", "inf", "1e400", "999999999999999999999", "x", "", "/no/such", "\udcff"]


@pytest.fixture
def no_heavy_work(monkeypatch):
    """The argv fuzz exercises parsing and validation: generation, loading and comparing are faked."""
    import ds4jax.commands.compare
    import ds4jax.generation.generate as gen

    monkeypatch.setenv("DS4JAX_COMPILATION_CACHE", "off")
    monkeypatch.setattr(gen, "generate", lambda *a, **k: [[3 + ord("k")]])
    monkeypatch.setattr("ds4jax.commands.generate.load_model", lambda args: _FakeModel())
    monkeypatch.setattr("ds4jax.compare.run_compare", lambda *a, **k: type("R", (), {"ok": True})())
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"stdin prompt")))


class _FakeModel:
    has_mtp = True


@settings(CI, max_examples=120)
@given(st.lists(st.sampled_from(WORDS), max_size=7))
def test_fuzz_argv(no_heavy_work, capsys, argv):
    from ds4jax import cli

    code = cli.main(argv)
    out, err = capsys.readouterr()
    assert code in (0, 2), (argv, code, err)
    assert "Traceback" not in err and err.count("ds4jax: error:") <= 1
