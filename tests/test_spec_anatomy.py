"""scripts/spec_anatomy.py's kernel groups: the op scopes the model records (`layer_stack.LayerAt.name`, under the
step's ``target`` / ``draft`` scopes when unrolled, alone inside a scan body) map to one group per layer or
scanned body, and draft ops to ``draft``."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import spec_anatomy  # noqa: E402
from ds4jax.model.config import AttentionType, MlpType  # noqa: E402
from ds4jax.model.layer_stack import LayerAt  # noqa: E402


def _name(attention: AttentionType, first: int, unit: int = 0) -> str:
    return LayerAt(attention, MlpType.TOPK, first=first, unit=((attention, MlpType.TOPK),) * unit).name


def test_groups_name_unrolled_layers_and_scanned_bodies():
    csa, hca = _name(AttentionType.CSA, 1), _name(AttentionType.HCA, 2, unit=2)
    assert (csa, hca) == ("layer1_csa", "layer2+2j_hca")  # the names the scopes carry
    assert spec_anatomy.group_of(f"jit(decode_loop)/while/body/target/{csa}/compressor/dot_general") == f"target/{csa}"
    assert spec_anatomy.group_of(f"{hca}/indexer/reduce_max") == f"target/{hca}"  # a scan body's op
    assert spec_anatomy.group_of("jit(speculative_loop)/while/body/draft/mtp/layer0_sliding/dot") == "draft"
    assert spec_anatomy.group_of("jit(decode_loop)/while/body/argmax") == "other"
