"""Sharded execution (issue 12). The layouts run in two subprocesses with 8 forced host devices (tests/mesh_worker.py;
the rest of the suite keeps its 4); everything else here runs in-process on the suite's devices."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

import ds4jax
from ds4jax.model import params as params_lib
from ds4jax.model.sharding import default_rules, mesh_spec
from ds4jax.runtime.mesh import MeshError, make_mesh, split_ranges
from ds4jax.runtime.data_parallel import check_rows, local_spec
from ds4jax.runtime.mesh_steps import POOL_AXES, ShardedPoolBook
from ds4jax.runtime.pool_spec import PoolSpec, shapes
from ds4jax.runtime.pools import PoolError
from ds4jax.runtime.roles import Role

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import mesh_worker  # noqa: E402  (importing it does not start jax work; its main() does)

TOL = 1e-5


@pytest.fixture(scope="module")
def mesh_cases():
    """Every case of the worker, in two subprocesses started together (`mesh_worker.GROUPS`): within a group the
    cases share their one-device references and compiled programs (one jit cache), and the groups share none, so
    the two run side by side on two cores instead of one after the other (the suite's longest item). conftest.py
    runs these tests first, so one test worker takes them all at the start."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    worker = os.path.join(HERE, "mesh_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, *group], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env=env) for group in mesh_worker.GROUPS]
    try:  # every process is waited for (killed on a timeout or an error) before any assertion
        outputs = [proc.communicate(timeout=2400) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    results = {}
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0, err[-4000:]
        results.update(json.loads(out.strip().splitlines()[-1]))
    return results


@pytest.mark.slow
@pytest.mark.parametrize("name", list(mesh_worker.LAYOUTS))
def test_layout_matches_single_device(mesh_cases, name):
    res = mesh_cases[name]
    # the layout really spreads the params over its devices (8, or 6 for three stages x tensor 2)
    assert res["devices"] == mesh_worker.devices_of(name) >= 6, res["devices"]
    assert res["prefill"] <= TOL and res["decode"] <= TOL, (res["prefill"], res["decode"])
    assert res["tokens_equal"], res["tokens"]
    bad = {k: v for k, v in res["pools"].items() if not v <= TOL}
    assert not bad, bad
    assert len(res["pools"]) == 2 * 11  # two slots x every pool array but the page table
    assert res["steps_compiled"] == res["stages"], res  # each stage's step compiled once for every call
    if name in mesh_worker.FORWARD:
        assert res["forward"] <= TOL


@pytest.mark.slow
@pytest.mark.parametrize("name", list(mesh_worker.ENGINES))
def test_engine_on_a_mesh_matches_single_device(mesh_cases, name):
    """`ds4jax.Engine` with sharded params and data-parallel pools: plain and speculative greedy tokens equal the
    single-device ones, and a second identical call compiles nothing."""
    res = mesh_cases[name]
    assert res["devices"] == mesh_worker.devices_of(name) >= 6 and not res["errors"], res
    assert res["tokens"] == res["ref"] and res["again"] == res["ref"], res
    assert res["accepted"][0] is None and sum(res["accepted"][1]) > 0, res["accepted"]  # row 1 drafted, accepted
    assert "'data'" in res["pool_spec"], res["pool_spec"]  # pools split by request slot
    assert not {"jit(prefill_call)", "jit(decode_loop)", "jit(speculative_loop)"} & set(res["recompiled"]), res
    # and the first call compiles each once (its pools come back placed as they went in)
    assert res["first_compiles"] == {"jit(prefill_call)": 1, "jit(decode_loop)": 1, "jit(speculative_loop)": 1}, res


@pytest.mark.slow
@pytest.mark.parametrize("name", list(mesh_worker.SPLIT_ENGINES))
def test_engine_on_a_layer_split_matches_single_device(mesh_cases, name):
    """`ds4jax.Engine` stage by stage on layer splits of 2 (x data 2 x expert 2) and 3 (x tensor 2): a ragged batch
    (two requests join mid-flight, prompts over several chunks) gives the single-device tokens, greedy and seeded
    top-k (top-k 1 = greedy), the pools at the committed positions and the last prefill logits equal, nothing
    compiles after warmup (park / unpark included); `ds4jax.generate` on the split (top-k honoured) equals one
    device and compiles nothing."""
    res = mesh_cases[name]
    assert res["devices"] == mesh_worker.devices_of(name) >= 6 and not res["errors"], res
    assert res["tokens"] == res["ref"] and res["again"] == res["ref"], res
    assert res["tokens"][3][:3] == res["tokens"][1], res["tokens"]  # top_k=1 at temperature 0.7 is greedy (prompt 1)
    assert len(res["pools"]) == 2 * 11 and all(v <= TOL for v in res["pools"].values()), res["pools"]
    assert res["logits"] <= TOL and res["compiles_after_warmup"] == 0, res
    gen, ref = res["generate"], res["ref_generate"]
    assert gen == ref and gen["top1"] == gen["greedy"] and gen["topk"] != gen["greedy"], (gen, ref)
    assert res["generate_compiles"] == 0, res["generate_compiles"]  # the engine's programs serve generate


@pytest.mark.slow
@pytest.mark.parametrize("name", list(mesh_worker.SPLIT_SNAPSHOTS))
def test_prefix_snapshots_on_a_layer_split(mesh_cases, name):
    """Prefix snapshots on a layer split (x data 2 x expert 2): a snapshot of the whole prompt restores with zero
    prefill steps, one of its first 12 tokens prefills only the suffix; tokens equal the one-device engine
    without snapshots, and so do the split's snapshots restored on one device (the same layout); a snapshot from
    another pool spec is INVALID_SNAPSHOT; nothing compiles after warmup."""
    res = mesh_cases[name]
    assert not res["errors"], res
    assert res["made"] == res["exact"] == res["ref"][0] and res["suffix"] == res["ref"][1], res
    assert res["exact_prefill"] == 0 and res["exact_steps"] == 0 and res["suffix_prefill"] == 6, res
    assert res["hits"] == 2 and res["on_one"] == res["ref"] and res["one_hits"] == 2, res
    assert res["refused"] == "ErrorCode.INVALID_SNAPSHOT" and res["compiles_after_warmup"] == 0, res


@pytest.mark.slow
@pytest.mark.parametrize("name", list(mesh_worker.SPLIT_SPEC))
def test_speculative_decoding_on_a_layer_split(mesh_cases, name):
    """Speculation (k = 2) on a layer split x data 2 x expert 2: the ragged batch (two requests join mid-flight,
    greedy, seeded top-k, top-k 1) gives the one-device speculative engine's tokens and drafts accepted per
    round, and its draft ring; greedy rows equal plain decoding; an exact snapshot hit restores the draft's
    pending row (no prefill) and continues identically; after park / unpark of the draft the batch repeats
    bit for bit; nothing compiles after warmup."""
    res = mesh_cases[name]
    ref = res["ref"]
    assert res["stages"] == 2 and not res["errors"] and not ref["errors"], res
    assert res["tokens"] == ref["tokens"] and res["accepted"] == ref["accepted"], res
    assert sum(a for r in res["accepted"] for a in r) > 0, res["accepted"]  # drafts were accepted, not only rejected
    assert res["draft_ring"] <= TOL, res["draft_ring"]
    greedy = [0, 1, 3]  # request 2 samples (top-k 5): speculation draws its tokens differently from plain decoding
    assert [res["tokens"][i] for i in greedy] == [ref["plain"][i] for i in greedy], (res["tokens"], ref["plain"])
    assert res["hit"] == res["made"] == ref["hit"] and res["hit_prefill"] == 0 and res["hits"] >= 1, res
    assert res["again"] == res["tokens"] and res["compiles_after_warmup"] == 0, res


def test_engine_rows_on_data_parallel_pools():
    """The engine's rows on a data-parallel mesh: buckets are multiples of data, row block d serves the requests
    whose slots live on data shard d (padded on its own). On a layer split the draft lives on the last stage."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    from types import SimpleNamespace

    from ds4jax.model.handle import Model
    from ds4jax.runtime.mesh import place_model

    cfg = ds4jax.tiny()
    model = Model(cfg, params_lib.init(cfg, jax.random.key(0)))
    placed = place_model(model, make_mesh(data=2, devices=jax.devices()[:2]))
    assert ds4jax.Engine(placed, max_slots=8, max_context=64).row_buckets == (2, 8)  # powers of 8 in units of data
    engine = ds4jax.Engine(placed, max_slots=8, max_context=64, row_buckets=(2, 4, 8))
    assert engine.row_buckets == (2, 4, 8) and "'data'" in str(engine.tpool.swa_kv.sharding.spec)
    live = [SimpleNamespace(slot=s) for s in (5, 0, 6, 7)]  # slots 0-3 on shard 0, 4-7 on shard 1
    assert [lv and lv.slot for lv in engine._row_plan(live, engine.row_buckets)] == [0, None, None, None,
                                                                                     5, 6, 7, None]
    assert [lv.slot for lv in engine._fit(live, 4)] == [5, 0, 6]  # two rows per shard
    with pytest.raises(PoolError, match="multiples of the mesh's data=2"):
        ds4jax.Engine(placed, max_slots=8, max_context=64, row_buckets=(1, 8))
    split = place_model(model, make_mesh(layer_split=2, devices=jax.devices()[:2]))
    engine = ds4jax.Engine(split, max_slots=2, max_context=64, speculative=2)
    last = set(split.layout.stages[-1].devices.flat)
    assert engine.dpool.swa_kv.devices() == last and engine.slot_state.draft_logits.devices() == last
    assert engine.stages.draft_params(engine.model.params)["embed"].devices() == last  # the draft's own copy
    assert engine.model.params["embed"].devices() == set(split.layout.stages[0].devices.flat)


def test_every_param_has_logical_axes():
    for cfg in (ds4jax.tiny(), ds4jax.flash()):
        decl = params_lib.declare(cfg)
        leaves = jax.tree.leaves(decl, is_leaf=lambda x: isinstance(x, params_lib.ParamInfo))
        assert leaves and all(isinstance(p, params_lib.ParamInfo) for p in leaves)
        for p in leaves:
            assert len(p.axes) == len(p.shape) and set(p.axes) <= params_lib.PARAM_AXES, p
    with pytest.raises(ValueError, match="logical axes"):
        params_lib.ParamInfo((4, 4), ("embed", None), params_lib._normal)
    with pytest.raises(ValueError, match="logical axes"):
        params_lib.ParamInfo((4, 4), ("embed",), params_lib._normal)


def test_every_pool_array_has_logical_axes():
    cfg = ds4jax.tiny()
    spec = PoolSpec.for_role(cfg, role=Role.TARGET, max_slots=2, max_context=64, page_size=8)
    for name, (shape, _) in shapes(spec).items():
        assert name in POOL_AXES, f"pool array {name} has no logical axes"
        axes = POOL_AXES[name]
        assert len(axes) == len(shape) and all(isinstance(a, str) for a in axes), (name, axes)
    assert set(POOL_AXES) == set(shapes(spec))


def test_rules_resolve_with_flax_and_respect_divisibility():
    sizes = {"data": 2, "expert": 4, "tensor": 2}
    assert mesh_spec((8, 64, 32), ("experts", "embed", "expert_mlp"), sizes, default_rules()) == \
        jax.sharding.PartitionSpec("expert", None, "tensor")
    assert mesh_spec((256, 64), ("vocab", "embed"), sizes, default_rules())[0] == ("expert", "tensor")
    # 6 experts do not split 4 ways: replicated rather than an uneven placement
    assert mesh_spec((6, 64, 32), ("experts", "embed", "expert_mlp"), sizes, default_rules())[0] is None


def test_layer_split_ranges():
    assert split_ranges(None, 5, 2) == ((0, 2), (2, 5)) or split_ranges(None, 5, 2) == ((0, 3), (3, 5))
    assert split_ranges([(0, 1), (1, 5)], 5, 2) == ((0, 1), (1, 5))
    with pytest.raises(MeshError, match=r"leaves layers \[2\] uncovered"):
        split_ranges([(0, 2), (3, 5)], 5, 2)
    with pytest.raises(MeshError, match=r"covers layers \[2\] twice"):
        split_ranges([(0, 3), (2, 5)], 5, 2)
    with pytest.raises(MeshError, match="outside"):
        split_ranges([(0, 2), (2, 6)], 5, 2)
    with pytest.raises(MeshError, match="not in layer order"):
        split_ranges([(2, 5), (0, 2)], 5, 2)
    with pytest.raises(MeshError, match="cannot split 5 layers into 6"):
        split_ranges(6, 5, 6)


def test_make_mesh_errors_and_geometry():
    n = len(jax.devices())
    with pytest.raises(MeshError, match="devices, only"):
        make_mesh(expert=n + 1)
    with pytest.raises(MeshError, match="tensor=0"):
        make_mesh(tensor=0)
    layout = make_mesh(expert=2, layer_split=[(0, 3), (3, 5)])
    assert layout.num_stages == 2 and layout.axis_sizes == {"data": 1, "expert": 2, "tensor": 1}
    assert [m.devices.size for m in layout.stages] == [2, 2]
    assert not set(layout.stages[0].devices.flat) & set(layout.stages[1].devices.flat)
    with pytest.raises(MeshError, match="outside the model's layers"):
        layout.stage_ranges(4)  # the split was written for a 5-layer model


def test_sharded_book_keeps_pages_on_the_slot_shard():
    cfg = ds4jax.tiny()
    spec = PoolSpec.for_role(cfg, role=Role.TARGET, max_slots=4, max_context=32, page_size=8)
    book = ShardedPoolBook(spec, cfg.vocab_size, data=2)
    per = spec.num_pages // 2
    for s in range(4):
        book.admit(s)
        book.reserve(s, 20)
        pages = book.page_table[s][book.page_table[s] >= 0]
        assert ((pages // per) == s // 2).all(), (s, pages)
    book.release(1)
    assert len(book.free_pages) == spec.num_pages - 3 * book.pages_needed(20)
    local = local_spec(spec, 2)
    assert local.max_slots == 2 and local.num_pages == per
    check_rows([0, 2], 4, 2)
    with pytest.raises(PoolError, match="row 0: slot 2 lives on data shard 1"):
        check_rows([2, 0], 4, 2)
    with pytest.raises(PoolError, match="not divisible"):
        check_rows([0, 1, 2], 4, 2)


def test_placed_params_are_split_not_copied():
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    cfg = ds4jax.tiny(num_heads=4, o_groups=4)
    params = params_lib.init(cfg, jax.random.key(0))
    layout = make_mesh(expert=2, tensor=2)
    placed = layout.place(params, cfg)
    w1 = placed["layers"][0]["ffn"]["experts"]["w1"]
    assert {s.data.shape for s in w1.addressable_shards} == {(cfg.num_routed_experts // 2, cfg.hidden_size,
                                                              cfg.moe_intermediate_size // 2)}
    per_device = layout.per_device_bytes(placed)
    total = sum(np.asarray(x).nbytes for x in jax.tree.leaves(params))
    assert max(per_device.values()) < total


def test_configure_on_a_mesh_reports_per_device_bytes():
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    cfg = ds4jax.tiny()
    layout = make_mesh(data=2, expert=2)
    params = layout.memory_report(cfg)["params"]
    budget = params + (4 << 20)
    spec, report = layout.configure(cfg, role=Role.TARGET, max_context=512, memory_budget_bytes=budget, max_slots=4,
                                    page_size=8)
    assert spec.max_slots == 4 and spec.num_pages % 2 == 0
    assert report["params"] == params and 0 < report["pools"] and report["total"] <= budget
    # the whole-model pool is about twice one device's (two data ranks), params are split, not replicated
    single = make_mesh(devices=jax.devices()[:1]).memory_report(cfg, spec)
    assert single["pools"] > 1.5 * report["pools"] and single["params"] > report["params"]
    with pytest.raises(MeshError, match="params alone"):
        layout.configure(cfg, role=Role.TARGET, max_context=512, memory_budget_bytes=params // 2, max_slots=4)


def test_dispatch_under_a_mesh_uses_shard_map():
    """The sharded paths are wired in: MoE and the Pallas kernels trace into shard_map under a mesh (and not
    without one), and an expert-parallel forward compiles without gathering any expert weights."""
    if len(jax.devices()) < 4:
        pytest.skip("needs 4 devices")
    from jax.sharding import NamedSharding

    from ds4jax.model import forward
    from ds4jax.runtime import kernels
    from ds4jax.runtime.mesh_plan import collectives

    S = jax.ShapeDtypeStruct
    t, h, d = 4, 4, 32
    args = (S((t, h, d), np.float32), S((16, d), np.float32), S((t, 8), np.int32), S((8, d), np.float32),
            S((t, 4), np.int32), S((h,), np.float32))
    attn = lambda *a: kernels.sparse_attention(*a, scale=0.1, impl=kernels.Impl.PALLAS_INTERPRET)
    plain = str(jax.make_jaxpr(attn)(*args))
    assert "pallas_call" in plain and "shard_map" not in plain
    mhc_cfg = ds4jax.tiny()
    m, e = mhc_cfg.hc_mult, mhc_cfg.hidden_size
    hc = {"fn": S((2 * m + m * m, m * e), np.float32), "scale": S((3,), np.float32),
          "base": S((2 * m + m * m,), np.float32)}
    mhc = lambda x, p, w: kernels.mhc_pre(x, p, w, cfg=mhc_cfg, impl=kernels.Impl.PALLAS_INTERPRET)
    mhc_args = (S((2, 3, m, e), np.float32), hc, S((e,), np.float32))
    assert "shard_map" not in str(jax.make_jaxpr(mhc)(*mhc_args))
    layout = make_mesh(tensor=2, expert=2)
    with layout.active():
        sharded = str(jax.make_jaxpr(attn)(*args))
        sharded_mhc = str(jax.make_jaxpr(mhc)(*mhc_args))
    assert "shard_map" in sharded and "pallas_call" in sharded
    assert "shard_map" in sharded_mhc and "pallas_call" in sharded_mhc

    cfg = ds4jax.tiny(num_heads=4, o_groups=4)
    abstract = params_lib.abstract(cfg, np.float32)
    layout = make_mesh(expert=4)
    params = jax.tree.map(lambda a, s: S(a.shape, a.dtype, sharding=s), abstract, layout.param_shardings(cfg))
    ids = S((2, 8), np.int32, sharding=NamedSharding(layout.stages[0], jax.sharding.PartitionSpec()))
    fwd = jax.jit(lambda p, i: forward.forward(cfg, p, i))
    unsharded = jax.make_jaxpr(lambda p, i: forward.forward(cfg, p, i))(abstract, S((2, 8), np.int32))
    assert "shard_map" not in str(unsharded)
    with layout.active():
        assert "shard_map" in str(jax.make_jaxpr(lambda p, i: forward.forward(cfg, p, i))(params, ids))
        hlo = fwd.lower(params, ids).compile().as_text()
    assert set(collectives(hlo)) <= {"all-reduce"}, collectives(hlo)  # no all-gather of experts (or anything)
