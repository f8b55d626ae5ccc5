"""Failures are failures: NaN/Inf logits end that request with `ErrorCode.NON_FINITE` (the tokens before the bad
one kept), the other requests of the batch finish as they would alone, and `ds4jax batch` writes an error row."""

from __future__ import annotations

import json

from ds4jax import Budget, Request
from ds4jax.generation.requests import ErrorCode
from ds4jax.model.handle import Model
from small_engine import one_layer_model, small_engine

POISON = 77  # an embedding row that overflows layer 0: the logits after this token are NaN/Inf


def poisoned_model() -> Model:
    model = one_layer_model()
    return Model(config=model.config, params=dict(model.params, embed=model.params["embed"].at[POISON].set(3e38)))


def test_nonfinite_logits_fail_only_their_request():
    model = poisoned_model()
    engine = small_engine(model)
    budget = Budget(max_tokens=1, close_ids=(POISON,))  # token 1 is forced to POISON; token 2's logits are bad
    healthy = Request(prompt=[5, 6, 7, 8], max_new_tokens=6, speculative=0)
    alone = engine.generate([healthy])[0]
    bad_plain, bad_spec, fine = engine.generate([
        Request(prompt=[5, 6, 7], max_new_tokens=6, budget=budget, speculative=0),
        Request(prompt=[5, 6, 7], max_new_tokens=6, budget=budget),
        healthy])
    for res in (bad_plain, bad_spec):
        assert not res.ok and res.error is ErrorCode.NON_FINITE and res.finish_reason == "error"
        assert res.nonfinite_at == 2 and len(res.tokens) == 2 and res.tokens[1] == POISON
        assert "NaN/Inf" in res.message and res.to_json()["nonfinite_at"] == 2
        assert res.to_json()["error"] == "non_finite"
    assert fine.ok and fine.tokens == alone.tokens
    assert engine.stats.failed == 2 and not engine._slots  # slots freed


def test_nonfinite_first_token_and_opt_out():
    model = poisoned_model()
    res = small_engine(model).generate([Request(prompt=[5, POISON], max_new_tokens=3)])[0]
    assert res.error is ErrorCode.NON_FINITE and res.tokens == [] and res.nonfinite_at == 0
    engine = small_engine(model)
    engine.check_finite = False  # the old behaviour: keep going, only record where
    res = engine.generate([Request(prompt=[5, POISON], max_new_tokens=3)])[0]
    assert res.ok and res.nonfinite_at == 0 and len(res.tokens) == 3


def test_batch_writes_an_error_row(tmp_path, monkeypatch):
    import argparse

    from ds4jax import batch
    from ds4jax.io.tokenizer import ByteTokenizer

    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "bad", "prompt": [5, POISON]}) + "\n"
                   + json.dumps({"id": "good", "prompt": [5, 6]}) + "\n")
    args = argparse.Namespace(input=str(src), output=str(out), max_new_tokens=3, temperature=0.0, top_p=1.0,
                              top_k=0, seed=0, no_progress=True, checkpoint=None, dtype=None, speculative=1,
                              max_slots=4, max_context=64, prefill_chunk=8, prefill_tokens=None, steps_per_call=4)
    assert batch.run(args, model=poisoned_model(), tokenizer=ByteTokenizer()) == 0
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert rows["bad"]["error"] == "non_finite" and rows["bad"]["finish_reason"] == "error"
    assert rows["bad"]["nonfinite_at"] == 0 and rows["good"]["error"] is None
