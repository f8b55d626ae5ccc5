"""Drafts looked up in the request's own tokens (prompt lookup / n-gram drafting), beside the MTP draft.

Greedy text repeats itself: code re-uses names and lines, a small model falls into loops, an edit copies its
prompt. When a row's last n tokens (n >= `min_n`) occurred earlier in its context, the k tokens that followed that
occurrence are a draft that costs no draft-model step. A speculative round whose greedy rows all found one skips
the MTP chain's k-1 draft steps; the target verifies the drafts exactly as it verifies the MTP's (greedy output is
the target's whatever the drafts are), and the draft extend still runs over the accepted tokens, so the MTP
draft's cache stays whole for the rounds that need it. Rows without a match, and rows that sample (a point-mass
draft would need its own acceptance rule), draft with the MTP block as before.

The history is each row's last `WINDOW` tokens, the pending token last, -1 before the request's first token: the
host builds it once per call (`host_history`) and the rounds append what they emit (`append`). A match prefers
the longest suffix (up to `MAX_N` tokens), then the most recent occurrence; a continuation that runs past the
history's end repeats the proposal itself (a periodic continuation: ``a b a b`` -> ``a b``).

`scripts/draft_tree_potential.py --lookup` simulates it on the held-out prompts before any of it runs.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

DEFAULT_MIN_N = 3  # what `lookup=None` (auto) uses with speculative decoding (docs/benchmarks/lookup/)
WINDOW = 512  # tokens of history per row (the host uploads [rows, WINDOW] int32 per speculative call)
MAX_N = 8  # the longest suffix a match counts (longer matches rank as MAX_N)
_OUTSIDE = -2  # what a shifted history reads before its start (never equal to a token or to the padding -1)


def check_min_n(lookup: int) -> int:
    """`lookup`: 0 (off) or the shortest suffix that counts as a match, 1..MAX_N."""
    if isinstance(lookup, bool) or not isinstance(lookup, (int, np.integer)) or not 0 <= lookup <= MAX_N:
        raise ValueError(f"lookup must be an int in [0, {MAX_N}] (0 = off; n = the shortest suffix that may match), "
                         f"got {lookup!r}")
    return int(lookup)


def match_lengths(history: jax.Array) -> jax.Array:
    """[B, H] -> [B, H] int32: at column c, how many tokens before c equal the history's last tokens (the suffix),
    up to MAX_N: the length of the match whose continuation starts at c. Column 0 never matches (nothing before
    it); the padding -1 never counts."""
    b, h = history.shape
    length = jnp.zeros((b, h), jnp.int32)
    running = jnp.ones((b, h), bool)  # the suffix's last i tokens all matched (a chain of elementwise ops: one fusion)
    for i in range(min(MAX_N, h)):
        last = history[:, h - 1 - i: h - i]  # [B, 1] suffix token i from the end
        shifted = jnp.pad(history, ((0, 0), (i + 1, 0)), constant_values=_OUTSIDE)[:, :h]  # [c] -> history[c-1-i]
        running = running & (shifted == last) & (last >= 0)
        length = length + running.astype(jnp.int32)
    return length


def propose(history: jax.Array, k: int, min_n: int) -> tuple[jax.Array, jax.Array]:
    """[B, H] history -> (drafts [B, k] int32, found [B] bool): the k tokens after the longest (then latest)
    earlier occurrence of the history's suffix, when one of at least `min_n` tokens exists (drafts of rows
    without one are 0, never read)."""
    b, h = history.shape
    length = match_lengths(history)
    col = jnp.arange(h, dtype=jnp.int32)[None, :]
    # the suffix itself (continuation at column h) is out of range by construction; column h-1 is allowed: its
    # continuation is the pending token itself, then the proposal repeats (the tokens from c on are a period)
    score = jnp.where(length >= min_n, length * h + col, -1)
    best = jnp.max(score, axis=1)
    found = best >= 0
    start = jnp.where(found, best % h, 0)  # column of the continuation's first token
    drafts = []
    for j in range(k):
        at = start + j
        from_history = jnp.take_along_axis(history, jnp.minimum(at, h - 1)[:, None], axis=1)[:, 0]
        if drafts:  # past the end: the proposal repeats itself (at - h < j)
            earlier = jnp.stack(drafts, axis=1)
            from_proposal = jnp.take_along_axis(earlier, jnp.clip(at - h, 0, j - 1)[:, None], axis=1)[:, 0]
        else:
            from_proposal = from_history
        drafts.append(jnp.where(at < h, from_history, from_proposal))
    out = jnp.stack(drafts, axis=1)
    return jnp.where(found[:, None], out, 0).astype(jnp.int32), found


def append(history: jax.Array, tokens: jax.Array, count: jax.Array) -> jax.Array:
    """The history after each row emitted its first `count` [B] of `tokens` [B, T]: still [B, H], the newest
    last."""
    b, h = history.shape
    joined = jnp.concatenate([history, tokens.astype(history.dtype)], axis=1)  # [B, H + T]
    # row r's window now ends at column h - 1 + count[r] of `joined`
    cols = jnp.arange(h, dtype=jnp.int32)[None, :] + count[:, None]
    return jnp.take_along_axis(joined, cols, axis=1)


def host_history(sequences: Sequence[Sequence[int] | None], window: int = WINDOW) -> np.ndarray:
    """[len(sequences), window] int32 of each row's last `window` tokens, right-aligned, -1 before them (None: a
    padding row, all -1)."""
    out = np.full((len(sequences), window), -1, np.int32)
    for r, seq in enumerate(sequences):
        if seq:
            tail = seq[-window:]
            out[r, window - len(tail):] = tail
    return out


def reference_propose(seq: Sequence[int], k: int, min_n: int) -> list[int] | None:
    """The same rule, one row, in Python (the tests' reference): None where no match of >= min_n tokens."""
    seq = list(seq)
    h = len(seq)
    best = None
    for c in range(1, h):  # the continuation's first column
        n = 0
        while n < min(MAX_N, c) and seq[c - 1 - n] == seq[h - 1 - n]:
            n += 1
        if n >= min_n and (best is None or (n, c) >= best):
            best = (n, c)
    if best is None:
        return None
    prop: list[int] = []
    for j in range(k):
        at = best[1] + j
        prop.append(seq[at] if at < h else prop[at - h])
    return prop
