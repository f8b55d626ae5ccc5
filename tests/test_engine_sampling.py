"""Per-request sampling and stop strings through a live `Engine`, plain and speculative rows.

Top-k runs on the device inside the engine's programs: with it, every drawn token is one of the k most likely
tokens of the model's logits at its position (the full-sequence forward says which), top_k=1 at any temperature is
greedy, and the draws are not all greedy (sampling did happen). Stop strings end a request at the token that
completes the string (also across tokens, and inside a speculative round that delivers several tokens at once);
its text is cut before the string.
"""

from __future__ import annotations

import chex
import jax.numpy as jnp
import numpy as np
import pytest

import ds4jax
from ds4jax import Request
from ds4jax.io.tokenizer import ByteTokenizer
from small_engine import one_layer_model, small_engine

PROMPT = np.random.default_rng(2).integers(3, 256, 10).tolist()
NEW = 12
HOT = 50.0  # nearly flat: without a working top-k the draws would leave the top k almost always
MODES = {"plain": 0, "speculative": None}


@pytest.fixture(scope="module")
def served():
    model = one_layer_model()
    engine = small_engine(model)
    engine.warmup()
    return model, engine


def greedy(engine, speculative):
    return engine.generate([Request(prompt=PROMPT, max_new_tokens=NEW, speculative=speculative)])[0].tokens


@pytest.mark.parametrize("mode", MODES)
def test_top_k_one_is_greedy_at_any_temperature(served, mode):
    _, engine = served
    want = greedy(engine, MODES[mode])
    got = engine.generate([Request(prompt=PROMPT, max_new_tokens=NEW, temperature=HOT, top_k=1, seed=s,
                                   speculative=MODES[mode]) for s in range(3)])
    assert [r.tokens for r in got] == [want] * 3


@pytest.mark.parametrize("mode", MODES)
def test_top_k_draws_only_the_k_most_likely_tokens(served, mode):
    model, engine = served
    k = 3
    got = engine.generate([Request(prompt=PROMPT, max_new_tokens=NEW, temperature=HOT, top_k=k, seed=s,
                                   speculative=MODES[mode]) for s in range(4)])
    assert all(r.ok for r in got), [r.message for r in got]
    tokens = np.asarray([r.tokens for r in got])  # [4, NEW]
    seqs = np.asarray([PROMPT + r.tokens[:-1] for r in got], np.int32)
    logits = np.asarray(ds4jax.forward_logits(model, jnp.asarray(seqs)))[:, len(PROMPT) - 1:]  # [4, NEW, v]
    top = np.argsort(-logits, axis=-1)[..., :k]
    chex.assert_shape(top, (4, NEW, k))
    inside = (top == tokens[..., None]).any(-1)
    assert inside.all(), f"drawn tokens outside the top {k} at (row, index) {np.argwhere(~inside).tolist()}"
    assert (tokens != top[..., 0]).any(), "every draw was the most likely token: nothing was sampled"


def _first_ascii_pair(text: str) -> str:
    pair = next((text[i: i + 2] for i in range(1, len(text) - 1)
                 if all(c.isprintable() and ord(c) < 128 for c in text[i: i + 2])), None)
    assert pair, f"no two printable ASCII characters in a row in {text!r}: pick another prompt"
    return pair


@pytest.mark.parametrize("mode", MODES)
def test_stop_string_across_tokens_ends_the_request(served, mode):
    _, engine = served
    tok = ByteTokenizer()
    want = greedy(engine, MODES[mode])
    needle = _first_ascii_pair(tok.decode(want))  # two characters: two byte tokens
    cut = next(n for n in range(1, NEW + 1) if needle in tok.decode(want[:n]))
    assert cut < NEW
    stopped, untouched = engine.generate([
        Request(prompt=PROMPT, max_new_tokens=NEW, stop_strings=("never \u2603 here", needle),
                speculative=MODES[mode]),
        Request(prompt=PROMPT, max_new_tokens=NEW, stop_strings=("never \u2603 here",), speculative=MODES[mode])])
    assert (stopped.finish_reason, stopped.error, stopped.tokens) == ("stop", None, want[:cut])
    text = tok.decode(want[:cut])
    assert stopped.text == text[: text.index(needle)]
    assert (untouched.finish_reason, untouched.tokens, untouched.text) == ("length", want, tok.decode(want))
