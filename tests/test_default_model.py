"""The shipped default model (checkpoints/default): loads from its packed file and from a converted safetensors
copy with identical logits, reproduces its report's held-out loss, speculative greedy == plain greedy for
k = 1..4, and is what ``ds4jax generate`` runs without --checkpoint."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ds4jax
from ds4jax.cli import main, printable
from ds4jax.commands.generate import STREAM_STEPS
from ds4jax.generation.generate import SamplingParams
from ds4jax.io import convert, default_model as dm, packed_params

CKPT = dm.SHIPPED
pytestmark = pytest.mark.skipif(not os.path.exists(os.path.join(CKPT, "config.json")),
                                reason="checkpoints/default is not present")


@pytest.fixture(autouse=True)
def no_persistent_cache(monkeypatch):
    monkeypatch.setenv("DS4JAX_COMPILATION_CACHE", "off")


@pytest.fixture(scope="module")
def model():
    return ds4jax.default_model(jnp.float32)


@pytest.fixture(scope="module")
def report():
    with open(os.path.join(CKPT, "train_report.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def heldout():
    return np.load(os.path.join(CKPT, "heldout_eval.npy")).astype(np.int32)


def test_shipped_checkpoint_is_packed_small_and_documented(report):
    assert packed_params.is_packed(CKPT)  # one read and one transfer at start-up (ds4jax.io.packed_params)
    assert convert.source_format(CKPT) == "packed"
    size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(CKPT) for f in fs)
    assert size <= 16 * 2**20, size
    for name in ("tokenizer.json", "tokenizer_config.json", "corpus_manifest.json", "loss.png", "REPORT.md"):
        assert os.path.exists(os.path.join(CKPT, name)), name
    with open(os.path.join(CKPT, "corpus_manifest.json")) as f:
        manifest = json.load(f)
    assert manifest["files"] and all(len(e["sha256"]) == 64 for e in manifest["files"])
    assert {e["split"] for e in manifest["files"]} == {"train", "heldout"}
    assert report["steps"] > 0 and report["tokens_seen"] > 0


@pytest.fixture(scope="module")
def first_logits(model, heldout):
    """The shipped model's logits on the first 4 held-out windows: the held-out loss test's first batch, and what the
    converted copy's logits must equal (one forward run fewer on this CPU, where a 4 x 512 forward takes seconds)."""
    return ds4jax.forward_logits(model, heldout[:4, :-3])


def test_packed_and_converted_safetensors_give_identical_logits(model, heldout, first_logits, tmp_path):
    convert.convert(CKPT, tmp_path / "st", to="safetensors")
    assert convert.source_format(str(tmp_path / "st")) == "safetensors"
    copy = ds4jax.load(tmp_path / "st", dtype=jnp.float32)
    # committed to the device as the packed load's arrays are (the safetensors load leaves them uncommitted, and jit
    # compiles per committed-ness), on the held-out loss test's windows: the copy's forward then runs the program
    # first_logits compiled, instead of the two small ones this test compiled of its own (the values compared are
    # the same kind: bit-identical logits of both loads)
    copy = ds4jax.Model(copy.config, jax.device_put(copy.params, jax.devices()[0]))
    np.testing.assert_array_equal(np.asarray(ds4jax.forward_logits(copy, heldout[:4, :-3])), np.asarray(first_logits))


def test_the_shipped_unrolled_layout_equals_the_suites_scanned_one(model, heldout, monkeypatch):
    """Users run the default model unrolled (no unit repeats 3 times); the suite scans its (HCA, CSA) x 2 (conftest
    sets DS4JAX_SCAN_MIN_REPEATS=2). Both give the same logits."""
    from ds4jax.model import layer_stack
    from ds4jax.model.handle import Model

    assert layer_stack.is_stacked(model.params)
    assert [s.repeats for s in layer_stack.plan(layer_stack.kinds(model.config))] == [1, 1, 2]  # the suite's
    monkeypatch.delenv("DS4JAX_SCAN_MIN_REPEATS")
    assert [s.repeats for s in layer_stack.plan(layer_stack.kinds(model.config))] == [1] * 6  # what users run
    shipped = Model(model.config, model.params)  # restacked by the library's rule: six single-layer segments
    assert [s.repeats for s in shipped.params["layers"].segments] == [1] * 6
    ids = heldout[:2, :48]
    np.testing.assert_allclose(np.asarray(ds4jax.forward_logits(shipped, ids)),
                               np.asarray(ds4jax.forward_logits(model, ids)), rtol=1e-5, atol=1e-5)


