"""OpenAI's ``logprobs`` objects from the engine's `TokenLogprob`s (docs/serving.md, "Log-probabilities").

The values are the raw model distribution's (log_softmax of the logits, before temperature / top-p / top-k), as
vLLM reports by default; every generated token has one (reasoning, ``</think>`` and the end-of-sequence token
included, as `usage.completion_tokens` counts them). A token's text is its own bytes decoded with replacement
(a byte-level token may hold part of a character; chat's ``bytes`` field carries them exactly). JSON has no
-inf: log-probabilities below -9999 (or NaN) are sent as -9999.0, as vLLM does.
"""

from __future__ import annotations

import functools

FLOOR = -9999.0


def _value(lp: float) -> float:
    return lp if lp > FLOOR else FLOOR  # NaN compares False: the floor too


class TokenText:
    """Each token id's (text, bytes), cached: a stream asks for the same ids over and over."""

    def __init__(self, tokenizer):
        self._bytes = tokenizer.token_bytes

    @functools.lru_cache(maxsize=1 << 16)
    def __call__(self, token: int) -> tuple[str, list[int]]:
        data = self._bytes(token)
        return data.decode("utf-8", errors="replace"), list(data)


def completion(entries, texts: TokenText) -> dict:
    """The completions shape for entries of (token id, TokenLogprob, text offset): ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (per token a {text: logprob} of the alternatives and the sampled token itself, so up to
    logprobs + 1 keys, as OpenAI documents) and ``text_offset`` (into this choice's text)."""
    tokens, values, tops, offsets = [], [], [], []
    for token, lp, offset in entries:
        text = texts(token)[0]
        tokens.append(text)
        values.append(_value(lp.logprob))
        top = {texts(t)[0]: _value(v) for t, v in lp.top}
        top.setdefault(text, _value(lp.logprob))
        tops.append(top)
        offsets.append(offset)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


def chat(entries, texts: TokenText) -> dict:
    """The chat shape: ``content`` = [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]."""

    def item(token: int, value: float) -> dict:
        text, data = texts(token)
        return {"token": text, "logprob": _value(value), "bytes": data}

    content = [{**item(token, lp.logprob), "top_logprobs": [item(t, v) for t, v in lp.top]}
               for token, lp, _ in entries]
    return {"content": content, "refusal": None}
