"""PoolSpec: peer shapes, ring write pads, memory-budget arithmetic, draft spec, validation.

Expected numbers are computed by hand from the architecture (spec §1, §4.1) and serving.md §5–6, never by
calling the code under test.
"""

import math

import jax
import jax.numpy as jnp
import pytest

from ds4jax.model import config
from ds4jax.runtime.pool_spec import (
    PoolSpec, PoolSpecError, bytes_per_request, bytes_per_slot, bytes_per_token, configure, page_bytes,
    shapes, total_bytes, write_pad,
)
from ds4jax.runtime.roles import Role

BF16, F32, I32 = 2, 4, 4
MIB = 1 << 20


def _tiny(**overrides):
    # 5 layers: sliding, CSA, HCA, CSA, HCA (two of each compressed kind, so every per-kind count below is 2, not
    # the layer count; the preset has one of each); head_dim 32, index_head_dim 32, ratios 4 / 8, window 8.
    A = config.AttentionType
    five = dict(num_layers=5, attention_types=(A.SLIDING, A.CSA, A.HCA, A.CSA, A.HCA),
                mlp_types=(config.MlpType.HASH,) * 2 + (config.MlpType.TOPK,) * 3)
    return config.tiny(**{**five, **overrides})


# ---- peer shapes (serving.md §2a, §5.3) -----------------------------------------------------------------

FULL, C4, C128 = 7_328_256, 1_832_064, 57_252  # SGLang #37713: target c4_size / c128_size per rank


def test_peer_shapes_exact():
    # 78 slots x 367 pages of 256 = 28,626 pages = 7,328,256 full tokens.
    args = dict(max_slots=78, max_context=367 * 256, draft_tokens=4)
    target = PoolSpec.for_role(config.flash(), role=Role.TARGET, **args)
    assert target.full_tokens == FULL and target.num_pages == 28_626
    assert (target.c4_entries, target.indexer_entries, target.c128_entries) == (C4, C4, C128)
    assert target.c4_pages == target.c128_pages == 28_626
    draft = PoolSpec.for_role(config.flash(), role=Role.DRAFT, **args)
    assert (draft.c4_entries, draft.indexer_entries, draft.c128_entries) == (0, 0, 0)
    assert (draft.c4_state_rows, draft.indexer_state_rows, draft.c128_state_rows) == (0, 0, 0)
    assert (draft.num_layers, draft.num_csa_layers, draft.num_hca_layers) == (1, 0, 0)


def _flash_slot_bytes_spec4(pages_per_slot):
    # One Flash slot, bf16 KV, fp32 states, draft_tokens 4 (rings: swa 131, c4/indexer 16, c128 256).
    swa = 43 * 131 * 512 * BF16
    c4_state = 21 * 16 * (2 * 512) * F32 * 2  # kv + gate, 2*head_dim channels
    indexer_state = 21 * 16 * (2 * 128) * F32 * 2
    c128_state = 20 * 256 * 512 * F32 * 2
    tables = pages_per_slot * I32 + I32
    draft = 1 * 131 * 512 * BF16 + I32  # the MTP layer's SWA ring and lengths
    return swa + c4_state + indexer_state + c128_state + tables + draft


