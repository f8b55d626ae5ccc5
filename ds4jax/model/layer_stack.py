"""Decoder layers stacked by kind, so one traced body serves every layer of that kind (`jax.lax.scan`).

Unrolling the layers in Python makes every program's trace, lowering and XLA compile grow linearly with depth
(a 43-layer Flash decode step compiled for ~1 minute on CPU). DeepSeek-V4's schedules repeat: Flash is two
sliding-window layers, then CSA / HCA alternating, with the first three MoE layers hash-routed. `plan` cuts a
schedule into *segments*: a unit of consecutive layer kinds (attention type, MLP type) repeated r times. A
segment with r > 1 runs under `lax.scan` over parameters stacked on a leading axis of size r, so the program
holds one body per unit member however deep the model is (MaxText's ``scan_layers``, generalised to a mixed
schedule). Flash: ``[(SWA, hash)] x 2, [(CSA, hash)] x 1, [(HCA, top-k), (CSA, top-k)] x 20`` -> four bodies.

`LayerStack` is that layout as a pytree node: ``groups[s][u]`` holds the params of member u of segment s with
every leaf stacked over the segment's repeats; the segment plan is static (tree structure). Indexing it gives
one layer's params (a copy: for inspection and tests). `run` iterates any layout: a plain list of per-layer
dicts runs unrolled (the debugging path, `Model(..., scan_layers=False)`), a `LayerStack` runs scanned; the
body sees the same `LayerAt` either way, so both paths trace the same per-layer code.

A layer split (pipeline stages on disjoint devices) stacks by stage: `plan_stages` plans each stage's layers as
a model of their own (`mesh_steps.stage_config`), so no segment crosses a stage boundary, and `layer_range` hands
a stage its segments as a `LayerStack` of its own (sharing the arrays): each stage's program scans its repeated
segments by the same `min_repeats` rule as a one-stage model (a shallow stage stays unrolled).

The KV pools need no restacking: their arrays are already per layer kind (`pool_layout`), and a scanned body
finds its rows through `LayerAt.rank`, which is affine in the scan index (stage-local on a stage's pool).

A scanned body gets its routed experts and its FP8 dense weights whole, as `LayerOf`s / `QuantizedLayerOf`s (the
stack and its layer index: `layer_of.py`), not as slices: a Pallas kernel receives a slice as a copy, which was a
layer's whole expert set every step. Under the Pallas kernels its unquantized dense linears too (`DenseLayerOf`:
XLA's GPU GEMMs copied their slices).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from ds4jax.model.config import AttentionType, Config, MlpType
from ds4jax.model import layer_of
from ds4jax.model.layer_of import in_place, reads_in_place
from ds4jax.model.layers import linear
from ds4jax.model.quantized import is_quantized

LayerKind = tuple[AttentionType, MlpType]
_MAX_UNIT = 4  # longest repeating unit looked for (DSv4 schedules repeat with period 1 or 2)


@dataclasses.dataclass(frozen=True)
class Segment:
    start: int  # first model layer
    unit: tuple[LayerKind, ...]  # the kinds of one repetition, in layer order
    repeats: int

    @property
    def period(self) -> int:
        return len(self.unit)

    @property
    def stop(self) -> int:
        return self.start + self.period * self.repeats

    def layer(self, rep: int, member: int) -> int:
        return self.start + rep * self.period + member


def kinds(cfg: Config) -> tuple[LayerKind, ...]:
    return tuple(zip(cfg.attention_types, cfg.mlp_types))


def scan_by_default() -> bool:
    """`Model.scan_layers` when not given: True unless ``DS4JAX_SCAN_LAYERS=0`` (debugging a whole program,
    e.g. a CLI run, on the unrolled path)."""
    return os.environ.get("DS4JAX_SCAN_LAYERS", "1").strip().lower() not in ("0", "false", "no", "off")


def min_repeats() -> int:
    """Fewest repetitions worth a scan. A loop of two costs XLA more to compile than two unrolled layers (measured
    on CPU, docs/benchmarks/compile_cpu.md), so short runs stay unrolled: shallow models (the default model,
    `flash_slice(4)`) keep their unrolled programs and deep ones scan. ``DS4JAX_SCAN_MIN_REPEATS`` overrides it
    (benchmarks measure the scanned path on shallow models that way)."""
    return max(int(os.environ.get("DS4JAX_SCAN_MIN_REPEATS", "3")), 2)


def plan(schedule: Sequence[LayerKind], min_reps: int | None = None) -> tuple[Segment, ...]:
    """Greedy cut of a layer schedule into repeating segments: at each layer, the unit (length <= 4) whose
    repetitions (at least `min_reps`, default `min_repeats()`) cover the most layers (ties: the shorter unit);
    layers in no such run are segments of their own. Deterministic, so equal configs stack equally."""
    min_reps = min_repeats() if min_reps is None else min_reps
    schedule, segments, i = tuple(schedule), [], 0
    while i < len(schedule):
        best = (1, 1)  # (covered layers, -period) maximised below
        choice = (1, 1)  # (period, repeats)
        for period in range(1, _MAX_UNIT + 1):
            unit = schedule[i:i + period]
            if len(unit) < period:
                break
            reps = 1
            while schedule[i + reps * period: i + (reps + 1) * period] == unit:
                reps += 1
            if reps >= min_reps and (period * reps, -period) > best:
                best, choice = (period * reps, -period), (period, reps)
        period, reps = choice
        segments.append(Segment(i, schedule[i:i + period], reps))
        i += period * reps
    return tuple(segments)


def plan_stages(schedule: Sequence[LayerKind], ranges: Sequence[tuple[int, int]] | None = None,
                min_reps: int | None = None) -> tuple[Segment, ...]:
    """`plan` of each stage's layers [lo, hi) on its own (None: one stage), in model layer numbers: the segments of
    a layer split, none crossing a stage boundary."""
    schedule = tuple(schedule)
    ranges = ((0, len(schedule)),) if ranges is None else tuple(ranges)
    return tuple(dataclasses.replace(seg, start=seg.start + lo)
                 for lo, hi in ranges for seg in plan(schedule[lo:hi], min_reps))


@jax.tree_util.register_pytree_with_keys_class
class LayerStack:
    """Per-layer parameter trees stacked by segment (see the module docstring). Behaves as a read-only
    sequence of layers: ``len``, iteration and ``stack[i]`` give per-layer read-only FrozenDicts (sliced copies)."""

    def __init__(self, segments: tuple[Segment, ...], groups: tuple[tuple[Any, ...], ...]):
        self.segments = segments
        self.groups = groups

    def tree_flatten_with_keys(self):
        children = [(jax.tree_util.GetAttrKey(f"segment{s}_member{u}"), g)
                    for s, members in enumerate(self.groups) for u, g in enumerate(members)]
        return children, self.segments

    @classmethod
    def tree_unflatten(cls, segments, children):
        children, groups = list(children), []
        for seg in segments:
            groups.append(tuple(children[:seg.period]))
            del children[:seg.period]
        return cls(segments, tuple(groups))

    def __len__(self) -> int:
        return self.segments[-1].stop if self.segments else 0

    def locate(self, layer: int) -> tuple[int, int, int]:
        """(segment, repetition, member) holding model layer `layer`."""
        for s, seg in enumerate(self.segments):
            if seg.start <= layer < seg.stop:
                rep, member = divmod(layer - seg.start, seg.period)
                return s, rep, member
        raise IndexError(f"layer {layer} is outside the {len(self)} stacked layers")

    def layer(self, layer: int) -> Any:
        """Layer `layer`'s params as a plain (mutable) tree of sliced copies."""
        layer = layer + len(self) if layer < 0 else layer
        s, rep, member = self.locate(layer)
        return jax.tree.map(lambda a: a[rep], self.groups[s][member])

    def __getitem__(self, layer):
        """Read-only views (a FrozenDict): assigning into a copy would silently change nothing, so it raises;
        edit `unstack(...)`'s plain dicts and build a new `Model` instead."""
        if isinstance(layer, slice):
            return [self[i] for i in range(*layer.indices(len(self)))]
        import flax.core  # here: loading a model must not import flax (tests/test_startup_imports.py)

        return flax.core.freeze(self.layer(layer))

    def __iter__(self) -> Iterator[Any]:
        return (self[i] for i in range(len(self)))

    def sub(self, lo: int, hi: int) -> "LayerStack | None":
        """Layers [lo, hi) as a `LayerStack` of their own (the same arrays, layers renumbered from 0), or None when a
        segment crosses lo or hi (the stack was planned for another split)."""
        inside = [s for s, seg in enumerate(self.segments) if lo <= seg.start and seg.stop <= hi]
        if not inside or self.segments[inside[0]].start != lo or self.segments[inside[-1]].stop != hi:
            return None  # (segments are contiguous: those inside cover [lo, hi) when the ends match)
        segments = tuple(dataclasses.replace(self.segments[s], start=self.segments[s].start - lo) for s in inside)
        return LayerStack(segments, tuple(self.groups[s] for s in inside))

    def __repr__(self) -> str:
        return f"LayerStack({len(self)} layers, segments {[(s.start, s.period, s.repeats) for s in self.segments]})"


