"""Reference comparison: ds4jax vs HF transformers' `DeepseekV4ForCausalLM` on the same checkpoint (fp32, CPU).

Both sides load the checkpoint with their own loader (HF's `from_pretrained`, ds4jax's `checkpoint.load`), run a
cache-free forward on the same random token ids, and the logits and every layer's output hyper-connection streams
[B, T, hc, D] are compared. The error of each tensor is reported as max|a - b| and as max|a - b| / max|ref|; the
run passes when every relative error is <= tol. MTP weights are not compared (HF has no MTP module).

    python -m ds4jax.compare CHECKPOINT_DIR [--seq-len 64] [--batch 2] [--tol 1e-5] [--seed 0]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any, Callable, Sequence

import numpy as np

_INSTALL_HINT = "the reference comparison needs torch and transformers: pip install ds4jax[test]"


@dataclasses.dataclass(frozen=True)
class ErrorRow:
    name: str
    max_abs: float  # max |ours - ref|
    max_rel: float  # max |ours - ref| / max |ref|


def error_row(name: str, ours: np.ndarray, ref: np.ndarray) -> ErrorRow:
    """Error of `ours` against `ref` (same shape). Non-finite differences count as infinite error."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    if ours.shape != ref.shape:
        raise ValueError(f"{name}: shape {ours.shape} vs reference {ref.shape}")
    diff = np.abs(ours - ref)
    max_abs = float(diff.max()) if np.isfinite(diff).all() else float("inf")
    scale = float(np.abs(ref).max()) if ref.size else 0.0
    return ErrorRow(name, max_abs, max_abs / scale if scale > 0 else max_abs)


@dataclasses.dataclass(frozen=True)
class CompareReport:
    checkpoint: str
    batch: int
    seq_len: int
    tol: float
    rows: tuple[ErrorRow, ...]

    @property
    def ok(self) -> bool:
        return all(r.max_rel <= self.tol for r in self.rows)  # NaN compares False: fails

    @property
    def worst(self) -> ErrorRow:
        return max(self.rows, key=lambda r: r.max_rel if r.max_rel == r.max_rel else float("inf"))

    def format(self) -> str:
        lines = [f"ds4jax vs transformers on {self.checkpoint} (batch {self.batch}, seq_len {self.seq_len}, fp32)",
                 f"{'tensor':<14} {'max abs err':>12} {'max rel err':>12}"]
        for r in self.rows:
            flag = "" if r.max_rel <= self.tol else "  FAIL"
            lines.append(f"{r.name:<14} {r.max_abs:>12.3e} {r.max_rel:>12.3e}{flag}")
        verdict = "PASS" if self.ok else "FAIL"
        lines.append(f"{verdict}: worst relative error {self.worst.max_rel:.3e} ({self.worst.name}), tol {self.tol:g}")
        return "\n".join(lines)

    __str__ = format


def _import_reference():
    try:
        import torch
        import transformers
    except ImportError as e:
        raise ImportError(f"{_INSTALL_HINT} ({e})") from None
    if not hasattr(transformers, "DeepseekV4ForCausalLM"):
        raise ImportError(f"transformers {transformers.__version__} has no DeepseekV4ForCausalLM; {_INSTALL_HINT}")
    return torch, transformers


def reference_forward(checkpoint_dir: str, token_ids: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """HF fp32 forward: token_ids [B, T] -> (logits [B, T, V], per-layer output streams [B, T, hc, D])."""
    torch, transformers = _import_reference()
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(
        checkpoint_dir, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    problems = {k: info.get(k) for k in ("missing_keys", "mismatched_keys") if info.get(k)}
    if problems:  # HF would silently random-initialise these
        from ds4jax.errors import CheckpointError

        raise CheckpointError(f"transformers could not load it completely: {problems}", source=checkpoint_dir)
    model.eval()
    streams: list[Any] = []
    hooks = [layer.register_forward_hook(lambda _m, _i, out: streams.append(out[0] if isinstance(out, tuple) else out))
             for layer in model.model.layers]
    try:
        with torch.no_grad():
            out = model(input_ids=torch.as_tensor(token_ids, dtype=torch.long), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return out.logits.float().numpy(), [s.float().numpy() for s in streams]


def ds4jax_forward(checkpoint_dir: str, token_ids: np.ndarray) -> tuple[np.ndarray, list[np.ndarray]]:
    """ds4jax fp32 forward (highest matmul precision): same outputs as `reference_forward`."""
    import jax
    import jax.numpy as jnp

    from ds4jax.io import checkpoint
    from ds4jax.model import forward as model

    loaded = checkpoint.load(checkpoint_dir, dtype=jnp.float32)
    fwd = jax.jit(model.forward, static_argnums=0, static_argnames="return_hidden")
    with jax.default_matmul_precision("highest"):
        logits, hidden = fwd(loaded.config, loaded.params, jnp.asarray(token_ids, jnp.int32), return_hidden=True)
    return np.asarray(logits), [np.asarray(h) for h in hidden]


def run_compare(checkpoint_dir: str | os.PathLike, seq_len: int = 64, batch: int = 2, tol: float = 1e-5,
                seed: int = 0, print_fn: Callable[[str], Any] | None = print) -> CompareReport:
    """Compare logits and per-layer streams of ds4jax and HF on `batch` x `seq_len` random tokens; print a table."""
    from ds4jax.model.config import load_config

    checkpoint_dir = os.fspath(checkpoint_dir)
    _import_reference()  # fail early, before the (slower) ds4jax load
    cfg = load_config(checkpoint_dir)  # ConfigError names the field
    token_ids = np.random.default_rng(seed).integers(0, cfg.vocab_size, (batch, seq_len), dtype=np.int64)
    # ds4jax first: its loader validates every tensor (CheckpointError naming it) before HF might guess around one
    logits, hidden = ds4jax_forward(checkpoint_dir, token_ids)
    ref_logits, ref_hidden = reference_forward(checkpoint_dir, token_ids)
    if len(hidden) != len(ref_hidden):
        raise RuntimeError(f"ds4jax returned {len(hidden)} layer streams, transformers {len(ref_hidden)}")
    rows = [error_row("logits", logits, ref_logits)]
    rows += [error_row(f"layer {i}", h, r) for i, (h, r) in enumerate(zip(hidden, ref_hidden))]
    report = CompareReport(checkpoint_dir, batch, seq_len, tol, tuple(rows))
    if print_fn is not None:
        print_fn(report.format())
    return report


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m ds4jax.compare DIR [flags]``: ``ds4jax compare --checkpoint DIR [flags]``, with its checks of
    every flag (this entry took ``--tol nan`` or ``--seq-len -5`` as they came) and its exit statuses: 0 within
    tolerance, 1 above it, 2 for a bad checkpoint or a missing reference."""
    from ds4jax import cli

    parser = argparse.ArgumentParser(prog="python -m ds4jax.compare", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint_dir")
    for flag in ("--seq-len", "--batch", "--tol", "--seed"):  # as text: `ds4jax compare` checks each
        parser.add_argument(flag, dest=flag)
    args = vars(parser.parse_args(argv))
    checkpoint = args.pop("checkpoint_dir")
    forwarded = [f"{flag}={value}" for flag, value in args.items() if value is not None]
    return cli.main(["compare", "--checkpoint", checkpoint, *forwarded])


if __name__ == "__main__":
    sys.exit(main())
