"""The numerics guard through ``ds4jax generate --speculative K``: a checkpoint with NaN weights exits 2 naming
the tensor (checked at load); finite weights that overflow exit 3 naming the first layer whose output is NaN/Inf;
``--no-check-finite`` skips both checks."""

from __future__ import annotations

import numpy as np
import pytest

from bad_inputs import numpy_params, write_checkpoint
from ds4jax import cli
from ds4jax.model.config import AttentionType, MlpType, tiny

# Two cheap layers, so "the first bad layer" is layer 1 and not simply the only one.
CFG = tiny(vocab_size=259, bos_token_id=0, eos_token_id=1, num_layers=2,
           attention_types=(AttentionType.SLIDING,) * 2, mlp_types=(MlpType.HASH,) * 2)


def generate(capsys, checkpoint, *extra):
    # one new token: the prefill's logits decide, so no speculative round needs compiling
    code = cli.main(["generate", "--prompt", "Hi", "--checkpoint", checkpoint, "--dtype", "float32",
                     "--max-new-tokens", "1", "--speculative", "1", "-q", *extra])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture(autouse=True)
def _no_disk_cache(monkeypatch):
    monkeypatch.setenv("DS4JAX_COMPILATION_CACHE", "off")


def test_nan_weights_exit_2_naming_the_tensor(tmp_path, capsys):
    params = numpy_params(CFG)
    params["layers"][1]["attn"]["wo_b"][0, 0] = np.nan
    code, out, err = generate(capsys, write_checkpoint(tmp_path, CFG, params))
    assert code == 2 and "layers.1.attn" in err and "non-finite" in err and out == "", err


def test_overflowing_weights_exit_3_naming_the_layer(tmp_path, capsys):
    params = numpy_params(CFG)
    for w in ("wo_a", "wo_b"):  # finite (float32 max is 3.4e38), but layer 1's attention output overflows
        params["layers"][1]["attn"][w][:] = 3e38
    d = write_checkpoint(tmp_path, CFG, params)
    code, out, err = generate(capsys, d)
    assert code == 3 and err.startswith("ds4jax: error: layer 1: NaN/Inf") and "Traceback" not in err, err
    assert out == ""
    assert generate(capsys, d, "--no-check-finite")[0] == 0
