"""The whole model through the Pallas kernels (interpreted on CPU) equals the reference path."""

import functools

import jax
from jax.extend.core import jaxprs_in_params
import jax.numpy as jnp
import numpy as np
import pytest

import ds4jax
from ds4jax.model import params as P
from ds4jax.runtime import pools
from ds4jax.runtime import steps
from ds4jax.model.config import AttentionType, MlpType
from ds4jax.runtime.kernels import Impl, default_impl, resolve
from ds4jax.runtime.pool_spec import PoolSpec


def _run(cfg, params, spec, ids, lengths, chunk, impl):
    book = pools.PoolBook(spec, cfg.vocab_size)
    slots = [book.admit(1), book.admit(0)]
    for s, n in zip(slots, lengths):
        book.reserve(s, n)
    pool = book.sync(pools.poisoned(spec))
    logits, pos = [], [0, 0]
    while any(p < n for p, n in zip(pos, lengths)):
        n = [min(chunk, L - p) for p, L in zip(pos, lengths)]
        tok = np.zeros((2, chunk), np.int32)
        for r in range(2):
            tok[r, : n[r]] = ids[r, pos[r] : pos[r] + n[r]]
        book.check_extend(slots, tok, n)
        batch = steps.StepBatch(jnp.asarray(slots, jnp.int32), jnp.asarray(tok), jnp.asarray(n, jnp.int32))
        out, pool = steps.prefill(params, pool, batch, cfg=cfg, spec=spec, all_logits=True, kernels=impl)
        book.commit(slots, n)
        logits.append(np.asarray(out.logits))
        pos = [p + k for p, k in zip(pos, n)]
    return np.concatenate(logits, axis=1), out.selections


def test_kernels_match_reference_in_the_model():
    cfg = ds4jax.tiny(num_layers=3, attention_types=(AttentionType.SLIDING, AttentionType.CSA, AttentionType.HCA),
                      mlp_types=(MlpType.HASH, MlpType.TOPK, MlpType.TOPK))
    params = P.init(cfg, jax.random.key(0))
    spec = PoolSpec.for_role(cfg, role=ds4jax.Role.TARGET, max_slots=2, max_context=64, page_size=16,
                             dtype="float32")
    ids = np.asarray(jax.random.randint(jax.random.key(1), (2, 40), 0, cfg.vocab_size))
    ref, ref_sel = _run(cfg, params, spec, ids, [40, 29], 10, Impl.REFERENCE)
    got, got_sel = _run(cfg, params, spec, ids, [40, 29], 10, Impl.PALLAS_INTERPRET)
    assert np.isfinite(ref).all()
    assert np.abs(got - ref).max() <= 1e-5 * np.abs(ref).max()
    for a, b in zip(ref_sel, got_sel):
        np.testing.assert_array_equal(np.sort(np.asarray(a), -1), np.sort(np.asarray(b), -1))


def test_dispatcher_defaults(monkeypatch):
    monkeypatch.delenv("DS4JAX_KERNELS", raising=False)
    assert default_impl() is Impl.REFERENCE  # CPU
    monkeypatch.setenv("DS4JAX_KERNELS", "pallas_interpret")
    assert default_impl() is Impl.PALLAS_INTERPRET
    assert resolve("pallas") is Impl.PALLAS
    monkeypatch.setenv("DS4JAX_KERNELS", "nope")
    try:
        default_impl()
    except ValueError as e:
        assert "DS4JAX_KERNELS" in str(e)
    else:
        raise AssertionError("a bad DS4JAX_KERNELS value must raise")


