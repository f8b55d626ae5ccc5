"""``ds4jax launch --processes N --devices-per-process D -- COMMAND ...``: a multi-process job on this machine.

Starts N copies of COMMAND (``ds4jax ...`` runs with this Python, so the same installation) with the coordinator
on 127.0.0.1 (a free port), ``JAX_NUM_PROCESSES`` / ``JAX_PROCESS_ID`` set, and each process's devices: D forced
host CPU devices (``--platform cpu``), or D of this host's GPUs by ``CUDA_VISIBLE_DEVICES`` /
``HIP_VISIBLE_DEVICES`` (an existing list is split, else GPUs 0..N*D-1). Their output lines come prefixed
``[p0] ...``. The job fails as a whole: when a process fails, the others get ``--grace`` seconds to end on their
own (a process of a broken job ends by itself once the heartbeat timeout passes), then are terminated; the launcher
exits with the first failure's status (3 for a process killed by a signal or a timeout). ``--timeout`` bounds the
whole job. Standard library only: the launcher itself never starts JAX.
"""

from __future__ import annotations

import argparse
import glob
import os
import signal
import socket
import subprocess
import sys
import threading
import time

from ds4jax.commands.options import HelpFormatter, positive_float, positive_int

NAME = "launch"
RUNTIME_FAILURE, INTERRUPTED = 3, 130
_FORCE = "--xla_force_host_platform_device_count"


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="run a command as a job of several processes on this machine (one mesh)",
                       description="Start N processes of COMMAND joined into one JAX job (coordinator on 127.0.0.1), "
                                   "each with D devices; prefix their output; fail as a whole. Example: ds4jax launch "
                                   "--processes 2 --devices-per-process 4 -- ds4jax batch in.jsonl out.jsonl "
                                   "--mesh expert=4,tensor=2",
                       formatter_class=HelpFormatter)
    p.add_argument("--processes", type=positive_int, required=True, metavar="N", help="processes to start")
    p.add_argument("--devices-per-process", type=positive_int, default=1, metavar="D", help="devices each")
    p.add_argument("--platform", choices=("auto", "cpu", "cuda", "rocm"), default="auto",
                   help="device kind: auto picks cuda / rocm when this host has such GPUs, else cpu")
    p.add_argument("--timeout", type=positive_float, default=None, metavar="S",
                   help="end the job (exit 3) when it has run S seconds (default: no limit)")
    p.add_argument("--heartbeat", type=positive_int, default=None, metavar="S",
                   help="seconds without a heartbeat after which a process counts as dead and the job's other "
                        "processes end themselves (DS4JAX_HEARTBEAT_TIMEOUT; default 30)")
    p.add_argument("--grace", type=positive_float, default=5.0, metavar="S",
                   help="after a process fails, seconds the others get to end by themselves before they are "
                        "terminated")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND",
                   help="the command each process runs (ds4jax ... runs with this Python)")
    return p


def command_line(command: list[str]) -> list[str]:
    from ds4jax.errors import UsageError

    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise UsageError("needs a command after --, e.g. -- ds4jax batch in.jsonl out.jsonl --mesh expert=4",
                         name="launch")
    return [sys.executable, "-m", "ds4jax", *command[1:]] if command[0] == "ds4jax" else command


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def platform_of(choice: str) -> str:
    if choice != "auto":
        return choice
    if glob.glob("/dev/nvidia[0-9]*"):
        return "cuda"
    if os.path.exists("/dev/kfd"):
        return "rocm"
    return "cpu"


def gpu_ids(platform: str, env) -> list[str]:
    var = "CUDA_VISIBLE_DEVICES" if platform == "cuda" else "HIP_VISIBLE_DEVICES"
    if env.get(var):
        return [x for x in env[var].split(",") if x.strip()]
    pattern = "/dev/nvidia[0-9]*" if platform == "cuda" else "/dev/dri/renderD*"
    return [str(i) for i in range(len(glob.glob(pattern)))]


