"""Grouped matmul over expert-sorted row tiles with block-scaled FP8 E4M3 weights (a base checkpoint's routed
experts), decoded per tile in registers."""

from pallas_kernels.grouped_matmul_fp8.blocks import BlockSizes
from pallas_kernels.grouped_matmul_fp8.kernel import grouped_matmul_fp8
from pallas_kernels.grouped_matmul_fp8.reference import grouped_matmul_fp8_reference
from pallas_kernels.grouped_matmul_fp8.validate import validate_grouped_matmul_fp8_static

__all__ = ["BlockSizes", "grouped_matmul_fp8", "grouped_matmul_fp8_reference", "validate_grouped_matmul_fp8_static"]