def _kernel_launches(jaxpr):
    """Names of the pallas_calls of a jaxpr and its sub-jaxprs, in program order."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn.params.get("name")
        for sub in jaxprs_in_params(eqn.params):
            yield from _kernel_launches(sub)


def test_routed_experts_dispatch_runs_the_grouped_kernel():
    """Under pallas_interpret, a step's MoE goes through the grouped-matmul kernel (two launches per MoE layer),
    and the kernel path equals the model's own routed experts for decode-sized and prefill-sized tile plans."""
    from ds4jax.model.layers import moe
    from ds4jax.runtime import kernels, routed_experts as re_mod

    cfg = ds4jax.tiny(num_layers=2, attention_types=(AttentionType.SLIDING, AttentionType.SLIDING),
                      mlp_types=(MlpType.HASH, MlpType.TOPK))
    params = P.init(cfg, jax.random.key(0))
    spec = PoolSpec.for_role(cfg, role=ds4jax.Role.TARGET, max_slots=2, max_context=32, dtype="float32")
    batch = steps.StepBatch(jnp.zeros((2,), jnp.int32), jnp.zeros((2, 1), jnp.int32), jnp.ones((2,), jnp.int32))
    for impl, launches in ((Impl.PALLAS_INTERPRET, 2 * cfg.num_layers), (Impl.REFERENCE, 0)):
        closed = jax.make_jaxpr(lambda p, pool, b: steps._step(
            p, pool, b, None, cfg=cfg, spec=spec, role=ds4jax.Role.TARGET, logits=steps.Logits.LAST,
            kernels=impl))(params, pools.zeros(spec), batch)
        names = list(_kernel_launches(closed.jaxpr))
        assert names.count("grouped_matmul") == launches, (impl, names)

    p = params["layers"][1]["ffn"]
    for n in (1, 3, 200):  # one token's tiles (no sort), 6 selections (16-row tiles), 400 (64-row tiles)
        x = jax.random.normal(jax.random.key(n), (n, cfg.hidden_size))
        routing = moe.route(x, jnp.zeros((n,), jnp.int32), p, cfg, MlpType.TOPK)
        want = moe.routed_experts(x, routing, p["experts"], cfg, strategy="ragged")
        got = kernels.routed_experts(x, routing, p["experts"], cfg, impl=Impl.PALLAS_INTERPRET)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5 * np.abs(want).max())
    assert re_mod.tile_rows(6) == 16 and re_mod.tile_rows(400) == 64
    src, group = re_mod.one_token_tiles(jnp.asarray([5, 2, 7], jnp.int32), 4)
    assert group.tolist() == [5, 2, 7] and src.tolist() == [0, -1, -1, -1, 1, -1, -1, -1, 2, -1, -1, -1]
    # the one-token path takes no sort (at decode batch 1 it was ~9 launches a layer)
    one = jax.make_jaxpr(lambda x, r: kernels.routed_experts(x, r, p["experts"], cfg, impl=Impl.PALLAS_INTERPRET))(
        x[:1], moe.route(x[:1], jnp.zeros((1,), jnp.int32), p, cfg, MlpType.TOPK))
    assert " sort[" not in str(one.jaxpr) and "grouped_matmul" in str(one.jaxpr)


def _three_kinds():
    return ds4jax.tiny(num_layers=3, attention_types=(AttentionType.SLIDING, AttentionType.CSA, AttentionType.HCA),
                       mlp_types=(MlpType.HASH, MlpType.TOPK, MlpType.TOPK))


def _abstract_step(cfg, role, dtype, rows=2, tokens=1):
    """(step function, abstract args) of the decode-shaped target step or draft extend of `cfg`."""
    spec = PoolSpec.for_role(cfg, role=role, max_slots=rows, max_context=64, page_size=16, draft_tokens=2,
                             dtype=jnp.dtype(dtype).name)
    params = jax.eval_shape(lambda k: P.init(cfg, k, dtype), jax.random.key(0))
    s = jax.ShapeDtypeStruct
    batch = steps.StepBatch(s((rows,), jnp.int32), s((rows, tokens), jnp.int32), s((rows,), jnp.int32))
    if role is ds4jax.Role.TARGET:
        return functools.partial(steps._target_step, cfg=cfg, spec=spec, role=role, logits=steps.Logits.LAST), (
            params, pools.abstract(spec), batch)
    streams = s((rows, tokens, cfg.hc_mult, cfg.hidden_size), jnp.float32)
    return functools.partial(steps._draft_step, cfg=cfg, spec=spec, role=role, logits=steps.Logits.LAST), (
        params, pools.abstract(spec), batch, streams)


