"""Multi-process jobs (issue 28): 2 processes x 4 forced CPU devices started by ``ds4jax launch``, all traffic on
127.0.0.1. One job runs tests/multiprocess_worker.py: every layout against one device, the engine with speculation
and snapshots, the engine data-parallel, a disagreement, the ``ds4jax batch`` command on the checkpoint it saved
(reusing the speculating engine's compiled programs), then a process killed mid-generation. One job, so every
program compiles once (``jax_share_binary_between_hosts``, one process compiling for both, does not work on the
CPU backend: its cache keys differ between the processes). The launcher, the
--mesh checks and the fingerprint run in-process, without JAX in the launched processes."""

import json
import os
import subprocess
import sys

import pytest

import ds4jax
from ds4jax import cli
from ds4jax.commands import launch, mesh_options
from ds4jax.runtime import distributed

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import multiprocess_worker as worker  # noqa: E402  (importing it starts no jax work)

TOL = 1e-5
HEARTBEAT = 10  # seconds: the killed process's peer must be ended by JAX's heartbeat, well inside --grace


def _launch(*args: str, cache: str, timeout: int = 1500) -> subprocess.CompletedProcess:
    """`ds4jax launch ARGS` with this checkout and compiled programs kept in `cache`. conftest's XLA flags (no
    backend optimisation: compiles take a third less) reach the processes; the launcher only sets the device count."""
    env = dict(os.environ, PYTHONPATH=ROOT, DS4JAX_COMPILATION_CACHE=cache)
    return subprocess.run([sys.executable, "-m", "ds4jax", "launch", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture(scope="module")
def mp_job(tmp_path_factory):
    """The worker's job: (the launcher's CompletedProcess, [process 0's results, process 1's], its directory)."""
    root = tmp_path_factory.mktemp("multiprocess")
    _batch_files(root)
    proc = _launch("--processes", "2", "--devices-per-process", "4", "--heartbeat", str(HEARTBEAT), "--grace", "60",
                   "--timeout", "1200", "--", sys.executable, os.path.join(HERE, "multiprocess_worker.py"), str(root),
                   cache=str(root / "cache"))
    results = []
    for i in range(2):
        path = root / f"p{i}.json"
        assert path.exists(), proc.stderr[-6000:]
        results.append(json.loads(path.read_text()))
    return proc, results, root


@pytest.mark.slow
def test_job_spans_two_processes(mp_job):
    _, results, _ = mp_job
    assert [r["process"] for r in results] == [0, 1]
    assert all(r["processes"] == 2 and r["devices"] == 8 and r["local"] == 4 for r in results), results
    assert results[0]["stage_processes"] == [[0], [1]]  # the 2-stage split: one stage per process


@pytest.mark.slow
@pytest.mark.parametrize("name", list(worker.LAYOUTS))
def test_layout_across_processes_matches_one_device(mp_job, name):
    """forward_logits (each process's blocks against the one-device logits), greedy decoding with it, and (the
    layouts of worker.ENGINES: speculating, data-parallel) the engine's greedy tokens, equal to one device's."""
    _, results, _ = mp_job
    for r in results:
        res = r[name]
        assert res["logits"] <= TOL and res["greedy"], (r["process"], res)
        if name in worker.ENGINES:  # the engine does not run on a split across processes yet
            assert res["tokens"] and not res["errors"], (r["process"], res)
    blocks = [r[name]["blocks"] for r in results]
    assert sum(blocks) > 0, blocks
    if name.startswith("split"):  # the logits live on the last stage: process 1's devices
        assert blocks == [0, 4], blocks


@pytest.mark.slow
def test_engine_speculation_and_snapshots_across_processes(mp_job):
    """The speculating engine's greedy tokens equal one device's (forward_logits greedy), those of a request that
    made a prefix snapshot and of one restored from it (an exact hit: no prefill) included."""
    _, results, _ = mp_job
    for r in results:
        got, ref = r[worker.SPECULATIVE]["spec"], r["reference"]
        assert got["tokens"] == ref and not got["errors"], (got, ref)
        assert got["made"] == got["hit"] == ref[0] and got["hit_prefill"] == 0 and got["hits"] == 1, got
        assert got["accepted"] > 0, got  # drafts were accepted


@pytest.mark.slow
def test_processes_that_disagree_are_named(mp_job):
    _, results, _ = mp_job
    for r in results:
        assert "processes disagree on the test value: process 0 has 0, process 1 has 1" in r["disagree"], r


@pytest.mark.slow
def test_a_killed_process_ends_the_job(mp_job):
    """Process 1 SIGKILLs itself as a decode call starts; process 0's generation does not succeed (its step fails
    without the peer), JAX's heartbeat ends process 0 (its own fatal error, inside --grace) and the launcher fails."""
    proc, _, _ = mp_job
    err = proc.stderr
    assert proc.returncode == launch.RUNTIME_FAILURE, err[-3000:]
    assert "[launch] process 1 was killed by SIGKILL" in err, err[-3000:]
    p0 = "\n".join(line for line in err.splitlines() if line.startswith("[p0] "))
    assert "generating; process 1 is about to be killed" in p0
    assert "stopped sending heartbeats" in p0 or "Terminating process because the JAX distributed service" in p0, \
        p0[-3000:]
    assert "UNEXPECTED" not in err, err[-3000:]


DONE = {"key": 'id:"a"', "id": "a", "line": 1, "tokens": [0], "note": "written before"}


def _batch_files(root) -> None:
    """The batch command's input (the last line not JSON) and a resumed output: an id already done, then a torn
    line (a kill mid-write)."""
    rows = [json.dumps(r) for r in worker.BATCH] + ["{not json"]
    (root / "in.jsonl").write_text("\n".join(rows) + "\n")
    (root / "out.jsonl").write_text(json.dumps(DONE) + "\n" + '{"key": "id:7", "id": 7, "tok')


@pytest.mark.slow
def test_batch_across_processes(mp_job):
    """``ds4jax batch ... --mesh expert=4,tensor=2`` in both processes of the launched job (worker.batch_command):
    the resumed output gets every other id once, from process 0 alone, with the one-device greedy tokens."""
    proc, results, root = mp_job
    ref = results[0]["reference"]
    assert [r["batch"] for r in results] == [0, 0], proc.stderr[-4000:]
    done, out = DONE, root / "out.jsonl"
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    keys = [x["key"] for x in lines]
    assert sorted(keys) == sorted(['id:"a"', "id:7", 'id:"c"', "line:4"]), keys  # each once; the torn line gone
    by = {x["key"]: x for x in lines}
    assert by['id:"a"'] == done  # skipped, not regenerated
    assert by["id:7"]["tokens"] == ref[1] and by['id:"c"']["tokens"] == ref[0], (by, ref)
    assert by["line:4"]["error"] == "invalid_request"
    summaries = [line for line in proc.stderr.splitlines() if "ds4jax: batch: wrote" in line]
    assert [line.split(" ", 1)[0] for line in summaries] == ["[p0]"], proc.stderr[-2000:]  # process 0 writes alone


@pytest.mark.slow
def test_info_plans_a_checkpoint_on_stand_in_devices(mp_job):
    """The README's command: the plan of the saved checkpoint on 8 stand-in devices, no weights read."""
    _, _, root = mp_job
    proc = subprocess.run([sys.executable, "-m", "ds4jax", "info", "--checkpoint", str(root / "ckpt"), "--mesh",
                           "expert=4,tensor=2", "--devices", "8", "--device-memory", "80"], capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=ROOT), timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "memory plan   expert 4 x tensor 2 (8 devices)" in proc.stdout and "of 80.0 GiB (--device-memory)" in \
        proc.stdout, proc.stdout


# ---- in process: the launcher on plain commands, --mesh, the fingerprint ------------------------------------------

def _py(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_launcher_fails_as_a_whole_and_prefixes_lines(capfd):
    """Process 1 exits 5 while process 0 would sleep a minute: the launcher ends process 0 and exits 5."""
    code = ("import os, sys, time; i = os.environ['JAX_PROCESS_ID']; print('hello from', i, os.environ['JAX_NUM_PROCESSES'],"
            " os.environ['JAX_COORDINATOR_ADDRESS'].split(':')[0], os.environ['XLA_FLAGS'].split()[-1], flush=True);"
            " sys.exit(5) if i == '1' else time.sleep(60)")
    rc = cli.main(["launch", "--processes", "2", "--devices-per-process", "3", "--platform", "cpu", "--grace", "0.5",
                   "--", *_py(code)])
    out, err = capfd.readouterr()
    assert rc == 5, err
    for i in range(2):
        assert f"[p{i}] hello from {i} 2 127.0.0.1 --xla_force_host_platform_device_count=3" in out, out
    assert "[launch] process 1 exited with status 5" in err and "ending the processes still running: 0" in err, err


def test_launcher_timeout_ends_the_job(capfd):
    rc = cli.main(["launch", "--processes", "2", "--platform", "cpu", "--timeout", "1", "--",
                   *_py("import time; time.sleep(60)")])
    assert rc == launch.RUNTIME_FAILURE
    assert "[launch] timed out after 1 s" in capfd.readouterr().err


def test_launcher_needs_a_command(capfd):
    assert cli.main(["launch", "--processes", "2"]) == cli.BAD_INPUT
    assert "needs a command after --" in capfd.readouterr().err


def test_launcher_splits_gpus_between_processes():
    envs = launch.environments(2, 2, "cuda", 1234, 7, base={"CUDA_VISIBLE_DEVICES": "4,5,6,7", "JAX_PROCESS_ID": "9"})
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["4,5", "6,7"]
    assert [e["JAX_PROCESS_ID"] for e in envs] == ["0", "1"] and envs[0]["DS4JAX_HEARTBEAT_TIMEOUT"] == "7"
    assert envs[1]["JAX_COORDINATOR_ADDRESS"] == "127.0.0.1:1234" and "XLA_FLAGS" not in envs[1]
    hip = launch.environments(2, 1, "rocm", 1, None, base={"HIP_VISIBLE_DEVICES": "0,1"})
    assert [e["HIP_VISIBLE_DEVICES"] for e in hip] == ["0", "1"]
    with pytest.raises(ds4jax.errors.UsageError, match="need 6 cuda GPUs, this host shows 4"):
        launch.environments(3, 2, "cuda", 1, None, base={"CUDA_VISIBLE_DEVICES": "0,1,2,3"})
    cpu = launch.environments(2, 4, "cpu", 1, None, base={"XLA_FLAGS": "--a --xla_force_host_platform_device_count=8"})
    assert cpu[0]["XLA_FLAGS"] == "--a --xla_force_host_platform_device_count=4" and cpu[0]["JAX_PLATFORMS"] == "cpu"


def test_mesh_option_parsing():
    assert mesh_options.parse_mesh("expert=4,tensor=2") == {"expert": 4, "tensor": 2}
    for bad, why in (("expert=4,expert=2", "twice"), ("experts=4", "AXIS=N"), ("tensor=two", "not an integer"),
                     ("data=0", ">= 1")):
        with pytest.raises(Exception, match=why):
            mesh_options.parse_mesh(bad)


@pytest.mark.parametrize("argv", [["info", "--preset", "tiny"], ["generate", "--prompt", "x"]])
def test_mesh_larger_than_the_devices_is_exit_2(capfd, argv):
    """Checked before anything is loaded: the message names the axes and the device count."""
    import jax

    n = jax.device_count()
    assert cli.main([*argv, "--mesh", f"expert={n},tensor=2"]) == cli.BAD_INPUT
    err = capfd.readouterr().err
    assert f"needs expert {n} x tensor 2 = {2 * n} devices, but there are {n} devices" in err, err


def test_info_mesh_prints_the_per_device_plan(capfd):
    assert cli.main(["info", "--preset", "tiny", "--mesh", "expert=2", "--max-slots", "2", "--max-context", "64",
                     "--device-memory", "1"]) == 0
    out = capfd.readouterr().out
    assert "memory plan   expert 2 (2 devices)" in out and "params" in out and "pools" in out, out
    assert "of 1.0 GiB (--device-memory)" in out, out
    assert cli.main(["info", "--preset", "tiny", "--mesh", "data=2", "--max-slots", "3"]) == cli.BAD_INPUT
    assert "data 2 does not divide --max-slots 3" in capfd.readouterr().err


def test_checkpoint_fingerprint_tells_checkpoints_apart(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text('{"vocab_size": 320}')
        (tmp_path / name / "model.safetensors").write_bytes(b"header" + bytes(100))
    same = distributed.checkpoint_fingerprint
    assert same(tmp_path / "a") == same(tmp_path / "b")
    (tmp_path / "b" / "config.json").write_text('{"vocab_size": 321}')
    assert same(tmp_path / "a") != same(tmp_path / "b")
    (tmp_path / "b" / "config.json").write_text('{"vocab_size": 320}')
    (tmp_path / "b" / "model.safetensors").write_bytes(b"HEADER" + bytes(100))
    assert same(tmp_path / "a") != same(tmp_path / "b")


def test_timeouts_come_from_the_environment():
    assert distributed.timeouts({})["heartbeat_timeout_seconds"] == 30
    assert distributed.timeouts({"DS4JAX_HEARTBEAT_TIMEOUT": "5"})["heartbeat_timeout_seconds"] == 5
    with pytest.raises(distributed.DistributedError, match="DS4JAX_SHUTDOWN_TIMEOUT=0 must be at least 1"):
        distributed.timeouts({"DS4JAX_SHUTDOWN_TIMEOUT": "0"})


def test_engine_refuses_a_layer_split_across_processes():
    """The Engine's stage loop does not run across processes yet (docs/mesh.md): such a split is refused by name
    before any program or pool is built, while a split inside one process passes the same check."""
    from types import SimpleNamespace

    import numpy as np

    from ds4jax.generation.programs import programs_for
    from ds4jax.generation.stage_programs import check_one_process
    from ds4jax.runtime.mesh import MeshError

    def layout(*owners):  # one stage per entry: two devices of that process
        stages = tuple(SimpleNamespace(devices=np.array([SimpleNamespace(process_index=p)] * 2, dtype=object))
                       for p in owners)
        return SimpleNamespace(num_stages=len(owners), stages=stages)

    with pytest.raises(MeshError, match=r"layer split across processes yet: this split's 2 stages are on processes "
                                        r"\[0, 1\]"):
        programs_for(layout(0, 1), None, None, 0)  # the Engine's own dispatch, not only the helper
    check_one_process(layout(0, 0))
