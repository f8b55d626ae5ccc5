"""On a GPU (marker `device`): the model's prefill and decode steps through the compiled Pallas kernels (sparse
attention, indexer top-k, grouped-matmul routed experts, mHC Sinkhorn) equal the reference path within bf16
tolerance."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ds4jax
from ds4jax.model import params as P
from ds4jax.model.config import AttentionType, MlpType
from ds4jax.runtime import pools, steps
from ds4jax.runtime.kernels import Impl
from ds4jax.runtime.pool_spec import PoolSpec

IMPL = Impl.PALLAS


def _generate(cfg, params, spec, prompt, decode_tokens, impl):
    """Prefill 2 ragged rows in chunks of 16, then decode `decode_tokens` [steps, 2] (None: greedy); returns the
    logits of every step and the decoded tokens."""
    book = pools.PoolBook(spec, cfg.vocab_size)
    slots = [book.admit(1), book.admit(0)]
    lengths = [prompt.shape[1], prompt.shape[1] - 11]
    for s, n in zip(slots, lengths):
        book.reserve(s, n + 8)
    pool = book.sync(pools.poisoned(spec))
    out, pos = [], [0, 0]
    while any(p < n for p, n in zip(pos, lengths)):
        n = [min(16, L - p) for p, L in zip(pos, lengths)]
        tok = np.zeros((2, 16), np.int32)
        for r in range(2):
            tok[r, : n[r]] = prompt[r, pos[r] : pos[r] + n[r]]
        batch = steps.StepBatch(jnp.asarray(slots, jnp.int32), jnp.asarray(tok), jnp.asarray(n, jnp.int32))
        res, pool = steps.prefill(params, pool, batch, cfg=cfg, spec=spec, kernels=impl)
        book.commit(slots, n)
        pos = [p + k for p, k in zip(pos, n)]
    logits, fed = [np.asarray(res.logits, np.float32)], []
    for i in range(4):
        fed.append(np.argmax(logits[-1], -1).astype(np.int32) if decode_tokens is None else decode_tokens[i])
        tok = jnp.asarray(fed[-1][:, None])
        res, pool = steps.decode(params, pool, steps.StepBatch(jnp.asarray(slots, jnp.int32), tok,
                                                              jnp.ones((2,), jnp.int32)), cfg=cfg, spec=spec,
                                 kernels=impl)
        logits.append(np.asarray(res.logits, np.float32))
    return np.stack(logits), fed


@pytest.mark.device
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pallas_steps_equal_reference(dtype):
    """f32: the kernels equal the reference to 1e-4 (IEEE f32 dots). bf16: rounding differs between the paths and
    a near-tie in expert routing or indexer selection can flip, so the check is per-step cosine >= 0.98 (a wrong
    kernel gives unrelated logits) plus the f32 check for exactness."""
    cfg = ds4jax.tiny(num_layers=3, attention_types=(AttentionType.SLIDING, AttentionType.CSA, AttentionType.HCA),
                      mlp_types=(MlpType.HASH, MlpType.TOPK, MlpType.TOPK), num_routed_experts=16,
                      moe_intermediate_size=64)
    params = P.init(cfg, jax.random.key(0), jnp.dtype(dtype))
    spec = PoolSpec.for_role(cfg, role=ds4jax.Role.TARGET, max_slots=2, max_context=128, page_size=16, dtype=dtype)
    prompt = np.asarray(jax.random.randint(jax.random.key(1), (2, 45), 0, cfg.vocab_size))
    ref, tokens = _generate(cfg, params, spec, prompt, None, Impl.REFERENCE)
    got, _ = _generate(cfg, params, spec, prompt, tokens, IMPL)  # the same tokens, so the steps stay comparable
    assert np.isfinite(got).all()
    for step, (g, r) in enumerate(zip(got, ref)):
        if dtype == "float32":
            err = np.abs(g - r).max() / np.abs(r).max()
            assert err <= 1e-4, f"step {step}: rel err {err:.2e}"
        else:
            cos = (g * r).sum(-1) / np.linalg.norm(g, axis=-1) / np.linalg.norm(r, axis=-1)
            assert cos.min() >= 0.98, f"step {step}: cosine {cos}"
