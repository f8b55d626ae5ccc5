"""Request bodies of ``/v1/completions`` and ``/v1/chat/completions`` -> a validated `GenerationParams`.

Every field is checked on the host and a bad one is a 400 naming it. Fields fall in three sets (docs/serving.md
has the table): supported; ignored (bookkeeping fields clients send that do not change generation: `user`,
`metadata`, `store`, `service_tier`, `parallel_tool_calls`); and rejected with ``unsupported_parameter`` unless
they hold their neutral value (penalties, `logit_bias`, `echo`, `suffix`, tools, ...), because silently ignoring
them would return something else than what was asked. Anything else is ``unknown_parameter``. `logprobs` (an int
for completions; true plus `top_logprobs` for chat) is supported up to the engine's ``logprobs`` setting
(``--max-logprobs``); with that at 0 it is rejected unless neutral.
"""

from __future__ import annotations

import dataclasses
import math
import os

from ds4jax.generation.requests import row_seed
from ds4jax.io.tokenizer import unencodable_at
from ds4jax.serving import chat
from ds4jax.serving.errors import APIError, ServerCode, invalid

MAX_STOP_STRINGS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256
MAX_SEED = (1 << 63) - 1

IGNORED = frozenset({"user", "metadata", "store", "service_tier", "parallel_tool_calls"})
# field -> its neutral values (accepted, since clients send them by default); anything else is rejected
NEUTRAL = {
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}), "echo": (None, False), "suffix": (None, ""),
    "best_of": (None, 1), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "response_format": (None, {"type": "text"}), "prediction": (None,),
    "modalities": (None, ["text"]), "audio": (None,), "reasoning_effort": (None,), "web_search_options": (None,),
}
COMMON = frozenset({"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream",
                    "stream_options"})