def environments(processes: int, devices: int, platform: str, port: int, heartbeat: int | None,
                 base=os.environ) -> list[dict[str, str]]:
    """Each process's environment: the coordinator, its id and its devices."""
    from ds4jax.errors import UsageError

    common = {k: v for k, v in base.items() if k not in ("JAX_PROCESS_ID", "JAX_NUM_PROCESSES")}
    common.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(processes),
                  PYTHONUNBUFFERED="1")  # lines reach the prefixer as they are printed
    if heartbeat is not None:
        common["DS4JAX_HEARTBEAT_TIMEOUT"] = str(heartbeat)
    ids = gpu_ids(platform, base) if platform != "cpu" else []
    if platform != "cpu" and len(ids) < processes * devices:
        raise UsageError(f"{processes} processes x {devices} devices need {processes * devices} {platform} GPUs, "
                         f"this host shows {len(ids)} (use --platform cpu for host devices)", name="--processes")
    out = []
    for i in range(processes):
        env = dict(common, JAX_PROCESS_ID=str(i))
        if platform == "cpu":
            flags = [f for f in base.get("XLA_FLAGS", "").split() if not f.startswith(_FORCE)]
            env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags + [f"{_FORCE}={devices}"]))
        else:
            var = "CUDA_VISIBLE_DEVICES" if platform == "cuda" else "HIP_VISIBLE_DEVICES"
            env[var] = ",".join(ids[i * devices:(i + 1) * devices])
        out.append(env)
    return out


def _end_with_parent() -> None:
    """Linux: a process dies with the launcher (SIGKILL: jax catches SIGTERM, as a preemption notice), so even a
    killed launcher leaves no job behind."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _pump(stream, out, prefix: bytes, lock: threading.Lock) -> None:
    for line in iter(stream.readline, b""):
        with lock:
            out.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.flush()
    stream.close()


def _describe(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with status {rc}"


def _say(message: str) -> None:
    print(f"[launch] {message}", file=sys.stderr, flush=True)


def run(args) -> int:
    command = command_line(args.command)
    platform = platform_of(args.platform)
    envs = environments(args.processes, args.devices_per_process, platform, free_port(), args.heartbeat)
    lock = threading.Lock()
    procs, pumps = [], []
    for i, env in enumerate(envs):
        proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                preexec_fn=_end_with_parent if sys.platform == "linux" else None)
        procs.append(proc)
        for stream, out in ((proc.stdout, sys.stdout.buffer), (proc.stderr, sys.stderr.buffer)):
            t = threading.Thread(target=_pump, args=(stream, out, f"[p{i}] ".encode(), lock), daemon=True)
            t.start()
            pumps.append(t)
    if not args.quiet:
        _say(f"{args.processes} processes x {args.devices_per_process} {platform} devices, coordinator "
             f"{envs[0]['JAX_COORDINATOR_ADDRESS']}: {' '.join(command)}")
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a terminated launcher ends its job too
    try:
        status = _supervise(procs, args.timeout, args.grace)
    except KeyboardInterrupt:
        _say("interrupted; ending the processes")
        _end(procs)
        status = INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)
    for t in pumps:
        t.join(timeout=5)
    return status


def _interrupt(_signum, _frame):
    raise KeyboardInterrupt


def _supervise(procs, timeout: float | None, grace: float) -> int:
    """Wait for the job; the first failure (or the timeout) ends it. Returns the launcher's exit status."""
    start = time.monotonic()
    failed = None  # (process index, status, when)
    while True:
        codes = [p.poll() for p in procs]
        if failed is None:
            bad = [(i, rc) for i, rc in enumerate(codes) if rc not in (None, 0)]
            if bad:
                i, rc = bad[0]
                _say(f"process {i} {_describe(rc)}; the job fails (the others get {grace:g} s to end)")
                failed = (i, rc, time.monotonic())
        if all(rc is not None for rc in codes):
            break
        now = time.monotonic()
        if failed is not None and now - failed[2] > grace:
            _say("ending the processes still running: " + ", ".join(str(i) for i, rc in enumerate(codes)
                                                                     if rc is None))
            _end(procs)
            break
        if timeout is not None and now - start > timeout:
            _say(f"timed out after {timeout:g} s; ending the processes")
            _end(procs)
            return RUNTIME_FAILURE
        time.sleep(0.05)
    if failed is None:
        return 0
    rc = failed[1]
    return rc if rc > 0 else RUNTIME_FAILURE


def _end(procs, wait: float = 5.0) -> None:
    """SIGTERM every live process, SIGKILL those still there after `wait` seconds (jax takes SIGTERM for a
    preemption notice and goes on)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.monotonic() + wait
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
