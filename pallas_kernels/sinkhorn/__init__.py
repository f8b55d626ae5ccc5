"""Sinkhorn projection of small [m, m] logit matrices onto doubly stochastic ones (mHC), one launch for all tokens."""

from pallas_kernels.sinkhorn.blocks import BlockSizes
from pallas_kernels.sinkhorn.kernel import sinkhorn
from pallas_kernels.sinkhorn.reference import sinkhorn_reference
from pallas_kernels.sinkhorn.validate import validate_sinkhorn_static

__all__ = ["BlockSizes", "sinkhorn", "sinkhorn_reference", "validate_sinkhorn_static"]
