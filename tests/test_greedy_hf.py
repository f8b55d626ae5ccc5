"""`ds4jax.greedy_generate` (pooled prefill + decode steps) equals HF transformers' `generate` token for token.

HF's `generate` runs its own dynamic cache (compressor / indexer state included), so this checks the whole pooled
path end to end against an independent implementation, on random fp32 tiny checkpoints saved by HF and loaded by
`ds4jax.load`. Two architectures: `CFG` of the step tests, prefilled one token per step (every chunk but the
last skips the vocab projection; width 1 shares its program with decode), and a variant (other layer order,
hc_mult 2, window 12, HCA ratio 16, no YaRN) generating for two ragged prompts in one batch, whole-prompt
prefill. Pool specs are greedy_generate's own (no speculation: rings == windows). Two programs per config.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import ds4jax  # noqa: E402
from ds4jax.model.config import AttentionType as A  # noqa: E402
from ds4jax.model.config import MlpType, tiny  # noqa: E402
from steps_helpers import CFG, make_model  # noqa: E402

VARIANT = tiny(num_layers=3, attention_types=(A.HCA, A.SLIDING, A.CSA), mlp_types=(MlpType.HASH,) + (MlpType.TOPK,) * 2,
               hc_mult=2, o_groups=4, o_lora_rank=8, num_routed_experts=6, num_experts_per_tok=3,
               moe_intermediate_size=48, vocab_size=200, sliding_window=12, hca_ratio=16, yarn=None)


def hf_greedy(hf, prompt, n: int) -> tuple[list[int], float]:
    """HF greedy continuation of one prompt, and the smallest top-1 / top-2 logit gap along it."""
    ids = torch.tensor([list(prompt)], dtype=torch.long)
    with torch.no_grad():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=0,
                          do_sample=False, output_scores=True, return_dict_in_generate=True)
    gaps = [float(np.diff(np.sort(s[0].float().numpy())[-2:])[0]) for s in out.scores]
    return out.sequences[0, ids.shape[1]:].tolist(), min(gaps)


@pytest.mark.parametrize("cfg, seed, lengths, n, chunk", [
    pytest.param(CFG, 1, [37], 16, 1, id="tiny3-chunk1"),
    pytest.param(VARIANT, 2, [31, 44], 12, None, id="variant-ragged-batch"),
])
def test_greedy_generate_equals_hf_generate(tmp_path, cfg, seed, lengths, n, chunk):
    model, hf = make_model(tmp_path, cfg, seed=seed, mtp=False)
    hf.generation_config.eos_token_id = None  # generate exactly n tokens (a random model emits eos too)
    hf.generation_config.pad_token_id = 0
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, cfg.vocab_size, length).tolist() for length in lengths]
    ours = ds4jax.greedy_generate(model, prompts if len(prompts) > 1 else prompts[0], n, prefill_chunk=chunk)
    ours = ours if len(prompts) > 1 else [ours]
    for prompt, got in zip(prompts, ours):
        want, gap = hf_greedy(hf, prompt, n)
        assert len(want) == n and gap > 1e-4, f"near-tie in the reference ({gap:.1e}): pick another seed"
        assert got == want
