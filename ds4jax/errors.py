"""ds4jax's exceptions: one small hierarchy, so callers catch `Ds4jaxError` and the CLI maps each to an exit status.

    Ds4jaxError
    ├── InputError (ValueError)           bad input: the user can fix it; `ds4jax` exits 2
    │   ├── ConfigError                   config.json / `Config` fields
    │   ├── CheckpointError               checkpoint files: headers, index, tensor names, shapes, dtypes, scales, values
    │   ├── TokenizerError                tokenizer files; token ids outside the model's vocabulary
    │   ├── ArgumentError                 Python API arguments: SamplingParams, token ids, lengths, chunk sizes, dtypes
    │   │   └── UsageError                command-line arguments
    │   ├── PoolSpecError                 pool capacities that cannot be built or cannot hold what is asked
    │   └── PoolError                     a step input that would overflow a pool (nothing has been written)
    │       └── EngineBusy                an Engine call from inside another call of that engine (a callback)
    └── RuntimeFailure (RuntimeError)     valid input, failed run; `ds4jax` exits 3
        ├── NonFiniteError                NaN/Inf logits; names the first layer that produced them
        └── DeviceMemoryError             out of device memory; names the sizes involved

Every error names its culprit: `source` (a file or object), `name` (a field, tensor or argument) and `value`.
These are optional keywords, so ``raise ConfigError("Config.x: must be > 0")`` also works; when given they are
rendered as ``source: name=value: message``. Catch `InputError` for "the input was wrong", `Ds4jaxError` for
anything ds4jax raised on purpose. This module imports nothing from ds4jax (every floor may raise from it).
"""

from __future__ import annotations

from typing import Any, ClassVar

_NO_VALUE: Any = object()
_MAX_VALUE_CHARS = 80


def show_value(value: Any) -> str:
    """``repr(value)``, shortened so a fuzzed 1 MB string cannot flood the terminal."""
    try:
        text = repr(value)
    except Exception:  # a hostile __repr__ must not hide the real error
        text = f"<{type(value).__name__}>"
    return text if len(text) <= _MAX_VALUE_CHARS else text[: _MAX_VALUE_CHARS - 3] + "..."


class Ds4jaxError(Exception):
    """Base of every error ds4jax raises on purpose. `exit_status` is what the ``ds4jax`` command exits with."""

    exit_status: ClassVar[int] = 2

    def __init__(self, message: str, *, source: Any = None, name: str | None = None, value: Any = _NO_VALUE):
        self.message = message
        self.source = None if source is None else str(source)
        self.name = name
        self.value = value
        super().__init__(str(self))

    def __str__(self) -> str:
        parts = [] if self.source is None else [self.source]
        if self.name is not None:
            parts.append(self.name if self.value is _NO_VALUE else f"{self.name}={show_value(self.value)}")
        elif self.value is not _NO_VALUE:
            parts.append(f"got {show_value(self.value)}")
        parts.append(self.message)
        return ": ".join(parts)

    def __reduce__(self):  # keep the keywords across pickling (pytest-xdist, multiprocessing)
        return _rebuild, (type(self), self.message, self.source, self.name, self.value)


def _rebuild(cls, message, source, name, value):
    return cls(message, source=source, name=name, value=value)


class InputError(Ds4jaxError, ValueError):
    """The input is wrong (a file, a field, an argument); nothing was written. ``ds4jax`` exits 2."""


class ConfigError(InputError):
    """An invalid configuration (``config.json`` or a `Config` field); names the field and its value."""


class CheckpointError(InputError):
    """A checkpoint that cannot be loaded; names the tensor (or shard / index / config) and its file."""


class TokenizerError(InputError):
    """A tokenizer that cannot be loaded or does not fit the model; names the file or the token id."""


class ArgumentError(InputError):
    """An invalid argument to the Python API (sampling parameters, token ids, lengths, chunk sizes, dtypes)."""


class UsageError(ArgumentError):
    """An invalid command-line argument or combination of arguments."""


class PoolSpecError(InputError):
    """An invalid pool specification or an impossible sizing request; names the field."""


class PoolError(InputError):
    """A request would overflow its pool, or a step input is invalid; names the row, slot and value.
    Nothing has been written."""


class EngineBusy(PoolError):
    """An `Engine` call made from inside another call of the same engine on the same thread (e.g. a callback
    calling `generate`): it would wait for itself. Calls from other threads wait their turn instead."""


class RuntimeFailure(Ds4jaxError, RuntimeError):
    """The input was valid but the run failed (numerics, device memory). ``ds4jax`` exits 3."""

    exit_status: ClassVar[int] = 3


class NonFiniteError(RuntimeFailure):
    """NaN or Inf in the activations; `name` is the first layer (or ``logits``) that produced them."""


class DeviceMemoryError(RuntimeFailure):
    """The device ran out of memory; the message gives the sizes involved and what to reduce."""


__all__ = [
    "ArgumentError", "CheckpointError", "ConfigError", "DeviceMemoryError", "Ds4jaxError", "EngineBusy", "InputError",
    "NonFiniteError", "PoolError", "PoolSpecError", "RuntimeFailure", "TokenizerError", "UsageError", "show_value",
]
