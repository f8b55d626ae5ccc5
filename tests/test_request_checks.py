"""Field checks of generation requests: every malformed field is named; fuzzed fields never raise."""

from __future__ import annotations

import math
import types

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from ds4jax.generation.request_checks import check_request, request_problem
from ds4jax.errors import ArgumentError

FIELDS = dict(prompt=[1, 2, 3], max_new_tokens=4, temperature=0.0, top_k=0, top_p=1.0, seed=0, stop_ids=(),
              stop_strings=(), speculative=None, on_token=None, budget=None, snapshot=False, snapshot_at=())


def request(**changes):
    return types.SimpleNamespace(**{**FIELDS, **changes})


def test_valid_requests_pass():
    check_request(request())
    check_request(request(prompt="text", temperature=0.7, top_p=0.5, top_k=3, seed=-5, stop_ids=(1, np.int32(2)),
                          stop_strings=("\n\n",), speculative=2, on_token=print, snapshot_at=(1, 2),
                          budget=types.SimpleNamespace(max_tokens=3, close_ids=(5,), open_ids=())))
    check_request(request(prompt=np.array([3, 4], np.int64)))


@pytest.mark.parametrize("field, value, says", [
    ("prompt", [1.5, 2], "Request.prompt[0]=1.5"),
    ("prompt", [1, -1], "Request.prompt[1]=-1"),
    ("prompt", np.zeros((2, 2), np.int32), "1-D"),
    ("prompt", 7, "sequence of token ids"),
    ("max_new_tokens", 0, "Request.max_new_tokens=0"),
    ("temperature", "hot", "finite number"),
    ("temperature", math.nan, "finite number"),
    ("temperature", -0.5, ">= 0"),
    ("top_p", 0, "(0, 1]"),
    ("top_p", None, "finite number"),
    ("top_k", -1, "Request.top_k=-1"),
    ("seed", 2**64, "Request.seed"),
    ("seed", -(2**63) - 1, "Request.seed"),
    ("stop_ids", 3, "sequence of token ids"),
    ("stop_ids", ("a",), "Request.stop_ids[0]='a'"),
    ("stop_strings", "stop", "non-empty strings"),
    ("stop_strings", ("",), "non-empty strings"),
    ("speculative", 1.0, "Request.speculative=1.0"),
    ("on_token", 3, "callable"),
    ("snapshot_at", (0,), "Request.snapshot_at[0]=0"),
    ("budget", types.SimpleNamespace(max_tokens=0, close_ids=(1,), open_ids=()), "budget.max_tokens"),
])
def test_malformed_fields_are_named(field, value, says):
    with pytest.raises(ArgumentError) as e:
        check_request(request(**{field: value}))
    assert says in str(e.value)
    assert says in request_problem(request(**{field: value}))


value = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(), st.text(max_size=4),
                  st.lists(st.one_of(st.integers(-3, 10), st.floats(), st.text(max_size=2)), max_size=3),
                  st.just(np.int64(2)), st.just(np.array([[1]])))


@settings(derandomize=True, database=None, deadline=None, max_examples=200)
@given(st.dictionaries(st.sampled_from(sorted(FIELDS)), value))
def test_fuzz_request_fields(changes):
    """Any field values: a message or None, never an exception; None only for well-formed values."""
    problem = request_problem(request(**changes))
    if problem is None:
        r = request(**changes)
        assert isinstance(r.max_new_tokens, (int, np.integer)) and r.max_new_tokens >= 1
        assert 0 <= r.temperature < math.inf and 0 < r.top_p <= 1


def test_a_text_prompt_no_tokenizer_can_encode_is_that_request_s_error():
    """A lone surrogate (a JSON "\\ud800" escape, e.g. in a `ds4jax batch` line) made the byte-level tokenizer
    raise UnicodeEncodeError inside the engine; now the request is rejected as invalid, naming the character."""
    from ds4jax.generation.request_checks import Rejected, tokenize
    from ds4jax.generation.requests import ErrorCode
    from ds4jax.io.tokenizer import ByteTokenizer

    assert tokenize("ok", ByteTokenizer())[-2:] == [ord("o") + 3, ord("k") + 3]  # after BOS
    with pytest.raises(Rejected, match="prompt: not valid Unicode \\(a lone surrogate at character 2\\)") as e:
        tokenize("ok\ud800", ByteTokenizer())
    assert e.value.code is ErrorCode.INVALID_REQUEST
