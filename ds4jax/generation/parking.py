"""Parking: a role's parameters moved to host memory and back, bit for bit, to where they were.

`Parking` keeps the host copies and which roles are parked; the engine frees and rebuilds the pools and state that
go with a role. Roles are `Role`s; the public `Engine.park` / `unpark` also take their names ('target', 'draft')
and '' / 'all' for both.
"""

from __future__ import annotations

import jax

from ds4jax.errors import ArgumentError
from ds4jax.runtime.pools import PoolError
from ds4jax.runtime.roles import Role

BOTH = (Role.TARGET, Role.DRAFT)


def roles(which, verb: str) -> tuple[Role, ...]:
    """`which` ('' / 'all', a role's name, a `Role`, or several of them) as roles in (target, draft) order."""
    items = which if isinstance(which, (list, tuple, set, frozenset)) else (which,)
    out = set()
    for item in items:
        if isinstance(item, Role):
            out.add(item)
        elif isinstance(item, str) and item in ("", "all"):
            out.update(BOTH)
        elif isinstance(item, str) and item in ("target", "draft"):
            out.add(Role(item))
        else:  # (a numpy array compared with the names raised numpy's own ValueError)
            raise ArgumentError("expected '' or 'all' (both), 'target' or 'draft' (or a Role, or several)",
                                name=f"Engine.{verb}", value=which)
    return tuple(r for r in BOTH if r in out)


def param_keys(params: dict, role: Role) -> list[str]:
    """The parameters a role owns: the draft its MTP block, the target everything else (embedding and head too:
    the draft cannot run without them either)."""
    return ["mtp"] if role is Role.DRAFT else [k for k in params if k != "mtp"]


def _placements(tree) -> list:
    """Each leaf's sharding if it is committed to it, else None: parked weights come back exactly where they were
    (a warmed-up program keys its executable on whether each argument is committed)."""
    return [x.sharding if getattr(x, "committed", False) else None for x in jax.tree.leaves(tree)]


def delete(tree) -> None:
    for leaf in jax.tree.leaves(tree):
        if isinstance(leaf, jax.Array) and not leaf.is_deleted():
            leaf.delete()


class Parking:
    def __init__(self):
        self.parked: set[Role] = set()
        self._host: dict[Role, dict] = {}

    def __contains__(self, role: Role) -> bool:
        return role in self.parked

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(r.value for r in self.parked))

    def park(self, params: dict, role: Role) -> list:
        """Copy the role's parameters to the host and take them out of `params` (their entries become None).
        Returns the device arrays to delete."""
        keys = param_keys(params, role)
        self._host[role] = {k: (jax.device_get(params[k]), _placements(params[k])) for k in keys}
        doomed = [params[k] for k in keys]
        for k in keys:
            params[k] = None
        self.parked.add(role)
        return doomed

    def unpark(self, params: dict, role: Role) -> None:
        """Put the role's parameters back into `params`, each leaf where it was."""
        for k, (host, placements) in self._host.pop(role).items():
            leaves, treedef = jax.tree.flatten(host)
            params[k] = jax.tree.unflatten(treedef, [jax.device_put(x, p) for x, p in zip(leaves, placements)])
        self.parked.discard(role)


class EngineParking:
    """`Engine.park` / `unpark` / `parked` (mixed into `Engine`: the pools and state of a parked role go with
    its parameters, fresh ones come back with them)."""

    def park(self, which: str | Role = "") -> None:
        """Release device memory: 'target' / `Role.TARGET` (its parameters, pools and per-slot state; the draft
        cannot run without the target's embedding and head either), 'draft' / `Role.DRAFT` (the MTP parameters and
        the draft pool), or both ('' / 'all'). Parameters are kept in host memory; requests needing a parked
        model return `ErrorCode.MODEL_PARKED`. The engine deletes the device buffers of the model it was built
        with."""
        parts = roles(which, "park")
        with self._exclusive("park()"):
            self._park(parts)

    def _park(self, parts: tuple[Role, ...]) -> None:
        # the snapshots' fingerprint covers every weight: take it while they are all here, or one taken later
        # (at the first snapshot) would describe the model without its parked part, and the snapshots saved from
        # then on would be refused by every engine that never parked (`INVALID_SNAPSHOT`, "model differ")
        if not self._parking.parked:  # (a later park finds it taken by the first)
            self.fingerprint()
        self.programs.drop_draft_params()  # a layer split's embedding copy for the draft goes with either part
        for role in parts:
            if role in self._parking or (role is Role.DRAFT and not self.k):
                continue
            doomed = self._parking.park(self.model.params, role)
            if role is Role.TARGET:
                doomed += [self.tpool, self.slot_state]
                self.tpool = self.slot_state = None
            else:
                doomed.append(self.dpool)
                self.dpool = None
            delete(doomed)

    def unpark(self, which: str | Role = "") -> None:
        """Bring parked models back (same parameters bit for bit, fresh pools); unparking only the draft while
        the target is parked is an error."""
        parts = roles(which, "unpark")
        if parts == (Role.DRAFT,) and Role.TARGET in self._parking:
            raise PoolError("unpark('draft'): the target is parked and the draft needs it; unpark('target') or "
                            "unpark('all') first")
        with self._exclusive("unpark()"):
            for role in parts:
                if role in self._parking:
                    self._parking.unpark(self.model.params, role)
                    self._new_state(role)

    @property
    def parked(self) -> tuple[str, ...]:
        return self._parking.names()
