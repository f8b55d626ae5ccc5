"""Joining a multi-process job (``jax.distributed``) with failures that end it, and start-up agreement checks.

* `init_distributed` runs ``jax.distributed.initialize`` when the job was launched on several processes
  (``JAX_COORDINATOR_ADDRESS`` with ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``: what ``ds4jax launch`` sets, or a
  SLURM / Open MPI job of more than one task), with the coordination service's timeouts from the environment
  (`TIMEOUTS`): a process that dies stops sending heartbeats, and after ``DS4JAX_HEARTBEAT_TIMEOUT`` seconds the
  service ends every other process with "Terminating process because the JAX distributed service detected fatal
  errors ... tasks are unhealthy (stopped sending heartbeats)" instead of leaving it blocked in a collective.
  A coordinator on a loopback address keeps the CPU collectives (gloo) on 127.0.0.1 too.
* `agree(what, value)` compares a value across processes through the coordination service's key-value store
  (no device work) and raises `DistributedError` naming the processes that differ: the CLI checks the ds4jax and
  jax versions, its arguments and a fingerprint of the checkpoint before it loads anything.
* `broadcast(what, value)`: process 0's value in every process (e.g. the ids a resumed batch job already has).
"""

from __future__ import annotations

import hashlib
import inspect
import ipaddress
import json
import os
from typing import Any

from ds4jax.errors import InputError

# jax.distributed.initialize argument -> (environment variable, default seconds). jax's own defaults (300 s to
# connect, a dead process noticed after 100 s, 300 s to shut down) let a failed job sit for minutes.
TIMEOUTS = {
    "initialization_timeout": ("DS4JAX_INIT_TIMEOUT", 300),
    "heartbeat_timeout_seconds": ("DS4JAX_HEARTBEAT_TIMEOUT", 30),
    "shutdown_timeout_seconds": ("DS4JAX_SHUTDOWN_TIMEOUT", 30),
}
# how long a process waits for another's value: past it the wait fails rather than hangs (a process that died is
# noticed sooner, by the heartbeat); a broadcast waits for process 0's work before it (a batch job's output read)
_AGREE_TIMEOUT_S, _BROADCAST_TIMEOUT_S = 120, 900
_CHUNK = 1 << 20  # key-value store values are sent in gRPC messages: big ones go in pieces


class DistributedError(InputError):
    """Processes of one job disagree (checkpoint, config, arguments, versions), or the job cannot be joined."""


def _client():
    from jax._src import distributed as _dist

    return _dist.global_state.client


def launched(env=os.environ) -> bool:
    """Whether this process belongs to a multi-process job that has not been joined yet."""
    return ("JAX_COORDINATOR_ADDRESS" in env or int(env.get("SLURM_NTASKS", "1")) > 1
            or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1)


def joined() -> bool:
    return _client() is not None


def process_index() -> int:
    """This process's index (0 when not in a multi-process job); never starts a backend by itself."""
    from jax._src import distributed as _dist

    return _dist.global_state.process_id if joined() else 0


def process_count() -> int:
    from jax._src import distributed as _dist

    return _dist.global_state.num_processes if joined() else 1


def timeouts(env=os.environ) -> dict[str, int]:
    """The coordination-service timeouts (seconds) for this jax: `TIMEOUTS` overridden by their variables."""
    accepted = inspect.signature(__import__("jax").distributed.initialize).parameters
    out = {}
    for arg, (var, default) in TIMEOUTS.items():
        if arg not in accepted:  # an older / newer jax without it: its default
            continue
        try:
            value = int(env.get(var, default))
        except ValueError:
            raise DistributedError(f"{var}={env[var]!r} must be a whole number of seconds") from None
        if value < 1:
            raise DistributedError(f"{var}={value} must be at least 1 second")
        out[arg] = value
    return out


