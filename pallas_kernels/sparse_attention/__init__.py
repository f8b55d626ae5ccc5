"""Sparse MQA attention with a sink over two gathered row lists (spec §3.4)."""

from pallas_kernels.sparse_attention.blocks import BlockSizes
from pallas_kernels.sparse_attention.kernel import sparse_attention
from pallas_kernels.sparse_attention.reference import (
    attention_partials_reference,
    finalize_partials,
    merge_partials,
    sparse_attention_reference,
)
from pallas_kernels.sparse_attention.validate import (
    validate_sparse_attention_dynamic,
    validate_sparse_attention_static,
)

__all__ = [
    "BlockSizes",
    "attention_partials_reference",
    "finalize_partials",
    "merge_partials",
    "sparse_attention",
    "sparse_attention_reference",
    "validate_sparse_attention_dynamic",
    "validate_sparse_attention_static",
]