def stacked_sharding(sharding: jax.sharding.NamedSharding) -> jax.sharding.NamedSharding:
    """A stacked leaf's sharding: the per-layer one behind a replicated leading axis, in the canonical form (no
    trailing unsharded axes, as jit outputs carry it: else equal placements compare unequal)."""
    spec = [None, *sharding.spec]
    while spec and spec[-1] is None:
        spec.pop()
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))


def _stack_leaves(*xs):
    """Stack one leaf of every repetition; a leaf placed on a mesh keeps its sharding (leading axis replicated)."""
    first = xs[0]
    sharding = getattr(first, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and len(sharding.device_set) > 1:
        return jax.jit(lambda *a: jnp.stack(a), out_shardings=stacked_sharding(sharding))(*xs)
    return jnp.stack(xs)


def stack_consuming(*xs):
    """`_stack_leaves`, then free the per-layer device arrays (a loader's own copies: peak memory stays one
    stacked leaf above the model instead of doubling)."""
    out = _stack_leaves(*xs)
    for x in xs:
        if isinstance(x, jax.Array) and x is not out:
            x.delete()
    return out


def stack(cfg: Config, layers: Sequence[Any], *, combine: Callable = _stack_leaves,
          ranges: Sequence[tuple[int, int]] | None = None) -> LayerStack:
    """Per-layer trees (params, or any tree shaped like them: shardings, ParamInfo) -> a `LayerStack`.
    `combine(*leaves)` merges one leaf of every repetition of a segment member (default: `jnp.stack`).
    `ranges`: a layer split's stage ranges (`plan_stages`; None: one stage)."""
    if isinstance(layers, LayerStack):
        return layers
    if len(layers) != cfg.num_layers:
        raise ValueError(f"{len(layers)} layer trees for a config of {cfg.num_layers} layers")
    return _stack_on(plan_stages(kinds(cfg), ranges), layers, combine)


def stack_like(like: LayerStack, layers: Sequence[Any], *, combine: Callable = _stack_leaves) -> LayerStack:
    """Per-layer trees stacked on `like`'s segments (e.g. the shardings or specs of a stack's leaves)."""
    if len(layers) != len(like):
        raise ValueError(f"{len(layers)} layer trees for a stack of {len(like)} layers")
    return _stack_on(like.segments, layers, combine)


def _stack_on(segments: tuple[Segment, ...], layers: Sequence[Any], combine: Callable) -> LayerStack:
    groups = tuple(
        tuple(jax.tree.map(combine, *[layers[seg.layer(r, u)] for r in range(seg.repeats)])
              for u in range(seg.period))
        for seg in segments)
    return LayerStack(segments, groups)


def unstack(layers: Any) -> list:
    """A `LayerStack` back to a list of per-layer trees (a list is returned as is)."""
    return [layers.layer(i) for i in range(len(layers))] if isinstance(layers, LayerStack) else layers


def unstacked_host(params: dict) -> dict:
    """Params as numpy with per-layer dicts (for writers: the per-layer views of a stacked leaf copy nothing)."""
    return unstacked_params(jax.tree.map(np.asarray, params))


def layer_range(layers: Any, lo: int, hi: int) -> Any:
    """Layers [lo, hi) for a stage's program: a `LayerStack` of that stage's segments (the same arrays, layers
    numbered from 0, scanned like a model of its own), a list slice of per-layer params (unrolled), or, for a stack
    planned for another split (a segment crossing lo or hi), the layers' per-layer copies."""
    if isinstance(layers, LayerStack):
        if (lo, hi) == (0, len(layers)):
            return layers
        sub = layers.sub(lo, hi)
        return sub if sub is not None else [layers.layer(i) for i in range(lo, hi)]
    return layers[lo:hi]


def is_stacked(params: Any) -> bool:
    return isinstance(params, dict) and isinstance(params.get("layers"), LayerStack)


def stage_ranges(cfg: Config, layout: Any = None) -> tuple[tuple[int, int], ...] | None:
    """A layout's stage ranges when it splits layers across stages, else None (one stage)."""
    if layout is None or getattr(layout, "num_stages", 1) <= 1:
        return None
    return tuple(layout.stage_ranges(cfg.num_layers))


def stacked_params(cfg: Config, params: dict, ranges: Sequence[tuple[int, int]] | None = None) -> dict:
    """Params with their layers stacked for a split into stage `ranges` (None: one stage); a stack planned
    otherwise (e.g. a one-stage model placed on a layer split) is restacked (its per-layer copies consumed)."""
    if "layers" not in params:
        return params
    want = plan_stages(kinds(cfg), ranges)
    if is_stacked(params):
        if params["layers"].segments == want:
            return params
        return {**params, "layers": _stack_on(want, unstack(params["layers"]), stack_consuming)}
    return {**params, "layers": _stack_on(want, params["layers"], _stack_leaves)}


def for_loader(cfg: Config, params: dict, layout: Any = None, combine: Callable = stack_consuming) -> dict:
    """A loader's freshly read params in the layout `Model` keeps for `layout`: stacked by stage (consuming the
    per-layer arrays, which nothing else references; `plan_stages`) unless ``DS4JAX_SCAN_LAYERS=0``.
    `combine`: how a leaf's repetitions are stacked (``np.stack`` for host arrays placed after stacking)."""
    if is_stacked(params) or not scan_by_default():
        return params
    return {**params, "layers": stack(cfg, params["layers"], combine=combine, ranges=stage_ranges(cfg, layout))}


def unstacked_params(params: dict) -> dict:
    return {**params, "layers": unstack(params["layers"])} if is_stacked(params) else params


# ---- running ------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class LayerAt:
    """Where a traced layer body runs: its kinds, and its model layer index (a tracer inside a scan)."""

    attention: AttentionType
    mlp: MlpType
    first: int  # model layer of this body at repetition 0
    schedule: tuple[LayerKind, ...] = ()  # the model's layer kinds (for `rank`)
    unit: tuple[LayerKind, ...] = ()  # the scanned unit ((): unrolled)
    rep: Any = 0  # repetition index (traced under scan)

    @property
    def index(self):
        return self.first + self.rep * max(len(self.unit), 1)

    @property
    def name(self) -> str:
        return f"layer{self.first}" + (f"+{len(self.unit)}j" if self.unit else "") + f"_{self.attention.name.lower()}"

    def rank(self, attention_kinds: Sequence[AttentionType]):
        """This layer's index among the layers whose attention kind is in `attention_kinds` (e.g. its row on a
        pool array of those layers): static for an unrolled layer, affine in the repetition under scan."""
        base = sum(1 for a, _ in self.schedule[:self.first] if a in attention_kinds)
        if not self.unit:
            return base
        return base + self.rep * sum(1 for a, _ in self.unit if a in attention_kinds)


Body = Callable[[Any, Any, LayerAt], tuple[Any, Any]]


def _is_slot(x: Any) -> bool:
    return x is None or is_quantized(x)


def _split_in_place(p: Any) -> tuple[Any, Any]:
    """(the member's leaves read in place, None elsewhere; the rest, None where those are): one tree shape."""
    dense, mhc = linear.layer_matmul_min_bytes(), layer_of.mhc_in_place_installed()
    kept = lambda path, w: w is not None and reads_in_place(path, w, dense_min_bytes=dense, mhc=mhc)  # noqa: E731
    return (jax.tree_util.tree_map_with_path(lambda path, w: w if kept(path, w) else None, p, is_leaf=_is_slot),
            jax.tree_util.tree_map_with_path(lambda path, w: None if kept(path, w) else w, p, is_leaf=_is_slot))


def _join_in_place(sliced: Any, kept: Any, rep: jax.Array) -> Any:
    """The body's params: the scanned slices, with the kept stacks as layer `rep` of themselves (`in_place`)."""
    return jax.tree_util.tree_map_with_path(lambda path, s, k: s if k is None else in_place(path, k, rep), sliced,
                                            kept, is_leaf=_is_slot)


def run(cfg: Config, layers: Any, carry: Any, body: Body, *, offset: int = 0) -> tuple[Any, list]:
    """Fold `body(carry, layer_params, at) -> (carry, out)` over the layers in order.

    `layers` is a list (unrolled: one traced body per layer) or a `LayerStack` (a `lax.scan` per repeated
    segment). `offset` is the model layer of ``layers[0]`` when they are a stage's slice of `cfg`'s layers (a
    stage run with its own `stage_config` has offset 0). Returns the final carry and the per-layer outputs as a
    list in layer order (scan outputs unstacked)."""
    schedule = kinds(cfg)
    if not isinstance(layers, LayerStack):
        outs = []
        for j, p in enumerate(layers):
            i = offset + j
            at = LayerAt(*schedule[i], first=i, schedule=schedule)
            with jax.named_scope(at.name):
                carry, out = body(carry, p, at)
            outs.append(out)
        return carry, outs
    outs: list = [None] * len(layers)
    for seg, group in zip(layers.segments, layers.groups):
        if seg.repeats == 1:  # nothing to share: run the unit unrolled on the squeezed params
            for u, p in enumerate(group):
                at = LayerAt(*seg.unit[u], first=offset + seg.layer(0, u), schedule=schedule)
                with jax.named_scope(at.name):
                    carry, outs[seg.layer(0, u)] = body(carry, jax.tree.map(lambda a: a[0], p), at)
            continue

        # the routed experts and the FP8 dense weights stay whole (closed over, not scanned): the body gets
        # `LayerOf`s and `QuantizedLayerOf`s (see layer_of.py)
        kept, sliced = zip(*(_split_in_place(p) for p in group))

        # the repetition counter rides in the carry, not as a scanned arange: each scanned input is sliced per
        # iteration, on the GPU a launch of its own (an asynchronous copy), while the carry's add fuses
        def step(state, members, seg=seg, kept=kept):
            c, rep = state
            ys = []
            for u, p in enumerate(members):
                p = _join_in_place(p, kept[u], rep)
                at = LayerAt(*seg.unit[u], first=offset + seg.layer(0, u), schedule=schedule, unit=seg.unit, rep=rep)
                with jax.named_scope(at.name):
                    c, y = body(c, p, at)
                ys.append(y)
            return (c, rep + 1), tuple(ys)

        (carry, _), ys = jax.lax.scan(step, (carry, jnp.zeros((), jnp.int32)), sliced, length=seg.repeats)
        for u, y in enumerate(ys):
            for r in range(seg.repeats):
                outs[seg.layer(r, u)] = jax.tree.map(lambda a, r=r: a[r], y)
    return carry, outs
