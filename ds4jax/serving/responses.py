"""OpenAI JSON for completions and chat completions, whole and streamed, from the same per-choice state: the
streamed deltas of a choice concatenate to exactly its non-streamed text, and their logprobs to its logprobs
(a token whose text is held back sends its logprobs with the next chunk that has text, or the last one).

A streamed chunk holds everything a choice released since its last chunk (`Choice.take`): the tokens of one
engine call arrive together, and one chunk of their joined text costs one JSON encoding and one SSE event
instead of one per token."""

from __future__ import annotations

import json
import time
import uuid

from ds4jax.serving import logprobs as logprobs_mod
from ds4jax.serving.chat import ReasoningSplit
from ds4jax.serving.text import TextStream


class Choice:
    """The text of one choice as its tokens arrive: reasoning (thinking on) and content, each a `TextStream`."""

    def __init__(self, index: int, tokenizer, stop, close_ids, thinking: bool):
        self.index = index
        self.split = ReasoningSplit(close_ids, thinking)
        self.reasoning, self.content = TextStream(tokenizer, stop), TextStream(tokenizer, stop)
        self.thinking = thinking
        self.reasoning_text, self.content_text = "", ""
        self.reasoning_tokens = 0
        self.result = None
        self.entries: list[tuple] = []  # (token id, TokenLogprob, text offset) of tokens that carry logprobs
        self._released = 0  # entries of the tokens up to the last one that released text
        self._sent = self._sent_reasoning = self._sent_content = 0  # entries and text already streamed

    def extend(self, events) -> None:
        """The `TokenEvent`s that arrived together (a decode call's), in order. Without logprobs their text is
        decoded once for all of them: decoding per token cost ~26 us a token with the default tokenizer on the 2-core
        CPU (the event loop's largest per-token cost), once per 4 tokens ~3 us a token. With logprobs they go
        one by one, so each token's text offset (the text released before it) is exact. The text is the same."""
        if all(e.logprob is None for e in events):
            self._release(*self._route([e.token for e in events]))
            return
        for e in events:
            if e.logprob is not None:
                self.entries.append((e.token, e.logprob, len(self.content_text)))
            self._release(*self._route([e.token]))

    def _route(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        """-> (reasoning tokens, content tokens) that `tokens` release from the reasoning split."""
        if not self.split.in_reasoning:  # past the thinking span (or none): all content, no per-token look
            return [], tokens
        reasoning, content = [], []
        for token in tokens:
            r, c = self.split.add(token)
            reasoning += r
            content += c
        self.reasoning_tokens += len(reasoning)
        return reasoning, content

    def _release(self, reasoning: list[int], content: list[int]) -> None:
        r, c = self.reasoning.add(reasoning), self.content.add(content)
        if r or c:
            self._keep(r, c)

    def finish(self, result) -> None:
        self.result = result
        rest = self.split.flush()
        self.reasoning_tokens += len(rest)
        self.reasoning.add(rest)
        self._keep(self.reasoning.finish(), self.content.finish() if self.content.ids else "")

    def _keep(self, r: str, c: str) -> None:
        self.reasoning_text += r
        self.content_text += c
        self._released = len(self.entries)

    def take(self) -> tuple[str, str, list[tuple]]:
        """What was released since the last take: (reasoning, content, the logprob entries of the tokens that
        released it, in order); marks it streamed. A token whose text is still held back keeps its entry."""
        r, c = self.reasoning_text[self._sent_reasoning:], self.content_text[self._sent_content:]
        entries = self.entries[self._sent: self._released]
        self._sent_reasoning, self._sent_content = len(self.reasoning_text), len(self.content_text)
        self._sent = self._released
        return r, c, entries

    @property
    def finish_reason(self) -> str:
        return self.result.finish_reason if self.result is not None else "stop"


_str = json.encoder.encode_basestring_ascii  # what json.dumps writes for a str (ensure_ascii)


def _choice_json(chat: bool, index: int, reasoning: str, content: str, finish_reason: str | None,
                 role: bool) -> str:
    """`json.dumps` of a stream chunk's choice without logprobs (`Shape.chunk_json` builds the same dict with
    them; tests/test_serve_stream.py checks both agree)."""
    finish = "null" if finish_reason is None else _str(finish_reason)
    if not chat:
        return f'{{"index": {index:d}, "text": {_str(content)}, "logprobs": null, "finish_reason": {finish}}}'
    delta = ['"role": "assistant"'] if role else []
    if reasoning:
        delta.append(f'"reasoning_content": {_str(reasoning)}')
    if content or role:
        delta.append(f'"content": {_str(content)}')
    return f'{{"index": {index:d}, "delta": {{{", ".join(delta)}}}, "logprobs": null, "finish_reason": {finish}}}'


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, choices: list[Choice], chat: bool) -> dict:
    completion = sum(len(c.result.tokens) for c in choices if c.result is not None)
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion, "total_tokens": prompt_tokens + completion}
    if chat:
        out["completion_tokens_details"] = {"reasoning_tokens": sum(c.reasoning_tokens for c in choices)}
    return out


class Shape:
    """The envelope of one response: id, created, model, object names; `texts` (a `logprobs.TokenText`) when
    the request asked for logprobs."""

    def __init__(self, chat: bool, model: str, texts=None):
        self.chat, self.model, self.texts = chat, model, texts
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        # every chunk's envelope is the same: encoded once, the choice spliced in (json.dumps' own separators)
        envelope = json.dumps(self._envelope("chat.completion.chunk" if chat else "text_completion", []))
        self._chunk_head = envelope[: -len("[]}")] + "["

    def _envelope(self, obj: str, choices: list, **extra) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices,
                **extra}

    def whole(self, choices: list[Choice], prompt_tokens: int) -> dict:
        if self.chat:
            body = [{"index": c.index, "message": self._message(c), "logprobs": self.logprobs(c.entries, True),
                     "finish_reason": c.finish_reason} for c in choices]
            return self._envelope("chat.completion", body, usage=usage(prompt_tokens, choices, True))
        body = [{"index": c.index, "text": c.content_text, "logprobs": self.logprobs(c.entries, True),
                 "finish_reason": c.finish_reason} for c in choices]
        return self._envelope("text_completion", body, usage=usage(prompt_tokens, choices, False))

    def logprobs(self, entries: list[tuple], whole: bool = False) -> dict | None:
        """The logprobs object of `entries` (None when not asked; a chunk without entries: None too)."""
        if self.texts is None or not (entries or whole):
            return None
        return (logprobs_mod.chat if self.chat else logprobs_mod.completion)(entries, self.texts)

    @staticmethod
    def _message(c: Choice) -> dict:
        m = {"role": "assistant", "content": c.content_text}
        if c.thinking:
            m["reasoning_content"] = c.reasoning_text
        return m

    def chunk_json(self, index: int, reasoning: str = "", content: str = "", finish_reason: str | None = None,
                   role: bool = False, logprobs: dict | None = None) -> str:
        """One stream chunk, JSON-encoded (without logprobs the choice is spliced from its encoded strings, the same
        text `json.dumps` gives: the event loop's one JSON encoding per event, at about a third of the cost)."""
        if logprobs is None:
            return self._chunk_head + _choice_json(self.chat, index, reasoning, content, finish_reason, role) + "]}"
        if self.chat:
            delta = {"role": "assistant"} if role else {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content or role:
                delta["content"] = content
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": content, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._chunk_head + json.dumps(choice) + "]}"

    def usage_chunk(self, choices: list[Choice], prompt_tokens: int) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [],
                              usage=usage(prompt_tokens, choices, self.chat))
