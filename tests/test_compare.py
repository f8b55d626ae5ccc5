"""ds4jax vs HF transformers on tiny random checkpoints (`ds4jax.compare`)."""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import hf_reference as hr  # noqa: E402

from ds4jax.io import checkpoint  # noqa: E402
from ds4jax.compare import CompareReport, error_row, run_compare  # noqa: E402
from ds4jax.model.config import AttentionType, MlpType, tiny  # noqa: E402


def variant():
    A = AttentionType
    return tiny(num_layers=4, attention_types=(A.HCA, A.CSA, A.SLIDING, A.HCA),
                mlp_types=(MlpType.HASH,) * 3 + (MlpType.TOPK,), hc_mult=2, o_groups=4, o_lora_rank=8,
                num_routed_experts=6, num_experts_per_tok=3, moe_intermediate_size=48, vocab_size=200, yarn=None)


def _check(report: CompareReport, num_layers: int) -> None:
    assert [r.name for r in report.rows] == ["logits"] + [f"layer {i}" for i in range(num_layers)]
    assert report.ok, report.format()


def test_compare_tiny(tmp_path):
    cfg = tiny()
    model = hr.save_hf_checkpoint(cfg, tmp_path, seed=0)
    logits, _ = hr.run_hf(model, np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 64)))
    assert logits.std(-1).mean() > 0.3  # the random model is not degenerate
    _check(run_compare(tmp_path, seq_len=64, batch=2, tol=1e-5, seed=0), cfg.num_layers)


@pytest.mark.slow
def test_compare_variant_on_saved_checkpoint(tmp_path):
    """Second architecture, through ds4jax's own `save` (upstream names, sharded) and an MTP block HF ignores."""
    cfg = variant()
    hr.save_hf_checkpoint(cfg, tmp_path / "hf", seed=5)
    hr.add_random_mtp(tmp_path / "hf", cfg)
    checkpoint.save(checkpoint.load(tmp_path / "hf", jnp.float32), tmp_path / "ours", max_shard_bytes=400_000)
    assert os.path.exists(tmp_path / "ours" / "model.safetensors.index.json")
    _check(run_compare(tmp_path / "ours", seq_len=40, batch=2, tol=1e-5, seed=1), cfg.num_layers)


def test_error_row_and_report():
    ref = np.array([[1.0, -4.0], [2.0, 0.5]])
    row = error_row("x", ref + np.array([[0.0, 1e-3], [0.0, 0.0]]), ref)
    assert row.max_abs == pytest.approx(1e-3) and row.max_rel == pytest.approx(1e-3 / 4)
    assert error_row("z", np.zeros(3), np.zeros(3)).max_rel == 0.0
    nan = error_row("n", np.array([np.nan, 1.0]), np.array([1.0, 1.0]))
    report = CompareReport("ckpt", 1, 2, 1e-3, (row, nan))
    assert not report.ok and report.worst.name == "n"
    assert "FAIL" in report.format() and "max rel err" in report.format()
    assert CompareReport("ckpt", 1, 2, 1e-3, (row,)).ok
    with pytest.raises(ValueError, match="shape"):
        error_row("s", np.zeros(2), np.zeros(3))


def test_missing_reference_says_how_to_install(monkeypatch, tmp_path):
    import sys

    from ds4jax import compare

    monkeypatch.setitem(sys.modules, "transformers", None)  # import of transformers now raises ImportError
    with pytest.raises(ImportError, match=r"pip install ds4jax\[test\]"):
        run_compare(tmp_path)
    assert compare.main([str(tmp_path)]) == 2


def test_the_module_entry_checks_its_flags_as_the_command_does(capsys):
    """`python -m ds4jax.compare DIR --tol nan` ran a comparison that no tolerance could pass (argparse's plain
    float); it is `ds4jax compare` now, with its checks and exit statuses."""
    from ds4jax import compare

    assert compare.main(["/no/such/dir", "--tol", "nan"]) == 2
    assert "argument --tol: must be finite, got nan" in capsys.readouterr().err
    assert compare.main(["/no/such/dir", "--seq-len", "-5"]) == 2
    assert "argument --seq-len: must be >= 1" in capsys.readouterr().err
    assert compare.main(["/no/such/dir"]) == 2
    assert "--checkpoint='/no/such/dir': does not exist" in capsys.readouterr().err
