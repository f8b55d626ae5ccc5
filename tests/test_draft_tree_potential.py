"""scripts/draft_tree_potential.py's round simulation on crafted draft predictions."""

import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts"))
import draft_tree_potential as dtp  # noqa: E402


def _tops(seq, wrong_first_at=(), second_ok=(), k=2):
    """Level j at t predicts seq[t + j + 1] (top-1), except level 1 at `wrong_first_at`, whose top-1 is wrong and
    whose top-2 is right only at `second_ok`."""
    n = len(seq)
    tops = []
    for j in range(1, k + 1):
        t = np.zeros((n - j, 2), np.int64) - 1
        for i in range(n - j - 1):
            t[i, 0] = seq[i + j + 1]
        tops.append(t)
    for i in wrong_first_at:
        tops[0][i] = [-5, seq[i + 2] if i in second_ok else -6]
    return tops


def test_chain_tree_and_oracle_rounds():
    seq = np.arange(100, 112)  # pending token at position 2: round 1 drafts positions 3, 4 from predictions at t=1
    tops = _tops(seq, wrong_first_at=(1, 4), second_ok=(1,))
    # chain: t=1 d1 wrong -> 0 accepted (p 2 -> 3); t=2: 2 accepted (p -> 6); t=5: 2 (p -> 9); t=8: 2 (p -> 12, end)
    assert dtp.simulate(seq, tops, start=2, k=2, width=1) == [0, 2, 2, 2]
    # width 2: t=1's second candidate is right -> 2 accepted (p -> 5); t=4 both wrong -> 0 (p -> 6); then 2, 2
    assert dtp.simulate(seq, tops, start=2, k=2, width=2) == [2, 0, 2, 2]
    # oracle first level: every d1 accepted (t=4's too); d2 as predicted: 2, 2, 2, then position 11 is the last
    assert dtp.simulate(seq, tops, start=2, k=2, width=None) == [2, 2, 2]


def test_lookup_rounds_follow_the_history():
    seq = np.array([1, 2, 3, 1, 2, 3, 1, 2, 3, 1])  # pending token at 3: its history "1 2 3 1" repeats itself
    assert dtp.simulate_lookup(seq, None, start=3, k=2, min_n=1, window=64) == [(2, True), (2, True)]
    # no repeat and no chain: each round yields the target's token alone
    assert dtp.simulate_lookup(np.array([5, 6, 7, 8]), None, start=1, k=2, min_n=1, window=64) == [(0, False),
                                                                                                    (0, False)]
    # no repeat: the chain drafts (here always right) -> 2 accepted, as `simulate` says
    seq = np.arange(100, 110)
    assert dtp.simulate_lookup(seq, _tops(seq), start=2, k=2, min_n=1, window=64)[0] == (2, False)
