"""Lightning-indexer scoring + top-k selection over a request's compressed entries (spec §3.8)."""

from pallas_kernels.indexer_topk.blocks import BlockSizes
from pallas_kernels.indexer_topk.kernel import indexer_topk
from pallas_kernels.indexer_topk.reference import indexer_scores_reference, indexer_topk_reference, select_topk
from pallas_kernels.indexer_topk.validate import validate_indexer_topk_dynamic, validate_indexer_topk_static

__all__ = [
    "BlockSizes",
    "indexer_scores_reference",
    "indexer_topk",
    "indexer_topk_reference",
    "select_topk",
    "validate_indexer_topk_dynamic",
    "validate_indexer_topk_static",
]
