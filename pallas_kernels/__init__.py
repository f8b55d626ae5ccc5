"""Pallas kernels for ds4jax (portable Pallas, Triton backend; interpret mode on CPU).

Each op: `op(...)` (kernel), `op_reference(...)` (pure jnp, same signature: the specification),
`validate_op_static/dynamic`, and a frozen `BlockSizes`. Backend selection lives in `_backend.py`.
This package never imports ds4jax.
"""

from pallas_kernels.fp8_matmul import BlockSizes as Fp8MatmulBlockSizes
from pallas_kernels.fp8_matmul import fp8_matmul, fp8_matmul_reference
from pallas_kernels.grouped_matmul import BlockSizes as GroupedMatmulBlockSizes
from pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_reference
from pallas_kernels.grouped_matmul_fp4 import BlockSizes as GroupedMatmulFp4BlockSizes
from pallas_kernels.grouped_matmul_fp4 import (
    gemv_block_sizes,
    grouped_gemv_fp4,
    grouped_gemv_fp4_reference,
    grouped_matmul_fp4,
    grouped_matmul_fp4_reference,
)
from pallas_kernels.grouped_matmul_fp8 import BlockSizes as GroupedMatmulFp8BlockSizes
from pallas_kernels.grouped_matmul_fp8 import grouped_matmul_fp8, grouped_matmul_fp8_reference
from pallas_kernels.indexer_topk import BlockSizes as IndexerTopkBlockSizes
from pallas_kernels.indexer_topk import (
    indexer_topk,
    indexer_topk_reference,
    validate_indexer_topk_dynamic,
    validate_indexer_topk_static,
)
from pallas_kernels.layer_matmul import layer_matmul, layer_matmul_reference
from pallas_kernels.mhc_pre import BlockSizes as MhcPreBlockSizes
from pallas_kernels.mhc_pre import mhc_pre, mhc_pre_reference, validate_mhc_pre_static
from pallas_kernels.sinkhorn import BlockSizes as SinkhornBlockSizes
from pallas_kernels.sinkhorn import sinkhorn, sinkhorn_reference, validate_sinkhorn_static
from pallas_kernels.sparse_attention import BlockSizes as SparseAttentionBlockSizes
from pallas_kernels.sparse_attention import (
    finalize_partials,
    merge_partials,
    sparse_attention,
    sparse_attention_reference,
    validate_sparse_attention_dynamic,
    validate_sparse_attention_static,
)

__all__ = [
    "Fp8MatmulBlockSizes",
    "fp8_matmul",
    "fp8_matmul_reference",
    "GroupedMatmulBlockSizes",
    "grouped_matmul",
    "grouped_matmul_reference",
    "GroupedMatmulFp4BlockSizes",
    "gemv_block_sizes",
    "grouped_gemv_fp4",
    "grouped_gemv_fp4_reference",
    "grouped_matmul_fp4",
    "grouped_matmul_fp4_reference",
    "GroupedMatmulFp8BlockSizes",
    "grouped_matmul_fp8",
    "grouped_matmul_fp8_reference",
    "IndexerTopkBlockSizes",
    "layer_matmul",
    "layer_matmul_reference",
    "MhcPreBlockSizes",
    "SinkhornBlockSizes",
    "SparseAttentionBlockSizes",
    "finalize_partials",
    "indexer_topk",
    "indexer_topk_reference",
    "merge_partials",
    "mhc_pre",
    "mhc_pre_reference",
    "sinkhorn",
    "sinkhorn_reference",
    "sparse_attention",
    "sparse_attention_reference",
    "validate_indexer_topk_dynamic",
    "validate_indexer_topk_static",
    "validate_mhc_pre_static",
    "validate_sinkhorn_static",
    "validate_sparse_attention_dynamic",
    "validate_sparse_attention_static",
]
