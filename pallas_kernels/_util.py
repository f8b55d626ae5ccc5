"""Small integer helpers shared by all kernels (defined once, per the style guide)."""

from __future__ import annotations


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1). Triton tensors need power-of-two extents."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def edge_bound(extent: int, tile: int) -> int | None:
    """The bound a tile along a dim of `extent` must be masked at, None when whole tiles cover it exactly."""
    return None if extent % tile == 0 else extent
