"""`ds4jax generate --speculative K` routes to speculative decoding (the loop itself is tested elsewhere)."""

import ds4jax.generation.speculative as speculative
from ds4jax.io.default_model import default_tokenizer
from ds4jax import cli


def test_speculative_option_is_wired(monkeypatch, capsys):
    calls = {}

    def fake(model, ids, sampling, *, k, prefill_chunk, check_finite, on_token, steps_per_call, kv_dtype, lookup):
        calls.update(k=k, ids=ids, max_new=sampling.max_new_tokens, chunk=prefill_chunk, check_finite=check_finite,
                     steps=steps_per_call, kv_dtype=kv_dtype, lookup=lookup)
        on_token(0, default_tokenizer().encode("word")[-1])  # a whole token of ASCII text
        calls["printed_while_running"] = capsys.readouterr().out  # streamed, not printed at the end
        return speculative.SpecResult(tokens=[[104, 105]], accepted_per_round=[[1]], rounds=[1], mean_accepted=[1.0],
                                       mean_tokens_per_round=[2.0], seconds=0.5, tokens_per_second=4.0)

    monkeypatch.setenv("DS4JAX_COMPILATION_CACHE", "off")  # keep JAX's on-disk cache off for this worker
    monkeypatch.setattr(speculative, "speculative_generate", fake)
    code = cli.main(["generate", "--prompt", "Hi", "--max-new-tokens", "2", "--speculative", "3",
                     "--prefill-chunk", "4", "--lookup", "2"])
    out = capsys.readouterr()
    assert code == 0
    assert calls["k"] == 3 and calls["max_new"] == 2 and calls["chunk"] == 4 and len(calls["ids"]) >= 2
    assert calls["check_finite"] is True  # the numerics guard is on by default in the CLI
    assert calls["steps"] == 1  # one round per host call: tokens print as they are accepted
    assert calls["kv_dtype"] == "auto"  # --kv-dtype reaches the speculative path too
    assert calls["lookup"] == 2  # and --lookup
    assert "speculative k=3" in out.err and "mean accepted 1.00" in out.err
    assert calls["printed_while_running"] != "" and (calls["printed_while_running"] + out.out).strip() != ""


def test_speculative_option_rejects_bad_k(monkeypatch):
    monkeypatch.setenv("DS4JAX_COMPILATION_CACHE", "off")
    assert cli.main(["generate", "--prompt", "Hi", "--speculative", "0"]) == 2


def test_lookup_needs_speculative_and_a_small_n(monkeypatch, capsys):
    monkeypatch.setenv("DS4JAX_COMPILATION_CACHE", "off")
    assert cli.main(["generate", "--prompt", "Hi", "--lookup", "3"]) == 2
    assert "--lookup=3" in capsys.readouterr().err
    assert cli.main(["generate", "--prompt", "Hi", "--speculative", "2", "--lookup", "9"]) == 2
    assert "at most 8" in capsys.readouterr().err
