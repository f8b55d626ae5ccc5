"""``--mesh data=D,expert=E,tensor=T,stages=S``: the device mesh a command runs on (``generate``, ``batch``,
``warmup``, ``serve``, ``info``), checked against the devices there are before anything is loaded.

In a job of several processes (``ds4jax launch``, SLURM, ...) the command joins it first (`init_distributed`); the
mesh then spans every process's devices, and the processes check at start-up that they run the same ds4jax and
jax, the same arguments and the same checkpoint (`check_agreement`)."""

from __future__ import annotations

import argparse
import math

AXES = ("stages", "data", "expert", "tensor")  # stages: a layer split (make_mesh's layer_split)


def parse_mesh(text: str) -> dict[str, int]:
    """An argparse type: ``expert=4,tensor=2`` -> {"expert": 4, "tensor": 2}."""
    sizes: dict[str, int] = {}
    for part in text.split(","):
        name, eq, value = part.strip().partition("=")
        if not eq or name not in AXES:
            raise argparse.ArgumentTypeError(f"{part.strip()!r} is not AXIS=N with AXIS one of {', '.join(AXES)} "
                                             f"(e.g. expert=4,tensor=2)")
        if name in sizes:
            raise argparse.ArgumentTypeError(f"names {name} twice")
        try:
            sizes[name] = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name}={value!r} is not an integer") from None
        if sizes[name] < 1:
            raise argparse.ArgumentTypeError(f"{name}={sizes[name]} must be >= 1")
    return sizes


def add_mesh_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--mesh", type=parse_mesh, default=None, metavar="AXIS=N,...",
                   help="run on a device mesh: data (data-parallel attention), expert (expert parallel), tensor "
                        "(tensor parallel), stages (a layer split), e.g. expert=4,tensor=2; the product must fit "
                        "the devices (all processes' devices in a multi-process job, which needs --mesh). "
                        "Default: one device")


def mesh_text(sizes: dict[str, int]) -> str:
    return ",".join(f"{a}={sizes[a]}" for a in AXES if a in sizes)


def mesh_layout(args, cfg=None):
    """The `MeshLayout` that ``args.mesh`` asks for (None: one device), after joining a multi-process job.

    Raises `MeshError` (exit 2) when the axes need more devices than there are (naming the axes and the device
    count), when a multi-process job has no --mesh or leaves devices out, when ``stages`` exceeds the model's
    layers (`cfg`) or ``data`` does not divide --max-slots."""
    import jax

    from ds4jax.runtime.distributed import init_distributed, process_count
    from ds4jax.runtime.mesh import MeshError, make_mesh

    init_distributed()
    sizes, procs = getattr(args, "mesh", None), process_count()
    n = jax.device_count()
    where = f"{n} devices" + (f" ({procs} processes x {jax.local_device_count()})" if procs > 1 else "")
    if sizes is None:
        if procs > 1:
            raise MeshError(f"a job of {procs} processes runs on one mesh over all {where}: pass --mesh "
                            f"(e.g. --mesh expert={n})", name="--mesh")
        return None
    need = math.prod(sizes.values())
    named = " x ".join(f"{a} {sizes[a]}" for a in AXES if a in sizes)
    if need > n:
        raise MeshError(f"needs {named} = {need} devices, but there are {where}", name="--mesh",
                        value=mesh_text(sizes))
    if procs > 1 and need != n:
        raise MeshError(f"{named} = {need} devices leaves some of the job's {where} out; a multi-process mesh "
                        f"uses every device", name="--mesh", value=mesh_text(sizes))
    stages = sizes.get("stages", 1)
    if cfg is not None and stages > cfg.num_layers:
        raise MeshError(f"stages {stages} is more than the model's {cfg.num_layers} layers", name="--mesh",
                        value=mesh_text(sizes))
    data, slots = sizes.get("data", 1), getattr(args, "max_slots", None)
    if slots is not None and slots % data:
        raise MeshError(f"data {data} does not divide --max-slots {slots} (each data shard holds as many slots)",
                        name="--mesh", value=mesh_text(sizes))
    return make_mesh(data=data, expert=sizes.get("expert", 1), tensor=sizes.get("tensor", 1),
                     layer_split=stages if stages > 1 else None)


def check_agreement(args, checkpoint: str | None) -> None:
    """In a multi-process job: every process must run the same ds4jax and jax, the same command-line arguments and
    the same checkpoint (`distributed.checkpoint_fingerprint`), else `DistributedError` naming the processes."""
    import jax

    from ds4jax.cli import version
    from ds4jax.runtime import distributed

    if distributed.process_count() == 1:
        return
    distributed.agree("the ds4jax and jax versions", {"ds4jax": version(), "jax": jax.__version__})
    arguments = {k: v for k, v in sorted(vars(args).items()) if isinstance(v, (str, int, float, bool, dict, list,
                                                                                 type(None)))}
    distributed.agree("the command-line arguments", arguments)
    distributed.agree("the checkpoint", "the embedded model" if checkpoint is None
                      else distributed.checkpoint_fingerprint(checkpoint))
