"""Prefix snapshots of engine slots: a slot's state as the host arrays a `snapshots.Snapshot` holds, written back
into another slot, and the check that a snapshot was made by an engine like this one.

The arrays are in the one-device layout whatever the programs (`programs.Programs.extract` / `inject`): the
target's per-slot arrays and the rows of its first `pages` pages, the draft's per-slot arrays, the slot's last
logits and stream.
"""

from __future__ import annotations

import time

import numpy as np

from ds4jax.errors import ArgumentError
from ds4jax.generation import logprob_rows, snapshots
from ds4jax.generation.delivery import Live
from ds4jax.generation.requests import ErrorCode, FinishReason, Request, TokenEvent
from ds4jax.generation.snapshots import Snapshot
from ds4jax.model.inputs import is_int
from ds4jax.runtime.distributed import fetch  # device_get across processes
from ds4jax.runtime.pool_spec import PoolSpec
from ds4jax.runtime.pools import PoolError


class SlotSnapshots:
    def __init__(self, programs, cfg, tspec: PoolSpec, dspec: PoolSpec | None):
        self.programs, self.tspec, self.dspec = programs, tspec, dspec
        self.ratios = snapshots.entries_per_page(cfg, tspec)  # paged arrays and their entries per page

    def arrays(self, tpool, dpool, slot_state, slot: int, pages: int) -> dict[str, np.ndarray]:
        """Host copies of `slot`'s state: its per-slot arrays, the rows of its first `pages` pages, last rows."""
        t = self.programs.extract(tpool, slot, self.tspec)
        d = self.programs.extract_draft(dpool, slot) if dpool is not None else {}
        logits, stream = self.programs.slot_rows(slot_state, slot)
        t, d, logits, stream = fetch((t, d, logits, stream))
        arrays = {f"target/{k}": v for k, v in t.items()}
        for name, per_page in self.ratios:
            arrays[f"target/{name}"] = arrays[f"target/{name}"][:, : pages * per_page]
        arrays.update({f"draft/{k}": v for k, v in d.items()})
        arrays["last_logits"], arrays["last_stream"] = logits, stream
        return arrays

    def write(self, tpool, dpool, slot_state, slot: int, arrays: dict, pages: int, length: int, *, draft: bool):
        """Write a snapshot's host arrays into `slot` (its pages already assigned): target at `length`, the draft
        (when `draft`) at `length` - 1 (`restore` computes its pending row). Returns (tpool, dpool, slot_state)."""
        target = {k[len("target/"):]: v for k, v in arrays.items() if k.startswith("target/")}
        for name, per_page in self.ratios:  # pad the held pages back to the slot's page capacity
            a = target[name]
            full = self.tspec.pages_per_slot * per_page
            target[name] = np.concatenate([a, np.zeros((a.shape[0], full - a.shape[1]) + a.shape[2:], a.dtype)], 1)
        tpool = self.programs.inject(tpool, slot, target, pages, length, self.tspec)
        if draft:
            mine = {k[len("draft/"):]: v for k, v in arrays.items() if k.startswith("draft/")}
            dpool = self.programs.inject_draft(dpool, slot, mine, length - 1, self.dspec)
        slot_state = self.programs.set_slot_rows(slot_state, slot, arrays["last_logits"], arrays["last_stream"])
        return tpool, dpool, slot_state


def mismatch(mine: dict[str, str], snap: Snapshot) -> list[str]:
    """The fingerprint fields that differ between this engine and the one that made `snap`. (Whether the snapshot
    holds the draft's state is not one: the pool specs in the fingerprint say whether that engine had a draft, and
    one saved while the draft was parked holds none; `admit` skips it while the draft runs.)"""
    return [k for k in sorted(set(mine) | set(snap.fingerprint)) if mine.get(k) != snap.fingerprint.get(k)]


