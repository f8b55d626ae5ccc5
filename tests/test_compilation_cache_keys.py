"""What JAX's persistent-cache key covers, checked on the key function itself (`jax._src.cache_key.get`, the one
`compile_or_get_cached` uses), so a JAX upgrade that drops a component fails here rather than loading a wrong
program: the lowered program (so shapes, dtypes and therefore the model config), the jaxlib version, the
backend's platform and version, and the devices (their topology's fingerprint; the device kinds where a backend
has no topology). The same program on the same machine keys the same, or nothing would ever hit.
`test_compilation_cache.py` shows the end to end behaviour in fresh processes."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import cache_key, compiler, xla_bridge
from jax._src.lib import _jax, xla_client


def step(x):
    return jnp.tanh(x) * 2 + x.sum()


def key(x=None, *, backend=None, devices=None) -> str:
    module = jax.jit(step).lower(jnp.ones(4) if x is None else x).compiler_ir("stablehlo")
    options = compiler.get_compile_options(num_replicas=1, num_partitions=1)
    devices = np.array([[jax.devices()[0]]]) if devices is None else devices
    return cache_key.get(module, devices, options, backend or xla_bridge.get_backend())


class Backend:
    """The real backend, but for the named attributes (as another build or another machine would report)."""

    def __init__(self, **overrides):
        self._real, self._overrides = xla_bridge.get_backend(), overrides

    def __getattr__(self, name):
        return self._overrides.get(name, getattr(self._real, name))


def test_the_same_program_keys_the_same():
    assert key() == key()


def test_shapes_and_dtypes():
    assert key(jnp.ones(5)) != key()
    assert key(jnp.ones(4, jnp.bfloat16)) != key()


def test_jaxlib_version(monkeypatch):
    before = key()
    monkeypatch.setattr(cache_key, "jaxlib_version_str", cache_key.jaxlib_version_str + ".other")
    assert key() != before


@pytest.mark.parametrize("name", ["platform", "platform_version"])
def test_backend_platform_and_version(name):
    real = getattr(xla_bridge.get_backend(), name)
    assert key(backend=Backend(**{name: real + "-other"})) != key()


def test_device_topology(monkeypatch):
    before = key()
    real = xla_client.get_topology_for_devices

    def other_topology(devices):  # the same devices, another fingerprint (another GPU model / interconnect)
        return types.SimpleNamespace(fingerprint=lambda: real(devices).fingerprint() ^ 1)

    monkeypatch.setattr(xla_client, "get_topology_for_devices", other_topology)
    assert key() != before


def test_device_kind_where_a_backend_has_no_topology(monkeypatch):
    def no_topology(devices):
        raise _jax.JaxRuntimeError("no topology")

    monkeypatch.setattr(xla_client, "get_topology_for_devices", no_topology)
    keys = [key(devices=np.array([[types.SimpleNamespace(device_kind=kind)]]))
            for kind in ("NVIDIA H200", "NVIDIA A100")]
    assert keys[0] != keys[1]
