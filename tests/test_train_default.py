"""scripts/train_default.py --smoke: the loss goes down over a few CPU steps, and a rerun resumes from the
Orbax training state instead of starting over."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))

import train_default  # noqa: E402

import ds4jax  # noqa: E402


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("smoke")
    first = train_default.main(["--smoke", "--workdir", str(workdir), "--steps", "8"])
    return workdir, first


def test_smoke_training_lowers_the_loss(smoke):
    _, report = smoke
    losses = [h["loss"] for h in report["history"]]
    assert len(losses) == 8 and np.all(np.isfinite(losses))
    assert np.mean(losses[-2:]) < losses[0] - 0.3, losses  # from ~ln(259) = 5.56 nats
    assert report["evals"] and report["heldout"]["loss"] < np.log(259)


def test_smoke_rerun_resumes_and_exports(smoke):
    workdir, first = smoke
    again = train_default.main(["--smoke", "--workdir", str(workdir), "--steps", "10"])
    assert again["invocations"] == 2 and again["steps"] == 10
    assert [h["step"] for h in again["history"]] == list(range(1, 11))  # steps 1..8 kept, 9..10 added
    assert again["history"][:8] == first["history"]
    model = ds4jax.load(workdir / "model")  # the export is an Orbax checkpoint ds4jax loads
    assert model.has_mtp and model.config.num_layers == 3
    report = json.loads((workdir / "model" / "train_report.json").read_text())
    assert report["steps"] == 10
