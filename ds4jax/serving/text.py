"""Incremental detokenization: the text of a growing token list, released as deltas that never need taking back.

A delta holds back (a) a trailing U+FFFD, which may be half a UTF-8 character the next token completes, and (b)
any tail that could be the start of a stop string; the text ends before the first stop string. `finish` releases
the rest, so the concatenated deltas of a stream equal the non-streamed text exactly.
"""

from __future__ import annotations


class TextStream:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()):
        self.tok, self.stop = tokenizer, tuple(stop)
        self.ids: list[int] = []
        self.sent = ""
        self.stopped = False

    def _text(self) -> tuple[str, bool]:
        text = self.tok.decode(self.ids)
        hits = [text.index(s) for s in self.stop if s in text]
        return (text[: min(hits)], True) if hits else (text, False)

    def add(self, tokens) -> str:
        if self.stopped or not tokens:
            return ""
        self.ids.extend(tokens)
        text, self.stopped = self._text()
        if not self.stopped:
            text = text.rstrip("\ufffd")
            hold = max((k for s in self.stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
            text = text[: len(text) - hold]
        return self._release(text)

    def finish(self) -> str:
        text, self.stopped = self._text()
        return self._release(text)

    def _release(self, text: str) -> str:
        if not text.startswith(self.sent) or len(text) <= len(self.sent):
            return ""  # (a tokenizer whose text of a prefix is not a prefix of the text: wait for the end)
        delta, self.sent = text[len(self.sent):], text
        return delta
