"""DS4JAX_COMMAND_BUFFERS: one switch for XLA's GPU command buffers (off on ROCm by default)."""

import pytest

from ds4jax import xla_flags

OFF = "--xla_gpu_enable_command_buffer="


@pytest.mark.parametrize("mode, rocm, off", [
    (None, True, True), (None, False, False), ("auto", True, True),
    ("on", True, False), ("off", False, True), ("OFF", True, True),
])
def test_switch(mode, rocm, off):
    env = {} if mode is None else {xla_flags.ENV: mode}
    assert xla_flags.command_buffers_off(env, rocm=rocm) is off


def test_bad_value_is_named():
    with pytest.raises(ValueError, match="DS4JAX_COMMAND_BUFFERS"):
        xla_flags.command_buffers_off({xla_flags.ENV: "maybe"}, rocm=True)


def test_flags_are_appended_once_and_explicit_flags_win():
    assert xla_flags.flags_with_switch("", True) == OFF
    assert xla_flags.flags_with_switch("--xla_foo=1", True) == f"--xla_foo=1 {OFF}"
    assert xla_flags.flags_with_switch("--xla_foo=1", False) == "--xla_foo=1"
    mine = "--xla_gpu_enable_command_buffer=FUSION"
    assert xla_flags.flags_with_switch(mine, True) == mine


def test_jax_platforms_excluding_gpus_means_no_rocm(monkeypatch):
    monkeypatch.setattr(xla_flags, "_rocm_installed", lambda: True)
    assert not xla_flags.rocm_expected({"JAX_PLATFORMS": "cpu"})
    assert xla_flags.rocm_expected({"JAX_PLATFORMS": "rocm,cpu"})
    assert xla_flags.rocm_expected({})


def test_apply_sets_xla_flags_before_backends_start(monkeypatch):
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    env = {xla_flags.ENV: "off", "XLA_FLAGS": "--xla_foo=1"}
    xla_flags.apply(env)
    assert env["XLA_FLAGS"] == f"--xla_foo=1 {OFF}"
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    env = {xla_flags.ENV: "off"}
    with pytest.warns(UserWarning, match="backend started"):
        xla_flags.apply(env)
    assert "XLA_FLAGS" not in env
