"""Argument types and progress output shared by the subcommands (standard library only)."""

from __future__ import annotations

import argparse
import math
import sys
import time


def _int_at_least(low: int, name: str):
    """An argparse type: an integer >= `low` (a clear message otherwise)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    parse.__name__ = name
    return parse


positive_int = _int_at_least(1, "positive_int")
non_negative_int = _int_at_least(0, "non_negative_int")


def port_number(text: str) -> int:
    """A TCP port: 0 (any free one) to 65535; a port outside failed only at bind time, after the model's load and
    warm-up."""
    value = non_negative_int(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be a TCP port (0 to 65535), got {value}")
    return value


def host_name(text: str) -> str:
    """An address to bind: not empty, no whitespace."""
    if not text or text != text.strip() or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"must be a host name or address, got {text!r}")
    return text


def integer(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer, got {text!r}") from None
    if not -(2**63) <= value < 2**63:
        raise argparse.ArgumentTypeError(f"must fit in 64 bits, got {text}")
    return value


def _number(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be finite, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def probability(text: str) -> float:
    value = _number(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def positive_float(text: str) -> float:
    value = _number(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


MAX_GIB = 2**20  # a PiB: more than any device has, and its bytes stay an exact integer


def gibibytes(text: str) -> float:
    """A memory size in GiB: > 0, at most a PiB (1e308 GiB overflowed its conversion to bytes)."""
    value = positive_float(text)
    if value > MAX_GIB:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_GIB} GiB, got {text}")
    return value


class Progress:
    """Short ``ds4jax: ...`` lines on stderr (silenced by --quiet), each with the time since the command began."""

    def __init__(self, quiet: bool):
        self.quiet = quiet
        self.start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def __call__(self, message: str) -> None:
        if not self.quiet:
            print(f"ds4jax: [{self.elapsed():5.1f} s] {message}", file=sys.stderr, flush=True)


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless the help already says it or there is no value to show."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if ("default" in text or default in (None, False, True, argparse.SUPPRESS)
                or action.option_strings == [] or isinstance(action, argparse._VersionAction)):
            return text
        return f"{text} (default: {default})"
