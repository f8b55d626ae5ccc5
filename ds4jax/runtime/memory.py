"""Does an allocation fit? The device's free memory where JAX reports it (GPU: ``bytes_limit - bytes_in_use``;
the CPU backend: the host's available memory), compared with what is about to be allocated, so a config or a
pool that cannot fit fails before the allocation with a `DeviceMemoryError` naming what was being allocated and
the fields it grows with, instead of an XLA out-of-memory deep inside a step (or the host's OOM killer).
Where nothing is reported the check passes: the allocation itself then decides.
"""

from __future__ import annotations

from typing import Any

from ds4jax.errors import DeviceMemoryError


def _host_available() -> int | None:
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def free_bytes(device: Any) -> int | None:
    """Bytes `device` can still allocate, or None when unknown."""
    try:
        stats = device.memory_stats()
    except Exception:  # backends without memory stats raise or return None
        stats = None
    if stats and "bytes_limit" in stats:
        return int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0))
    if getattr(device, "platform", None) == "cpu":
        return _host_available()
    return None


def _gib(n: int) -> str:
    return f"{n / 2**30:,.2f} GiB"


def check_fits(nbytes: int, what: str, device: Any = None) -> None:
    """`DeviceMemoryError` when `nbytes` (the allocation `what` describes, naming the fields it grows with)
    exceed what `device` (default: JAX's first device) has free."""
    if device is None:
        import jax

        device = jax.devices()[0]
    free = free_bytes(device)
    if free is not None and nbytes > free:
        raise DeviceMemoryError(f"out of memory before allocating {what}: it needs {_gib(nbytes)}, {device} has "
                                f"{_gib(max(free, 0))} free")
