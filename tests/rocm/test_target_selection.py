"""The kernel dispatcher picks tiles from the device's platform and architecture (devices mocked)."""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace
from unittest import mock

import jax
import jax.numpy as jnp
import pytest

import pallas_kernels
from ds4jax.rocm_check.extract import triton_kernels
from ds4jax.runtime import kernels, target
from ds4jax.runtime.target import Target


def fake_device(platform, cc, version):
    return SimpleNamespace(platform=platform, compute_capability=cc, client=SimpleNamespace(platform_version=version))


@pytest.mark.parametrize("device, want", [
    (fake_device("gpu", "gfx942:sramecc+:xnack-", "rocm 70000"), Target("rocm", "gfx942")),
    (fake_device("gpu", "gfx950", "rocm 70100"), Target("rocm", "gfx950")),
    (fake_device("gpu", "9.0", "cuda 13000"), Target("cuda", "sm90")),
    (fake_device("gpu", "10.0", "PJRT C API\ncuda 13000"), Target("cuda", "sm100")),
    (fake_device("cpu", None, "cpu"), Target("cpu")),
])
def test_target_of_device(device, want):
    assert target.target_of(device) == want


def test_device_target_reads_the_default_device():
    with mock.patch.object(jax, "devices", lambda: [fake_device("gpu", "gfx942:sramecc+:xnack-", "rocm 70000")]):
        assert target.device_target() == Target("rocm", "gfx942")


@pytest.mark.parametrize("arch", ["gfx942", "gfx950"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_rocm_devices_get_rocm_tiles(arch, dtype):
    with mock.patch.object(target, "device_target", lambda: Target("rocm", arch)):
        assert kernels.kernel_arch(kernels.Impl.PALLAS) == arch
        assert kernels.kernel_arch(kernels.Impl.PALLAS_INTERPRET) is None  # interpret: generic tiles
    for op, cls in (("sparse_attention", pallas_kernels.SparseAttentionBlockSizes),
                    ("indexer_topk", pallas_kernels.IndexerTopkBlockSizes)):
        rocm, generic = kernels.block_sizes(op, dtype, arch), cls.get_default(dtype)
        assert rocm == cls.get_default(dtype, arch=arch)
        assert kernels.block_sizes(op, dtype, "sm90") == generic


def test_rocm_tiles_differ_where_the_report_says_so():
    """bf16 sparse attention: the H200 tile spills on gfx942 (docs/benchmarks/rocm_kernels.md)."""
    assert kernels.block_sizes("sparse_attention", jnp.bfloat16, "gfx942") != kernels.block_sizes(
        "sparse_attention", jnp.bfloat16, "sm90")


S = jax.ShapeDtypeStruct


def _sparse_call():
    fn = functools.partial(kernels.sparse_attention, scale=0.04, impl=kernels.Impl.PALLAS)
    args = (S((8, 64, 512), jnp.bfloat16), S((1032, 512), jnp.bfloat16), S((8, 128), jnp.int32),
            S((8192, 512), jnp.bfloat16), S((8, 512), jnp.int32), S((64,), jnp.float32))
    return fn, args


@pytest.mark.parametrize("tgt", [Target("rocm", "gfx942"), Target("cuda", "sm90")])
def test_dispatcher_launches_the_selected_tiles(tgt):
    """The tiles reach the compiled program: the Triton call's launch parameters are the target's defaults."""
    fn, args = _sparse_call()
    want = kernels.block_sizes("sparse_attention", jnp.bfloat16, tgt.arch)
    jax.clear_caches()
    with mock.patch.object(target, "device_target", lambda: tgt):
        lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(tgt.platform,))
    jax.clear_caches()
    (call,) = triton_kernels(lowered)
    assert (call.num_warps, call.num_stages) == (want.num_warps, want.num_stages)
    # the query block: block_h heads x d in the module's q load
    assert f"tensor<{want.block_h}x512xbf16>" in call.ttir


def test_block_sizes_are_hashable_static_args():
    bs = kernels.block_sizes("sparse_attention", jnp.bfloat16, "gfx942")
    assert hash(bs) == hash(dataclasses.replace(bs))
