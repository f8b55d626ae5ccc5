"""Fuzzed request bodies through the server's parser (`ds4jax.serving.params.parse`; no engine, no HTTP).

Property: whatever JSON a client sends to ``/v1/completions`` or ``/v1/chat/completions``, `parse` either raises
`APIError` with a 4xx status (OpenAI's error shape, naming the parameter where there is one) or returns
`GenerationParams` the engine can run as they are: every prompt id inside the vocabulary, prompt + max_tokens +
the speculative positions within the context, max_tokens within the cap, n within its limit, finite sampling
values in their ranges, a 63-bit seed. A 5xx or any other exception would be a server bug.
"""

from __future__ import annotations

import math

import hypothesis.strategies as st
from hypothesis import HealthCheck, given, settings

from ds4jax.io.tokenizer import ByteTokenizer
from ds4jax.serving import params
from ds4jax.serving.errors import APIError

CI = settings(derandomize=True, database=None, deadline=None, print_blob=True, max_examples=300,
              suppress_health_check=[HealthCheck.too_slow])
LIMITS = params.Limits(model="m", max_context=64, spec_positions=4, max_tokens_cap=16, default_max_tokens=8,
                       max_n=4, vocab_size=ByteTokenizer.VOCAB_SIZE, max_logprobs=5)

leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                 st.sampled_from([0, 1, -1, 2, 3, 16, 17, 63, 64, 2**31, 2**63 - 1, 2**63, 2**64]),
                 st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, 2.0, 2.5, -0.0]),
                 st.text(max_size=6), st.sampled_from(["m", "", "x" * 80, "\x00", "</think>", "a\ud800", "\udfff"]))
value = st.recursive(leaf, lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=6), c,
                                                                                       max_size=3)), max_leaves=8)
message = st.fixed_dictionaries({"role": st.sampled_from(["user"] * 4 + ["system", "assistant", "tool", "", 3]),
                                 "content": st.one_of(st.text(min_size=1, max_size=20), value)})
prompt = st.one_of(st.text(min_size=1, max_size=70), st.sampled_from(["\ud800", "ab\udc00", ["x", "\ud83d"]]),
                   st.lists(st.integers(0, 258), min_size=1, max_size=70),
                   st.lists(st.integers(-2, 300), max_size=70),
                   st.lists(st.lists(st.integers(-2, 300), max_size=8), max_size=3), st.lists(st.text(max_size=8),
                                                                                              max_size=3), value)
small = st.one_of(st.integers(-2, 20), leaf)
# each supported field: mostly plausible values, sometimes anything
PLAUSIBLE = {
    "model": st.sampled_from(["m", "other"]), "max_tokens": small, "max_completion_tokens": small,
    "temperature": st.one_of(st.floats(-1, 3), leaf), "top_p": st.one_of(st.floats(-0.5, 1.5), leaf),
    "top_k": small, "seed": st.one_of(st.integers(-(2**64), 2**64), leaf), "n": small,
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=6), leaf),
    "stream": st.one_of(st.booleans(), leaf),
    "stream_options": st.one_of(st.fixed_dictionaries({"include_usage": st.one_of(st.booleans(), leaf)}), value),
    "logprobs": st.one_of(st.booleans(), small), "top_logprobs": small,
    "thinking": st.one_of(st.booleans(), st.fixed_dictionaries({"type": st.sampled_from(["enabled", "disabled",
                                                                                          "x"])},
                                                               optional={"budget_tokens": small}), leaf),
    "thinking_budget": small,
    "chat_template_kwargs": st.one_of(st.fixed_dictionaries({"thinking": st.one_of(st.booleans(), leaf)}), value),
}
EXTRA = sorted(params.IGNORED | set(params.NEUTRAL)) + ["bogus"]


@st.composite
def body(draw, is_chat: bool):
    allowed = sorted((params.CHAT_FIELDS if is_chat else params.COMPLETION_FIELDS) - {"messages", "prompt"})
    out = {f: draw(PLAUSIBLE.get(f, value)) for f in draw(st.lists(st.sampled_from(allowed), max_size=6,
                                                                      unique=True))}
    if draw(st.sampled_from([False] * 4 + [True])):  # a neutral, ignored or unknown field, with any value
        out[draw(st.sampled_from(EXTRA))] = draw(value)
    if draw(st.sampled_from([True] * 9 + [False])):  # mostly a prompt, so the checks past it are reached
        if is_chat:
            out["messages"] = draw(st.one_of(st.lists(message, min_size=1, max_size=3), value))
        else:
            out["prompt"] = draw(prompt)
    return draw(value) if draw(st.sampled_from([False] * 19 + [True])) else out


def _check(got: params.GenerationParams, is_chat: bool) -> None:
    assert got.chat is is_chat and got.prompts and all(got.prompts)
    assert all(0 <= t < LIMITS.vocab_size for p in got.prompts for t in p)
    assert 1 <= got.max_tokens <= LIMITS.max_tokens_cap
    assert max(map(len, got.prompts)) + got.max_tokens + LIMITS.spec_positions <= LIMITS.max_context
    assert 1 <= got.n and len(got.prompts) * got.n <= LIMITS.max_n
    assert math.isfinite(got.temperature) and 0 <= got.temperature <= 2 and 0 < got.top_p <= 1
    assert type(got.top_k) is int and got.top_k >= 0
    assert got.seed is None or (type(got.seed) is int and -(2**63) <= got.seed < 2**63)
    assert all(isinstance(s, str) and s for s in got.stop) and len(got.stop) <= params.MAX_STOP_STRINGS
    assert got.logprobs is None or 0 <= got.logprobs <= LIMITS.max_logprobs
    assert got.thinking_budget is None or (got.thinking and got.thinking_budget >= 1)
    assert isinstance(got.stream, bool) and isinstance(got.include_usage, bool)


def _parse(raw, is_chat: bool) -> None:
    try:
        got = params.parse(raw, LIMITS, ByteTokenizer(), is_chat=is_chat)
    except APIError as e:
        assert 400 <= e.status < 500, (e.code, e.status, e.message)
        assert e.body()["error"]["code"] == e.code and e.message
        return
    _check(got, is_chat)


@CI
@given(raw=body(is_chat=False))
def test_fuzzed_completion_bodies(raw):
    _parse(raw, is_chat=False)


@CI
@given(raw=body(is_chat=True))
def test_fuzzed_chat_bodies(raw):
    _parse(raw, is_chat=True)
