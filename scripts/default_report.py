"""REPORT.md and loss.png of a trained default model, from the train_report.json that train_default.py wrote.

    python scripts/default_report.py checkpoints/default [--sample-file sample.txt]
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def plot(report: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hist, evals = report["history"], report["evals"]
    tokens_per_step = report["hyper"]["batch"] * report["hyper"]["seq_len"]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    x = [h["step"] * tokens_per_step / 1e6 for h in hist]
    ax.plot(x, [h["loss"] for h in hist], lw=0.8, alpha=0.8, label="train: next token")
    ax.plot(x, [h["mtp_loss"] for h in hist], lw=0.8, alpha=0.8, label="train: MTP next-next token")
    ex = [e["step"] * tokens_per_step / 1e6 for e in evals]
    ax.plot(ex, [e["loss"] for e in evals], "o-", color="k",
            label=f"held-out: next token ({evals[-1]['windows'] if evals else 0} windows)")
    if report.get("heldout_all"):
        a = report["heldout_all"]
        ax.plot([x[-1]], [a["loss"]], "D", color="tab:red", label=f"held-out: all {a['windows']} windows, final")
    ax.plot(ex, [e.get("mtp_loss", float("nan")) for e in evals], "s--", color="gray",
            label="held-out: MTP") if evals and "mtp_loss" in evals[0] else None
    ax.set(xlabel="training tokens (millions)", ylabel="cross-entropy (nats/token)", ylim=(0, 9),
           title=f"default model: {report['parameters'] / 1e6:.1f}M parameters, "
                 f"{report.get('device_name', report['device'])}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def markdown(report: dict, sample: str | None) -> str:
    h, c = report["heldout"], report["config"]
    s = report["corpus_summary"] or {}
    rows = [
        ("corpus", f"{report['corpus']} ({report['license']})"),
        ("corpus files", f"{s.get('train', {}).get('files')} train / {s.get('heldout', {}).get('files')} held out "
                         f"(split by a hash of the path); every file's sha256 in corpus_manifest.json "
                         f"(sha256 {report['corpus_manifest_sha256']})"),
        ("corpus tokens", f"{s.get('train', {}).get('tokens'):,} train / {s.get('heldout', {}).get('tokens'):,} "
                          f"held out ({s.get('train', {}).get('bytes'):,} / {s.get('heldout', {}).get('bytes'):,} "
                          f"bytes)"),
        ("tokenizer", f"byte-level BPE, {c['vocab_size']} tokens (tokenizers library), trained on the train split"),
        ("parameters", f"{report['parameters']:,} (bfloat16 on disk, MTP block included)"),
        ("steps", f"{report['steps']:,} of batch {report['hyper']['batch']} x {report['hyper']['seq_len']} tokens"
                  + (f" (of {report['total_steps']:,} planned; the time budget ended the run near the end of the "
                     f"learning-rate schedule)" if report.get("stopped_early") else "")),
        ("tokens seen", f"{report['tokens_seen']:,} ({report['tokens_seen'] / s.get('train', {}).get('tokens', 1):.1f}"
                        f" epochs)"),
        ("training time", f"{report['train_seconds']:.0f} s of steps on {report.get('device_name', report['device'])} (jax {report['jax']}), "
                          f"{report['tokens_per_s']:,.0f} tokens/s"),
        ("held-out loss", f"{h['loss']:.4f} nats/token, {h['bits_per_byte']:.4f} bits/byte "
                          f"({h['windows']} windows, {int(h['tokens']):,} tokens, {h['bytes']:,} bytes; heldout_eval.npy)"),
        ("top-1 accuracy", f"next token {h['top1']:.3f}; MTP next-next token {h['mtp_top1']:.3f}; MTP chained "
                           f"(its own streams, draft steps 2..k) {h['mtp_chain_top1']:.3f}"),
    ]
    if report.get("heldout_all"):
        a = report["heldout_all"]
        rows.append(("all held-out windows", f"{a['loss']:.4f} nats/token, {a['bits_per_byte']:.4f} bits/byte, MTP "
                                             f"top-1 {a['mtp_top1']:.3f} ({a['windows']} windows, {int(a['tokens']):,} "
                                             f"tokens)"))
    table = "\n".join(f"| {k} | {v} |" for k, v in rows)
    kinds = {"sliding_attention": "SWA", "compressed_sparse_attention": "CSA", "heavily_compressed_attention": "HCA"}
    arch = (f"{c['num_hidden_layers']} layers ({', '.join(kinds[t] for t in c['layer_types'])}), hidden "
            f"{c['hidden_size']}, {c['num_attention_heads']} heads x {c['head_dim']}, window {c['sliding_window']}, "
            f"CSA ratio {c['compress_rates']['compressed_sparse_attention']} (indexer top {c['index_topk']}), HCA "
            f"ratio {c['compress_rates']['heavily_compressed_attention']}, {c['n_routed_experts']} experts (top "
            f"{c['num_experts_per_tok']}, ffw {c['moe_intermediate_size']}) + 1 shared; MoE layers "
            f"{', '.join('hash' if t == 'hash_moe' else 'top-k' for t in c['mlp_layer_types'])}; mHC {c['hc_mult']} streams; YaRN off; one MTP block")
    o = report["objective"]
    text = (f"# Default model: training report\n\n{arch}.\n\n"
            f"Objective: next-token cross-entropy + {o['mtp_weight']} x MTP next-next-token cross-entropy + "
            f"{o['chain_weight']} x the MTP block applied to its own streams (as the speculative draft chain uses "
            f"it) + the lightning indexer's KL distillation to the layer's attention over compressed entries "
            f"(DeepSeek-V3.2; trains only the indexer, whose top-k passes no gradient); AdamW (b2 0.95, weight decay {report['hyper']['weight_decay']}, clip 1.0), peak learning rate "
            f"{report['hyper']['lr']}, warmup {report['hyper']['warmup']} steps then cosine; top-k routers balanced "
            f"without an auxiliary loss (bias step {o['bias_rate']}). Trained with `scripts/train_default.py` "
            f"({report['invocations']} invocation(s)).\n\n| | |\n|---|---|\n{table}\n\n![loss](loss.png)\n")
    if sample:
        text += f"\n## Sample (greedy)\n\n```\n{sample}\n```\n"
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("checkpoint")
    ap.add_argument("--sample-file")
    args = ap.parse_args(argv)
    with open(os.path.join(args.checkpoint, "train_report.json")) as f:
        report = json.load(f)
    sample = open(args.sample_file).read() if args.sample_file else None
    plot(report, os.path.join(args.checkpoint, "loss.png"))
    with open(os.path.join(args.checkpoint, "REPORT.md"), "w") as f:
        f.write(markdown(report, sample))
    return 0


if __name__ == "__main__":
    sys.exit(main())
