"""Prefix snapshots of engine slots: a slot's state as the host arrays a `snapshots.Snapshot` holds, written back
into another slot, and the check that a snapshot was made by an engine like this one.

The arrays are in the one-device layout whatever the programs (`programs.Programs.extract` / `inject`): the
target's per-slot arrays and the rows of its first `pages` pages, the draft's per-slot arrays, the slot's last
logits and stream.
"""

from __future__ import annotations

import jax
import numpy as np

from ds4jax.generation import snapshots
from ds4jax.generation.snapshots import Snapshot
from ds4jax.runtime.pool_spec import PoolSpec


class SlotSnapshots:
    def __init__(self, programs, cfg, tspec: PoolSpec, dspec: PoolSpec | None):
        self.programs, self.tspec, self.dspec = programs, tspec, dspec
        self.ratios = snapshots.entries_per_page(cfg, tspec)  # paged arrays and their entries per page

    def arrays(self, tpool, dpool, slot_state, slot: int, pages: int) -> dict[str, np.ndarray]:
        """Host copies of `slot`'s state: its per-slot arrays, the rows of its first `pages` pages, last rows."""
        t = self.programs.extract(tpool, slot, self.tspec)
        d = self.programs.extract_draft(dpool, slot) if dpool is not None else {}
        logits, stream = self.programs.slot_rows(slot_state, slot)
        t, d, logits, stream = jax.device_get((t, d, logits, stream))
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


def mismatch(mine: dict[str, str], snap: Snapshot, has_draft: bool) -> list[str]:
    """What differs between this engine and the one that made `snap` (fingerprint fields, or 'draft')."""
    bad = [k for k in sorted(set(mine) | set(snap.fingerprint)) if mine.get(k) != snap.fingerprint.get(k)]
    if not bad and has_draft != any(k.startswith("draft/") for k in snap.arrays):
        bad = ["draft"]
    return bad
