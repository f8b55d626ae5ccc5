"""An engine without JAX for the serving tests that need only its surface (`Driver`: warmup, iterations, tspec,
stats): every request gets the tokens of "abc...", one per iteration of `delay_s`. Built in an engine process in
about a second, where the real one compiles for tens of seconds; module-level, so that an engine process can be
given it (ds4jax/serving/engine_process.py pickles the builder)."""

from __future__ import annotations

import time
import types

from ds4jax.generation.requests import ErrorCode, FinishReason, GenerateResult, TokenEvent
from ds4jax.io.tokenizer import ByteTokenizer

TEXT = b"abcdefghijklmnopqrstuvwxyz"


class FakeEngine:
    def __init__(self, max_slots: int = 2, delay_s: float = 0.01):
        self.delay_s = delay_s
        self.tspec = types.SimpleNamespace(max_slots=max_slots, max_context=64)
        self.cfg = types.SimpleNamespace(vocab_size=ByteTokenizer.VOCAB_SIZE)
        self.k, self.logprobs, self.steps_per_call = 0, 0, 1
        self.tokenizer = ByteTokenizer()
        self.stats = types.SimpleNamespace(compiles_after_warmup=0, spec_rounds=0, lookup_drafts=0, lookup_skips=0)

    def warmup(self):
        return types.SimpleNamespace(programs=(), compiles=0)

    def iterations(self, requests, *, on_result=None, feed=None, waiting=None):
        live: dict[int, tuple] = {}  # index in this stream -> (request, its tokens)
        count = 0
        while True:
            for request in feed():
                live[count] = (request, [])
                count += 1
            if not live:
                return
            time.sleep(self.delay_s)
            for i, (request, tokens) in list(live.items()):
                tokens.append(TEXT[len(tokens) % len(TEXT)] + ByteTokenizer.OFFSET)
                go_on = request.on_tokens([TokenEvent(i, tokens[-1], len(tokens) - 1)])
                if go_on is False:
                    result = GenerateResult(tokens=list(tokens), finish_reason=FinishReason.CANCELLED.value,
                                            error=ErrorCode.CANCELLED, message="cancelled")
                elif len(tokens) >= request.max_new_tokens:
                    result = GenerateResult(tokens=list(tokens), finish_reason=FinishReason.LENGTH.value, error=None,
                                            message="")
                else:
                    continue
                del live[i]
                on_result(i, result)
            yield None