def init_distributed(**kwargs) -> bool:
    """Join a multi-process job with ``jax.distributed.initialize`` when one is launched; returns True if joined.

    Detected: ``JAX_COORDINATOR_ADDRESS`` (with ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID``, or keyword arguments),
    or a SLURM / Open MPI job of more than one task (jax's own cluster detection). Must run before anything
    touches a device; `make_mesh` calls it, so scripts only need to call `make_mesh` first. Every process then
    sees every device in ``jax.devices()``, holds the shards of its own devices, and loads only those."""
    import jax

    if joined():
        return True
    env = os.environ
    if not kwargs and not launched(env):
        return False
    if kwargs.get("num_processes") is None and "JAX_NUM_PROCESSES" in env:
        kwargs["num_processes"] = int(env["JAX_NUM_PROCESSES"])
    if kwargs.get("process_id") is None and "JAX_PROCESS_ID" in env:
        kwargs["process_id"] = int(env["JAX_PROCESS_ID"])
    for arg, value in timeouts(env).items():
        kwargs.setdefault(arg, value)
    address = kwargs.get("coordinator_address") or env.get("JAX_COORDINATOR_ADDRESS")
    loopback = address is not None and _is_loopback(address)
    if loopback and "JAX_COORDINATOR_BIND_ADDRESS" not in env:  # jax binds [::]:port (every interface) by default
        kwargs.setdefault("coordinator_bind_address", f"127.0.0.1:{address.rsplit(':', 1)[1]}")
    try:
        jax.distributed.initialize(**kwargs)
    except (RuntimeError, ValueError) as e:
        raise DistributedError(f"jax.distributed.initialize failed ({e}); call ds4jax.make_mesh (or "
                               f"init_distributed) before anything creates a jax array") from None
    if loopback:
        _cpu_collectives_on_loopback()
        _transfers_on_loopback()
    return True


def _is_loopback(address: str) -> bool:
    host = address.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _cpu_collectives_on_loopback() -> None:
    """CPU collectives (gloo) advertise this host's name by default, which may resolve to an outside address;
    a job on one machine keeps them on 127.0.0.1 (the CPU backend is created later, on first device use)."""
    import jax
    from jax._src import xla_bridge
    from jax._src.lib import _jax

    if jax.config.jax_cpu_collectives_implementation not in (None, "gloo"):
        return

    def cpu_client():
        collectives = _jax.make_gloo_tcp_collectives(distributed_client=_client(), hostname="127.0.0.1")
        return xla_bridge.make_cpu_client(collectives=collectives)

    xla_bridge.register_backend_factory("cpu", cpu_client, priority=0, fail_quietly=False)


def _transfers_on_loopback() -> None:
    """Device-to-device copies between processes (a layer split's stage handoff) on backends that cannot do them
    natively (CPU) go through jax's transfer server: on 127.0.0.1, at a free port of this process."""
    import socket

    import jax

    flag = "jax_cross_host_transfer_socket_address"
    if flag not in jax.config.values or jax.config.values[flag]:  # a jax without it, or the user's own address
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    jax.config.update(flag, f"127.0.0.1:{port}")
    jax.config.update("jax_cross_host_transport_addresses", "127.0.0.1:0")  # its default: 0.0.0.0 (every interface)


def put(x, sharding):
    """`jax.device_put` that also places host values on devices of other processes: every process builds its own
    devices' blocks from its (equal) copy. (``device_put`` of a host value in a multi-process job first all-gathers
    it to check the copies agree, and fails for a sharding with no devices in this process, a layer split's other
    stage.) Global arrays go through ``device_put`` (a copy between processes where they differ)."""
    import jax
    import numpy as np

    if process_count() == 1:
        return jax.device_put(x, sharding)
    # a global array moves (between processes if need be); a host value or this process's own array is a copy
    if isinstance(x, jax.Array) and not (x.is_fully_addressable and not sharding.is_fully_addressable):
        return jax.device_put(x, sharding)
    value = np.asarray(x)
    return jax.make_array_from_callback(value.shape, sharding, value.__getitem__, dtype=value.dtype)


def fetch(tree):
    """`jax.device_get` for every process of a job, whatever devices an array lives on: an array over every process
    (a data-parallel step's rows) is all-gathered (`multihost_utils.process_allgather`); one held by a single
    process (a layer split's last stage) is read there and sent to the others through the key-value store. Every
    process must call it on the same mesh arrays (SPMD); an array on one device (`SingleDeviceSharding`) is
    taken for this process's own and read locally."""
    import jax

    if process_count() == 1:
        return jax.device_get(tree)

    def whole(x):
        if not isinstance(x, jax.Array) or isinstance(x.sharding, jax.sharding.SingleDeviceSharding):
            return x  # one device's array is this process's own (a one-device engine beside the job)
        if x.is_fully_replicated and not x.is_fully_addressable and x.addressable_shards:
            return x.addressable_data(0)  # every process holds a whole copy
        holders = sorted({d.process_index for d in x.sharding.device_set})
        if len(holders) == process_count():
            if x.is_fully_addressable:
                return x
            from jax.experimental import multihost_utils

            return multihost_utils.process_allgather(x, tiled=True)
        if len(holders) == 1:
            return _from_holder(x, holders[0])
        raise DistributedError(f"cannot read an array held by processes {holders} of {process_count()}")

    return jax.device_get(jax.tree.map(whole, tree))


