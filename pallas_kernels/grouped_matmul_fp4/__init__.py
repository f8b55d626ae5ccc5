"""Grouped matmul over expert-sorted row tiles with MXFP4 weights (packed E2M1 + E8M0 scales), dequantized per
tile in registers; the GEMV form (one row per expert selection, no dot) for decode."""

from pallas_kernels.grouped_matmul_fp4.blocks import BlockSizes
from pallas_kernels.grouped_matmul_fp4.gemv import gemv_block_sizes, grouped_gemv_fp4, grouped_gemv_fp4_reference
from pallas_kernels.grouped_matmul_fp4.kernel import grouped_matmul_fp4
from pallas_kernels.grouped_matmul_fp4.reference import grouped_matmul_fp4_reference
from pallas_kernels.grouped_matmul_fp4.validate import validate_grouped_matmul_fp4_static

__all__ = ["BlockSizes", "gemv_block_sizes", "grouped_gemv_fp4", "grouped_gemv_fp4_reference", "grouped_matmul_fp4",
           "grouped_matmul_fp4_reference", "validate_grouped_matmul_fp4_static"]
