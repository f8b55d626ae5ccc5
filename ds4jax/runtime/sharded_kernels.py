"""The Pallas kernels under a mesh: each runs inside ``shard_map`` with explicit specs, so XLA never has to
partition (or gather around) a custom call. Query heads split over the mesh axes of ``heads`` (TP attention: a
device attends with its heads only); pools, index rows, indexer inputs and Sinkhorn logits enter whole on every
device of the automatic axes (they are replicated there; under data parallelism the step's own ``shard_map`` has
already given each data shard its pools and tokens). Without a mesh the kernel is called directly.
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from ds4jax.model import sharding


def per_head(kernel, q, *rest, sink):
    """kernel(q [t, h, d], *rest, sink [h]) -> [t, h, d], with heads split over the ``heads`` mesh axes."""
    act = sharding.active()
    if act is None:
        return kernel(q, *rest, sink)
    heads = act.spec((q.shape[1],), ("heads",))[0]
    specs = (P(None, heads, None),) + (P(),) * len(rest) + (P(heads),)
    return jax.shard_map(kernel, mesh=act.mesh, in_specs=specs, out_specs=P(None, heads, None),
                         axis_names=set(act.auto), check_vma=False)(q, *rest, sink)


def replicated(kernel, *args):
    """kernel(*args) computed on every device from whole (replicated) inputs: no partitioning of the call."""
    act = sharding.active()
    if act is None:
        return kernel(*args)
    return jax.shard_map(kernel, mesh=act.mesh, in_specs=(P(),) * len(args), out_specs=P(),
                         axis_names=set(act.auto), check_vma=False)(*args)
