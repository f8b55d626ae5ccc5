"""DeepSeek-V4's chat format (the V3.2 / V4 encoding) and the split of generated tokens into reasoning and content.

    <BOS>{system}<｜User｜>{user}<｜Assistant｜></think>{answer}<｜end▁of▁sentence｜><｜User｜>{user}<｜Assistant｜><think>

The generation prompt ends in ``<think>`` with thinking on (the model reasons, closes the span with ``</think>``,
then answers) and in ``</think>`` with thinking off (it answers at once). Earlier assistant turns are rendered
without their reasoning, as DeepSeek's API does (``reasoning_content`` sent back in a message is dropped). BOS is
the tokenizer's id, not text, so a byte-level tokenizer and the real one both get it.
"""

from __future__ import annotations

from ds4jax.io.tokenizer import unencodable_at
from ds4jax.serving.errors import invalid

USER, ASSISTANT, END = "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
ROLES = ("system", "developer", "user", "assistant")


def _content(message: dict, i: int) -> str:
    c = message.get("content")
    if c is None and message.get("role") == "assistant":
        return ""
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in c):
        c = "".join(p["text"] for p in c)
    if not isinstance(c, str):
        raise invalid(f"messages[{i}].content", "must be a string or a list of text parts")
    at = unencodable_at(c)
    if at is not None:
        raise invalid(f"messages[{i}].content", f"is not valid Unicode (a lone surrogate at character {at})")
    return c


def render(messages, *, thinking: bool) -> str:
    """The prompt text (without BOS) for `messages`, ending in the assistant's opening."""
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "must be a non-empty list of {role, content} objects")
    system, turns = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise invalid(f"messages[{i}].role", f"must be one of {', '.join(ROLES)} (tools are not supported)")
        extra = set(m) - {"role", "content", "name", "reasoning_content"}
        if extra:
            raise invalid(f"messages[{i}].{sorted(extra)[0]}", "not supported in a message")
        text = _content(m, i)
        if m["role"] in ("system", "developer"):
            if turns:
                raise invalid(f"messages[{i}].role", "system messages must come before the conversation")
            system.append(text)
        else:
            turns.append((m["role"], text))
    if not turns or turns[-1][0] != "user":
        raise invalid("messages", "the last message must be the user's")
    out = ["\n\n".join(system)]
    for role, text in turns:
        out.append(f"{USER}{text}{ASSISTANT}" if role == "user" else f"{THINK_CLOSE}{text}{END}")
    out.append(THINK_OPEN if thinking else THINK_CLOSE)
    return "".join(out)


def render_ids(messages, tokenizer, *, thinking: bool) -> list[int]:
    return tokenizer.encode(render(messages, thinking=thinking), add_bos=tokenizer.bos_id is not None)


def close_ids(tokenizer) -> tuple[int, ...]:
    """The ids of ``</think>`` (one id with DeepSeek's tokenizer, several with a byte-level one)."""
    return tuple(tokenizer.encode(THINK_CLOSE))


class ReasoningSplit:
    """Routes a thinking request's tokens: those before the first ``</think>`` id sequence are reasoning, those
    after it are content (the close itself is neither). A tail that could be the start of the close is held
    until the next token decides."""

    def __init__(self, close: tuple[int, ...], thinking: bool):
        self.close, self.in_reasoning = tuple(close), thinking
        self.held: list[int] = []

    def add(self, token: int) -> tuple[list[int], list[int]]:
        """-> (reasoning tokens, content tokens) released by this token."""
        if not self.in_reasoning:
            return [], [token]
        self.held.append(token)
        if tuple(self.held[-len(self.close):]) == self.close:
            out = self.held[: -len(self.close)]
            self.held, self.in_reasoning = [], False
            return out, []
        keep = next((k for k in range(min(len(self.close) - 1, len(self.held)), 0, -1)
                     if tuple(self.held[-k:]) == self.close[:k]), 0)
        out = self.held[: len(self.held) - keep]
        self.held = self.held[len(self.held) - keep:]
        return out, []

    def flush(self) -> list[int]:
        """Reasoning tokens still held at the end (a span the request ended inside)."""
        out, self.held = self.held, []
        return out