COMPLETION_FIELDS = COMMON | {"prompt", "logprobs"}
CHAT_FIELDS = COMMON | {"messages", "max_completion_tokens", "thinking", "thinking_budget", "chat_template_kwargs",
                        "logprobs", "top_logprobs"}


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the server allows (ServerConfig); `max_context` and `spec_positions` come from the engine."""
    model: str
    max_context: int
    spec_positions: int  # positions a speculative request reserves beyond max_tokens (k + 1, or 0)
    max_tokens_cap: int
    default_max_tokens: int
    max_n: int
    vocab_size: int
    max_logprobs: int = 0  # the engine's logprobs setting: most alternatives per token (0: logprobs rejected)


@dataclasses.dataclass(frozen=True)
class GenerationParams:
    chat: bool
    prompts: tuple[tuple[int, ...], ...]  # token ids of each prompt (completions may send several)
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    n: int
    stream: bool
    include_usage: bool
    thinking: bool  # chat: the prompt opens a <think> span whose text is returned as reasoning_content
    thinking_budget: int | None  # the engine force-closes the span after this many tokens
    logprobs: int | None = None  # alternatives per token with each token's log-probability (None: not asked)

    def seed_of(self, choice: int) -> int:
        """Choice j's seed: independent streams per choice (the CLI's row 0 draws with row_seed(seed, 0), so
        `ds4jax generate --seed S` and a server request with seed S sample the same tokens)."""
        return row_seed(self.seed, choice) if self.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1


def _int(body: dict, name: str, default, low: int, high: int | None = None):
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool):
        raise invalid(name, f"must be an integer, got {type(v).__name__}")
    if v < low or (high is not None and v > high):
        raise invalid(name, f"must be in [{low}, {high if high is not None else 'inf'}], got {v}")
    return v


def _float(body: dict, name: str, default: float, low: float, high: float, low_open: bool = False) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        raise invalid(name, f"must be a finite number, got {v!r}")
    if v < low or v > high or (low_open and v == low):
        raise invalid(name, f"must be in {'(' if low_open else '['}{low}, {high}], got {v}")
    return float(v)


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(name, f"must be true or false, got {v!r}")
    return v


def _check_fields(body: dict, allowed: frozenset) -> None:
    for name, value in body.items():
        if name in allowed or name in IGNORED:
            continue
        if name in NEUTRAL:
            if any(value == ok and type(value) is type(ok) or (value is None and ok is None) for ok in NEUTRAL[name]):
                continue
            raise APIError(ServerCode.UNSUPPORTED_PARAMETER, f"{name}: not supported by this server (only "
                           f"{' / '.join(map(repr, NEUTRAL[name]))} is accepted; docs/serving.md)", param=name)
        raise APIError(ServerCode.UNKNOWN_PARAMETER, f"{name}: unknown parameter", param=name)


def _stop(body: dict) -> tuple[str, ...]:
    v = body.get("stop")
    if v is None:
        return ()
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", "must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS or any(not s or len(s) > MAX_STOP_CHARS for s in stops):
        raise invalid("stop", f"at most {MAX_STOP_STRINGS} non-empty strings of at most {MAX_STOP_CHARS} characters")
    return tuple(stops)


def _prompts(body: dict, tokenizer, vocab: int) -> list[list[int]]:
    p = body.get("prompt")
    if isinstance(p, str):
        texts = [p]
    elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        return [_ids(p, vocab)]
    elif isinstance(p, list) and p and all(isinstance(t, str) for t in p):
        texts = p
    elif isinstance(p, list) and p and all(isinstance(t, list) for t in p):
        return [_ids(t, vocab) for t in p]
    else:
        raise invalid("prompt", "must be a string, a list of strings, token ids or a list of token id lists")
    if any(not t for t in texts):
        raise invalid("prompt", "must not be empty")
    for at in map(unencodable_at, texts):
        if at is not None:
            raise invalid("prompt", f"is not valid Unicode (a lone surrogate at character {at})")
    return [tokenizer.encode(t, add_bos=tokenizer.bos_id is not None) for t in texts]


def _ids(ids: list, vocab: int) -> list[int]:
    if not ids or any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab for t in ids):
        raise invalid("prompt", f"token ids must be a non-empty list of integers in [0, {vocab})")
    return ids


def _logprobs(body: dict, is_chat: bool, most: int) -> int | None:
    """Completions: ``logprobs: N`` (0..most). Chat: ``logprobs: true`` with ``top_logprobs: N`` (0..most; it
    needs logprobs true, as OpenAI). None when not asked."""
    if not most:  # only the neutral values (completions' logprobs 0 asks for the sampled tokens' values)
        value, top = body.get("logprobs"), body.get("top_logprobs")
        name = "logprobs" if value is not None and value is not False else "top_logprobs" if top else None
        if name is not None:
            raise APIError(ServerCode.UNSUPPORTED_PARAMETER, f"{name}: this server was started with "
                           "--max-logprobs 0", param=name)
        return None
    if not is_chat:
        if body.get("logprobs") is True:
            raise invalid("logprobs", f"completions take the number of alternatives (0..{most}), not true")
        return _int(body, "logprobs", None, 0, most) if body.get("logprobs") is not False else None
    on = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, 0, most)
    if top and not on:
        raise invalid("top_logprobs", "needs logprobs: true")
    return (top or 0) if on else None


def _thinking(body: dict) -> tuple[bool, int | None]:
    """DeepSeek's ``thinking: {"type": "enabled"|"disabled"}`` (also a bool, or vLLM's
    ``chat_template_kwargs: {"thinking": bool}``) and a budget: ``thinking.budget_tokens`` or ``thinking_budget``."""
    on, budget = False, None
    t = body.get("thinking")
    if isinstance(t, bool):
        on = t
    elif isinstance(t, dict):
        extra = set(t) - {"type", "budget_tokens"}
        if extra or t.get("type") not in ("enabled", "disabled"):
            raise invalid("thinking", 'must be {"type": "enabled" | "disabled", "budget_tokens": N} or a bool')
        on = t["type"] == "enabled"
        budget = _int(t, "budget_tokens", None, 1)
    elif t is not None:
        raise invalid("thinking", 'must be {"type": "enabled" | "disabled"} or a bool')
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        if not isinstance(kwargs, dict) or set(kwargs) - {"thinking"}:
            raise invalid("chat_template_kwargs", 'only {"thinking": bool} is supported')
        on = _bool(kwargs, "thinking", on)
    if body.get("thinking_budget") is not None:
        budget = _int(body, "thinking_budget", None, 1)
    if budget is not None and not on:
        raise invalid("thinking_budget", "needs thinking enabled")
    return on, budget


def parse(body, limits: Limits, tokenizer, *, is_chat: bool) -> GenerationParams:
    if not isinstance(body, dict):
        raise APIError(ServerCode.INVALID_JSON, "the request body must be a JSON object")
    _check_fields(body, CHAT_FIELDS if is_chat else COMPLETION_FIELDS)
    model = body.get("model")
    if model is not None and model != limits.model:
        raise APIError(ServerCode.MODEL_NOT_FOUND, f"model {model!r} is not served here (this server serves "
                       f"{limits.model!r}; GET /v1/models)", param="model")
    thinking, budget = _thinking(body) if is_chat else (False, None)
    if is_chat:
        prompts = [chat.render_ids(body.get("messages"), tokenizer, thinking=thinking)]
    else:
        prompts = _prompts(body, tokenizer, limits.vocab_size)
    if any(t >= limits.vocab_size for p in prompts for t in p):
        raise invalid("prompt", f"encodes to ids outside the model's vocabulary ({limits.vocab_size})")
    longest = max(map(len, prompts))
    room = limits.max_context - limits.spec_positions - longest
    if room < 1:
        raise APIError("prompt_too_long", f"the prompt has {longest} tokens; this server's context is "
                       f"{limits.max_context} tokens (--max-context)", param="messages" if is_chat else "prompt")
    name = "max_completion_tokens" if is_chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _int(body, name, min(limits.default_max_tokens, room), 1, limits.max_tokens_cap)
    if max_tokens > room:
        raise APIError("prompt_too_long", f"{longest} prompt tokens + {name} {max_tokens} exceed the context of "
                       f"{limits.max_context} tokens (--max-context)", param=name)
    options = body.get("stream_options")
    if options is not None and (not isinstance(options, dict) or set(options) - {"include_usage"}):
        raise invalid("stream_options", 'only {"include_usage": bool} is supported')
    stream = _bool(body, "stream", False)
    n = _int(body, "n", 1, 1, limits.max_n)
    if len(prompts) * n > limits.max_n:
        raise invalid("n", f"prompts x n must be at most {limits.max_n}, got {len(prompts)} x {n}")
    return GenerationParams(
        chat=is_chat, prompts=tuple(map(tuple, prompts)), max_tokens=max_tokens,
        temperature=_float(body, "temperature", 1.0, 0.0, 2.0), top_p=_float(body, "top_p", 1.0, 0.0, 1.0, True),
        top_k=max(_int(body, "top_k", 0, -1), 0), seed=_int(body, "seed", None, -MAX_SEED - 1, MAX_SEED),
        stop=_stop(body), n=n, stream=stream,
        include_usage=stream and bool(options) and _bool(options, "include_usage", False),
        thinking=thinking, thinking_budget=budget, logprobs=_logprobs(body, is_chat, limits.max_logprobs))