def _from_holder(x, holder: int):
    import io

    import numpy as np

    key, client = _key("fetch"), _client()
    if process_index() == holder:
        value = np.asarray(x)
        buf = io.BytesIO()
        np.save(buf, value, allow_pickle=False)
        _put_bytes(key, buf.getvalue())
        return value
    value = np.load(io.BytesIO(_get_bytes(key, holder, _BROADCAST_TIMEOUT_S)), allow_pickle=False)
    if client.key_value_increment(f"{key}/read", 1) == process_count() - 1:  # the last reader frees the value
        client.key_value_delete(key)
    return value


# ---- agreement across processes -----------------------------------------------------------------------------------

_rounds: dict[str, int] = {}


def _key(what: str) -> str:
    n = _rounds.get(what, 0)  # the same check may run more than once per job
    _rounds[what] = n + 1
    return f"ds4jax/{what}/{n}"


def _put(key: str, text: str) -> None:
    _put_bytes(key, text.encode())


def _put_bytes(key: str, data: bytes) -> None:
    client = _client()
    chunks = [data[i : i + _CHUNK] for i in range(0, len(data), _CHUNK)] or [b""]
    for i, chunk in enumerate(chunks):
        client.key_value_set_bytes(f"{key}/{i}", chunk)
    client.key_value_set(f"{key}/n", str(len(chunks)))


def _get(key: str, owner: int, timeout_s: int) -> str:
    return _get_bytes(key, owner, timeout_s).decode()


def _get_bytes(key: str, owner: int, timeout_s: int) -> bytes:
    client, ms = _client(), timeout_s * 1000
    try:
        n = int(client.blocking_key_value_get(f"{key}/n", ms))
        return b"".join(client.blocking_key_value_get_bytes(f"{key}/{i}", ms) for i in range(n))
    except Exception as e:  # jax raises its own runtime error types for a deadline or a lost service
        raise DistributedError(f"process {owner} did not publish {key!r} within {timeout_s} s "
                               f"({str(e).splitlines()[0][:200]})") from None


def agree(what: str, value: Any) -> None:
    """Raise `DistributedError` unless every process passes an equal (JSON-able) `value`; a no-op alone."""
    if process_count() == 1:
        return
    key, me = _key(f"agree/{what}"), process_index()
    _put(f"{key}/{me}", json.dumps(value, sort_keys=True))
    values = {p: json.loads(_get(f"{key}/{p}", p, _AGREE_TIMEOUT_S)) for p in range(process_count())}
    differ = sorted(p for p, v in values.items() if v != values[0])
    if differ:
        raise DistributedError(f"processes disagree on {what}: process 0 has {_short(values[0])}, "
                               + ", ".join(f"process {p} has {_short(values[p])}" for p in differ))


def broadcast(what: str, value: Any = None, timeout_s: int = _BROADCAST_TIMEOUT_S) -> Any:
    """Process 0's (JSON-able) `value` in every process (the others wait up to `timeout_s` for it)."""
    if process_count() == 1:
        return value
    key = _key(f"broadcast/{what}")
    if process_index() == 0:
        _put(key, json.dumps(value))
        return value
    return json.loads(_get(key, 0, timeout_s))


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 200 else text[:197] + "..."


def checkpoint_fingerprint(path: str) -> str:
    """A digest of a checkpoint directory that differs when its files differ: every file's name and size, all of
    config.json, and the first MiB of every other file (a safetensors header: tensor names, dtypes, shapes, offsets;
    Orbax metadata). Cheap for any size of checkpoint; two checkpoints equal in all of that but differing in a
    weight further into a file are not told apart."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            rel = os.path.relpath(full, path)
            h.update(f"{rel}\0{os.path.getsize(full)}\0".encode())
            with open(full, "rb") as f:
                h.update(f.read() if rel == "config.json" else f.read(_CHUNK))
    return h.hexdigest()[:16]


__all__ = ["DistributedError", "TIMEOUTS", "agree", "broadcast", "checkpoint_fingerprint", "init_distributed",
           "joined", "launched", "process_count", "process_index", "timeouts"]
