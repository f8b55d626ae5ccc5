"""The engine's shapes: the row counts and prefill widths its compiled programs take.

An engine program is compiled once per shape, so these buckets fix the whole program set (`Engine.warmup`
compiles each once; nothing compiles afterwards):

* decode and speculative calls: one program per row bucket (`row_buckets`; default the powers of eight up to
  `max_slots`, in units of the mesh's data size: 1, 8, 64, ..., max_slots), each running `steps_per_call` steps
  or rounds. Eight, not two: each bucket is a program of several seconds of XLA on a GPU, and a small decode
  batch is bound by reading the weights, so padding a call of 3 rows to 8 costs little. Measured on the H200
  (docs/benchmarks/warmup_probe.md, default model, max_slots=8): cold warm-up 51 -> 33 s with (1, 8) instead of
  (1, 2, 4, 8), decode at 1 / 8 rows 999 / 6,671 tokens/s against 949 / 6,237. A model whose routed experts
  dominate the bytes (padding rows route too) may prefer finer buckets: pass `row_buckets`;
* prefill calls: one program per prefill row bucket, of one width from a token budget: a call of R rows takes
  min(prefill_chunk, prefill_tokens // R) prompt tokens per row. A prefill call computes at most `prefill_tokens`
  tokens whatever its rows, and there are as many prefill programs as prefill row buckets (not rows x widths).
  The default budget, max(prefill_chunk, 16 x max_slots), gives every row bucket a prefill program whose rows
  take at least 16 tokens each (the whole chunk when it is smaller): max_slots=8, prefill_chunk=256 prefill
  [1, 256], [8, 32];
* the snapshot restore: one program, on the widest prefill row bucket.

`one_shot` sizes the engine of a `ds4jax.generate` call from buckets of the call's arguments, so a new prompt
length or `max_new_tokens` within the same buckets reuses every compiled program. Its speculative pools are sized
for a bucket of the draft length (`draft_bucket`: k = 1..4 all get pools for 4 drafts), so a call with another k of
the same bucket reuses the prefill and decode programs and compiles only its speculative program.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from ds4jax.errors import PoolError

MIN_WIDTH = 16  # the narrowest prefill share of a row the defaults give (below it calls are mostly overhead)
ONE_SHOT_MIN = 32  # smallest prompt and new-token bucket of a one-shot engine (short runs share programs)
ONE_SHOT_STEPS = 16  # steps (or rounds) per host call of a one-shot engine: fixed, so max_new_tokens picks no
# program (a call returns early when its rows finish; tokens reach on_token every <= 16 steps)


DRAFT_MIN = 4  # the fewest drafts per round a one-shot engine's speculative pools are sized for (`draft_bucket`)


def bucket(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def draft_bucket(k: int, most: int | None = None) -> int:
    """The drafts per round a one-shot engine's pools are sized for when its rounds draft k: max(DRAFT_MIN,
    bucket(k)), at most `most` (what the model's state rings take: `pool_spec.most_drafts`) but never below k;
    0 for k = 0. The pools' size is static in every program that touches them, and pools sized for more drafts
    serve shorter rounds unchanged (as the adaptive policy's shorter draft lengths run on the pools of its
    longest), so runs whose k share a bucket share the prefill and decode programs. The cost: the rings and each
    request's reserved window grow by at most DRAFT_MIN - 1 positions (k = 1: 3 SWA rows per layer and slot)."""
    if not k:
        return 0
    top = max(DRAFT_MIN, bucket(k))
    return top if most is None else max(k, min(top, most))


ROW_BUCKET_FACTOR = 8  # ratio of consecutive default row buckets (see the module docstring)


def powers_up_to(top: int, low: int = 1, factor: int = 2) -> tuple[int, ...]:
    """low, factor x low, factor^2 x low, ... below `top`, then `top`."""
    out, b = [], min(low, top)
    while b < top:
        out.append(b)
        b *= factor
    return tuple(out) + (top,)


@dataclasses.dataclass(frozen=True)
class Buckets:
    rows: tuple[int, ...]  # decode / speculative call rows, ascending; the last is max_slots
    prefill: tuple[tuple[int, int], ...]  # (rows, tokens per row) of each prefill program, rows ascending

    @property
    def prefill_rows(self) -> tuple[int, ...]:
        return tuple(r for r, _ in self.prefill)

    def width(self, rows: int) -> int:
        """Prompt tokens per row of the prefill program of `rows` rows."""
        return dict(self.prefill)[rows]

    @property
    def restore_rows(self) -> int:
        return self.prefill[-1][0]


def _positive(value, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PoolError(f"{name} must be an int >= 1, got {value!r}")
    return value


def _checked_rows(given: Sequence[int], name: str, slots: int) -> tuple[int, ...]:
    rows = tuple(sorted({_positive(r, name) for r in given}))
    if not rows or rows[-1] > slots:
        raise PoolError(f"{name} {rows} must lie in [1, max_slots={slots}]")
    return rows


def engine_buckets(slots: int, data: int, *, prefill_chunk: int, prefill_tokens: int | None,
                   row_buckets: Sequence[int] | None, prefill_row_buckets: Sequence[int] | None) -> Buckets:
    """The buckets of an engine with `slots` slots over `data` data shards (a call's rows split evenly over them).

    prefill_tokens: the budget of one prefill call (default max(prefill_chunk, MIN_WIDTH x slots)). Default
    prefill row buckets: the row buckets whose share of the budget is >= MIN_WIDTH tokens (or the whole chunk when
    it is smaller), at least the first; with the default budget, every row bucket."""
    chunk = _positive(prefill_chunk, "prefill_chunk")
    budget = max(chunk, MIN_WIDTH * slots) if prefill_tokens is None else _positive(prefill_tokens, "prefill_tokens")
    default = tuple(b * data for b in powers_up_to(slots // data, factor=ROW_BUCKET_FACTOR))
    rows = _checked_rows(row_buckets or default, "row buckets", slots)
    if rows[-1] < slots:  # a decode call can always take every slot
        rows += (slots,)
    if prefill_row_buckets:
        prefill_rows = _checked_rows(prefill_row_buckets, "prefill row buckets", slots)
        starved = [r for r in prefill_rows if budget < r]
        if starved:
            raise PoolError(f"prefill row buckets {starved} exceed prefill_tokens={budget}: a prefill call of R rows "
                            "takes prefill_tokens // R tokens per row; raise prefill_tokens or drop those buckets")
    else:
        narrowest = min(MIN_WIDTH, chunk)
        prefill_rows = tuple(r for r in rows if budget // r >= narrowest) or rows[:1]
        if budget < prefill_rows[0]:
            raise PoolError(f"prefill_tokens={budget} is below the smallest row bucket ({prefill_rows[0]} rows): "
                            "each prefill row needs at least one token")
    if any(b % data for b in rows + prefill_rows):
        raise PoolError(f"row buckets {rows} / {prefill_rows} must be multiples of the mesh's data={data} "
                        "(each data shard runs an equal share of a call's rows)")
    return Buckets(rows, tuple((r, min(chunk, budget // r)) for r in prefill_rows))


def one_shot(prompt_lengths: Sequence[int], max_new_tokens: int, *, speculative: int, data: int,
             max_position_embeddings: int, prefill_chunk: int | None = None,
             steps_per_call: int | None = None, most_drafts: int | None = None) -> dict:
    """Engine arguments for one batch call: slots, prompt width and context from power-of-two buckets (at least
    `ONE_SHOT_MIN`) of the prompts' count and length and of max_new_tokens, a fixed `ONE_SHOT_STEPS`. Two calls
    whose arguments fall in the same buckets build equal engines, so the second compiles nothing.
    `prefill_chunk` (explicit) prefills every prompt in chunks of that many tokens.
    speculative=k > 0: the engine's pools (and its `speculative`, the most drafts a request may ask for) are
    sized for `draft_bucket(k, most_drafts)` drafts, and its one speculative program drafts k (`draft_lengths`),
    so two calls whose k share a bucket differ only in that program."""
    prompt = bucket(max(max(prompt_lengths), ONE_SHOT_MIN))
    new = bucket(max(max_new_tokens, ONE_SHOT_MIN))
    pools = draft_bucket(speculative, most_drafts)
    spec = pools + 1 if pools else 0
    # the model's own limit caps the bucket (prompt + max_new_tokens were checked against it)
    context = min(bucket(prompt + new + spec), max(max_position_embeddings, max(prompt_lengths) + max_new_tokens + spec))
    slots = -(-bucket(len(prompt_lengths)) // data) * data  # data-parallel pools: slots split evenly over data
    width = prefill_chunk or prompt
    return dict(max_slots=slots, max_context=context, speculative=pools,
                draft_lengths=(speculative,) if speculative else None, prefill_chunk=width,
                prefill_tokens=width * slots, row_buckets=(slots,),
                steps_per_call=steps_per_call or ONE_SHOT_STEPS)