def test_heldout_loss_matches_the_report(model, heldout, first_logits, report):
    """The report's held-out figure is next-token cross-entropy over these windows (computed on the GPU)."""
    x, y = heldout[:, :-3], heldout[:, 1:-2]
    nats = 0.0
    for i in range(0, len(x), 4):
        logits = first_logits if i == 0 else ds4jax.forward_logits(model, x[i:i + 4])
        logp = jax.nn.log_softmax(logits, axis=-1)
        nats += float(-jnp.sum(jnp.take_along_axis(logp, jnp.asarray(y[i:i + 4])[..., None], axis=-1)))
    loss = nats / y.size
    assert loss == pytest.approx(report["heldout"]["loss"], rel=0.01)
    assert loss < 3.0  # a trained model: far below ln(vocab) = 8.3


SPEC_NEW = 20


@pytest.fixture(scope="module")
def prompts(heldout):
    # 4 ragged prompts of <= 32 tokens: every k = 1..4 then runs on the engine sizes notebooks/03 warms up (4 slots,
    # 128-token context, pools for 4 drafts: buckets.draft_bucket), so all four share one prefill program, which the
    # run's shared cache hands to this test (tests/run_cache.py), as it does k = 4's rounds
    return [list(heldout[0, :20]), list(heldout[1, :13]), list(heldout[2, :27]), list(heldout[3, :9])]


@pytest.fixture(scope="module")
def plain_greedy(model, prompts):
    """ds4jax.generate's greedy tokens, one prompt at a time with `ds4jax generate`'s engine settings (one step per
    call, logits checked): these run the programs test_generate_without_checkpoint_runs_the_default_model
    compiles (one slot, 32-token prompt and new-token buckets), where a batch of 4 would compile a plain prefill
    and decode program of its own; greedy tokens depend on neither the batch nor the steps per call."""
    return [ds4jax.generate(model, p, SamplingParams(max_new_tokens=SPEC_NEW), steps_per_call=STREAM_STEPS,
                            check_finite=True)[0] for p in prompts]


@pytest.fixture(scope="module")
def k4_engine(model, prompts):
    """The one-shot engine `ds4jax.speculative_generate(model, prompts, k=4)` builds (`buckets.one_shot`, the sizes
    notebooks/03 warms up), kept for the smaller k as per-request caps: one speculative program serves every k, where
    a `speculative_generate` per k compiled a program of its own for each (~7 CPU s apiece on the CI machine). A
    program with a static k < 4 is tested on the tiny model (tests/test_speculative.py)."""
    from ds4jax.generation import buckets
    from ds4jax.runtime.pool_spec import most_drafts

    cfg = model.config
    shape = buckets.one_shot([len(p) for p in prompts], SPEC_NEW, speculative=4, data=1,
                             max_position_embeddings=cfg.max_position_embeddings, most_drafts=most_drafts(cfg))
    return ds4jax.Engine(model, **shape)


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_speculative_greedy_equals_plain_greedy(model, prompts, plain_greedy, k4_engine, k):
    """k = 4 through `ds4jax.speculative_generate`; k = 1..3 capped per request on that call's engine."""
    if k == 4:
        spec = ds4jax.speculative_generate(model, prompts, SamplingParams(max_new_tokens=SPEC_NEW), k=k)
        tokens, per_round = spec.tokens, spec.mean_tokens_per_round
    else:
        results = k4_engine.generate([ds4jax.Request(prompt=p, max_new_tokens=SPEC_NEW, speculative=k)
                                      for p in prompts])
        assert all(r.ok for r in results), [r.message for r in results]
        assert max(a for r in results for a in r.accepted_per_round) <= k  # the cap holds
        tokens = [r.tokens for r in results]
        per_round = [(len(r.tokens) - 1) / len(r.accepted_per_round) for r in results]
    assert tokens == plain_greedy
    assert np.mean(per_round) > 1.3  # the trained MTP head's drafts are accepted


def test_generate_without_checkpoint_runs_the_default_model(model, capsys):
    prompt = "def "
    code = main(["generate", "--prompt", prompt, "--max-new-tokens", "16"])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "default model" in err
    tok = dm.default_tokenizer()
    # the reference with the command's engine settings (one step per call, logits checked), so it runs the
    # programs the command compiled: greedy tokens do not depend on them, and a second decode program (about
    # 5 CPU seconds) is not compiled for it
    ids = ds4jax.generate(model, tok.encode(prompt, add_bos=True),
                          SamplingParams(max_new_tokens=16, stop_ids=(tok.eos_id,)), steps_per_call=STREAM_STEPS,
                          check_finite=True)[0]
    assert out == printable(tok.decode([i for i in ids if i != tok.eos_id])) + "\n"
