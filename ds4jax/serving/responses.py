"""OpenAI JSON for completions and chat completions, whole and streamed, from the same per-choice state: the
streamed deltas of a choice concatenate to exactly its non-streamed text, and their logprobs to its logprobs
(a token whose text is held back sends its logprobs with the next chunk that has text, or the last one)."""

from __future__ import annotations

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
        self._sent = 0  # entries already streamed

    def add(self, event) -> tuple[str, str]:
        """A `TokenEvent` -> (reasoning delta, content delta) its token releases."""
        token = event.token
        if event.logprob is not None:
            self.entries.append((token, event.logprob, len(self.content_text)))
        r, c = self.split.add(token)
        self.reasoning_tokens += len(r)
        return self._keep(self.reasoning.add(r), self.content.add(c))

    def finish(self, result) -> tuple[str, str]:
        self.result = result
        rest = self.split.flush()
        self.reasoning_tokens += len(rest)
        self.reasoning.add(rest)
        return self._keep(self.reasoning.finish(), self.content.finish() if self.content.ids else "")

    def _keep(self, r: str, c: str) -> tuple[str, str]:
        self.reasoning_text += r
        self.content_text += c
        return r, c

    def unsent(self) -> list[tuple]:
        """The entries not streamed yet (marked sent)."""
        out, self._sent = self.entries[self._sent:], len(self.entries)
        return out

    @property
    def finish_reason(self) -> str:
        return self.result.finish_reason if self.result is not None else "stop"


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

    def chunk(self, index: int, reasoning: str = "", content: str = "", finish_reason: str | None = None,
              role: bool = False, logprobs: dict | None = None) -> dict:
        if self.chat:
            delta = {"role": "assistant"} if role else {}
            if reasoning:
                delta["reasoning_content"] = reasoning
            if content or role:
                delta["content"] = content
            return self._envelope("chat.completion.chunk", [{"index": index, "delta": delta, "logprobs": logprobs,
                                                              "finish_reason": finish_reason}])
        return self._envelope("text_completion", [{"index": index, "text": content, "logprobs": logprobs,
                                                    "finish_reason": finish_reason}])

    def usage_chunk(self, choices: list[Choice], prompt_tokens: int) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [],
                              usage=usage(prompt_tokens, choices, self.chat))
