"""Dense matmul with one layer of a stacked (unquantized) weight, the stack read in place."""

from pallas_kernels.layer_matmul.kernel import layer_matmul
from pallas_kernels.layer_matmul.reference import layer_matmul_reference
from pallas_kernels.layer_matmul.validate import validate_layer_matmul_static

__all__ = ["layer_matmul", "layer_matmul_reference", "validate_layer_matmul_static"]