def test_peer_shapes_from_budget():
    page = 256 * (21 * 64 * (512 + 128) + 20 * 2 * 512) * BF16 // 256  # c4 + indexer + c128 rows of one page
    assert page == 256 * 6880
    slots, context = 64, 1 << 20
    fixed = slots * _flash_slot_bytes_spec4(context // 256)
    budget = fixed + 28_626 * page + page - 1  # just short of one more page: rounds down
    args = dict(max_context=context, max_slots=slots, memory_budget_bytes=budget, draft_tokens=4, oversubscribe=True)
    target = configure(config.flash(), role=Role.TARGET, **args)
    assert target.full_tokens == FULL
    assert (target.c4_entries, target.indexer_entries, target.c128_entries) == (C4, C4, C128)
    assert target.max_slots == slots
    draft = configure(config.flash(), role=Role.DRAFT, **args)
    assert (draft.c4_entries, draft.indexer_entries, draft.c128_entries, draft.pages_per_slot) == (0, 0, 0, 0)
    assert (draft.c4_state_rows, draft.indexer_state_rows, draft.c128_state_rows) == (0, 0, 0)
    assert draft.max_slots == slots and draft.swa_rows == target.swa_rows == 131
    for name, (shape, _) in shapes(draft).items():
        if name not in ("swa_kv", "lengths"):
            assert math.prod(shape) == 0, name


# ---- rings and write pads (serving.md §6) -------------------------------------------------------------

def test_write_pad_table():
    assert write_pad(16, 8) == 10  # C4, speculating
    assert write_pad(256, 128) == 130  # C128, speculating
    assert write_pad(8, 8) == 0 and write_pad(128, 128) == 0  # plain rings
    assert write_pad(4, 8) == 0


@pytest.mark.parametrize("draft_tokens, swa, c4, c128", [(0, 128, 8, 128), (1, 128, 16, 256), (4, 131, 16, 256),
                                                         (10, 137, 16, 256)])
def test_flash_ring_rows(draft_tokens, swa, c4, c128):
    s = PoolSpec.for_role(config.flash(), role=Role.TARGET, max_slots=2, max_context=4096, draft_tokens=draft_tokens)
    assert (s.swa_rows, s.c4_state_rows, s.indexer_state_rows, s.c128_state_rows) == (swa, c4, c4, c128)


@pytest.mark.parametrize("cfg", [config.flash(), _tiny()], ids=["flash", "tiny"])
@pytest.mark.parametrize("role", list(Role))
def test_draft_tokens_beyond_pad_raise(cfg, role):
    page = 256 if cfg.hca_ratio == 128 else 16
    kw = dict(role=role, max_slots=2, max_context=1024, page_size=page)
    PoolSpec.for_role(cfg, draft_tokens=10, **kw)  # C4 pad 10 is the binding limit (tiny's C128 pad is 10 too)
    with pytest.raises(PoolSpecError, match=r"PoolSpec\.draft_tokens: 11 exceeds the write pad"):
        PoolSpec.for_role(cfg, draft_tokens=11, **kw)
    with pytest.raises(PoolSpecError, match=r"PoolSpec\.draft_tokens"):
        configure(cfg, max_context=1024, max_slots=2, draft_tokens=11, memory_budget_bytes=1 << 40,
                  role=role, page_size=page)


# ---- memory-budget arithmetic (tiny, fp32, page 16) -----------------------------------------------------

TINY_PAGE = 2 * (16 // 4) * 32 * F32 * 2 + 2 * (16 // 8) * 32 * F32  # c4 + indexer, c128 rows of 16 tokens
TINY_SLOT = (5 * 8 * 32 * F32  # SWA ring, 5 layers x 8 rows
             + 2 * 8 * 64 * F32 * 2 + 2 * 8 * 64 * F32 * 2  # C4 and indexer state rings (kv + gate, 2x32 wide)
             + 2 * 8 * 32 * F32 * 2  # C128 state ring (8 rows = hca_ratio)
             + 4 * I32 + I32)  # page-table row (64 / 16 pages) and length
TINY = dict(max_context=64, page_size=16, dtype="float32")


def test_tiny_hand_numbers():
    assert (TINY_PAGE, TINY_SLOT) == (2560, 25620)
    spec = PoolSpec.for_role(_tiny(), role=Role.TARGET, max_slots=2, **TINY)
    assert page_bytes(spec) == TINY_PAGE and bytes_per_slot(spec)["total"] == TINY_SLOT
    assert bytes_per_token(spec)["total"] == TINY_PAGE / 16 == 160
    assert total_bytes(spec) == 2 * TINY_SLOT + 8 * TINY_PAGE


def test_budget_exact_fit_and_cap():
    budget = 2 * TINY_SLOT + 8 * TINY_PAGE + 100  # 100 B too little for another page
    spec = configure(_tiny(), role=Role.TARGET, max_slots=2, memory_budget_bytes=budget, **TINY)
    assert (spec.num_pages, spec.full_tokens, spec.c4_entries, spec.indexer_entries, spec.c128_entries) == (
        8, 128, 32, 32, 16)
    assert spec == PoolSpec.for_role(_tiny(), role=Role.TARGET, max_slots=2, **TINY)
    # More memory than two slots can address buys nothing.
    assert configure(_tiny(), role=Role.TARGET, max_slots=2, memory_budget_bytes=1 << 30, **TINY).num_pages == 8


def test_budget_page_rounding_and_oversubscription():
    budget = 2 * TINY_SLOT + 8 * TINY_PAGE - 1  # 7.99 pages
    with pytest.raises(PoolSpecError, match=r"memory_budget_bytes: .* holds 112 paged tokens.* needs 128"):
        configure(_tiny(), role=Role.TARGET, max_slots=2, memory_budget_bytes=budget, **TINY)
    spec = configure(_tiny(), role=Role.TARGET, max_slots=2, memory_budget_bytes=budget, oversubscribe=True, **TINY)
    assert (spec.num_pages, spec.full_tokens, spec.c4_entries, spec.c128_entries) == (7, 112, 28, 14)
    assert spec.pages_per_slot == 4


@pytest.mark.parametrize("budget", [2 * TINY_SLOT - 1, 2 * TINY_SLOT, 2 * TINY_SLOT + TINY_PAGE - 1,
                                    2 * TINY_SLOT + 3 * TINY_PAGE])  # last: 3 pages < one request's 4
def test_not_enough_memory(budget):
    with pytest.raises(PoolSpecError, match="not enough memory"):
        configure(_tiny(), role=Role.TARGET, max_slots=2, memory_budget_bytes=budget, oversubscribe=True, **TINY)


def test_budget_reserves_the_draft_when_speculating():
    # draft_tokens 4: SWA ring 8 + 4 - 1 = 11 rows, state rings doubled to 16, plus the draft's own ring.
    slot = (5 * 11 * 32 * F32 + 2 * 16 * 64 * F32 * 2 * 2 + 2 * 16 * 32 * F32 * 2 + 4 * I32 + I32
            + 1 * 11 * 32 * F32 + I32)
    assert slot == 49432
    kw = dict(max_slots=2, draft_tokens=4, **TINY)
    spec = configure(_tiny(), role=Role.TARGET, memory_budget_bytes=2 * slot + 8 * TINY_PAGE, **kw)
    assert spec.num_pages == 8
    with pytest.raises(PoolSpecError, match="needs 128"):
        configure(_tiny(), role=Role.TARGET, memory_budget_bytes=2 * slot + 8 * TINY_PAGE - 1, **kw)


def test_swa_full_ratio_derives_slots():
    # Ratio 0.5 with 8 SWA rows: every 16-token page brings one slot; 10 (page + slot) units fit.
    budget = 10 * (TINY_PAGE + TINY_SLOT) + 5
    spec = configure(_tiny(), role=Role.TARGET, swa_full_ratio=0.5, memory_budget_bytes=budget, oversubscribe=True,
                     **TINY)
    assert (spec.max_slots, spec.num_pages) == (10, 10)
    assert total_bytes(spec) <= budget
    with pytest.raises(PoolSpecError, match="needs 640"):
        configure(_tiny(), role=Role.TARGET, swa_full_ratio=0.5, memory_budget_bytes=budget, **TINY)


def test_configure_arguments():
    assert configure(_tiny(), role=Role.TARGET, max_slots=3, **TINY) == PoolSpec.for_role(
        _tiny(), role=Role.TARGET, max_slots=3, **TINY)
    with pytest.raises(PoolSpecError, match="exactly one"):
        configure(_tiny(), role=Role.TARGET, max_slots=3, swa_full_ratio=0.1, memory_budget_bytes=1 << 20, **TINY)
    with pytest.raises(PoolSpecError, match="swa_full_ratio"):
        configure(_tiny(), role=Role.TARGET, max_slots=3, swa_full_ratio=0.1, **TINY)


# ---- draft spec, shapes, hashability -----------------------------------------------------------------------

def test_tiny_shapes():
    spec = PoolSpec.for_role(_tiny(), role=Role.TARGET, max_slots=3, max_context=40, page_size=16, draft_tokens=2)
    # 40 tokens -> 3 pages per slot, 9 pages: 36 C4 entries, 18 C128 entries; rings 9 / 16 / 16 / 16.
    assert shapes(spec) == {
        "swa_kv": ((5, 3, 9, 32), "bfloat16"),
        "c4_kv": ((2, 36, 32), "bfloat16"),
        "indexer_kv": ((2, 36, 32), "bfloat16"),
        "c128_kv": ((2, 18, 32), "bfloat16"),
        # the FP8 cache's row scales: no layers without kv_dtype="fp8"
        "swa_kv_scale": ((0, 3, 9), "float32"),
        "c4_kv_scale": ((0, 36), "float32"),
        "indexer_kv_scale": ((0, 36), "float32"),
        "c128_kv_scale": ((0, 18), "float32"),
        "c4_state_kv": ((2, 3, 16, 64), "float32"),
        "c4_state_gate": ((2, 3, 16, 64), "float32"),
        "indexer_state_kv": ((2, 3, 16, 64), "float32"),
        "indexer_state_gate": ((2, 3, 16, 64), "float32"),
        "c128_state_kv": ((2, 3, 16, 32), "float32"),
        "c128_state_gate": ((2, 3, 16, 32), "float32"),
        "page_table": ((3, 3), "int32"),
        "lengths": ((3,), "int32"),
    }


def test_draft_spec_zero_size_pools():
    spec = PoolSpec.for_role(_tiny(), role=Role.DRAFT, max_slots=3, max_context=40, page_size=16, draft_tokens=2)
    arrays = {name: jnp.zeros(shape, dtype) for name, (shape, dtype) in shapes(spec).items()}
    assert arrays["swa_kv"].shape == (1, 3, 9, 32) and arrays["lengths"].shape == (3,)
    assert all(a.size == 0 for n, a in arrays.items() if n not in ("swa_kv", "lengths"))
    assert spec.num_pages == spec.full_tokens == 0
    assert bytes_per_token(spec)["total"] == 0
    assert "draft" in spec.describe()


def test_draft_role_needs_speculation_and_mtp():
    with pytest.raises(PoolSpecError, match=r"PoolSpec\.draft_tokens"):
        PoolSpec.for_role(_tiny(), role=Role.DRAFT, max_slots=1, max_context=32, page_size=16)
    with pytest.raises(PoolSpecError, match=r"PoolSpec\.num_layers"):
        PoolSpec.for_role(_tiny(num_mtp_layers=0), role=Role.DRAFT, max_slots=1, max_context=32, page_size=16,
                          draft_tokens=2)


def test_sliding_only_target_has_no_pages():
    spec = PoolSpec.for_role(config.flash_slice(2), role=Role.TARGET, max_slots=2, max_context=1000)
    assert (spec.num_csa_layers, spec.num_hca_layers, spec.pages_per_slot, spec.num_pages) == (0, 0, 0, 0)


def test_hashable_static_argument():
    a = PoolSpec.for_role(_tiny(), role=Role.TARGET, max_slots=2, page_size=16, max_context=64, dtype=jnp.bfloat16)
    b = PoolSpec.for_role(_tiny(), role=Role.TARGET, max_slots=2, page_size=16, max_context=64, dtype="bfloat16")
    assert a == b and hash(a) == hash(b) and a.dtype == "bfloat16"
    assert {a: 1}[b] == 1
    traces = []

    def step(x, *, spec):
        traces.append(spec)
        return x + spec.swa_rows

    jitted = jax.jit(step, static_argnames="spec")
    assert int(jitted(jnp.int32(1), spec=a)) == 9
    jitted(jnp.int32(2), spec=b)
    assert len(traces) == 1
    jitted(jnp.int32(2), spec=a.replace(max_slots=3))
    assert len(traces) == 2


# ---- validation names the field ---------------------------------------------------------------------------

@pytest.mark.parametrize("change, field", [
    (dict(swa_rows=7), "swa_rows"),
    (dict(page_size=20), "page_size"),
    (dict(c4_entries=33), "c4_entries"),
    (dict(indexer_entries=16), "indexer_entries"),
    (dict(c128_pages=7, c128_entries=14), "c128_pages"),
    (dict(c4_pages=3, c4_entries=12, indexer_entries=12, c128_pages=3, c128_entries=6), "c4_pages"),
    (dict(pages_per_slot=5), "pages_per_slot"),
    (dict(c4_state_rows=6), "c4_state_rows"),
    (dict(c128_state_rows=12), "c128_state_rows"),
    (dict(draft_tokens=1), "draft_tokens"),  # plain rings have no write pad
    (dict(max_slots=0), "max_slots"),
    (dict(dtype="no_such_dtype"), "dtype"),
    (dict(num_csa_layers=4), "num_layers"),
])
def test_validation_names_field(change, field):
    spec = PoolSpec.for_role(_tiny(), role=Role.TARGET, max_slots=2, **TINY)
    with pytest.raises(PoolSpecError, match=rf"PoolSpec\.{field}:"):
        spec.replace(**change)


def test_real_page_size_must_hold_c128_entries():
    with pytest.raises(PoolSpecError, match=r"PoolSpec\.page_size: 64 is not a multiple of hca_ratio \(128\)"):
        PoolSpec.for_role(config.flash(), role=Role.TARGET, max_slots=1, max_context=1024, page_size=64)
    with pytest.raises(PoolSpecError, match=r"PoolSpec\.max_context"):
        PoolSpec.for_role(_tiny(), role=Role.TARGET, max_slots=1, max_context=8192, page_size=16)


# ---- Flash numbers -------------------------------------------------------------------------------------------

def test_flash_bytes_per_token_bf16():
    spec = PoolSpec.for_role(config.flash(), role=Role.TARGET, max_slots=4, max_context=1 << 20)
    per_token = bytes_per_token(spec)
    # 21 CSA layers: one 512-wide entry and one 128-wide indexer key per 4 tokens; 20 HCA layers: one 512 / 128.
    assert per_token["c4_kv"] == 21 * 512 * BF16 / 4 == 5376
    assert per_token["indexer"] == 21 * 128 * BF16 / 4 == 1344
    assert per_token["c128_kv"] == 20 * 512 * BF16 / 128 == 160
    assert per_token["swa"] == per_token["states"] == per_token["tables"] == 0
    assert per_token["total"] == 6880
    assert bytes_per_token(spec.replace(dtype="float32"))["total"] == 2 * 6880


def test_flash_bytes_per_request_1m():
    spec = PoolSpec.for_role(config.flash(), role=Role.TARGET, max_slots=4, max_context=1 << 20)
    req = bytes_per_request(spec)
    assert req["c4_kv"] == (1 << 20) * 5376 and req["c128_kv"] == (1 << 20) * 160
    assert req["swa"] == 43 * 128 * 512 * BF16  # 5.25 MiB
    assert req["states"] == (21 * 8 * 1024 + 21 * 8 * 256 + 20 * 128 * 512) * F32 * 2
    assert req["tables"] == 4096 * I32 + I32
    assert 6.7 * 1024 * MIB < req["total"] < 6.8 * 1024 * MIB  # Lucebox logs 6,898 MB for a 1M context (F16)
    assert total_bytes(spec) == 4 * bytes_per_slot(spec)["total"] + spec.num_pages * page_bytes(spec)
    text = spec.describe()
    assert all(name in text for name in shapes(spec))
