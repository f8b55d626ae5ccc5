"""`PoolSpec`: every KV-pool capacity of one attention rank, explicit, frozen and hashable.

A `PoolSpec` is a static argument of every jitted step. Pool array shapes derive from the spec alone
(`shapes(spec)`), so equal specs build identical pools and share compiled programs. Two constructors:

* `PoolSpec.for_role(cfg, role=…, max_slots, max_context)` — exact: every slot can reach `max_context`;
* `configure(cfg, role=…, …, memory_budget_bytes=…)` — sized from a memory budget with the arithmetic of
  SGLang's DSV4PoolConfigurator (serving.md §5.3), adapted to this layout (see `configure`).

Pool arrays: the table, with shape rules, dtypes, roles, layer kinds and logical axes, is
`ds4jax.runtime.pool_layout.POOL_ARRAYS` (the one place that lists them); `shapes(spec)` evaluates it.

The layer axis of c4_*/indexer_* arrays follows `cfg.layers_of(AttentionType.CSA)`, that of c128_* arrays
`cfg.layers_of(AttentionType.HCA)`; swa_kv covers every layer (every layer has the sliding branch).

Paging. Logical page j of slot b covers positions [j·z, (j+1)·z). One physical page id n = page_table[b, j]
addresses all three paged pools: C4 entries and indexer keys at rows [n·z/csa_ratio, (n+1)·z/csa_ratio),
C128 entries at rows [n·z/hca_ratio, (n+1)·z/hca_ratio). Hence c4_pages == c128_pages (= `num_pages`)
wherever both kinds of layer exist. A page id outside [0, num_pages) (-1 in the tables: no page; `null_page`
= num_pages) is owned by no request and addresses no row: steps drop writes to it (mode="drop" scatters) and
end a request's readable entries before it, so an unreserved page never aliases another request's page.

Compressor state rings (spec §3.6–3.7, §4.1). Row q mod rows holds the raw projections of token q: kv = V_q
and gate = Z_q + ape[q mod ratio] (bias added, so rows are position-independent once written). CSA rows
keep all 2d channels (overlap half [0:d] feeds the next entry, current half [d:2d] this one). A CSA entry
reads the previous and the current window, so its ring needs `2·csa_ratio` rows; an HCA entry reads the
current window, `hca_ratio` rows. Reset values are 0; rows are only read at positions the request itself
wrote, so reset contents never enter a computation (the window before position 0 is masked explicitly).

Speculation. `draft_tokens` D is the number of positions one target verify step writes at or beyond the
committed length c, i.e. c … c+D−1: the last sampled token (always accepted) plus k drafts, D = k+1
(SGLang's num_draft_tokens). D = 0 means no speculation (a decode step writes one position, c). Rings grow
so that those writes never clobber rows still needed after rejection (serving.md §6):

* SWA: the query at c reads c−W+1 … c while the step writes up to c+D−1, so W + D − 1 positions are live
  at once: `swa_rows = sliding_window + max(D, 1) − 1`.
* states: speculating doubles each ring (C4 8 → 16, C128 128 → 256), and D must not exceed
  `write_pad(rows, window)`. C4 overwrites rejected rows before reading them; C128 can read them at a
  window boundary, so after a verify the unaccepted C128 rows must be cleared (SGLang
  `clear_unaccepted_c128_draft_states`).

The SWA bound allows a step to write its rows before reading them; the state pads do not: a step reads
the state rows its own entries need before writing new rows (or takes in-step positions from the fresh
projections). A step that writes more positions than these rings allow (a prefill chunk) attends to its
fresh keys directly and writes into the rings only what later steps read.

The draft (`Role.DRAFT`, the MTP block) is one sliding-only layer: its spec has num_layers = 1,
num_csa_layers = num_hca_layers = 0, and every paged, state and page-table capacity 0 (zero-size arrays).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp

from ds4jax.model.config import AttentionType, Config
from ds4jax.runtime import kv_quant, pool_layout as layout
from ds4jax.runtime.roles import Role
from ds4jax.errors import PoolSpecError  # noqa: F401 (re-exported: importable from here too)

_INT32_LIMIT = 2**31  # paged row indices are int32 in the kernels


def _fail(field: str, why: str) -> None:
    raise PoolSpecError(f"PoolSpec.{field}: {why}")


def write_pad(ring: int, window: int) -> int:
    """Most positions one step may write at or beyond the committed length into a state ring (serving.md §6).

    `window` rows hold state that committed tokens still need. After a verify at least its first token is
    committed, so the oldest needed position is ≥ c − window + 2; writes up to c + D − 1 stay off its row
    while D ≤ ring − window + 2. A ring no larger than the window has no room to write ahead: 0.
    """
    return ring - window + 2 if ring > window else 0


def _state_rows(window: int, draft_tokens: int) -> int:
    # SGLang's choice: the plain ring, doubled when speculating (pad = window + 2).
    return 2 * window if draft_tokens > 0 else window


def most_drafts(cfg: Config) -> int | None:
    """The most drafts per round (k = draft_tokens − 1) the speculating state rings of `cfg`'s compressed layers
    take: the smallest `write_pad` of those rings, less one. None without compressed layers (the SWA ring grows
    with any k)."""
    pads = [write_pad(_state_rows(window, 1), window)
            for kind, window in ((AttentionType.CSA, 2 * cfg.csa_ratio), (AttentionType.HCA, cfg.hca_ratio))
            if cfg.layers_of(kind)]
    return min(pads) - 1 if pads else None


def _dtype_name(dtype: Any, field: str) -> str:
    try:
        return jnp.dtype(dtype).name
    except TypeError:
        _fail(field, f"not a dtype: {dtype!r}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class PoolSpec:
    """Capacities of one attention rank's KV pools (the table and semantics are in the module docstring)."""

    # Model dimensions, copied from Config so that shapes derive from the spec alone.
    num_layers: int  # layers with an SWA ring (all target layers; 1 for the draft)
    num_csa_layers: int  # CSA (ratio csa_ratio) layers: c4_*, indexer_* arrays
    num_hca_layers: int  # HCA (ratio hca_ratio) layers: c128_* arrays
    head_dim: int
    index_head_dim: int
    csa_ratio: int
    hca_ratio: int
    sliding_window: int
    # Requests.
    max_slots: int  # concurrent requests (slots b)
    max_context: int  # tokens per request
    draft_tokens: int = 0  # positions one verify step writes ahead: k + 1, or 0 without speculation
    # Per-slot rings (rows per slot).
    swa_rows: int  # sliding_window + max(draft_tokens, 1) − 1
    c4_state_rows: int  # 2·csa_ratio, doubled when speculating; 0 without CSA layers
    indexer_state_rows: int  # same as c4_state_rows
    c128_state_rows: int  # hca_ratio, doubled when speculating; 0 without HCA layers
    # Shared paged pools.
    page_size: int = 256  # tokens per page (z)
    pages_per_slot: int  # ceil(max_context / page_size); 0 without compressed layers
    c4_pages: int  # pages of the C4 KV and indexer pools
    c4_entries: int  # c4_pages · page_size / csa_ratio
    indexer_entries: int  # == c4_entries (one indexer key per C4 entry)
    c128_pages: int  # pages of the C128 pool (== c4_pages when both exist)
    c128_entries: int  # c128_pages · page_size / hca_ratio
    # Storage dtypes, as names so the spec stays hashable and printable.
    dtype: str = "bfloat16"  # the model's dtype: the KV arrays' storage unless kv_dtype says otherwise
    state_dtype: str = "float32"  # compressor state rings
    # KV storage (`ds4jax.runtime.kv_quant`): "auto" = `dtype`; an E4M3 name = FP8 values + a float32 scale per row
    # ("fp8" is resolved to the device's variant on construction)
    kv_dtype: str = "auto"

    def __post_init__(self):
        object.__setattr__(self, "dtype", _dtype_name(self.dtype, "dtype"))
        object.__setattr__(self, "state_dtype", _dtype_name(self.state_dtype, "state_dtype"))
        object.__setattr__(self, "kv_dtype", kv_quant.resolve(self.kv_dtype))
        _validate(self)

    # ---- derived -------------------------------------------------------------------------------
    @property
    def num_pages(self) -> int:
        """Pages in the shared allocator (one id addresses C4, indexer and C128 rows)."""
        return max(self.c4_pages, self.c128_pages)

    @property
    def null_page(self) -> int:
        """Out-of-range page id for unallocated page-table entries."""
        return self.num_pages

    @property
    def full_tokens(self) -> int:
        """Token capacity of the paged pools (SGLang's full_token)."""
        return self.num_pages * self.page_size

    @property
    def c4_entries_per_page(self) -> int:
        return self.page_size // self.csa_ratio

    @property
    def c128_entries_per_page(self) -> int:
        return self.page_size // self.hca_ratio

    @property
    def c4_state_width(self) -> int:
        """CSA compressor ring width: overlap half + current half, 2·head_dim."""
        return 2 * self.head_dim

    @property
    def indexer_state_width(self) -> int:
        return 2 * self.index_head_dim

    @property
    def c128_state_width(self) -> int:
        return self.head_dim

    @property
    def kv_scaled(self) -> bool:
        """Whether the KV arrays are FP8 with a scale per row (the `*_scale` arrays have their layers)."""
        return self.kv_dtype != kv_quant.AUTO

    @property
    def kv_storage_dtype(self) -> str:
        """dtype name of swa_kv, c4_kv, indexer_kv and c128_kv."""
        return self.kv_dtype if self.kv_scaled else self.dtype

    # layers of the scale arrays: those of their KV arrays with an FP8 cache, else 0 (zero-size arrays)
    @property
    def swa_scale_layers(self) -> int:
        return self.num_layers if self.kv_scaled else 0

    @property
    def csa_scale_layers(self) -> int:
        return self.num_csa_layers if self.kv_scaled else 0

    @property
    def hca_scale_layers(self) -> int:
        return self.num_hca_layers if self.kv_scaled else 0

    @property
    def c4_window(self) -> int:
        """Positions of compressor state a CSA entry reads: previous + current window."""
        return 2 * self.csa_ratio

    @property
    def c128_window(self) -> int:
        return self.hca_ratio

    # ---- constructors ----------------------------------------------------------------------------
    @classmethod
    def for_role(
        cls,
        cfg: Config,
        *,
        role: Role,
        max_slots: int,
        max_context: int,
        draft_tokens: int = 0,
        page_size: int = 256,
        dtype: Any = "bfloat16",
        state_dtype: Any = "float32",
        num_pages: int | None = None,
        kv_dtype: Any = "auto",
    ) -> "PoolSpec":
        """The pool of `role` for `max_slots` requests of up to `max_context` tokens.

        `num_pages` defaults to max_slots · pages_per_slot (no oversubscription); `configure` passes the
        number a memory budget affords. A draft spec is checked against its target's limits too, since a
        draft exists only to serve that target.
        """
        if not isinstance(role, Role):
            raise PoolSpecError(f"role: expected a Role, got {role!r}")
        for name, value, least in (("max_slots", max_slots, 1), ("max_context", max_context, 1),
                                   ("page_size", page_size, 1), ("draft_tokens", draft_tokens, 0)):
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                _fail(name, f"must be an int >= {least}, got {value!r}")
        if max_context > cfg.max_position_embeddings:
            _fail("max_context", f"{max_context} exceeds cfg.max_position_embeddings ({cfg.max_position_embeddings})")
        common = dict(
            head_dim=cfg.head_dim, index_head_dim=cfg.index_head_dim, csa_ratio=cfg.csa_ratio,
            hca_ratio=cfg.hca_ratio, sliding_window=cfg.sliding_window, max_slots=max_slots,
            max_context=max_context, draft_tokens=draft_tokens, page_size=page_size,
            swa_rows=cfg.sliding_window + max(draft_tokens, 1) - 1, dtype=dtype, state_dtype=state_dtype,
            kv_dtype=kv_dtype,
        )
        if role is Role.DRAFT:
            if cfg.num_mtp_layers < 1:
                _fail("num_layers", "Role.DRAFT needs an MTP layer, cfg.num_mtp_layers is 0")
            if draft_tokens < 1:
                _fail("draft_tokens", "Role.DRAFT exists only to speculate: draft_tokens must be >= 1")
            cls.for_role(cfg, role=Role.TARGET, max_slots=max_slots, max_context=max_context,
                         draft_tokens=draft_tokens, page_size=page_size, dtype=dtype, state_dtype=state_dtype,
                         num_pages=num_pages, kv_dtype=kv_dtype)
            return cls(
                num_layers=cfg.num_mtp_layers, num_csa_layers=0, num_hca_layers=0, c4_state_rows=0,
                indexer_state_rows=0, c128_state_rows=0, pages_per_slot=0, c4_pages=0, c4_entries=0,
                indexer_entries=0, c128_pages=0, c128_entries=0, **common,
            )
        num_csa = len(cfg.layers_of(AttentionType.CSA))
        num_hca = len(cfg.layers_of(AttentionType.HCA))
        pages_per_slot = -(-max_context // page_size) if num_csa + num_hca else 0
        if num_pages is None:
            num_pages = max_slots * pages_per_slot
        c4_pages = num_pages if num_csa else 0
        c128_pages = num_pages if num_hca else 0
        return cls(
            num_layers=cfg.num_layers, num_csa_layers=num_csa, num_hca_layers=num_hca,
            c4_state_rows=_state_rows(2 * cfg.csa_ratio, draft_tokens) if num_csa else 0,
            indexer_state_rows=_state_rows(2 * cfg.csa_ratio, draft_tokens) if num_csa else 0,
            c128_state_rows=_state_rows(cfg.hca_ratio, draft_tokens) if num_hca else 0,
            pages_per_slot=pages_per_slot,
            c4_pages=c4_pages, c4_entries=c4_pages * (page_size // cfg.csa_ratio),
            indexer_entries=c4_pages * (page_size // cfg.csa_ratio),
            c128_pages=c128_pages, c128_entries=c128_pages * (page_size // cfg.hca_ratio),
            **common,
        )

    def replace(self, **changes: Any) -> "PoolSpec":
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """A human-readable table of every pool array, its shape, dtype and size."""
        kind = "draft (sliding only)" if self.num_csa_layers + self.num_hca_layers == 0 else "target"
        lines = [
            f"PoolSpec [{kind}]: {self.num_layers} layers ({self.num_csa_layers} CSA, {self.num_hca_layers} HCA), "
            f"{self.max_slots} slots x {self.max_context:,} tokens, draft_tokens {self.draft_tokens}",
            f"  pages {self.num_pages:,} x {self.page_size} = {self.full_tokens:,} tokens "
            f"({self.pages_per_slot:,} per slot); entries c4 {self.c4_entries:,}, indexer "
            f"{self.indexer_entries:,}, c128 {self.c128_entries:,}",
            f"  ring rows: swa {self.swa_rows}, c4 state {self.c4_state_rows} "
            f"(pad {write_pad(self.c4_state_rows, self.c4_window)}), indexer state {self.indexer_state_rows}, "
            f"c128 state {self.c128_state_rows} (pad {write_pad(self.c128_state_rows, self.c128_window)})",
            f"  kv storage: {self.kv_storage_dtype}" + (
                f" + a float32 scale per row: {fp8_capacity_gain(self):.2f}x the paged tokens of a {self.dtype} "
                f"cache in the same memory" if self.kv_scaled else ""),
            f"  {'array':<20} {'shape':<32} {'dtype':<16} {'size':>12}",
        ]
        for name, (shape, dtype) in shapes(self).items():
            size = math.prod(shape) * jnp.dtype(dtype).itemsize
            lines.append(f"  {name:<20} {str(list(shape)):<32} {dtype:<16} {_human(size):>12}")
        lines.append(f"  {'total':<70} {_human(total_bytes(self)):>12}")
        per_token = bytes_per_token(self)
        per_slot = bytes_per_slot(self)
        paged = ", ".join(f"{k} {v:,.1f} B" for k, v in per_token.items() if v) or "none (no paged pools)"
        lines.append(f"  per paged token: {paged}")
        lines.append("  per slot: " + ", ".join(f"{k} {_human(v)}" for k, v in per_slot.items() if v))
        lines.append(f"  per request at max_context: {_human(bytes_per_request(self)['total'])}")
        return "\n".join(lines)


def _validate(s: PoolSpec) -> None:
    ints = [f.name for f in dataclasses.fields(s) if f.type in ("int", int)]
    positive = {"num_layers", "head_dim", "index_head_dim", "csa_ratio", "hca_ratio", "sliding_window",
                "max_slots", "max_context", "page_size", "swa_rows"}
    for name in ints:
        value = getattr(s, name)
        if not isinstance(value, int) or isinstance(value, bool):
            _fail(name, f"must be an int, got {value!r}")
        if value < (1 if name in positive else 0):
            _fail(name, f"must be {'> 0' if name in positive else '>= 0'}, got {value}")
    if s.num_csa_layers + s.num_hca_layers > s.num_layers:
        _fail("num_layers", f"{s.num_layers} < num_csa_layers + num_hca_layers "
                            f"({s.num_csa_layers} + {s.num_hca_layers})")
    for ratio in ("csa_ratio", "hca_ratio"):
        if s.page_size % getattr(s, ratio):
            _fail("page_size", f"{s.page_size} is not a multiple of {ratio} ({getattr(s, ratio)}): "
                               "a page must hold whole compressed entries")

    paged = s.num_csa_layers + s.num_hca_layers > 0
    want = -(-s.max_context // s.page_size) if paged else 0
    if s.pages_per_slot != want:
        _fail("pages_per_slot", f"must be {want} (ceil(max_context / page_size), 0 without compressed "
                                f"layers), got {s.pages_per_slot}")

    swa_min = s.sliding_window + max(s.draft_tokens, 1) - 1
    if s.swa_rows < swa_min:
        _fail("swa_rows", f"{s.swa_rows} < sliding_window + max(draft_tokens, 1) - 1 = {swa_min}: "
                          "a step would overwrite keys its own queries still read")

    rings = (("c4_state_rows", s.num_csa_layers, s.csa_ratio, s.c4_window, "CSA"),
             ("indexer_state_rows", s.num_csa_layers, s.csa_ratio, s.c4_window, "CSA"),
             ("c128_state_rows", s.num_hca_layers, s.hca_ratio, s.c128_window, "HCA"))
    for name, layers, ratio, window, kind in rings:
        rows = getattr(s, name)
        if not layers:
            if rows:
                _fail(name, f"must be 0 without {kind} layers, got {rows}")
            continue
        if rows < window or rows % ratio:
            _fail(name, f"{rows} must be a multiple of {ratio} and >= the {window}-position window its "
                        f"{kind} entries read")
        pad = write_pad(rows, window)
        if s.draft_tokens > pad:
            _fail("draft_tokens", f"{s.draft_tokens} exceeds the write pad of the {name} ring ({rows} rows, "
                                  f"window {window}: pad {pad}); rejected drafts would overwrite state "
                                  "that committed tokens still need")

    pools = (("c4", s.num_csa_layers, s.c4_pages, s.c4_entries, s.c4_entries_per_page, "CSA"),
             ("c128", s.num_hca_layers, s.c128_pages, s.c128_entries, s.c128_entries_per_page, "HCA"))
    for prefix, layers, pages, entries, per_page, kind in pools:
        if not layers:
            if pages or entries:
                _fail(f"{prefix}_pages", f"{prefix}_pages and {prefix}_entries must be 0 without {kind} "
                                         f"layers, got {pages} and {entries}")
            continue
        if entries != pages * per_page:
            _fail(f"{prefix}_entries", f"{entries} != {prefix}_pages x page_size / ratio "
                                       f"= {pages} x {per_page} (whole pages only)")
        if pages < s.pages_per_slot:
            _fail(f"{prefix}_pages", f"{pages} pages cannot hold one request of max_context "
                                     f"({s.pages_per_slot} pages)")
        if entries * layers >= _INT32_LIMIT:  # the kernels index the rows of all layers at once
            _fail(f"{prefix}_entries", f"{entries} rows x layers overflow int32 row indices")
    if s.indexer_entries != s.c4_entries:
        _fail("indexer_entries", f"must equal c4_entries ({s.c4_entries}): one indexer key per C4 entry, "
                                 f"got {s.indexer_entries}")
    if s.c4_pages and s.c128_pages and s.c4_pages != s.c128_pages:
        _fail("c128_pages", f"{s.c128_pages} != c4_pages ({s.c4_pages}): one page id addresses both pools")


# ---- shapes and byte accounting ---------------------------------------------------------------------------

def shapes(spec: PoolSpec) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every pool array as name -> (shape, dtype name), from the spec alone (rules in `pool_layout`)."""
    return {a.name: (layout.shape_of(a, spec), layout.dtype_of(a, spec)) for a in layout.POOL_ARRAYS}


def _array_bytes(spec: PoolSpec) -> dict[str, int]:
    return {name: math.prod(shape) * jnp.dtype(dtype).itemsize for name, (shape, dtype) in shapes(spec).items()}


def _report(per_array: dict[str, float]) -> dict[str, float]:
    out = dict.fromkeys(layout.GROUPS, 0)
    for name, value in per_array.items():
        out[layout.BY_NAME[name].group] += value
    out["total"] = sum(out[g] for g in layout.GROUPS)
    return out


def _per_page(spec: PoolSpec) -> dict[str, int]:
    # Bytes one page adds to each paged array (every paged array has num_pages pages, or no layers).
    sizes = _array_bytes(spec)
    return {a.name: sizes[a.name] // spec.num_pages if spec.num_pages else 0
            for a in layout.POOL_ARRAYS if a.paged}


def page_bytes(spec: PoolSpec) -> int:
    """Bytes of one page across all paged pools (c4_kv + indexer_kv + c128_kv, all layers)."""
    return sum(_per_page(spec).values())


def bytes_per_token(spec: PoolSpec) -> dict[str, float]:
    """Bytes per token of paged capacity (what each extra full token costs), by pool.

    swa, states and tables are per-slot costs (see `bytes_per_slot`) and read 0 here.
    """
    return _report({name: b / spec.page_size for name, b in _per_page(spec).items()})


def bytes_per_slot(spec: PoolSpec) -> dict[str, int]:
    """Bytes each request slot owns whatever its length (SWA ring, state rings, its table row), by pool."""
    sizes = _array_bytes(spec)
    return _report({n: v // spec.max_slots for n, v in sizes.items() if not layout.BY_NAME[n].paged})


def bytes_per_request(spec: PoolSpec) -> dict[str, float]:
    """Bytes one request at max_context occupies: its slot plus pages_per_slot pages, by pool."""
    per_slot, per_token = bytes_per_slot(spec), bytes_per_token(spec)
    tokens = spec.pages_per_slot * spec.page_size
    return {k: per_slot[k] + tokens * per_token[k] for k in per_slot}


def fp8_capacity_gain(spec: PoolSpec) -> float:
    """Paged tokens an FP8 cache holds for each token the same spec holds in `dtype`, in equal memory (the ratio of
    `bytes_per_token`): 1.98x from bf16 at head_dim 512 (1 byte per value + 4 per row instead of 2 per value)."""
    fp8 = spec if spec.kv_scaled else spec.replace(kv_dtype="float8_e4m3fn")
    plain = bytes_per_token(fp8.replace(kv_dtype=kv_quant.AUTO))["total"]
    return plain / bytes_per_token(fp8)["total"] if plain else 1.0


def total_bytes(spec: PoolSpec) -> int:
    """Bytes of every pool array of the spec."""
    return sum(_array_bytes(spec).values())


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.2f} {unit}"
        n /= 1024


# ---- sizing from a memory budget ----------------------------------------------------------------------------

def configure(
    cfg: Config,
    *,
    role: Role,
    max_context: int,
    max_slots: int | None = None,
    memory_budget_bytes: int | None = None,
    swa_full_ratio: float | None = None,
    draft_tokens: int = 0,
    page_size: int = 256,
    dtype: Any = "bfloat16",
    state_dtype: Any = "float32",
    oversubscribe: bool = False,
    kv_dtype: Any = "auto",
) -> PoolSpec:
    """Size the pools of one attention rank; returns `role`'s spec (the target's sizing decides both).

    Without a budget this is `PoolSpec.for_role`. With one, the unknown is the paged capacity `full`
    (SGLang's full_token) and everything else follows from it: c4 = indexer = full / csa_ratio,
    c128 = full / hca_ratio, full rounded down to a page multiple. Costs split as in this layout:

    * per slot (fixed): SWA ring, C4/indexer/C128 state rings, page-table row and length, and, when
      speculating, the draft's SWA ring. SGLang charges only the C128 state as fixed because its SWA pool
      and C4 states scale with an SWA token pool; here they are rings owned by the slot.
    * per full token: C4 KV + indexer keys + C128 KV (`bytes_per_token`). The draft has no paged pools,
      so its reserve is exact instead of SGLang's (L+1)/L scaling.

    Slots: `max_slots` fixes them, full = floor((budget − max_slots · per_slot) / per_token). Or
    `swa_full_ratio` r derives them SGLang-style from SWA tokens = r · full: slots = floor(r · full / swa_rows).

    `full` is capped at what the slots can use (slots · pages_per_slot pages). A smaller `full` means
    requests cannot all reach max_context at once; that raises unless `oversubscribe=True` (then the
    engine must admit or preempt by free pages).
    """
    if memory_budget_bytes is None:
        if swa_full_ratio is not None:
            raise PoolSpecError("swa_full_ratio: only meaningful with memory_budget_bytes")
        if max_slots is None:
            raise PoolSpecError("max_slots: required without memory_budget_bytes")
        return PoolSpec.for_role(cfg, role=role, max_slots=max_slots, max_context=max_context,
                                 draft_tokens=draft_tokens, page_size=page_size, dtype=dtype,
                                 state_dtype=state_dtype, kv_dtype=kv_dtype)
    if (max_slots is None) == (swa_full_ratio is None):
        raise PoolSpecError("max_slots / swa_full_ratio: give exactly one when sizing from a memory budget")
    if swa_full_ratio is not None and not swa_full_ratio > 0:
        raise PoolSpecError(f"swa_full_ratio: must be > 0, got {swa_full_ratio}")

    def build(which: Role, slots: int, num_pages: int | None = None) -> PoolSpec:
        return PoolSpec.for_role(cfg, role=which, max_slots=slots, max_context=max_context,
                                 draft_tokens=draft_tokens, page_size=page_size, dtype=dtype,
                                 state_dtype=state_dtype, num_pages=num_pages, kv_dtype=kv_dtype)

    budget = int(memory_budget_bytes)
    probe = build(Role.TARGET, max_slots or 1)  # exact, only read for per-slot and per-page costs
    per_slot = bytes_per_slot(probe)["total"]
    if draft_tokens > 0 and cfg.num_mtp_layers:
        per_slot += bytes_per_slot(build(Role.DRAFT, max_slots or 1))["total"]
    per_page = page_bytes(probe)
    need_pages = probe.pages_per_slot  # pages one request at max_context needs

    def no_memory(why: str) -> PoolSpecError:
        return PoolSpecError(f"memory_budget_bytes: not enough memory: {why} (budget {budget:,} B, "
                             f"{per_slot:,} B per slot, {per_page:,} B per page of {page_size} tokens)")

    if max_slots is not None:
        slots = max_slots
        avail = budget - slots * per_slot
        if avail < 0 or (per_page and avail < per_page):
            raise no_memory(f"{slots} slots cost {slots * per_slot:,} B, leaving {max(avail, 0):,} B for pages")
        pages = avail // per_page if per_page else 0
    else:
        if not per_page:
            raise PoolSpecError("swa_full_ratio: needs compressed layers (no paged pools to size against)")
        # Per page, r · page_size / swa_rows slots come along; solve in floats, then fix up exactly.
        pages = int(budget // (per_page + swa_full_ratio * page_size * per_slot / probe.swa_rows))

        def slots_for(p: int) -> int:
            return int(swa_full_ratio * p * page_size // probe.swa_rows)

        while pages > 0 and pages * per_page + slots_for(pages) * per_slot > budget:
            pages -= 1
        slots = slots_for(pages)
        if slots < 1:
            raise no_memory(f"swa_full_ratio {swa_full_ratio} affords {pages:,} pages but not one slot")
    if pages < need_pages:
        raise no_memory(f"{pages:,} pages cannot hold one request of max_context {max_context:,} "
                        f"({need_pages:,} pages)")
    pages = min(pages, slots * need_pages)  # pages beyond what the slots can address are wasted
    if pages < slots * need_pages and not oversubscribe:
        raise PoolSpecError(
            f"memory_budget_bytes: {budget:,} B holds {pages * page_size:,} paged tokens, but max_slots {slots} x "
            f"max_context {max_context:,} needs {slots * need_pages * page_size:,}; lower max_slots or "
            "max_context, raise the budget, or pass oversubscribe=True")
    return build(role, slots, pages)
