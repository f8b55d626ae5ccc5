"""Custom calls of a lowered JAX program, and the Triton kernels (one per `pallas_call`) inside it."""

from __future__ import annotations

import dataclasses

from jax._src.lib import triton as jaxlib_triton  # jaxlib's Triton dialect (private API: jaxlib <= 0.10.2)
from jax._src.lib.mlir import ir  # the MLIR bindings jaxlib was built with (they parse the Triton bytecode)

TRITON_TARGET = "__gpu$xla.gpu.triton"  # jaxlib <= 0.10.2: the Pallas Triton module travels in the backend config


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """One `pallas_call` as XLA receives it: the Triton IR (text) and the launch parameters Pallas chose."""

    name: str
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]
    operands: tuple[str, ...]  # "8x64x512xbf16", ... (results follow in `results`)
    results: tuple[str, ...]
    ttir: str


def custom_calls(lowered):
    """Every stablehlo.custom_call op of a `jax.stages.Lowered` (all functions, nested regions included)."""
    found = []

    def walk(op):
        for region in op.regions:
            for block in region.blocks:
                for inner in block.operations:
                    if inner.operation.name == "stablehlo.custom_call":
                        found.append(inner)
                    walk(inner.operation)

    walk(lowered.compiler_ir("stablehlo").operation)
    return found


def call_target(op) -> str:
    return ir.StringAttr(op.attributes["call_target_name"]).value


def custom_call_targets(lowered) -> list[str]:
    return [call_target(op) for op in custom_calls(lowered)]


def _shape(t) -> str:
    t = ir.RankedTensorType(t)
    return "x".join([*map(str, t.shape), str(t.element_type)])


def triton_kernels(lowered) -> list[TritonKernel]:
    """The Triton kernels of a program lowered for "cuda" or "rocm", in program order."""
    kernels = []
    for op in custom_calls(lowered):
        if call_target(op) != TRITON_TARGET:
            continue
        cfg = ir.DictAttr(op.attributes["mhlo.backend_config"])
        as_int = lambda key: ir.IntegerAttr(cfg[key]).value  # noqa: E731
        with ir.Context() as ctx:  # pip triton parses the text form (bytecode versions differ)
            jaxlib_triton.dialect.register_dialect(ctx)
            module = ir.Module.parse(ir.StringAttr(cfg["ir"]).value_bytes)
            text = module.operation.get_asm(enable_debug_info=False)
        kernels.append(TritonKernel(
            name=ir.StringAttr(cfg["name"]).value, num_warps=as_int("num_warps"), num_stages=as_int("num_stages"),
            grid=(as_int("grid_x"), as_int("grid_y"), as_int("grid_z")),
            operands=tuple(_shape(v.type) for v in op.operands), results=tuple(_shape(r.type) for r in op.results),
            ttir=text))
    return kernels
