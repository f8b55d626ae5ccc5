"""Run-ahead decoding: the engine starts the next decode call (plain steps, or speculative rounds of the same draft
length) before it reads the current one, so the device computes call i+1 while the host delivers call i's tokens
(and a server's event loop sends them).

Without it every call ends in a round trip the device waits through: fetch the tokens, split them per request,
run the callbacks, plan the next rows, dispatch. Call i+1 needs only what call i computed, so its inputs are call
i's outputs on the device (`next_rows`: each row's last token and token count, done rows off); no host value
enters. A speculative call's draft state (the draft pool and each slot's pending draft logits) is its output as
well, and its draft length stays the one the call before it ran: when the policy picks another, the call run ahead
is read first. The engine runs ahead only where that is exact (`may_run_ahead`): one device (a layer split's
stages loop on the host), every decoding row in this one call, nothing queued for a free slot or prefilling once
the iteration's admission and prefill are done, and no row with forced tokens or a thinking-budget limit (those the
host rebuilds per call).

The call run ahead (`Ahead`) is landed, its tokens read and delivered, before anything that rewrites the page
table (admission, a slot reset, a prefill: the host's lengths would be one call behind the device's) and before
a decode call for other rows. Rows the host finished meanwhile (a stop string, a cancel) ran one call too many
on the device; their tokens are dropped, and their slots are reset before reuse as always.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses

from ds4jax.generation.delivery import Live
from ds4jax.generation.loops import DecodeOut, Rows
from ds4jax.generation.spec_rounds import SpecOut


@dataclasses.dataclass
class Ahead:
    """A decode call dispatched before the previous one was read."""

    plan: list[Live | None]  # its rows (None: padding), as the call before it had them
    rows: Rows  # its inputs, on the device
    out: concurrent.futures.Future[DecodeOut | SpecOut]  # its outputs, once a worker thread dispatched it
    dispatched: float  # perf_counter at dispatch
    k: int = 0  # draft length (0: plain steps)

    @property
    def part(self) -> list[Live]:
        return [lv for lv in self.plan if lv is not None]

    def serves(self, plan: list[Live | None]) -> bool:
        """Whether it is the call `plan` would make (the same requests in the same rows)."""
        return len(plan) == len(self.plan) and all(a is b for a, b in zip(plan, self.plan))


def next_rows(rows: Rows, out: DecodeOut | SpecOut) -> Rows:
    """The inputs of the call after `out`'s, from its outputs on the device: rows that finished are off (and, with
    lookup drafting, each row's history is the one the call ended with)."""
    history = getattr(out, "history", None)
    return rows._replace(cur=out.cur, n_out=out.n_out, active=out.live,
                         history=rows.history if history is None else history)


def may_run_ahead(plan: list[Live | None]) -> bool:
    """Whether the rows of `plan` may run a call ahead, as far as the requests go (the engine checks the rest:
    one device, plain rows, the only decode call, nothing waiting or prefilling): none with forced tokens or an
    open thinking budget (its next call's limit and forced tokens come from the host)."""
    return all(not lv.forced and (lv.request.budget is None or lv.budget_done)
               for lv in plan if lv is not None)
