"""The mHC pre-step of a decoder block in one launch: mixing weights, Sinkhorn, stream collapse, RMSNorm."""

from pallas_kernels.mhc_pre.blocks import BlockSizes
from pallas_kernels.mhc_pre.kernel import mhc_pre
from pallas_kernels.mhc_pre.reference import mhc_pre_reference
from pallas_kernels.mhc_pre.validate import validate_mhc_pre_static

__all__ = ["BlockSizes", "mhc_pre", "mhc_pre_reference", "validate_mhc_pre_static"]
