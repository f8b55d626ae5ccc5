"""scripts/distill_draft.py: the MTP draft learns the target's distribution; the target's tensors stay as stored."""

import json
import os
import sys

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
import distill_draft  # noqa: E402


@pytest.fixture(scope="module")
def distilled(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("distill") / "model")
    report = distill_draft.main(["--smoke", "--out", out, "--steps", "8", "--eval-windows", "2"])
    return out, report


def test_the_draft_moves_towards_the_target(distilled):
    out, report = distilled
    assert report["steps"] == 8
    assert report["after"]["kl"] < 0.8 * report["before"]["kl"], (report["before"], report["after"])
    with open(os.path.join(out, "distill_report.json")) as f:
        assert json.load(f)["after"] == report["after"]


def test_only_the_mtp_tensors_change(distilled):
    out, _ = distilled
    src, new = load_file(os.path.join(out + ".source", "params.safetensors")), load_file(
        os.path.join(out, "params.safetensors"))
    assert set(src) == set(new)
    mtp = [k for k in src if k.startswith("mtp.")]
    assert mtp and any(src[k].tobytes() != new[k].tobytes() for k in mtp)
    for k in src:
        assert new[k].dtype == src[k].dtype and new[k].shape == src[k].shape, k
        if not k.startswith("mtp."):
            assert new[k].tobytes() == src[k].tobytes(), k


def test_export_refuses_a_tree_that_does_not_match(distilled, tmp_path):
    out, _ = distilled
    import ds4jax

    mtp = jax.device_get(ds4jax.load(out).params["mtp"])
    mtp["extra"] = np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="mtp"):
        distill_draft.export(out, mtp, str(tmp_path / "bad"), {})
    assert not (tmp_path / "bad").exists()