@pytest.mark.parametrize("role", [ds4jax.Role.TARGET, ds4jax.Role.DRAFT], ids=["target", "draft"])
def test_mhc_dispatch_runs_the_fused_kernel(role):
    """Under pallas_interpret every hyper-connection pre-step of a step is one launch of the fused mHC kernel (two
    a block: the attention and the FFN ones; the draft is one block) and the head's is one `mhc_head`; under the
    reference none of them (nor the stand-alone Sinkhorn kernel) runs."""
    cfg = _three_kinds()
    step, args = _abstract_step(cfg, role, jnp.float32)
    blocks = cfg.num_layers if role is ds4jax.Role.TARGET else 1
    for impl, pre, head in ((Impl.PALLAS_INTERPRET, 2 * blocks, 1), (Impl.REFERENCE, 0, 0)):
        names = list(_kernel_launches(jax.make_jaxpr(functools.partial(step, kernels=impl))(*args).jaxpr))
        assert (names.count("mhc_pre"), names.count("mhc_head"), names.count("sinkhorn")) == (pre, head, 0), (
            role, impl, names)


@pytest.mark.parametrize("role,platform", [(ds4jax.Role.TARGET, "cuda"), (ds4jax.Role.TARGET, "rocm"),
                                           (ds4jax.Role.DRAFT, "cuda")], ids=["target-cuda", "target-rocm",
                                                                               "draft-cuda"])
def test_gpu_steps_have_no_while_loops(role, platform):
    """The decode step and the draft extend lowered for a GPU (Pallas kernels) hold no `while` loop: on a GPU each
    iteration of an XLA loop costs a few small kernel launches (a binary-search searchsorted was once a large part
    of a decode step's kernels on the H200; the mHC Sinkhorn's 19-step loop, twice a layer, was the last one, now
    one kernel launch)."""
    cfg = _three_kinds()
    step, args = _abstract_step(cfg, role, jnp.bfloat16)
    text = jax.jit(functools.partial(step, kernels=Impl.PALLAS)).trace(*args).lower(
        lowering_platforms=(platform,)).as_text()
    assert text.count("stablehlo.custom_call") >= 3  # the Pallas kernels are in (lowered for the GPU)
    assert text.count("stablehlo.while") == 0


def test_routed_experts_dispatch_hands_the_kernel_the_architectures_tiles(monkeypatch):
    """Prefill tiles on sm90 are Hopper's wide ones (too big for MI300's LDS); decode tiles and other targets keep
    the tiles every target fits. The dispatch itself: what `grouped_matmul` receives."""
    import pallas_kernels
    from ds4jax.model.layers import moe
    from ds4jax.runtime import kernels

    cfg = ds4jax.tiny(num_layers=2, attention_types=(AttentionType.SLIDING, AttentionType.SLIDING),
                      mlp_types=(MlpType.HASH, MlpType.TOPK))
    p = jax.eval_shape(lambda k: P.init(cfg, k, jnp.bfloat16), jax.random.key(0))["layers"][1]["ffn"]
    seen = []
    monkeypatch.setattr(pallas_kernels, "grouped_matmul", lambda x, ws, tg, **kw: seen.append(kw["block_sizes"])
                        or tuple(jnp.zeros((x.shape[0], w.shape[2]), jnp.float32) for w in ws))
    for arch in ("sm90", "gfx942", None):
        monkeypatch.setattr(kernels, "kernel_arch", lambda impl, arch=arch: arch)
        for n in (1, 200):  # decode (16-row tiles) and prefill (64-row tiles)
            x = jax.ShapeDtypeStruct((n, cfg.hidden_size), jnp.bfloat16)
            jax.eval_shape(lambda x, p: kernels.routed_experts(
                x, moe.route(x, jnp.zeros((x.shape[0],), jnp.int32), p, cfg, MlpType.TOPK), p["experts"], cfg,
                impl=Impl.PALLAS), x, p)
    wide = pallas_kernels.GroupedMatmulBlockSizes(block_n=256, block_k=64, num_warps=8, num_stages=3)
    narrow = pallas_kernels.GroupedMatmulBlockSizes(block_k=64, num_stages=2)
    decode = pallas_kernels.GroupedMatmulBlockSizes(block_k=64)
    assert seen == [decode, decode, wide, wide] + [decode, decode, narrow, narrow] * 2
