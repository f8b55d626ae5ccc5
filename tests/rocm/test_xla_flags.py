"""DS4JAX_COMMAND_BUFFERS: one switch for XLA's GPU command buffers (off on ROCm, loops included on CUDA by default)."""

import pytest

from ds4jax import xla_flags

OFF = "--xla_gpu_enable_command_buffer="


@pytest.mark.parametrize("mode, rocm, off", [
    (None, True, True), (None, False, False), ("auto", True, True),
    ("on", True, False), ("off", False, True), ("OFF", True, True),
])
def test_switch(mode, rocm, off):
    env = {} if mode is None else {xla_flags.ENV: mode}
    assert (xla_flags.mode(env, rocm=rocm, cuda=False) == "off") is off


def test_bad_value_is_named():
    with pytest.raises(ValueError, match="DS4JAX_COMMAND_BUFFERS"):
        xla_flags.mode({xla_flags.ENV: "maybe"}, rocm=True)


@pytest.mark.parametrize("mode, rocm, cuda, want", [
    (None, False, True, "loops"), (None, True, True, "off"), (None, False, False, "on"), ("loops", True, False, "loops"),
    ("on", False, True, "on"), ("Loops", False, False, "loops"),
])
def test_auto_resolves_by_the_gpu_jax_will_start(mode, rocm, cuda, want):
    env = {} if mode is None else {xla_flags.ENV: mode}
    assert xla_flags.mode(env, rocm=rocm, cuda=cuda) == want


def test_flags_are_appended_once_and_explicit_flags_win():
    assert xla_flags.flags_with_mode("", "off") == OFF
    assert xla_flags.flags_with_mode("--xla_foo=1", "off") == f"--xla_foo=1 {OFF}"
    assert xla_flags.flags_with_mode("--xla_foo=1", "on") == "--xla_foo=1"
    assert xla_flags.flags_with_mode("--xla_foo=1", "loops") == f"--xla_foo=1 {OFF}+WHILE,+CONDITIONAL"
    mine = "--xla_gpu_enable_command_buffer=FUSION"
    assert xla_flags.flags_with_mode(mine, "off") == mine and xla_flags.flags_with_mode(mine, "loops") == mine


def test_jax_platforms_excluding_gpus_means_no_rocm(monkeypatch):
    monkeypatch.setattr(xla_flags, "_rocm_installed", lambda: True)
    assert not xla_flags.rocm_expected({"JAX_PLATFORMS": "cpu"})
    assert xla_flags.rocm_expected({"JAX_PLATFORMS": "rocm,cpu"})
    assert xla_flags.rocm_expected({})


def test_jax_platforms_excluding_cuda_sets_nothing(monkeypatch):
    """On a CUDA host running on the CPU (JAX_PLATFORMS=cpu, as the test suite does) XLA_FLAGS stay as they are."""
    monkeypatch.setattr(xla_flags, "_cuda_installed", lambda: True)
    monkeypatch.setattr(xla_flags, "_rocm_installed", lambda: False)
    assert xla_flags.mode({"JAX_PLATFORMS": "cpu"}) == "on"
    assert xla_flags.mode({"JAX_PLATFORMS": "cuda,cpu"}) == "loops" == xla_flags.mode({})


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


def test_apply_on_cuda_adds_loops_and_on_a_cpu_run_nothing(monkeypatch):
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setattr(xla_flags, "_cuda_installed", lambda: True)
    monkeypatch.setattr(xla_flags, "_rocm_installed", lambda: False)
    env = {}
    xla_flags.apply(env)
    assert env["XLA_FLAGS"] == f"{OFF}+WHILE,+CONDITIONAL"
    env = {"DS4JAX_PARALLEL_COMPILE": "on"}  # a switch of an earlier version, for a flag this XLA does not know
    xla_flags.apply(env)
    assert env["XLA_FLAGS"] == f"{OFF}+WHILE,+CONDITIONAL"
    env = {"JAX_PLATFORMS": "cpu"}  # the suite's case: nothing to set
    xla_flags.apply(env)
    assert "XLA_FLAGS" not in env
