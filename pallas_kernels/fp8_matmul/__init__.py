"""Dense matmul with FP8 E4M3 weights and float32 block scales, dequantized per tile in registers."""

from pallas_kernels.fp8_matmul.blocks import BlockSizes
from pallas_kernels.fp8_matmul.kernel import fp8_matmul
from pallas_kernels.fp8_matmul.reference import dequantize_fp8, fp8_matmul_reference
from pallas_kernels.fp8_matmul.validate import validate_fp8_matmul_static

__all__ = ["BlockSizes", "dequantize_fp8", "fp8_matmul", "fp8_matmul_reference", "validate_fp8_matmul_static"]
