"""`speculative_generate`: MTP speculative decoding of a batch of prompts (a thin wrapper over `Engine`).

The rounds themselves (draft chain, verify, acceptance, rollback, draft extend) are `spec_rounds.py`; the engine
runs up to M of them per host call. Greedy output equals plain decoding; sampled output follows the target.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from ds4jax.runtime import kv_quant
from ds4jax.generation.generate import SamplingParams, check_lookup, check_prompts, check_stop_ids, run_batch
from ds4jax.model.inputs import check_int
from ds4jax.generation.loops import MAX_STOP_IDS  # noqa: F401 (re-exported)
from ds4jax.generation.spec_rounds import speculative_loop  # noqa: F401 (re-exported)
from ds4jax.model.handle import Model
from ds4jax.runtime.pools import PoolError


@dataclasses.dataclass(frozen=True)
class SpecResult:
    tokens: list[list[int]]
    accepted_per_round: list[list[int]]  # per request
    rounds: list[int]
    mean_accepted: list[float]  # mean accepted drafts per round
    mean_tokens_per_round: list[float]  # tokens emitted per round (accepted + 1 unless a stop cut the round)
    seconds: float
    tokens_per_second: float


def speculative_generate(model: Model, prompt_ids, params: SamplingParams = SamplingParams(), *, k: int = 2,
                         prefill_chunk: int | None = None, check_finite: bool = False,
                         on_token: Callable[[int, int], None] | None = None,
                         steps_per_call: int | None = None, kv_dtype: str = "auto",
                         lookup: int | None = None) -> SpecResult:
    """Speculative generation with the model's MTP block as the draft (k draft tokens per round).

    `check_finite` raises `NonFiniteError` naming the first layer when the target's logits turn NaN/Inf, and
    `on_token(row, token)` sees every token as it is delivered (a round delivers its accepted drafts at once), as
    in `generate`. `lookup` = n > 0 also drafts from the prompt's and the output's own tokens where the last >= n
    tokens occurred before (`ds4jax.generation.lookup`; None: the engine's default, 3; 0: off)."""
    cfg = model.config
    if not model.has_mtp:
        raise PoolError("speculative decoding needs the MTP block; this checkpoint has no mtp.* tensors")
    check_int(k, "k", low=1)
    lookup = check_lookup(lookup, k)
    if len(params.stop_ids) > MAX_STOP_IDS:
        raise PoolError(f"at most {MAX_STOP_IDS} stop ids are supported, got {len(params.stop_ids)}")
    prompts = check_prompts(prompt_ids, cfg, params.max_new_tokens + k + 1)
    check_stop_ids(params.stop_ids, cfg.vocab_size)
    if prefill_chunk is not None:
        check_int(prefill_chunk, "prefill_chunk", low=1)
    start = time.perf_counter()
    kv_quant.check_argument(kv_dtype)
    results = run_batch(model, prompts, params, k=k, prefill_chunk=prefill_chunk, check_finite=check_finite,
                        on_token=on_token, steps_per_call=steps_per_call, kv_dtype=kv_dtype, lookup=lookup)
    seconds = time.perf_counter() - start
    tokens = [r.tokens for r in results]
    per_round = [list(r.accepted_per_round or []) for r in results]
    total = sum(len(t) for t in tokens)
    return SpecResult(
        tokens=tokens,
        accepted_per_round=per_round,
        rounds=[len(a) for a in per_round],
        mean_accepted=[sum(a) / len(a) if a else 0.0 for a in per_round],
        # tokens actually emitted per round (the first token comes from prefill; stop ids and the budget can cut
        # a round's accepted tokens short, so this is not mean(accepted) + 1)
        mean_tokens_per_round=[(len(t) - 1) / len(a) if a else 0.0 for t, a in zip(tokens, per_round)],
        seconds=seconds,
        tokens_per_second=total / seconds if seconds > 0 else float("inf"),
    )