class EngineSnapshots:
    """`Engine.snapshot` / `fingerprint` and the engine's side of prefix snapshots: saving a slot after a prefill
    chunk, writing a stored one into a new request's slot, and the restore call's first tokens (mixed into
    `Engine`)."""

    def fingerprint(self) -> dict[str, str]:
        if self._fingerprint is None:
            self._fingerprint = snapshots.fingerprint(self.model, self.tspec, self.dspec)
        return self._fingerprint

    def snapshot(self, which, at: int | None = None) -> Snapshot:
        """Snapshot a running request (its slot, or its `Request`) right after its prefill, e.g. from on_token of
        its first token. Positions inside the prompt (`at`) are taken during prefill: `Request(snapshot_at=...)`;
        `Request(snapshot=True)` snapshots the whole prompt without a callback."""
        if not isinstance(which, Request) and not is_int(which):
            raise ArgumentError("a running request's slot number or its Request", name="Engine.snapshot", value=which)
        if at is not None and not is_int(at):
            raise ArgumentError("a prompt length (an integer) or None", name="Engine.snapshot(at)", value=at)
        live = [lv for lv in self._slots.values() if lv.request is which or lv.slot == which]
        if not live:
            raise PoolError(f"snapshot({which!r}): no running request there")
        lv = live[0]
        if at is not None and at != len(lv.ids):
            raise PoolError(f"snapshot(at={at}): only the whole prompt ({len(lv.ids)} tokens) can be snapshotted "
                            "after prefill; pass Request(snapshot_at=({at},)) to snapshot inside the prompt")
        if lv.prefilling or len(lv.result.tokens) > 1:
            raise PoolError("snapshot(): a request can be snapshotted between its prefill and its first decode step")
        return self._save_snapshot(lv)

    def _save_snapshot(self, lv: Live) -> Snapshot:
        """Snapshot `lv`'s slot right after prefilling its first lv.pos prompt tokens."""
        pages = self.tbook.pages_needed(lv.pos)
        arrays = self._slot_snaps.arrays(self.tpool, self.dpool, self.slot_state, lv.slot, pages)
        snap = Snapshot(tuple(lv.ids[: lv.pos]), self.fingerprint(), arrays, pages)
        self.snapshots.put(snap)
        self.stats.snapshots_saved += 1
        return snap

    def _write_snapshot(self, slot: int, arrays: dict, pages: int, length: int) -> None:
        self.tpool, self.dpool, self.slot_state = self._slot_snaps.write(
            self.tpool, self.dpool, self.slot_state, slot, arrays, pages, length, draft=self._live_dspec is not None)

    def _inject(self, lv: Live, snap: Snapshot) -> None:
        bad = mismatch(self.fingerprint(), snap)
        if bad:
            self._out.finish(lv, FinishReason.ERROR, ErrorCode.INVALID_SNAPSHOT,
                             f"request {lv.index}: the prefix snapshot of {snap.length} tokens was made by another "
                             f"engine ({', '.join(bad)} differ)")
            return
        length = snap.length
        self._write_snapshot(lv.slot, snap.arrays, snap.pages, length)
        self.tbook.lengths[lv.slot] = length
        if self._live_dspec is not None:
            self.dbook.lengths[lv.slot] = length - 1
        lv.pos, lv.restored = length, length
        lv.result.prefill_tokens = len(lv.ids) - length
        self.stats.snapshot_hits += 1

    def _restore_once(self, live: list[Live], events: list[TokenEvent]) -> None:
        """First tokens of exact hits (sampled from the saved logits) and the draft's pending row."""
        exact = [lv.restored == len(lv.ids) for lv in live]
        if self._live_dspec is None and not any(exact):
            return
        rest = list(live)
        while rest:
            part = self._fit(rest, self.buckets.restore_rows)
            rest = rest[len(part):] if self.data == 1 else [lv for lv in rest if lv not in part]
            plan = self._row_plan(part, (self.buckets.restore_rows,))
            row_of = {lv.slot: r for r, lv in enumerate(plan) if lv is not None}
            rows = self._padding_rows(plan)
            b = rows.slots.shape[0]
            sampled, nxt = np.zeros(b, bool), np.zeros(b, np.int32)
            for lv in part:
                r = row_of[lv.slot]
                sampled[r] = lv.restored == len(lv.ids)
                nxt[r] = 0 if sampled[r] else lv.ids[lv.restored]
            first, lp = self._restore_call(rows, sampled, nxt)
            first, lp = np.asarray(fetch(first)), logprob_rows.fetch(lp, [lv.request for lv in part])
            if self._live_dspec is not None:
                for lv in part:
                    self.dbook.lengths[lv.slot] = lv.restored
            now = time.perf_counter()
            for lv in part:
                r = row_of[lv.slot]
                if sampled[r]:
                    self._first_token(lv, int(first[r]), logprob_rows.first(lp, r, lv.request.logprobs), now, events)
