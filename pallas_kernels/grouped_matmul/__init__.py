"""Grouped matmul over expert-sorted row tiles (the routed experts of an MoE layer, decode and prefill)."""

from pallas_kernels.grouped_matmul.blocks import BlockSizes
from pallas_kernels.grouped_matmul.kernel import grouped_matmul
from pallas_kernels.grouped_matmul.reference import grouped_matmul_reference
from pallas_kernels.grouped_matmul.validate import validate_grouped_matmul_static

__all__ = ["BlockSizes", "grouped_matmul", "grouped_matmul_reference", "validate_grouped_matmul_static"]
