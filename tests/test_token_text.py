"""Token text for logprobs: each token's own bytes (byte-level BPE mapped back through its byte table, so the
tokens of a text concatenate to its UTF-8 exactly, split characters included), and the OpenAI shapes built from
them (completions: up to N + 1 alternatives with the sampled token; chat: bytes; -inf / NaN sent as -9999)."""

from __future__ import annotations

import math
import os

import pytest

from ds4jax.generation.requests import TokenLogprob
from ds4jax.io import default_model as dm
from ds4jax.io.tokenizer import ByteTokenizer
from ds4jax.serving import logprobs

TEXT = "def héllo():  # ✓ done\n\tpass"


@pytest.mark.skipif(not os.path.exists(os.path.join(dm.SHIPPED, "tokenizer.json")),
                    reason="checkpoints/default is not present")
def test_byte_level_tokens_concatenate_to_the_text():
    tok = dm.default_tokenizer()
    ids = tok.encode(TEXT)
    pieces = [tok.token_bytes(i) for i in ids]
    assert b"".join(pieces) == TEXT.encode() and any(len(p) == 1 and p[0] >= 0x80 for p in pieces)  # a split "é"
    assert tok.token_bytes(tok.eos_id) == b"<|eos|>"  # a special token: its text


def test_byte_tokenizer_and_the_shapes():
    tok = ByteTokenizer()
    ids = tok.encode("é!")
    assert [tok.token_bytes(i) for i in ids] == [b"\xc3", b"\xa9", b"!"] and tok.token_bytes(tok.eos_id) == b""
    texts = logprobs.TokenText(tok)
    entries = [(ids[0], TokenLogprob(-0.5, ((ids[1], -0.1), (ids[2], -float("inf")))), 0),
               (ids[2], TokenLogprob(math.nan, ((ids[2], math.nan),)), 1)]
    comp = logprobs.completion(entries, texts)
    assert comp["tokens"] == ["\ufffd", "!"] and comp["token_logprobs"] == [-0.5, -9999.0]
    assert comp["text_offset"] == [0, 1]
    assert comp["top_logprobs"][0] == {"\ufffd": -0.1, "!": -9999.0}  # two ids, one text: one key
    chat = logprobs.chat(entries, texts)
    first = chat["content"][0]
    assert first["bytes"] == [0xC3] and first["logprob"] == -0.5 and chat["refusal"] is None
    assert [t["bytes"] for t in first["top_logprobs"]] == [[0xA9], [ord("!")]]


@pytest.mark.parametrize("which", ["bytes", "default"])
def test_incremental_text_equals_decoding_everything(which):
    """TextStream decodes incrementally; its text after every token equals decoding the whole list (random ids,
    so split characters, specials and invalid bytes all occur)."""
    import random

    from ds4jax.serving.text import TextStream

    if which == "default":
        if not os.path.exists(os.path.join(dm.SHIPPED, "tokenizer.json")):
            pytest.skip("checkpoints/default is not present")
        tok, vocab = dm.default_tokenizer(), 4096
    else:
        tok, vocab = ByteTokenizer(), ByteTokenizer.VOCAB_SIZE
    rng = random.Random(0)
    for _ in range(20):
        stream, ids = TextStream(tok), []
        for _ in range(60):
            ids.append(rng.randrange(vocab) if rng.random() < 0.5 else rng.choice(tok.encode(TEXT)))
            stream.ids.append(ids[-1])
            assert stream._text()[0] == tok.decode(ids)
